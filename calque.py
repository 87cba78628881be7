"""calque: warm-worker pools for batch model inference: the CLI, Python API and handler API.
A run: stage_run writes the run record, a manifest and a queue message per claim; warmd.py's
Worker._loop_once receives a claim, open_claim accepts it, run_claim runs its batches, finish
writes its summary and Acks.flush acks it; wait_for_run waits on the summaries. The map (each
section uses only those above it; docs/contract.md: the contract; README.md: the commands):
       handler API   enter, batch, __all__           6. local workers  calque_supervisor.py
    1. settings      DEFAULTS, settings, UserError   7. cost model     rates.json, run cost
    2. CONTRACT      keys, message, summary, parts   8. EC2 cohort     calque_ec2.py
    3. backends      LocalStore, S3Store, queues     9. both paths     cold_run, status, make_plan
    4. records       pool and run records, scaling  10. Python API     Pool, submit(), Run
    5. submit, runs  stage_run, wait_for_run        11. CLI            cmd_* per verb, main()
"""
import sys
if __name__ == "__main__":   # `python calque.py` / `python -m calque`: the role files' `import calque` must get this
    sys.modules["calque"] = sys.modules[__name__]   # module, not a second copy with its own state and error classes
import argparse, ast, base64, collections, contextlib, ctypes, datetime, difflib, enum, fcntl
import functools, glob, gzip, hashlib, heapq, importlib.util, inspect, io, itertools, json, math
import os, re, secrets, shlex, shutil, signal, socket, sqlite3, stat, statistics, struct, subprocess
import tarfile, threading, time, traceback, typing, uuid, zipfile, zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

try:
    import orjson   # submit's check of JSONL lines (checked_json); a worker's result lines
except ImportError:   # a Python without the kit's packages: main() re-runs under the .venv
    orjson = None
# numpy, pyarrow, boto3, tqdm, asyncio, importlib.resources/metadata and tomllib are imported where
# they are used: most commands, and every worker, never need them.

__all__ = [
    "enter", "batch",                                   # the handler API
    "Pool", "submit", "Run",                            # the Python API (section 10)
    "UserError", "StoreFault", "WorkersFailed", "NotFound", "ResultsIncomplete",
    "SubmitInterrupted",
]


# ------------------------------------------------------------------------------------------------
# the handler API: a class with one @calque.enter and one @calque.batch method, and optionally
# collate(self, payloads): what its batch method receives (README.md, "Writing a handler").
def enter(fn):
    """Mark the method that loads the model: it runs once per worker, before its first batch."""
    fn._calque_role = "enter"
    return fn


def batch(fn=None, *, whole_claim=False):
    """Mark the method that runs a batch: a list of item payloads in, one result per item out.
    `@calque.batch(whole_claim=True)`: each call gets the whole claim (an engine that batches for
    itself: vLLM, a pipeline(), generate); a call that raises is retried item by item, as any."""
    def mark(fn):
        fn._calque_role, fn._calque_whole_claim = "batch", whole_claim
        return fn
    return mark if fn is None else mark(fn)


# ------------------------------------------------------------------------------------------------
# 1. settings, errors and paths. A setting comes from the environment, else pool.env (KEY=value
# lines: in the current directory, or the file $CALQUE_ENV names, the one environment-only setting),
# else these. pool.env.example documents each.
DEFAULTS = {
    "CALQUE_STORE": ".calque",          # a path: SQLite + folders; s3://bucket/prefix: SQS + S3
    "CALQUE_STATE": ".calque-state",    # this machine's supervisors and worker logs (not shared)
    "CALQUE_BATCH_SIZE": "32",          # items per handler.batch() call
    "CALQUE_CLAIM_SIZE": "",            # items per claim (one queue message); empty: sized to the run
                                        # and the pool (ClaimSizes, claim_sizing)
    "CALQUE_CLAIM_SECONDS": "30",       # s a claim sized to the run should take at most, once measured
    "CALQUE_VISIBILITY_TIMEOUT": "60",  # s a claim stays invisible to others (heartbeats renew it)
    "CALQUE_MAX_DELIVERIES": "3",       # deliveries of a claim before the dead-letter queue
    "CALQUE_POLL_WAIT": "20",           # s of one long poll (SQS caps it at 20)
    "CALQUE_GRACE": "30",               # s a SIGTERM'd worker has to finish its claim in
    "CALQUE_TIMEOUT": "3600",           # s submit waits for the summaries
    "CALQUE_ENDPOINT_RETRY": "60",      # s an S3/SQS call retries a connection that failed
    "CALQUE_SPOT_POLL": "",             # EC2 metadata address (EC2 bootstrap sets it); empty: off
    "CALQUE_SPOT_INTERVAL": "5",        # s between two spot-interruption checks
    "CALQUE_ROOT_GB": "150",            # GB of an EC2 worker's root volume (gp3): the AMI, CUDA torch and its
                                        # libraries (~10 GB), the pool's packages, a model cache (~$0.02/h)
    "CALQUE_INSTANCE_TYPE": "",         # EC2 type the workers run on, their work priced as it (EC2 bootstrap sets it)
    "CALQUE_GPUS": "",                  # GPU indices the supervisor hands out (empty: NVML's)
    "CALQUE_BATCH_TIMEOUT": "900",      # s a handler call may run before the worker calls it hung
    "CALQUE_CHECKPOINT_SECONDS": "30",  # s of drain and ...
    "CALQUE_CHECKPOINT_BATCHES": "8",   # ... batches, both, between two result parts of a claim
    "CALQUE_TARGET_DRAIN": "60",        # s a pool that sizes itself aims to drain its backlog in
}
ENV_FILE = "pool.env"                   # what settings() reads unless $CALQUE_ENV names a file
LOCAL_POLL_INTERVAL = 0.005             # s between two index probes of the local queue's long poll (~30 us each)
QUEUE_FILE_CHECK = 2.0                  # s between two checks that the local queue file is still the one opened
ENDPOINT_BACKOFF = (0.25, 4.0)          # s: first wait before retrying an unreachable AWS endpoint, doubling to a cap
INCLUDE_MAX_BYTES = 64 << 20           # bytes of files a pool snapshots beside its handler (--include, add_local_*)
ITEM_DEPTH_MAX = 512                    # nesting levels of an item (a manifest nests it 3 deeper; json stops near 1000)
SUMMARY_POLL_MIN = 0.002                # s, the first gap between two summary checks (an idle pool's round trip)
SUMMARY_POLL_MAX = 0.5                  # s between two checks for a claim's summary while results are followed
SUMMARY_POLL_FLOOR = 0.1                # s, the shortest gap once summaries land (a LIST finds several, not one)
SUMMARY_WAIT_MAX = 1.0                  # s, the longest gap between two summary LISTs of a waiting submit
LOCAL_SUMMARY_WAIT = 0.1                # s, the same on the local store, whose LIST is a folder read
SUMMARY_BATCH = 10                      # summaries a LIST should find at the rate they land (sets the gap)
RUN_RECHECK = 1.0                       # s without a new summary before submit looks at the run record and DLQ depth
RUN_RECHECK_MAX = 4.0                   # s, the longest gap between two such looks while the run stays stalled
DLQ_SCAN_WAIT = 1.0                     # s of each receive of a dead-letter scan (an SQS short poll may miss messages)
STORE_WRITERS = 16                      # parallel store writes: staging manifests, cancel marking claims (stage_run)
LOCAL_WRITERS = 2                       # the same on the local store, whose writes wait on no
                                        # network (more threads would only hold more claims)
SEND_BATCH = 10                         # claims per queue send (SQS's SendMessageBatch takes at most 10)
STAGE_AHEAD = 4                         # manifests staged but not sent yet, per store writer (bounds submit's memory)
CLAIM_BYTES = 16 << 20                  # media bytes (bytes values, files) a claim copied into the store holds, at
                                        # most one item more: claims are cut at claim_size items or here
CLAIM_SIZE_MAX = 1000                   # items a claim sized to the run holds at most (ClaimSizes)
CLAIM_SIZE_FLOOR = 10                   # ... at least (more where its measured per-claim costs ask)
CLAIM_OVERHEAD_SHARE = 0.1              # ... at least so that its fixed costs are this share of its time
CLAIM_LOOKAHEAD_MAX = 1 << 17           # items of a stream read ahead of its claims to count the rest
STAGE_BYTES = 64 << 20                  # media bytes staged but not sent yet, at most (bounds submit's memory)
ITEM_BYTES_MAX = 256 << 20              # media bytes one item may hold: a bigger one is refused at submit
READ_BLOCK = 1 << 22                    # bytes of a JSONL items file read at once (4 MiB), at most
READ_FIRST = 1 << 16                    # bytes of its first read (64 KiB), doubling up to READ_BLOCK: the first
                                        # claim waits on ~1k items parsed, not 40k (0.1-0.3 s here)
ERRORS_KEPT = 100                       # per-item error messages kept in a summary (the count is always exact)
ERROR_CHARS = 500                       # an error message is cut to this many characters
ERROR_GROUPS_SHOWN = 5                  # distinct item errors a run report prints (--json has every kept one)
FIRST_ITEMS_SHOWN = 5                   # item indices a run report prints per error
TRACE_FRAMES = 3                        # last traceback frames a failed item's result line carries
QUEUE_OPEN_RETRY = 10.0                 # s to retry opening a queue that does not resolve yet (SQS lag)
QUEUE_REUSE_WAIT = 65.0                 # s after its deletion a queue's name is waited on: SQS takes up to 60
                                        # to delete it (it still resolves) and refuses the name till then
AWS_RETRY_STEP = 5.0                    # s between two tries of a call AWS refuses until it is consistent
REDRIVE_BACKSTOP = 100                  # receives after which SQS itself moves a pool's claim to its DLQ: far
                                        # behind the workers' rule (max deliveries without progress), which a
                                        # claim that makes progress may pass; SQS allows 1000 at most
DEFAULT_REGION = "us-east-1"            # AWS region when neither the environment nor ~/.aws/config names one
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_REPLACED = 75   # a worker whose pool runs another version now (pool deploy): restarted on
                     # it at once by its supervisor, by systemd on EC2 (an exit 0 stays down there)
HERE = os.path.dirname(os.path.abspath(__file__))
WARMD = os.path.join(HERE, "warmd.py")
_warned = set()   # unknown pool.env keys already warned about: one line per key and process


def package_file(package, name):
    """A file calque reads at run time (rates.json, ...), found through its package."""
    import importlib.resources
    return str(importlib.resources.files(package) / name)


def pyproject():
    """calque's pyproject.toml as its package holds it (calque_data/sdist)."""
    import tomllib
    with open(package_file("calque_data", "sdist/pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def calque_version():
    """This calque's version: its package metadata, else (a checkout) its pyproject.toml's."""
    import importlib.metadata
    try:
        return importlib.metadata.version("calque")
    except importlib.metadata.PackageNotFoundError:
        return pyproject()["project"]["version"]


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit 2, nothing lost."""


def command():
    """calque as a hint names it: the way it was run (pip's `calque` or `warmd` script, else the file)."""
    return "calque" if os.path.basename(sys.argv[0]) in ("calque", "warmd") else "python calque.py"


class NotFound(Exception):
    """A store key or a queue that does not exist."""


class Changed(Exception):
    """An object read by reference is not the one submit listed (its size, ETag or mtime)."""


class Unavailable(str):
    """An item by reference that cannot be had (its object changed or vanished since submit): its
    message. The worker fails that item alone with it."""
    __slots__ = ()


class StoreFault(Exception):
    """The store or queue failed, or holds an unreadable record: one line, the next step, exit 1."""


class WorkersFailed(Exception):
    """A pool's workers die before @enter is done: one line naming the first error, exit 1."""


class LeaseLost(Exception):
    """The claim's receipt is no longer valid: another worker may own the message now."""


def settings():
    """The merged settings: DEFAULTS < pool.env < environment."""
    merged = dict(DEFAULTS)
    env_file = os.environ.get("CALQUE_ENV", ENV_FILE)
    if os.path.exists(env_file):
        try:
            with open(env_file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UserError(f"cannot read {env_file} ({e.strerror}) ---> HINT: fix it, or point CALQUE_ENV "
                            f"elsewhere")
        for lineno, line in text_lines(data, env_file):
            parsed = env_line(line, f"{env_file}:{lineno}")
            if parsed:
                merged[parsed[0]] = parsed[1]
    for key in DEFAULTS:
        if key in os.environ:
            merged[key] = os.environ[key]
    return merged


def env_line(line, where):
    """(key, value) of a pool.env line as a shell reads it (`export K=v`, K="v # kept", K=v # note);
    None for a blank or comment line. An unknown CALQUE_* key is warned about, once."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    key, sep, value = re.sub(r"^export\s+", "", line).partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UserError(f"{where}: expected KEY=value, got {line!r}")
    quoted = re.fullmatch(r"""(["'])(.*)\1(\s+#.*)?""", value)
    value = quoted[2] if quoted else re.sub(r"(^|\s+)#.*$", "", value)
    if key.startswith("CALQUE_") and key not in DEFAULTS and key != "CALQUE_ENV" and key not in _warned:
        _warned.add(key)
        print(f"calque: warning: {where}: unknown setting {key}{did_you_mean(key, DEFAULTS)}: ignored",
              file=sys.stderr)
    return key, value


def did_you_mean(name, known):
    """' (did you mean X?)' for the known name closest to `name`, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def text_lines(data, where, first=1):
    """(number, text) of each line of `data` (bytes, its first line numbered `first`), decoded at
    once; bytes that are not UTF-8 are a UserError naming the line."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        lineno, column = data.count(b"\n", 0, e.start) + first, e.start - data.rfind(b"\n", 0, e.start)
        raise UserError(f"{where}:{lineno}: not UTF-8 text (byte {column} of the line) ---> HINT: "
                        f"save the file as UTF-8") from None
    return enumerate(text.split("\n"), first)   # not splitlines(): a string may hold U+2028


_scan_json = json.decoder.JSONDecoder().scan_once   # json's own C scanner, as json.loads uses it


def json_line(text):
    """json.loads(text) for one short line, through json's C scanner alone (half json.loads' cost);
    a line the scanner does not take whole goes to json.loads, for its value or its error."""
    try:
        value, end = _scan_json(text, 0)
        if end == len(text):
            return value
    except StopIteration:
        pass
    return json.loads(text)


def checked_json(text):
    """The value of one JSONL line (checked_line keeps only its shape): orjson's parse, or for what
    orjson refuses, json_line's (json alone takes NaN, lone surrogates, 1e400; nothing else)."""
    if orjson is not None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json_line(text)


def setting_number(conf, key, kind=float, minimum=None):
    try:
        value = kind(conf[key])
    except ValueError:
        raise UserError(f"{key}={conf[key]!r} is not a number: fix it in the environment or pool.env")
    if minimum is not None and value < minimum:
        raise UserError(f"{key}={value} must be at least {minimum}")
    return value


def stop_seconds(conf):
    """How long a signalled worker may take to stop: its grace for the running claim, or an idle
    worker's long poll, which it lets end (SQS still sends a claim to a poll cut short)."""
    return max(setting_number(conf, "CALQUE_GRACE"), setting_number(conf, "CALQUE_POLL_WAIT"))


def now_iso(t=None):
    t = time.time() if t is None else t
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


def write_file_atomic(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# 2. THE CONTRACT: names, store keys, message, summary, result parts, handler loading, numeric
# views, AWS errors. warmd.py imports these; change them with care (docs/contract.md).
POOL_PREFIX, DLQ_PREFIX = "calque-pool-", "calque-dlq-"
RUN_QUEUE_PREFIX, RUN_DLQ_PREFIX = "calque-run-", "calque-rundlq-"
QUEUE_NAME_MAX = 80                     # SQS's limit on a queue name
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # run and claim ids: safe path parts


def slug(model, prefix=POOL_PREFIX):
    """The queue-safe form of a model name, cut so that prefix + slug fits in 80 characters."""
    s = re.sub(r"[^a-z0-9_]", "-", model.lower())
    s = re.sub(r"-+", "-", s).strip("-")
    s = s[: QUEUE_NAME_MAX - len(prefix)].rstrip("-")
    if not s:
        raise UserError(f"model name {model!r} has no letters or digits to name a queue with: "
                        f"pick another name")
    return s


def pool_queue_name(model):
    return POOL_PREFIX + slug(model, POOL_PREFIX)


def dlq_name(model):
    return DLQ_PREFIX + slug(model, DLQ_PREFIX)


def pool_key(model):
    return f"pools/{slug(model)}/pool.json"


def worker_stats_prefix(model):
    return f"pools/{slug(model)}/workers/"


def output_key(prefix, seq, label):
    """A chunk of what a worker's handler printed: MS-PID-SEQ.LABEL, MS by the worker's clock (a
    LIST after a time finds the newer chunks), LABEL the worker's (wN, its slot; or the host)."""
    return f"{prefix}{int(time.time() * 1000):013d}-{os.getpid()}-{seq:06d}.{label}"


def run_key(run_id):
    return f"runs/{run_id}/run.json"


def cold_record_key(run_id):
    return f"runs/{run_id}/pool.json"


def manifest_key(run_id, claim):
    return f"runs/{run_id}/manifests/{claim}.json"


def results_key(run_id, claim):
    return f"runs/{run_id}/results/{claim}.jsonl"


def results_prefix(run_id, claim):
    """The folder of a claim's result parts (and of its attempt record)."""
    return f"runs/{run_id}/results/{claim}/"


def part_key(run_id, claim, start, stop, suffix=".jsonl"):
    """The part holding the claim's results [start, stop): .jsonl, or .npz (encode_part);
    zero-padded, so keys sort in item order."""
    return f"{results_prefix(run_id, claim)}{start:07d}-{stop:07d}{suffix}"


PART_NAME = re.compile(r"^(\d{7})-(\d{7})\.(jsonl|npz)$")


def progress_key(run_id, claim):
    """A long claim's items done so far, as its worker last reported (warmd PROGRESS_SECONDS)."""
    return f"runs/{run_id}/progress/{claim}.json"


def attempt_key(run_id, claim):
    """The attempt record of a redelivered claim: the item a worker runs alone next (poison)."""
    return f"{results_prefix(run_id, claim)}attempt.json"


class ResultsIncomplete(Exception):
    """A claim's result parts do not cover its items: a part is missing or truncated."""


def part_chain(keys, count):
    """(start, stop, key) of the parts among `keys` that cover the claim's items from 0 up to
    `count` or a gap; where two deliveries' parts overlap, the one reaching furthest is taken."""
    parts = [(int(m[1]), int(m[2]), key) for key in keys if (m := PART_NAME.match(key.rsplit("/", 1)[1]))]
    chain, at = [], 0
    while at < count:
        covering = [p for p in parts if p[0] <= at < p[1]]
        if not covering:
            break
        chain.append(max(covering, key=lambda p: p[1]))
        at = chain[-1][1]
    return chain


# Typed results: a numeric array or tensor (a result, or a value of its dict) is stored in binary
# in its dtype (docs/contract.md#typed-result-parts); numpy is imported only where one is met.
NUMERIC_KINDS = "biuf"                  # numpy dtype kinds stored in binary; others as JSON lists
PART_FORMAT = 1                         # index.json's "format" in an .npz part
BYTES = "bytes"                         # a block's dtype for bytes results: uint8, flat, one row each


def host_array(value):
    """(numpy array, dtype name) of a numeric array or tensor, on the host; None for anything else.
    bfloat16, which numpy lacks, is its raw bits as uint16, named "bfloat16"."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):      # a torch tensor, on any device
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            return value.view(sys.modules["torch"].int16).numpy().view("<u2"), "bfloat16"
        value = value.numpy()
    np = sys.modules.get("numpy")       # nothing imported numpy yet: the value is no array
    if np is None or not isinstance(value, np.ndarray) or value.dtype.kind not in NUMERIC_KINDS:
        return None
    name = _dtype_names.get(value.dtype)
    return value, name or _dtype_names.setdefault(value.dtype, value.dtype.name)


_dtype_names = {}   # numpy dtype -> its name (dtype.name is Python code, run once an item)


def batch_rows(outputs, count):
    """A handler's return for `count` items as their results: a list as it is, an array or tensor
    (or a dict of them) split along its first dim; else a ValueError naming both lengths."""
    if isinstance(outputs, (list, tuple)):
        if len(outputs) != count:
            raise ValueError(f"handler returned {len(outputs)} results for a batch of {count} items")
        return list(outputs)
    columns = dict(outputs) if isinstance(outputs, dict) else {None: outputs}
    for key, column in columns.items():
        if hasattr(column, "detach") and hasattr(column, "cpu"):
            columns[key] = column = column.detach().cpu()
        shape = getattr(column, "shape", None) or ((len(column),) if isinstance(column, (list, tuple)) else ())
        what = "" if key is None else f" for {key!r}"
        if not shape:
            raise ValueError(f"handler returned {type(column).__name__}{what} for a batch of "
                             f"{count} items (a list, an array or a dict of them, one row an item)")
        if shape[0] != count:
            raise ValueError(f"handler returned {shape[0]} rows{what} for a batch of {count} items")
    rows = [{key: column[j, ...] if hasattr(column, "shape") else column[j] for key, column in columns.items()}
            for j in range(count)]
    return [row[None] for row in rows] if None in columns else rows


def typed_cells(value):
    """(result with typed values None, [(field, array, dtype)]) of an array or a dict of arrays."""
    if isinstance(value, dict):
        cells = [(key, *typed) for key, v in value.items() if (typed := typed_value(v)) is not None]
        typed_keys = {key for key, _, _ in cells}
        return ({k: None if k in typed_keys else v for k, v in value.items()}, cells) if cells else None
    typed = typed_value(value)
    return (None, [(None, *typed)]) if typed is not None else None


def typed_value(value):
    """host_array of a value, or of bytes their uint8 view, named BYTES: a block like any other."""
    if isinstance(value, (bytes, bytearray)):
        import numpy as np
        return np.frombuffer(value, np.uint8), BYTES
    return host_array(value)


class TypedLines(str):
    """Result lines with each typed value null, carrying `cells`: (line, field, array, dtype)."""
    cells = ()


def _row_ranges(rows):
    """[[start, stop], ...] of sorted row offsets: index.json's compact form of a block's rows."""
    ranges = []
    for row in rows:
        if ranges and ranges[-1][1] == row:
            ranges[-1][1] += 1
        else:
            ranges.append([row, row + 1])
    return ranges


def _npy(array):
    import numpy as np
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def encode_part(chunks):
    """(suffix, data) of a part of these chunks of result lines: .jsonl, their text, when none has
    typed cells; else .npz, a stored zip of results.jsonl, index.json and one b<k>.npy a block (a
    field's arrays of one dtype stacked, or flat with b<k>.shapes.npy where shapes differ)."""
    text, groups, at = "".join(chunks), {}, 0
    for chunk in chunks:
        for offset, field, array, dtype in getattr(chunk, "cells", ()):
            groups.setdefault((field, dtype, array.ndim), []).append((at + offset, array))
        at += chunk.count("\n")
    if not groups:
        return ".jsonl", text
    import numpy as np
    buf, blocks = io.BytesIO(), []
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("results.jsonl", text)
        for k, ((field, dtype, _), cells) in enumerate(groups.items()):
            arrays = [array for _, array in cells]
            uniform = dtype != BYTES and all(a.shape == arrays[0].shape for a in arrays)
            blocks.append({"field": field, "dtype": dtype, "shape": list(arrays[0].shape) if uniform else None,
                           "rows": _row_ranges([row for row, _ in cells])})
            stacked = np.stack(arrays) if uniform else np.concatenate([a.ravel() for a in arrays])
            z.writestr(f"b{k}.npy", _npy(stacked))
            if not uniform:
                z.writestr(f"b{k}.shapes.npy", _npy(np.array([a.shape for a in arrays], dtype=np.int64)))
        z.writestr("index.json", json.dumps({"format": PART_FORMAT, "items": at, "blocks": blocks}))
    return ".npz", buf.getvalue()


class Block(typing.NamedTuple):
    """A typed block of a part: `rows` (offsets) hold `field` in `dtype`, `values` stacked or (with
    `shapes`) flat; bfloat16 values are raw uint16 bits (widen() gives float32)."""
    field: typing.Optional[str]
    dtype: str
    rows: typing.Any
    values: typing.Any
    shapes: typing.Any = None

    def widen(self):
        """The values in a numpy dtype: bfloat16 bits as float32 exactly (its top half)."""
        import numpy as np
        if self.dtype != "bfloat16":
            return self.values
        return (self.values.astype(np.uint32) << 16).view(np.float32)

    def arrays(self):
        """Each row's array, in rows' order (widened); a bytes block's rows as bytes."""
        values = self.widen()
        if self.shapes is None:
            return list(values)
        ends = self.shapes.prod(axis=1).cumsum()
        rows = [values[end - size:end].reshape(shape) for end, size, shape in
                zip(ends, self.shapes.prod(axis=1), self.shapes)]
        return [row.tobytes() for row in rows] if self.dtype == BYTES else rows

    def since(self, skip):
        """The block less its rows before offset `skip`, the rest renumbered from 0."""
        keep = self.rows >= skip
        if self.shapes is None:
            return self._replace(rows=self.rows[keep] - skip, values=self.values[keep])
        import numpy as np
        ends = self.shapes.prod(axis=1).cumsum()
        flat = np.concatenate([self.values[end - size:end] for end, size, k in
                               zip(ends, self.shapes.prod(axis=1), keep) if k] or [self.values[:0]])
        return self._replace(rows=self.rows[keep] - skip, values=flat, shapes=self.shapes[keep])


class Part(typing.NamedTuple):
    """A result part as read: its lines (newline kept; a typed value null) and its blocks."""
    lines: list
    blocks: list

    def since(self, skip):
        return Part(self.lines[skip:], [b.since(skip) for b in self.blocks]) if skip else self


def decode_npz_part(data):
    """(result lines text, [Block]) of an .npz part, values viewing its bytes; ValueError: torn."""
    import numpy as np
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        def member(name):
            info = z.getinfo(name)
            name_size, extra_size = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_size + extra_size
            if info.compress_type != zipfile.ZIP_STORED or start + info.file_size > len(data):
                raise ValueError(f"member {name} is compressed or cut short")
            return memoryview(data)[start:start + info.file_size]
        index = json.loads(z.read("index.json"))
        if index.get("format") != PART_FORMAT:
            raise ValueError(f"part format {index.get('format')!r}, not {PART_FORMAT}: "
                             f"written by another calque")
        blocks = []
        for k, b in enumerate(index["blocks"]):
            rows = np.concatenate([np.arange(a, s) for a, s in b["rows"]])
            blocks.append(Block(b["field"], b["dtype"], rows, npy_view(member(f"b{k}.npy")),
                                None if b["shape"] is not None else npy_view(member(f"b{k}.shapes.npy"))))
        return z.read("results.jsonl").decode(), blocks


def read_part(store, key, start, stop):
    """One part as a Part of stop - start lines, else ResultsIncomplete. Split on "\n" only: a
    result may hold U+2028 and the like, which str.splitlines() would cut at."""
    data, blocks = store.get(key), []
    if key.endswith(".npz"):
        try:
            data, blocks = decode_npz_part(data)
        except (ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise ResultsIncomplete(f"part {key} is unreadable ({type(e).__name__}: {e})")
    text = data if isinstance(data, str) else data.decode()
    lines = text.count("\n")
    if not text.endswith("\n") or lines != stop - start:
        raise ResultsIncomplete(f"part {key} is truncated ({lines} of {stop - start} lines)")
    return Part([line + "\n" for line in text[:-1].split("\n")], blocks)


def read_claim_parts(store, run_id, claim, count, keys=None):
    """The claim's parts holding its `count` results in order, each cut to the items past the one
    before (`keys`: the folder as listed); a gap or a short part raises ResultsIncomplete."""
    keys = store.list(results_prefix(run_id, claim)) if keys is None else keys
    chain = part_chain(keys, count)
    at = chain[-1][1] if chain else 0
    if at < count:
        raise ResultsIncomplete(f"run {run_id} claim {claim}: no result part holds item offset "
                                f"{at} of {count}")
    parts, at = [], 0
    for start, stop, key in chain:
        try:
            parts.append(read_part(store, key, start, stop).since(at - start))
        except ResultsIncomplete as e:
            raise ResultsIncomplete(f"run {run_id} claim {claim}: {e}")
        at = stop
    return parts


def block_texts(block):
    """Each row of a block as JSON text (NaN and infinities null), 1-D rows in one orjson call;
    bytes as {"$bytes": base64}, JSONL's one form of them."""
    if block.dtype == BYTES:
        return [bytes_text(row) for row in block.arrays()]
    values, option = block.widen(), orjson.OPT_SERIALIZE_NUMPY
    if block.shapes is None and values.ndim == 2 and len(values) and values.flags.c_contiguous:
        return [f"[{row}]" for row in orjson.dumps(values, option=option).decode()[2:-2].split("],[")]
    return [orjson.dumps(array, default=to_jsonable, option=option).decode() for array in block.arrays()]


def bytes_text(data):
    return f'{{"$bytes":"{base64.b64encode(data).decode()}"}}'


def result_lines(part):
    """The part's result lines as JSONL prints them, typed values written in as lists."""
    if not part.blocks:
        return part.lines
    lines, parsed = list(part.lines), {}
    for block in part.blocks:
        for row, text in zip(block.rows.tolist(), block_texts(block)):
            if block.field is None and lines[row].endswith('"result":null}\n'):   # spliced in
                lines[row] = f"{lines[row][:-6]}{text}}}\n"
            else:
                parsed.setdefault(row, orjson.loads(lines[row]))["result"][block.field] = orjson.Fragment(text)
    for row, line in parsed.items():
        lines[row] = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE).decode()
    return lines


def with_bytes(line):
    """A parsed result line with its {"$bytes": base64} values (the result, or its dict's) as bytes."""
    def decoded(v):
        return base64.b64decode(v["$bytes"]) if isinstance(v, dict) and v.keys() == {"$bytes"} else v
    if line.get("ok"):
        result = decoded(line["result"])
        line["result"] = {k: decoded(v) for k, v in result.items()} if isinstance(result, dict) else result
    return line


def read_claim_results(store, run_id, claim, count, keys=None):
    """The claim's `count` result lines in item order, as JSONL prints them."""
    return [line for part in read_claim_parts(store, run_id, claim, count, keys) for line in result_lines(part)]


def summary_key(run_id, claim):
    return f"runs/{run_id}/summaries/{claim}.json"


MANIFEST_KEY = re.compile(r"^runs/([A-Za-z0-9][A-Za-z0-9._-]*)/manifests/([A-Za-z0-9][A-Za-z0-9._-]*)\.json$")


def new_run_id(model):
    """<slug>.<UTC time>-<6 hex>: the slug leads, so that IAM can confine a pool's workers to its
    runs (runs/<slug>.*); slugs have no '.', so no slug's runs match another's."""
    return f"{slug(model)}.{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def run_slug(run_id):
    """The slug a run id starts with ('' for an id without one)."""
    return run_id.split(".", 1)[0] if "." in run_id else ""


def run_queue_names(run_id):
    """A cold run's queue and DLQ, named by the id's tail (the slug would not fit in 80 chars)."""
    tail = run_id.rsplit(".", 1)[-1]
    return RUN_QUEUE_PREFIX + tail, RUN_DLQ_PREFIX + tail


def claim_id(index):
    return f"c{index:05d}"


def make_message(run_id, model, manifest_uri, claim, resume=False, version=None):
    # `claim` (an extra field) lets a worker write a failure summary for a claim whose
    # manifest_uri it refuses; `resume` (runs resume, redrive): look for its result parts;
    # `version`: the pool version the run was submitted to, the only one that may run it.
    msg = {"run_id": run_id, "model": model, "manifest_uri": manifest_uri, "claim": claim}
    if version:
        msg["version"] = version
    if resume:
        msg["resume"] = True
    return json.dumps(msg)


def parse_message(body):
    """The message fields, or ValueError naming what is wrong with it."""
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise ValueError(f"body is not JSON ({e})")
    if not isinstance(msg, dict):
        raise ValueError("body is not a JSON object")
    for field in ("run_id", "model", "manifest_uri"):
        if not isinstance(msg.get(field), str) or not msg[field]:
            raise ValueError(f"field {field!r} missing or not a string")
    return msg


def to_jsonable(value):
    """json.dumps default=: numpy and torch values as numbers and lists, enums as their value, UUIDs
    as text, as orjson writes them (warmd encodes results with either)."""
    if hasattr(value, "tolist"):        # numpy arrays and scalars, torch tensors (CPU or not)
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def dumps(value):
    return json.dumps(value, default=to_jsonable, separators=(",", ":"))


# the request counters every backend keeps and every summary carries; the cost model prices them
REQUEST_KEYS = (
    "queue_receives",        # ReceiveMessage calls that returned a claim
    "queue_empty_receives",  # ReceiveMessage calls that returned nothing: billed too
    "queue_other",           # SendMessage, DeleteMessage, ChangeMessageVisibility (heartbeats), ...
    "store_gets",            # S3 GET (manifests, pool record, handler code, summary checks)
    "store_puts",            # S3 PUT (result parts, summaries, stats)
    "store_lists",           # S3 LIST (priced as PUT by S3)
)


def claim_summary(*, run_id, claim, model, worker_id, mode, backend, receive_count, enter_count,
                  started, finished, requests, items=0, failed=(), errors=None, warm_hit=False,
                  enter_seconds_paid=0.0, acquisition_seconds=0.0, model_seconds=None, error=None,
                  notes=(), parts=(), resumed=0, **measured):
    """A claim's completion record, written last. With `error`: a claim not run (dead-lettered);
    model_seconds None: not measured; `parts`: [start, stop] of each part covering it; `resumed`:
    items from earlier deliveries; `measured`: the worker's other measurements."""
    failed, claim_seconds = list(failed), max(0.0, finished - started)
    if error is None and not failed:
        status = "ok"
    else:
        status = "failed" if error is not None or len(failed) == items else "partial"
    occupancy = {"value": None, "source": "drain-loop", "scope": "claim", "measured": model_seconds is not None}
    if model_seconds is not None and claim_seconds > 0:
        occupancy["value"] = round(model_seconds / claim_seconds, 4)
    summary = {
        "run_id": run_id, "claim": claim, "model": model, "worker_id": worker_id, "status": status,
        "items": items, "ok": items - len(failed), "failed": failed, "errors": errors or {},
        "warm_hit": warm_hit, "enter_seconds_paid": round(enter_seconds_paid, 6), "enter_count": enter_count,
        "acquisition_seconds": round(acquisition_seconds, 6), "receive_count": receive_count,
        "claim_seconds": round(claim_seconds, 6), "model_seconds": round(model_seconds or 0.0, 6),
        "occupancy": occupancy, "mode": mode, "backend": backend,
        "started_at": now_iso(started), "finished_at": now_iso(finished),
        "requests": {k: requests.get(k, 0) for k in REQUEST_KEYS}, "notes": list(notes),
        "parts": [list(p) for p in parts], "resumed": resumed, **measured,
    }
    if error is not None:
        summary["error"] = error
    return summary


# ------------------------------------------------------------------------------------------------
# loading a handler (the handler API is at the top): a class file, or a Modal app file
def parse_handler_spec(spec):
    """(path, name): name is ClassName, or for a Modal app Cls.method or a function's name."""
    path, sep, cls = spec.rpartition(":")
    if not sep or not path or not all(part.isidentifier() for part in cls.split(".")) or cls.count(".") > 1:
        raise UserError(f"--handler {spec!r}: expected path/to/file.py:ClassName (a Modal app: "
                        f"Cls, Cls.method or function)")
    if not os.path.isfile(path):
        raise UserError(f"--handler {spec!r}: file {path} not found ---> HINT: give the file's path from "
                        "this folder, as --handler path/file.py:Class")
    return path, cls


def check_handler_source(source, cls, where):
    """Check, without running it, that `source` defines `cls` with @calque.enter and @batch, its
    own or inherited from a class of the same file (a name a subclass redefines hides the base's).
    A base from elsewhere (an import) cannot be read without running the file, whose packages may
    be on the workers only: then the worker's import of the handler checks (load_handler)."""
    tree = parse_source(source, where)
    if imports_modal(tree):
        return check_modal_source(tree, cls, where)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if cls not in classes:
        raise UserError(f"handler {where}: no class {cls} (classes found: {', '.join(classes) or 'none'})")
    roles, names, order, elsewhere = set(), set(), [cls], False
    for name in order:   # the class, then its bases as met: the MRO of a chain of them
        for node in classes[name].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in names:
                names.add(node.name)
                called = (deco.func if isinstance(deco, ast.Call) else deco for deco in node.decorator_list)
                roles.update(deco.attr if isinstance(deco, ast.Attribute) else getattr(deco, "id", "")
                             for deco in called)   # @calque.batch, or called: @calque.batch(whole_claim=True)
        for base in classes[name].bases:
            here = isinstance(base, ast.Name) and base.id in classes
            order += [base.id] if here and base.id not in order else []
            elsewhere |= not here and not (isinstance(base, ast.Name) and base.id == "object")
    missing = [f"@calque.{r}" for r in ("enter", "batch") if r not in roles]
    if missing and not elsewhere:
        raise UserError(f"handler {where}: class {cls} lacks {' and '.join(missing)}: decorate its "
                        "load and batch methods (its own, or a base class's)")


def stream_prefix(model, stream):
    """Where a .remote_gen call's worker writes the generator's items as they come (Streamed)."""
    return f"pools/{slug(model)}/streams/{stream}/"


class Streamed(list):
    """A generator's items, also written to the store for a .remote_gen call (`stream`) as chunks
    {"start": index, "values": [...]}, the first at once, then every STREAM_FLUSH s."""

    def __init__(self, streams, stream):
        ok = streams and isinstance(stream, str) and re.fullmatch(r"[0-9a-f]{32}", stream)
        self.store = streams[0] if ok else None
        self.prefix = stream_prefix(streams[1], stream) if ok else None
        self.sent, self.at, self.timer, self.lock = 0, -STREAM_FLUSH, None, threading.Lock()

    def add(self, value):
        with self.lock:
            self.append(value)
            if not self.prefix or self.timer:
                return
            wait = max(0.0, self.at + STREAM_FLUSH - time.monotonic())
            self.timer = threading.Timer(wait, self._write)
            self.timer.daemon = True
            self.timer.start()

    def _write(self):
        with self.lock:
            chunk, prefix = {"start": self.sent, "values": self[self.sent:]}, self.prefix
            self.sent, self.at, self.timer = len(self), time.monotonic(), None
        try:
            data = json.dumps(chunk, default=to_jsonable).encode()
            if prefix:
                self.store.put(f"{prefix}{chunk['start']:09d}.json", data)
        except Exception:   # a value JSON cannot take, a store fault: the result has them all
            self.prefix = None

    def done(self):
        """No chunk is written after this (the call's result, or its error, says the rest)."""
        with self.lock:
            self.prefix = None
            if self.timer:
                self.timer.cancel()


def import_file(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_handler(path, cls, modal=None, container=False):
    """(instance, enter, batch, collate or None) of the handler class in a file; a Modal app file
    gives a ModalHandler (`modal`: the pool's modal options; `container`: in a worker)."""
    with open(path, "rb") as f:
        if imports_modal(f.read(), path):
            os.environ.update((modal or {}).get("image", {}).get("env", {}))   # before the app runs
            _, target, method = import_modal_app(path, cls, container)
            handler = ModalHandler(target, method, modal or {})
            return handler, handler.enter, handler.batch, handler.collate
    module = import_file(path, "calque_handler_" + re.sub(r"\W", "_", os.path.basename(path)[:-3]))
    obj, methods = getattr(module, cls)(), {}
    for attr in dir(type(obj)):
        role = getattr(getattr(type(obj), attr), "_calque_role", None)
        if role:
            methods[role] = getattr(obj, attr)
    missing = [f"@calque.{r}" for r in ("enter", "batch") if r not in methods]
    if missing:
        raise UserError(f"handler {path}:{cls} lacks {' and '.join(missing)} (its own or a base class's)")
    return obj, methods["enter"], methods["batch"], getattr(obj, "collate", None)


# ------------------------------------------------------------------------------------------------
# Modal app files as handlers: the stand-in `modal` (modal_shim/modal.py) records what the
# decorators declare; ModalHandler gives it a handler's shape (docs/modal.md).
MODAL_CALL_KEY = "__modal_call__"    # a `modal run` call's item: {key: [args, kwargs(, stream)]}
STREAM_FLUSH = 0.5                   # s between two chunks of a .remote_gen call's items (Streamed)
MODAL_GPU_ALIASES = {"A100": "A100-40GB", "A100-40G": "A100-40GB", "A100-80G": "A100-80GB"}  # rates


def parse_source(source, where):
    try:
        return ast.parse(source, filename=where)
    except (SyntaxError, ValueError) as e:   # ValueError: a NUL byte
        raise UserError(f"handler {where}: syntax error on line {getattr(e, 'lineno', '?')}: "
                        f"{getattr(e, 'msg', e)} ---> HINT: python -m py_compile {where}")


def imports_modal(source, where="handler"):
    """Whether a handler's source (bytes, or its parsed tree) imports modal: a Modal app file."""
    tree = source if isinstance(source, ast.AST) else parse_source(source, where)
    return any(isinstance(node, ast.Import) and any(a.name.split(".")[0] == "modal" for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "modal"
               for node in ast.walk(tree))


def check_modal_source(tree, name, where):
    """Check, without running it, that a Modal app file defines `name` (Cls[.method], function)."""
    top, _, method = name.partition(".")
    defined = {node.name: node for node in tree.body
               if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    if top not in defined:
        raise UserError(f"handler {where}: no class or function {top} (found: {', '.join(defined) or 'none'})")
    if method and not any(getattr(n, "name", None) == method for n in getattr(defined[top], "body", [])):
        raise UserError(f"handler {where}: class {top} has no method {method}")


def load_modal_shim():
    """The stand-in `modal` in sys.modules (shadowing a real one: see modal_shim/modal.py)."""
    shim, path = sys.modules.get("modal"), package_file("modal_shim", "modal.py")
    if getattr(shim, "__file__", None) != path:
        shim = import_file(path, "modal")
    return shim


def import_modal_file(path, container=False):
    """(shim, module) of a Modal app file imported under the stand-in; whatever stops the import is
    one UserError naming file and line."""
    shim = load_modal_shim()
    shim.container = container
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:   # its sibling modules import, as under `modal run app.py`
        sys.path.insert(0, folder)
    try:
        return shim, import_file(path, "calque_modal_app_" + re.sub(r"\W", "_", os.path.basename(path)[:-3]))
    except Exception as e:
        if kit_fault(e, path):
            raise
        raise UserError(user_code_error(path, e, container))


def kit_file(filename):
    """Whether a traceback's file is the kit's own code (the stand-in modal included)."""
    path = os.path.realpath(filename)
    return path == os.path.realpath(package_file("modal_shim", "modal.py")) or (
        os.path.dirname(path) == os.path.realpath(HERE)
        and re.fullmatch(r"calque\w*\.py|warmd\.py", os.path.basename(path)) is not None)


def kit_fault(e, path):
    """Whether `e` is the kit's bug, to be raised as such (its traceback, with a note naming the
    kit's line): its innermost frame of the kit's or the app folder's is the kit's. Not when it is
    the app's doing: Unsupported and what the stand-in marks app_error, or an attribute the app
    asked of a stand-in object that lacks it."""
    folder = os.path.join(os.path.dirname(os.path.realpath(path)), "")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if kit_file(f.filename)
              or not f.filename.startswith("<") and os.path.realpath(f.filename).startswith(folder)]
    if not frames or not kit_file(frames[-1].filename) or getattr(e, "app_error", False):
        return False
    if isinstance(e, AttributeError) and len(frames) > 1 and not kit_file(frames[-2].filename):
        return False
    where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"
    e.add_note(f"calque: a bug in calque ({where}), not in {path}: please report it with this "
               "traceback")
    return True


def user_code_error(path, e, container=False):
    """One line for an exception in a user's file: where (file:line) and what."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if os.path.abspath(f.filename) == os.path.abspath(path)]
    where = f"{path}:{e.lineno if isinstance(e, SyntaxError) else (lines or ['?'])[-1]}"
    if type(e).__name__ == "Unsupported":
        return f"{where}: {e}"
    if isinstance(e, SyntaxError):
        return f"{where}: {e.msg} ---> HINT: fix that line (python -m py_compile {path} checks it)"
    if isinstance(e, ImportError) and (e.name or "").startswith("modal."):
        return (f"{where}: import {e.name} is not supported on a calque pool (the stand-in modal "
                f"is one module) ---> HINT: import modal and use modal.X")
    if isinstance(e, ModuleNotFoundError):
        return (f"{where}: module {e.name!r} is not installed in this Python ({sys.executable}) ---> HINT: "
                f"{sys.executable} -m pip install PACKAGE (the one that provides {e.name})"
                + ("" if container else ", or import it inside `with image.imports():`"))
    return f"{where}: {type(e).__name__}: {one_line(e)}"


def one_line(message):
    """An exception's text on one line (a library's message may hold several)."""
    return " ".join(str(message).split())


def import_modal_app(path, name, container=False):
    """(shim, registered object, method name or None) of `name` in a Modal app file."""
    shim, module = import_modal_file(path, container)
    top, _, method = name.partition(".")
    target = getattr(module, top, None)
    if isinstance(target, shim.Function):
        web = getattr(target.raw_f, "_modal_role", {}).get("web")
        if web:
            raise UserError(f"{path}:{name}: {top} is a @modal.{web} web endpoint: a calque pool serves batch "
                            f"claims, not HTTP ---> HINT: name a plain @app.function or @modal.method")
        return shim, target, None
    if not isinstance(target, shim.Cls):
        raise UserError(f"{path}:{name}: {top} is not an @app.cls class or an @app.function function")
    methods = target.methods()
    if method and method not in methods:
        raise UserError(f"{path}:{name}: {top}.{method} is not a @modal.method or @modal.batched "
                        f"method (those: {', '.join(methods) or 'none'})")
    if not method and len(methods) != 1:
        raise UserError(f"{path}:{name}: class {top} has {len(methods)} methods ({', '.join(methods) or 'none'}) "
                        f"---> HINT: name one: --handler {path}:{top}.METHOD")
    return shim, target, method or next(iter(methods))


def read_env_file(path, where):
    """KEY=value lines of a --secret file; none where it is absent (EC2: the pool's env has
    them)."""
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        return dict(filter(None, (env_line(line, f"{where}:{n}") for n, line in text_lines(f.read(), path))))


def modal_param(user_cls, key, value):
    """A --param value (text) as the type the modal.parameter() field is annotated with."""
    kind = typing.get_type_hints(user_cls).get(key, str)
    if not isinstance(value, str) or kind is str:
        return value
    if kind is bool:
        return value.lower() in ("1", "true", "yes")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise UserError(f"--param {key}={value}: {user_cls.__name__}.{key} is annotated {kind.__name__}")


def mount_volume(mount, folder):
    """Make the app's volume mount path (/data) show `folder`: a symlink where nothing is yet."""
    if os.path.lexists(mount):
        if not (os.path.exists(mount) and os.path.samefile(mount, folder)):
            raise UserError(f"volume mount {mount} exists and is not {folder} ---> HINT: move it, "
                            f"or name it with --volume NAME={mount}")
        return
    try:
        os.makedirs(os.path.dirname(mount), exist_ok=True)
        os.symlink(folder, mount)
    except OSError as e:
        raise UserError(f"volume mount {mount}: cannot link it to {folder} ({e.strerror}) ---> "
                        f"HINT: sudo ln -s {folder} {mount} on the worker machine")


def key_values(pairs, flag):
    """{key: value} of repeated `--flag KEY=VALUE` options."""
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"{flag} {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


class ModalHandler:
    """A Modal @app.cls method or @app.function as a calque handler. enter() runs the @modal.enter
    hooks (snap=True first) and __enter__; batch() calls per item (@modal.method; a list item
    splatted, as .starmap) or per max_batch_size items (@modal.batched),
    @modal.concurrent(max_inputs) at once; calque_exit() runs the @modal.exit hooks and __exit__.
    Async hooks and methods run on one event loop, as in a Modal container: what an async @enter
    made on it (a client, a lock, a task) works in the methods."""
    streams = None   # (store, model), set by warmd: where .remote_gen calls' items go (Streamed)

    def __init__(self, target, method, options):
        self.target, self.method, self.options = target, method, options
        self.instance, self.replay, self.loop = None, {}, None
        self.raw = target.user_cls if method else target.raw_f

    def _run(self, value):
        """A hook's or a call's value, a coroutine's awaited on the handler's one event loop."""
        if not inspect.isawaitable(value):
            return value
        if self.loop is None:
            import asyncio
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(value)

    def collate(self, payloads):
        return list(payloads)   # items reach the method as JSON values: no array gathering

    def _hooks(self, kind):
        hooks = [v for v in vars(self.raw).values() if getattr(v, "_modal_role", {}).get("kind") == kind]
        return sorted(hooks, key=lambda fn: not fn._modal_role.get("snap"))

    def enter(self):
        for name, path in self.options.get("secrets", {}).items():
            for key, value in read_env_file(path, f"--secret {name}").items():
                os.environ.setdefault(key, value)
        for secret in self.target.options["secrets"]:   # modal.Secret.from_dict: in the source
            for key, value in secret.values.items():
                os.environ.setdefault(key, value)
        for mount, folder in self.options.get("volumes", {}).items():
            mount_volume(mount, folder)
        if not self.method:
            self.fn = self.raw
            return
        self.instance = self.raw()
        for key, default in self.target.parameters().items():
            value = self.options.get("params", {}).get(key, default)
            if value is inspect.Parameter.empty:
                raise UserError(f"{self.raw.__name__}.{key} is a modal.parameter() without a "
                                f"default: pool create --param {key}=VALUE")
            setattr(self.instance, key, modal_param(self.raw, key, value))
        for hook in self._hooks("enter"):
            self._run(hook(self.instance))
        if hasattr(self.instance, "__enter__"):
            self.instance.__enter__()
        self.fn = getattr(self.instance, self.method)

    def calque_exit(self):
        """On a graceful stop, once the last claim is done."""
        if self.instance is None:
            return
        for hook in self._hooks("exit"):
            self._run(hook(self.instance))
        if hasattr(self.instance, "__exit__"):
            self.instance.__exit__(None, None, None)
        if self.loop:
            self.loop.close()

    def batch(self, payloads):
        role = getattr(self.fn, "_modal_role", {})
        if role.get("kind") == "batched":
            size, out = role["max_batch_size"], []
            for k in range(0, len(payloads), size):   # a list per parameter, as Modal's
                columns = zip(*(self._args(item)[0] for item in payloads[k:k + size]))
                out += self._call([list(c) for c in columns], {})
            return out
        if len(payloads) == 1 and id(payloads[0]) in self.replay:   # warmd retrying one item
            ok, value = self.replay.pop(id(payloads[0]))
            if ok:
                return [value]
            raise value
        outcomes = self._each(payloads)
        if all(ok for ok, _ in outcomes):
            return [value for _, value in outcomes]
        # warmd retries a failed batch item by item: replay each outcome, not a second call
        self.replay = {id(p): outcome for p, outcome in zip(payloads, outcomes)}
        raise next(value for ok, value in outcomes if not ok)

    def _args(self, item):
        """(args, kwargs) of an item: a `modal run` call's own, else the item (a list splatted)."""
        if isinstance(item, dict) and len(item) == 1 and MODAL_CALL_KEY in item:
            args, kwargs, *stream = item[MODAL_CALL_KEY]
            return args, kwargs, *stream[:1]
        required = [p for p in inspect.signature(self.fn).parameters.values() if p.default is p.empty]
        return (item if len(required) > 1 and isinstance(item, list) else [item]), {}

    def _call(self, args, kwargs, stream=None):
        out = self._run(self.fn(*args, **kwargs))   # an async @modal.batched's awaited
        if not hasattr(out, "__next__"):
            return out
        items = Streamed(self.streams, stream)
        try:
            for value in out:
                items.add(value)
        finally:
            items.done()
        return list(items)

    def _each(self, payloads):
        """[(ok, result or exception)] per item, max_inputs at once."""
        calls = [self._args(item) for item in payloads]
        limit = getattr(self.raw, "_modal_concurrent",
                        self.target.options.get("allow_concurrent_inputs") or 1)
        if inspect.iscoroutinefunction(self.fn) or inspect.isasyncgenfunction(self.fn):
            return self._run(self._each_async(calls, limit))

        def one(call):
            try:
                return True, self._call(*call)
            except Exception as e:
                return False, e
        if limit <= 1:
            return [one(c) for c in calls]
        with ThreadPoolExecutor(min(limit, len(calls))) as pool:
            return list(pool.map(one, calls))

    async def _each_async(self, calls, limit):
        import asyncio
        gate = asyncio.Semaphore(limit)

        async def one(call):
            async with gate:
                try:
                    out = self.fn(*call[0], **call[1])
                    if hasattr(out, "__anext__"):
                        items = Streamed(self.streams, call[2] if len(call) > 2 else None)
                        try:
                            async for value in out:
                                items.add(value)
                        finally:
                            items.done()
                        return True, list(items)
                    return True, await out
                except Exception as e:
                    return False, e
        return await asyncio.gather(*(one(c) for c in calls))


# ------------------------------------------------------------------------------------------------
# numeric items as views, and what an AWS error says
NPY_HEADER_MAX = 10 + 65535   # bytes of a version 1.0 .npy header at most (plain dtypes')


def npy_view(data):
    """A read-only numpy array over a .npy object's bytes, not copied; refuses object dtypes
    (pickle) and Fortran order."""
    import numpy as np
    f = io.BytesIO(bytes(data[:NPY_HEADER_MAX]))   # the header alone: the values are not copied
    version = np.lib.format.read_magic(f)
    fmt = np.lib.format
    read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, fortran_order, dtype = read_header(f)
    if dtype.hasobject or fortran_order:
        raise ValueError("object or Fortran-ordered array refused")
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(data, dtype=dtype, count=count, offset=f.tell()).reshape(shape)


def array_items(store, manifest):
    """A numeric claim's items: [{field: view into the fetched bytes}], merged into the manifest's
    JSON `items` when it has both; None where `valid` is False."""
    fields, count = {}, manifest["count"]
    for name, keys in manifest["arrays"].items():
        values, offsets, valid = (npy_view(store.get(keys[role])) if role in keys else None
                                  for role in ("values", "offsets", "valid"))
        if (offsets is not None and len(offsets) != count + 1) or (offsets is None and len(values) != count) \
                or (valid is not None and len(valid) != count):
            raise ValueError(f"field {name!r} does not hold {count} items")
        fields[name] = (values, offsets, valid)
    items = manifest.get("items") or [{} for _ in range(count)]
    if len(items) != count:
        raise ValueError(f"'items' does not hold {count} items")
    return merge_fields(items, fields)


def merge_fields(items, fields):
    """Set each {field: (values, offsets, valid)} in the items, row i item i's."""
    for name, (values, offsets, valid) in fields.items():
        for i, item in enumerate(items):
            item[name] = (None if valid is not None and not valid[i] else
                          values[i] if offsets is None else values[offsets[i]:offsets[i + 1]])
    return items


def bytes_items(store, manifest, items):
    """Set a manifest's `bytes` in its items: each [k, path, start, stop] of `at` is the slice of
    the object `key` found at `path` (dict keys, list indices) in item k; an empty path: item k."""
    entry = manifest["bytes"]
    blob = store.get(entry["key"])
    for k, path, start, stop in entry["at"]:
        if not 0 <= start <= stop <= len(blob):
            raise ValueError(f"bytes [{start}, {stop}) are outside {entry['key']}")
        if not path:
            items[k] = blob[start:stop]
            continue
        node = items[k]
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = blob[start:stop]
    return items


def manifest_items(store, manifest):
    """A claim's items as its manifest holds them: JSON `items`, numeric `arrays` merged in, `bytes`
    set in (the by-reference forms, `refs` and `rows`, are warmd's: it fetches them)."""
    items = array_items(store, manifest) if "arrays" in manifest else manifest["items"]
    if not isinstance(items, list):
        raise ValueError("'items' is not a list")
    return bytes_items(store, manifest, items) if "bytes" in manifest else items


SQS_NOT_FOUND = ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist")   # no such queue
SQS_DELETED_RECENTLY = ("AWS.SimpleQueueService.QueueDeletedRecently", "QueueDeletedRecently")
STALE_RECEIPT = ("ReceiptHandleIsInvalid", "InvalidParameterValue")   # an ack's receipt went stale


def _aws_error_code(error):
    return _aws_error_info(error).get("Code", "")


def _aws_error_info(error):
    """The Error part of a botocore error's response; {} for none (a dropped connection's)."""
    return (getattr(error, "response", None) or {}).get("Error", {})


def aws_error_line(error):
    """'AccessDenied: ... (CreateQueue)' from a botocore error, else its text."""
    info = _aws_error_info(error)
    if info:
        return f"{info.get('Code')}: {info.get('Message')} ({getattr(error, 'operation_name', '?')})"
    return str(error)


def aws_retry(fn, retryable, what, bound, sleep, hint):
    """fn()'s answer. While AWS refuses it with an error `retryable` accepts (AWS not consistent yet:
    a new instance profile, a queue name just freed), it is called again every AWS_RETRY_STEP s,
    what it waits for said once; past `bound` s of waiting, one line says so and `hint`."""
    waited = 0.0
    while True:
        try:
            return fn()
        except Exception as e:
            if not retryable(e):
                raise
            if waited >= bound:
                raise UserError(f"gave up after {waited:.0f} s waiting for {what}: "
                                f"{aws_error_line(e)} ---> HINT: {hint}") from None
            if not waited:
                print(f"waiting for {what} (AWS answers {_aws_error_code(e)}; {bound:.0f} s at "
                      f"most)", file=sys.stderr)
            sleep(AWS_RETRY_STEP)
            waited += AWS_RETRY_STEP


def deleted_queue_key(name):
    return f"queues/{name}.deleted.json"


def note_queue_deleted(store, name):
    """Keep when this store's queue `name` was deleted: for up to 60 s SQS still resolves it."""
    store.put(deleted_queue_key(name), json.dumps({"queue": name, "deleted_at": time.time()}))


def wait_queue_reusable(store, name, sleep):
    """Before queue `name` is created or resolved: wait out what is left of QUEUE_REUSE_WAIT since
    it was deleted (said in one line), so that the dying queue is not taken for a live one."""
    try:
        deleted_at = json.loads(store.get(deleted_queue_key(name)))["deleted_at"]
    except (NotFound, ValueError, KeyError, TypeError):
        return
    left = min(deleted_at + QUEUE_REUSE_WAIT - time.time(), QUEUE_REUSE_WAIT)
    if left > 0:
        print(f"queue {name} was deleted {QUEUE_REUSE_WAIT - left:.0f} s ago and SQS may still be "
              f"deleting it: waiting {left:.0f} s before creating it again", file=sys.stderr)
        sleep(left)
    store.delete(deleted_queue_key(name))


def redrive_policy(dlq_arn, max_deliveries):
    """A pool queue's RedrivePolicy: SQS moves a claim received REDRIVE_BACKSTOP times (twice max
    deliveries, if more) to the DLQ as it was sent, a backstop for a claim no worker can end."""
    receives = min(1000, max(REDRIVE_BACKSTOP, 2 * int(max_deliveries)))
    return json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": receives})


def aws_client_config(region):
    """The botocore settings of every AWS client: standard retries, timeouts of seconds, and a
    connection each for a worker's 16 fetch threads and the rest (botocore keeps 10: more are
    opened, used once and dropped, with a warning each)."""
    import botocore.config
    retries = {"mode": "standard"}
    if "AWS_MAX_ATTEMPTS" not in os.environ:   # botocore's own retries a call, unless set
        retries["max_attempts"] = 5
    return botocore.config.Config(region_name=region, retries=retries, connect_timeout=5, read_timeout=30,
                                  max_pool_connections=32)


# ------------------------------------------------------------------------------------------------
# 3. backends. A backend is a store (get/put/put_new/exists/list/delete/delete_prefix/uri/
# key_for_uri) plus queues (create/open/delete_queue; a queue: send/receive/delete/
# change_visibility/counts). Both count their requests in `requests` (priced by the cost model).
class Message:
    __slots__ = ("body", "receipt", "receive_count")

    def __init__(self, body, receipt, receive_count):
        self.body, self.receipt, self.receive_count = body, receipt, receive_count


class Requests(Counter):
    """A backend's request counts (REQUEST_KEYS). Inside `with requests.tally(counter)` a thread's
    requests also count in `counter`, else in `loose` (warmd's overlapping claims: one each)."""

    def __init__(self, *args, **kwargs):
        self.loose, self._thread = Counter(), threading.local()
        super().__init__(*args, **kwargs)

    def __setitem__(self, key, value):
        tally = getattr(self._thread, "tally", self.loose)
        tally[key] += value - self.get(key, 0)
        super().__setitem__(key, value)

    @contextlib.contextmanager
    def tally(self, counter):
        """This thread's requests also count in `counter` (None: in no tally)."""
        saved = getattr(self._thread, "tally", self.loose)
        self._thread.tally = Counter() if counter is None else counter
        try:
            yield
        finally:
            self._thread.tally = saved

    def carried(self, fn):
        """fn, to run on another thread with this thread's tally."""
        tally = getattr(self._thread, "tally", self.loose)

        def run(*args):
            with self.tally(tally):
                return fn(*args)
        return run

    def take(self):
        """This thread's tally plus the loose requests, both emptied; the thread's next requests
        count in no tally until its tally block ends (a summary taken now counts its own last
        writes)."""
        mine = getattr(self._thread, "tally", None)
        taken, self.loose = self.loose, Counter()
        if mine is not None:
            taken = taken + mine
            self._thread.tally = Counter()
        return taken


class LocalStore:
    """A directory of objects: a write goes to a temporary file renamed over the key (never half an
    object; not fsynced). A file system error is a StoreFault naming the key."""

    def __init__(self, root, requests):
        self.root = os.path.realpath(root)
        self.requests = requests
        self.keys_listed = 0   # keys every list() returned (a bench measures a waiting submit)

    def _path(self, key):
        return os.path.join(self.root, key)

    def uri(self, key):
        return "file://" + self._path(key)

    def key_for_uri(self, uri):
        """The key a URI names, or None when it points outside this store's root."""
        if not uri.startswith("file://"):
            return None
        path = os.path.realpath(uri[len("file://"):])
        if not path.startswith(self.root + os.sep):
            return None
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _fault(self, doing, key, error):
        return StoreFault(f"store {self.root}: cannot {doing} {key} ({error.strerror or error}) "
                          f"---> HINT: check that the folder is writable and has free space, "
                          f"then retry")

    def get(self, key):
        self.requests["store_gets"] += 1
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(key)
        except OSError as e:
            raise self._fault("read", key, e) from None

    def fetch(self, key, size, mtime_ns):
        """get of an object read by reference: Changed unless it has the size and mtime (ns) that
        submit listed."""
        self.requests["store_gets"] += 1
        try:
            with open(self._path(key), "rb") as f:
                unchanged(os.fstat(f.fileno()), size, mtime_ns)
                return f.read()
        except FileNotFoundError:
            raise NotFound(key)
        except OSError as e:
            raise self._fault("read", key, e) from None

    def put(self, key, data):
        self.requests["store_puts"] += 1
        self._publish(key, data, os.replace)

    def put_new(self, key, data):
        """put where the key does not exist yet; True when this call wrote it. os.link of the whole
        temporary file fails on an existing name: of two racing writers one wins."""
        self.requests["store_puts"] += 1
        return self._publish(key, data, _link_new)

    def _publish(self, key, data, place):
        """Write data beside the key, then place(tmp, path); the temporary file never outlives
        it."""
        path = self._path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data if isinstance(data, bytes) else data.encode())
            return place(tmp, path)
        except OSError as e:
            failed = e
        finally:
            with contextlib.suppress(FileNotFoundError):   # left by os.link, or a partial write
                os.remove(tmp)
        with contextlib.suppress(OSError):   # a folder made for this key alone goes too
            os.rmdir(os.path.dirname(path))
        raise self._fault("write", key, failed)

    def delete(self, key):
        """Remove the key, and its folder if left empty (on S3 a folder is only a prefix)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(key))
        with contextlib.suppress(OSError):   # not empty: another key lives there
            os.rmdir(os.path.dirname(self._path(key)))

    def exists(self, key):
        self.requests["store_gets"] += 1
        return os.path.exists(self._path(key))

    def list(self, prefix, start_after=None):
        """Keys under a prefix ending in '/', one level deep, in order; with `start_after`, only
        those that sort after it (as S3's StartAfter)."""
        self.requests["store_lists"] += 1
        try:
            names = os.listdir(self._path(prefix))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._fault("list", prefix, e) from None
        keys = sorted(prefix + n for n in names if ".tmp-" not in n)
        if start_after is not None:
            keys = [k for k in keys if k > start_after]
        self.keys_listed += len(keys)
        return keys

    def delete_prefix(self, prefix):
        """Delete every key under the prefix; returns (objects, bytes) deleted."""
        sizes = [os.path.getsize(os.path.join(d, f))
                 for d, _, files in os.walk(self._path(prefix)) for f in files]
        shutil.rmtree(self._path(prefix), ignore_errors=True)   # files removed meanwhile are fine
        if os.path.lexists(self._path(prefix)):                 # a folder that stayed is not
            raise StoreFault(f"store {self.root}: cannot delete {prefix} ---> HINT: check the "
                             f"folder's permissions, then retry")
        return len(sizes), sum(sizes)


def unchanged(seen, size, mtime_ns):
    """Raise Changed unless a file's os.stat result has the size and mtime submit listed."""
    if seen.st_size != size:
        raise Changed(f"size {size} -> {seen.st_size}")
    if seen.st_mtime_ns != mtime_ns:
        raise Changed(f"modified at {now_iso(seen.st_mtime_ns / 1e9)}")


def _link_new(tmp, path):
    """os.link that answers False where `path` exists already."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False


class LocalQueues:
    """SQS semantics on one SQLite file (WAL: many workers read while one writes); a claim takes the
    write lock (BEGIN IMMEDIATE) for its UPDATE, so two workers never receive the same message."""

    SCHEMA = """
    CREATE TABLE IF NOT EXISTS queues (
        name TEXT PRIMARY KEY, visibility_timeout REAL NOT NULL, created_at REAL NOT NULL);
    CREATE TABLE IF NOT EXISTS messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, body TEXT NOT NULL,
        visible_at REAL NOT NULL, receive_count INTEGER NOT NULL DEFAULT 0, receipt TEXT, sent_at REAL NOT NULL);
    CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue, visible_at);
    """
    SQL_READY = "SELECT 1 FROM messages WHERE queue = ? AND visible_at <= ? LIMIT 1"
    SQL_NEXT = ("SELECT id, body, receive_count FROM messages WHERE queue = ? AND visible_at <= ? "
                "ORDER BY visible_at, id LIMIT 1")
    SQL_TAKE = "UPDATE messages SET visible_at = ?, receive_count = receive_count + 1, receipt = ? WHERE id = ?"
    SQL_VISIBILITY = "UPDATE messages SET visible_at = ? WHERE id = ? AND receipt = ?"
    SQL_DELETE = "DELETE FROM messages WHERE id = ? AND receipt = ?"
    SQL_COUNTS = ("SELECT COALESCE(SUM(visible_at <= ?), 0), COALESCE(SUM(visible_at > ?), 0) "
                  "FROM messages WHERE queue = ?")

    def __init__(self, path, requests):
        self.path, self.requests = path, requests
        self._local = threading.local()   # a lazy connection per thread (the heartbeat's own)

    def db(self):
        """This thread's connection. Every QUEUE_FILE_CHECK s it checks that the path still holds
        its file; if not (deleted, replaced), a StoreFault, and the next call opens the new one."""
        local = self._local
        if getattr(local, "conn", None) is not None and time.monotonic() >= local.check_at:
            local.check_at = time.monotonic() + QUEUE_FILE_CHECK
            if _file_id(self.path) != local.file_id:
                local.conn.close()
                local.conn = None
                raise StoreFault(f"local queue {self.path} was deleted or replaced under this process: the claims "
                                 f"it held are gone ---> HINT: recreate the pools (`pool create` "
                                 f"is idempotent) and submit their runs again")
        if getattr(local, "conn", None) is None:
            local.conn, local.file_id = self._open()
            local.check_at = time.monotonic() + QUEUE_FILE_CHECK
        return local.conn

    def _open(self):
        """A new connection and its file's id. A queue file gone while its -wal and -shm remain:
        those are removed first, under a lock (live processes' log would corrupt the new file)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if os.path.exists(self.path):
            return self._connect()
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(self.path):
                for side in ("-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.path + side)
            return self._connect()

    def _connect(self):
        conn = sqlite3.connect(self.path, timeout=10, isolation_level=None)   # autocommit
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")   # durable across process crashes, not power loss
        conn.executescript(self.SCHEMA)
        return conn, _file_id(self.path)

    @contextlib.contextmanager
    def transaction(self):
        db = self.db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def create_queue(self, name, visibility_timeout, dead_letter=None):
        """`dead_letter`: SQS's backstop (SqsQueues); here the workers' rule alone moves claims."""
        with self.transaction() as db:
            db.execute("INSERT INTO queues VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                       "visibility_timeout = excluded.visibility_timeout",
                       (name, visibility_timeout, time.time()))
        return LocalQueue(self, name, visibility_timeout)

    def open_queue(self, name):
        row = self.db().execute("SELECT visibility_timeout FROM queues WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(f"queue {name}")
        return LocalQueue(self, name, row[0])

    def delete_queue(self, name):
        with self.transaction() as db:
            db.execute("DELETE FROM messages WHERE queue = ?", (name,))
            db.execute("DELETE FROM queues WHERE name = ?", (name,))


def _file_id(path):
    """(device, inode) of the file at path, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class LocalQueue:
    def __init__(self, queues, name, visibility_timeout):
        self.queues, self.name, self.visibility_timeout = queues, name, visibility_timeout

    def send(self, body):
        self.send_batch([body])

    def send_batch(self, bodies):
        """Send up to SEND_BATCH messages in one transaction (one request, as SendMessageBatch)."""
        self.queues.requests["queue_other"] += 1
        now = time.time()
        with self.queues.transaction() as db:
            db.executemany("INSERT INTO messages (queue, body, visible_at, sent_at) VALUES (?, ?, ?, ?)",
                           [(self.name, body, 0.0, now) for body in bodies])

    def receive(self, wait_seconds, should_stop=lambda: False):
        """One message or None after wait_seconds: an index is probed every LOCAL_POLL_INTERVAL, and
        the write lock taken only when a message is ready."""
        deadline = time.monotonic() + wait_seconds
        while True:
            now = time.time()
            if self.queues.db().execute(LocalQueues.SQL_READY, (self.name, now)).fetchone():
                with self.queues.transaction() as tx:
                    row = tx.execute(LocalQueues.SQL_NEXT, (self.name, now)).fetchone()
                    if row:
                        receipt = f"{row[0]}:{uuid.uuid4().hex}"
                        tx.execute(LocalQueues.SQL_TAKE, (now + self.visibility_timeout, receipt, row[0]))
                if row:
                    self.queues.requests["queue_receives"] += 1
                    return Message(row[1], receipt, row[2] + 1)
            if time.monotonic() >= deadline or should_stop():
                self.queues.requests["queue_empty_receives"] += 1
                return None
            time.sleep(LOCAL_POLL_INTERVAL)

    def change_visibility(self, message, seconds):
        self.queues.requests["queue_other"] += 1
        with self.queues.transaction() as db:
            row_id = int(message.receipt.split(":")[0])
            changed = db.execute(LocalQueues.SQL_VISIBILITY,
                                 (time.time() + seconds, row_id, message.receipt)).rowcount
        if not changed:
            raise LeaseLost(f"queue {self.name}: receipt no longer valid")

    def delete(self, message):
        """Ack. False when the receipt went stale (the message went to another worker)."""
        return not self.delete_batch([message])

    def delete_batch(self, messages):
        """Ack up to SEND_BATCH messages in one transaction; those whose receipt went stale."""
        self.queues.requests["queue_other"] += 1
        with self.queues.transaction() as db:
            return [m for m in messages
                    if db.execute(LocalQueues.SQL_DELETE, (int(m.receipt.split(":")[0]), m.receipt)).rowcount != 1]

    def created_at(self):
        """Epoch s the queue was created (a queue created after a run was sent lost its claims)."""
        self.queues.requests["queue_other"] += 1
        row = self.queues.db().execute("SELECT created_at FROM queues WHERE name = ?", (self.name,)).fetchone()
        return row[0]

    def counts(self):
        self.queues.requests["queue_other"] += 1
        now = time.time()
        visible, in_flight = self.queues.db().execute(LocalQueues.SQL_COUNTS, (now, now, self.name)).fetchone()
        return {"visible": int(visible), "in_flight": int(in_flight)}


class LocalBackend:
    kind = "local"

    def __init__(self, root):
        self.requests = Requests()
        self.root = os.path.abspath(root)
        self.store = LocalStore(self.root, self.requests)
        self.queues = LocalQueues(os.path.join(self.root, "queue.db"), self.requests)

    def describe(self):
        return self.root

    def check(self, prefix=""):
        """The store's folder, or where it would be made: made only by its first write, so that a
        command that fails leaves none behind."""
        found = self.root
        while not os.path.lexists(found):
            found = os.path.dirname(found)
        if not os.path.isdir(found) or found != self.root and not os.access(found, os.W_OK):
            raise UserError(f"store {self.root} cannot be created ({found} is not a writable "
                            f"folder): set CALQUE_STORE to a writable folder")


def endpoint_retried(method):
    """An S3 or SQS call that outlasts an endpoint blip: a dropped, refused or timed-out connection
    is retried with backoff (ENDPOINT_BACKOFF) for `endpoint_retry` s, then it is a StoreFault. Only
    calls that may run twice carry it (a repeated send is a duplicate claim, acked as one)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        import botocore.exceptions
        deadline = time.monotonic() + self.endpoint_retry
        delay = ENDPOINT_BACKOFF[0]
        while True:
            try:
                return method(self, *args, **kwargs)
            except (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError) as e:
                if time.monotonic() + delay > deadline:
                    raise StoreFault(f"AWS endpoint {self.endpoint} unreachable for {self.endpoint_retry:g} s "
                                     f"({type(e).__name__}) ---> HINT: check the network and AWS_ENDPOINT_URL, "
                                     f"then retry (a submitted run goes on: `runs show RUN` reads it)") from e
            time.sleep(delay)
            delay = min(delay * 2, ENDPOINT_BACKOFF[1])
    return call


class S3Store:
    def __init__(self, s3, bucket, prefix, requests, endpoint_retry=0.0):
        self.s3, self.bucket, self.prefix, self.requests = s3, bucket, prefix, requests
        self.endpoint_retry = endpoint_retry
        self.keys_listed = 0   # keys every list() returned (a bench measures a waiting submit)
        self.endpoint = s3.meta.endpoint_url if s3 else None

    def _key(self, key):
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key):
        return f"s3://{self.bucket}/{self._key(key)}"

    def key_for_uri(self, uri):
        root = self.uri("")
        if not uri.startswith(root) or "/../" in uri or uri.endswith("/..") or "/./" in uri:
            return None
        return uri[len(root):]

    @endpoint_retried
    def get(self, key):
        self.requests["store_gets"] += 1
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            raise NotFound(key)

    @endpoint_retried
    def fetch(self, key, size, etag):
        """get of an object read by reference (If-Match its ETag): Changed unless it is the one
        submit listed; a refusal (403: the role cannot read it yet, IAM is eventually consistent)
        is a StoreFault, which lets the claim go and come back, not an item's failure."""
        self.requests["store_gets"] += 1
        try:
            data = self.s3.get_object(Bucket=self.bucket, Key=self._key(key), IfMatch=etag)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            raise NotFound(key)
        except Exception as e:
            code = _aws_error_code(e)
            if code in ("PreconditionFailed", "412"):
                raise Changed(f"its ETag is no longer {etag}") from None
            if code in ("AccessDenied", "403"):
                raise StoreFault(f"cannot read {self.uri(key)}: {aws_error_line(e)}") from None
            raise
        if len(data) != size:
            raise Changed(f"size {size} -> {len(data)}")
        return data

    def walk(self, prefix=""):
        """(key under `prefix`, size, ETag) of every object under it, in key order, a LIST page
        (1000 keys) at a time as they come: a prefix of any size is never held whole."""
        more, strip = {}, len(self._key(prefix))
        while True:
            page = self._page(Prefix=self._key(prefix), **more)
            for o in page.get("Contents", []):
                yield o["Key"][strip:], o["Size"], o["ETag"]
            if not page.get("IsTruncated"):
                return
            more = {"ContinuationToken": page["NextContinuationToken"]}

    @endpoint_retried
    def _page(self, **params):
        self.requests["store_lists"] += 1
        return self.s3.list_objects_v2(Bucket=self.bucket, **params)

    @endpoint_retried
    def put(self, key, data):
        self.requests["store_puts"] += 1
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key),
                           Body=data if isinstance(data, bytes) else data.encode())

    @endpoint_retried
    def put_new(self, key, data):
        """put where the key does not exist yet (If-None-Match: *); True when this call wrote it. S3
        answers 412 when it exists, 409 while a racing conditional write runs (ask again)."""
        self.requests["store_puts"] += 1
        for delay in (0.05, 0.1, 0.2, 0.4, 0.8, None):
            try:
                self.s3.put_object(Bucket=self.bucket, Key=self._key(key), IfNoneMatch="*",
                                   Body=data if isinstance(data, bytes) else data.encode())
                return True
            except Exception as e:
                code = _aws_error_code(e)
                if code == "PreconditionFailed":
                    return False
                if code != "ConditionalRequestConflict" or delay is None:
                    raise
                time.sleep(delay)

    @endpoint_retried
    def exists(self, key):
        self.requests["store_gets"] += 1
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            if _aws_error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            if _aws_error_code(e) not in ("403", "AccessDenied"):
                raise
        # S3 answers a missing key's HEAD with 403 unless it deems the caller may list it; whether a
        # ListBucket grant limited by s3:prefix counts is not documented: ask the listing it grants
        found = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=self._key(key), MaxKeys=1)
        return any(o["Key"] == self._key(key) for o in found.get("Contents", []))

    @endpoint_retried
    def list(self, prefix, start_after=None):
        """Keys and folders one level under a prefix, as LocalStore.list."""
        keys = []
        more = {"StartAfter": self._key(start_after)} if start_after is not None else {}
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix),
                                                                  Delimiter="/", **more)
        for page in pages:
            self.requests["store_lists"] += 1
            keys += [o["Key"] for o in page.get("Contents", [])]
            keys += [p["Prefix"].rstrip("/") for p in page.get("CommonPrefixes", [])]
        strip = len(self._key(""))
        self.keys_listed += len(keys)
        return sorted(k[strip:] for k in keys)

    @endpoint_retried
    def delete_prefix(self, prefix):
        """Delete every key under the prefix, a DeleteObjects a page; returns (objects, bytes)."""
        count = size = 0
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                  Prefix=self._key(prefix))
        for page in pages:
            self.requests["store_lists"] += 1
            objects = page.get("Contents", [])
            if objects:
                keys = [{"Key": o["Key"]} for o in objects]
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                self.requests["store_puts"] += 1
                count, size = count + len(objects), size + sum(o["Size"] for o in objects)
        return count, size

    def delete(self, key):
        """Delete one object; one that is not there is no error (S3 answers 204 either way)."""
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))


class SqsQueues:
    def __init__(self, sqs, requests, endpoint_retry=0.0):
        self.sqs, self.requests = sqs, requests
        self.sleep = time.sleep     # waits on SQS (a queue name just freed); a test's clock instead
        self.endpoint_retry, self.endpoint = endpoint_retry, sqs.meta.endpoint_url

    @endpoint_retried
    def create_queue(self, name, visibility_timeout, dead_letter=None):
        """Create or resolve the queue. `dead_letter`: (its DLQ, max deliveries), a redrive policy
        (the backstop). A name deleted less than a minute ago is waited on, said."""
        attributes = {"VisibilityTimeout": str(int(visibility_timeout))}
        if dead_letter:
            dlq_arn = self.sqs.get_queue_attributes(QueueUrl=dead_letter[0].url, AttributeNames=[
                "QueueArn"])["Attributes"]["QueueArn"]
            attributes["RedrivePolicy"] = redrive_policy(dlq_arn, dead_letter[1])
        try:
            url = aws_retry(lambda: self.sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"],
                            lambda e: _aws_error_code(e) in SQS_DELETED_RECENTLY,
                            f"SQS to free the name {name} (deleted less than 60 s ago)", QUEUE_REUSE_WAIT,
                            self.sleep, "run the command again in a minute")
        except Exception as e:
            if _aws_error_code(e) not in ("QueueAlreadyExists", "QueueNameExists"):
                raise
            url = self.sqs.get_queue_url(QueueName=name)["QueueUrl"]   # other settings: ours
            self.sqs.set_queue_attributes(QueueUrl=url, Attributes=attributes)
        return SqsQueue(self, name, url, visibility_timeout)

    @endpoint_retried
    def open_queue(self, name):
        """Resolve a queue, retrying briefly: a new queue may take seconds to resolve on SQS."""
        deadline = time.monotonic() + QUEUE_OPEN_RETRY
        delay = 0.1
        while True:
            try:
                url = self.sqs.get_queue_url(QueueName=name)["QueueUrl"]
                break
            except Exception as e:
                if _aws_error_code(e) not in SQS_NOT_FOUND:
                    raise
                if time.monotonic() >= deadline:
                    raise NotFound(f"queue {name}")
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        attrs = self.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout"])["Attributes"]
        return SqsQueue(self, name, url, int(attrs["VisibilityTimeout"]))

    @endpoint_retried
    def delete_queue(self, name):
        try:
            self.sqs.delete_queue(QueueUrl=self.sqs.get_queue_url(QueueName=name)["QueueUrl"])
        except Exception as e:
            if _aws_error_code(e) not in SQS_NOT_FOUND:
                raise


class SqsQueue:
    def __init__(self, queues, name, url, visibility_timeout):
        self.queues, self.name, self.url, self.visibility_timeout = queues, name, url, visibility_timeout
        self.sqs, self.endpoint_retry, self.endpoint = queues.sqs, queues.endpoint_retry, queues.endpoint

    @endpoint_retried
    def send(self, body):
        self.queues.requests["queue_other"] += 1
        self.sqs.send_message(QueueUrl=self.url, MessageBody=body)

    @endpoint_retried
    def send_batch(self, bodies):
        """Send up to SEND_BATCH messages in one request; an entry refused is sent again alone."""
        self.queues.requests["queue_other"] += 1
        reply = self.sqs.send_message_batch(QueueUrl=self.url, Entries=[
            {"Id": str(n), "MessageBody": body} for n, body in enumerate(bodies)])
        for failed in reply.get("Failed", []):
            self.send(bodies[int(failed["Id"])])

    def receive(self, wait_seconds, should_stop=lambda: False):
        # should_stop is not consulted in the long poll: warmd's SIGTERM handler interrupts it
        reply = self.sqs.receive_message(QueueUrl=self.url, MaxNumberOfMessages=1,
                                         WaitTimeSeconds=math.ceil(min(wait_seconds, 20)),
                                         MessageSystemAttributeNames=["ApproximateReceiveCount"])
        messages = reply.get("Messages", [])
        if not messages:
            self.queues.requests["queue_empty_receives"] += 1
            return None
        self.queues.requests["queue_receives"] += 1
        m = messages[0]
        count = int(m.get("Attributes", {}).get("ApproximateReceiveCount", 1))
        return Message(m["Body"], m["ReceiptHandle"], count)

    def change_visibility(self, message, seconds):
        self.queues.requests["queue_other"] += 1
        try:
            self.sqs.change_message_visibility(QueueUrl=self.url, ReceiptHandle=message.receipt,
                                               VisibilityTimeout=int(seconds))
        except Exception as e:
            if _aws_error_code(e) in (*STALE_RECEIPT, "MessageNotInflight"):
                raise LeaseLost(f"queue {self.name}: {e}")
            raise

    @endpoint_retried
    def delete(self, message):
        self.queues.requests["queue_other"] += 1
        try:
            self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=message.receipt)
            return True
        except Exception as e:
            if _aws_error_code(e) in STALE_RECEIPT:
                return False
            raise

    @endpoint_retried
    def delete_batch(self, messages):
        """Ack up to SEND_BATCH messages in one request; returns those whose receipt went stale. An
        entry failed for another reason is acked again alone."""
        self.queues.requests["queue_other"] += 1
        reply = self.sqs.delete_message_batch(QueueUrl=self.url, Entries=[
            {"Id": str(n), "ReceiptHandle": m.receipt} for n, m in enumerate(messages)])
        failed = [(messages[int(f["Id"])], f.get("Code")) for f in reply.get("Failed", [])]
        return [m for m, code in failed if code in STALE_RECEIPT or not self.delete(m)]

    @endpoint_retried
    def created_at(self):
        self.queues.requests["queue_other"] += 1
        return float(self.sqs.get_queue_attributes(QueueUrl=self.url, AttributeNames=["CreatedTimestamp"])[
            "Attributes"]["CreatedTimestamp"])

    @endpoint_retried
    def counts(self):
        self.queues.requests["queue_other"] += 1
        attrs = self.sqs.get_queue_attributes(QueueUrl=self.url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return {"visible": int(attrs["ApproximateNumberOfMessages"]),
                "in_flight": int(attrs["ApproximateNumberOfMessagesNotVisible"])}


class AwsBackend:
    """SQS + S3 through boto3's credential chain and region; AWS_ENDPOINT_URL (or _SQS / _S3) points
    it at moto_server or LocalStack."""
    kind = "aws"

    def __init__(self, uri, endpoint_retry=None):
        import boto3   # imported here so that the embedded backend never loads it
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise UserError(f"CALQUE_STORE={uri!r} names no bucket: use s3://bucket/prefix")
        self.uri, self.bucket = uri, bucket
        self.requests = Requests()
        if endpoint_retry is None:
            endpoint_retry = setting_number(settings(), "CALQUE_ENDPOINT_RETRY", float, 0)
        self.session = boto3.session.Session()
        # boto3's resolution: AWS_REGION / AWS_DEFAULT_REGION, then ~/.aws/config's profile
        self.region = self.session.region_name or DEFAULT_REGION
        config = aws_client_config(self.region)
        data = self.data_session(boto3)
        self.store = S3Store(data.client("s3", config=config), bucket, prefix.strip("/"), self.requests,
                             endpoint_retry)
        self.queues = SqsQueues(data.client("sqs", config=config), self.requests, endpoint_retry)

    @staticmethod
    def data_session(boto3):
        """A session whose clients leave the answers' timestamps as text: calque reads none, and
        parsing them is much of a LIST's CPU. `session` (EC2, IAM...) parses them as usual."""
        import botocore.session
        core = botocore.session.get_session()
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=lambda text: text)
        return boto3.session.Session(botocore_session=core)

    def describe(self):
        return self.uri

    def check(self, prefix=""):
        import botocore.exceptions
        try:   # a LIST, not HeadBucket: a worker's role may list only under its own prefixes
            self.store.s3.list_objects_v2(Bucket=self.bucket, Prefix=self.store._key(prefix), MaxKeys=1)
        except botocore.exceptions.NoCredentialsError:
            raise UserError("no AWS credentials found: configure them (aws configure, or "
                            "AWS_ACCESS_KEY_ID) or use a local CALQUE_STORE")
        except botocore.exceptions.EndpointConnectionError as e:
            raise UserError(f"cannot reach the S3 endpoint ({e}): check AWS_ENDPOINT_URL and the network")
        except botocore.exceptions.ClientError as e:
            if _aws_error_code(e) in ("404", "NoSuchBucket", "NotFound"):
                raise UserError(f"bucket {self.bucket} does not exist: create it (aws s3 mb "
                                f"s3://{self.bucket}) or fix CALQUE_STORE")
            raise UserError(f"bucket {self.bucket} is not usable ({_aws_error_code(e)}): check "
                            "your credentials' S3 permissions")


def open_backend(store=None, check_prefix=""):
    """The backend CALQUE_STORE names, checked by a LIST under check_prefix (a worker's folder)."""
    store = store or settings()["CALQUE_STORE"]
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", store) and not store.startswith("s3://") or store.startswith("s3/"):
        raise UserError(f"CALQUE_STORE={store!r} looks like a mistyped URI ---> HINT: "
                        f"s3://bucket/prefix for S3, or a folder path (./{store} if a folder of "
                        f"that name is meant)")
    backend = AwsBackend(store) if store.startswith("s3://") else LocalBackend(store)
    backend.check(check_prefix)
    return backend


# ------------------------------------------------------------------------------------------------
# 4. records: pool records, run records, summaries, worker stats (all JSON in the store)
def read_json(backend, key, fix=None):
    """A JSON object of the store; one unparsable or no object is a StoreFault (`fix`: what to
    do)."""
    data = backend.store.get(key)
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:   # ValueError: not JSON, or not UTF-8
        raise corrupt_record(backend, key, str(e).splitlines()[0] if str(e) else type(e).__name__, fix) from None
    if not isinstance(value, dict):
        raise corrupt_record(backend, key, f"a JSON {type(value).__name__}, not an object", fix)
    return value


def corrupt_record(backend, key, why, fix=None):
    return StoreFault(f"store record {key} is corrupt ({why}) ---> HINT: "
                      + (fix or f"repair or delete {backend.store.uri(key)}"))


def write_json(backend, key, value):
    backend.store.put(key, json.dumps(value, indent=1, default=to_jsonable))


def load_pool(backend, model, missing=None):
    """The pool record of `model`; none: a UserError naming the closest pool and `missing`."""
    fix = (f"`{command()} pool delete --model {model} --yes --force` deletes the pool by its "
           f"names, then create it again")
    try:
        record = read_json(backend, pool_key(model), fix)
    except NotFound:
        names = [read_json(backend, folder + "/pool.json").get("model") for folder in backend.store.list("pools/")
                 if backend.store.exists(folder + "/pool.json")]
        close = did_you_mean(model, [n for n in names if isinstance(n, str)])
        raise UserError(f"no pool for model {model!r} in {backend.describe()}{close} ---> HINT: " + (
            missing or f"create it: `{command()} pool create --model {model} --handler "
                       f"file.py:Class` (`pool list` lists the pools)")) from None
    if not isinstance(record.get("model"), str):
        raise corrupt_record(backend, pool_key(model), "no model name", fix)
    if record["model"] != model:
        raise UserError(f"model {model!r} shares its queue name with the pool of "
                        f"{record['model']!r}: use that exact name")
    return record


def name_key(model):
    """Who owns a slug: {"model": M}, the model of pools/<slug>/ (written once, atomically)."""
    return f"pools/{slug(model)}/name.json"


@contextlib.contextmanager
def pool_name_claimed(backend, model, queues=()):
    """Hold the model's slug (queue names, store folder) during `pool create`: the first model to
    write pools/<slug>/name.json (create-if-absent) owns it, so a colliding name (Foo/Bar, foo-bar)
    is refused even at the same moment. A create of a new pool that fails before its record leaves
    nothing: the slug's folder goes, and `queues` (those it makes)."""
    existed = None
    with contextlib.suppress(NotFound):
        existed = read_json(backend, pool_key(model)).get("model")
    owner = existed or model
    created = owner == model and backend.store.put_new(name_key(model), json.dumps({"model": model}))
    if owner == model and not created:
        owner = read_json(backend, name_key(model)).get("model")
    if owner != model:
        raise slug_clash(model, owner)
    try:
        yield
    except BaseException:
        if not existed and not backend.store.exists(pool_key(model)):
            with contextlib.suppress(Exception):   # the error being raised is the one to report
                backend.store.delete_prefix(f"pools/{slug(model)}/")
            for queue in queues:
                with contextlib.suppress(Exception):
                    backend.queues.delete_queue(queue)
        raise


def check_slug_free(backend, model):
    """The pool record under the model's slug, or None; a UserError when it is another model's."""
    try:
        existing = read_json(backend, pool_key(model))
    except NotFound:
        return None
    if existing["model"] != model:
        raise slug_clash(model, existing["model"])
    return existing


def slug_clash(model, owner):
    """The error of a model whose slug (queue names, store folder) is another model's."""
    return UserError(f"model {model!r} shares its queue name {pool_queue_name(model)} with the pool "
                     f"of {owner!r} ---> HINT: use that exact name, or one that differs in more "
                     f"than case or punctuation")


def pool_settings(conf, batch_size=None, visibility_timeout=None, max_deliveries=None):
    """{batch_size, visibility_timeout, max_deliveries}: each flag given (>= 1), or its setting."""
    given = {"batch_size": batch_size, "visibility_timeout": visibility_timeout, "max_deliveries": max_deliveries}
    for name, value in given.items():
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    return {k: v or setting_number(conf, f"CALQUE_{k.upper()}", int, 1) for k, v in given.items()}


def snapshot_handler(handler_spec, key_prefix, put, include=()):
    """Check the handler file and put(key, data) it into the store: the code every worker runs.
    `include`: [local, relative path] of files it needs, put as one tar.gz. Returns its record."""
    path, cls = parse_handler_spec(handler_spec)
    with open(path, "rb") as f:
        source = f.read()
    check_handler_source(source, cls, path)
    key = f"{key_prefix}handler/{os.path.basename(path)}"
    put(key, source)
    record = {"key": key, "file": os.path.basename(path), "class": cls,
              "sha256": hashlib.sha256(source).hexdigest(), "source_path": os.path.abspath(path)}
    if include:
        blob, files = include_snapshot(include)
        record["include"] = {"key": f"{key_prefix}handler/include.tar.gz",
                             "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
                             "files": files}
        put(record["include"]["key"], blob)
    return record


def pool_version(record):
    """The record's version id: a digest of its handler snapshot (code, class, --include files) and
    of what shapes results beside it (batch size, a Modal app's options); worker counts, timeouts
    and retries are not part of it (docs/contract.md, "Versions")."""
    h = record["handler"]
    shaping = [h["file"], h["class"], h["sha256"], h.get("include", {}).get("sha256"),
               record["batch_size"], record.get("modal")]
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def version_of(record):
    """The record's version (computed for a record from before versions); None without a handler."""
    return record.get("version") or (pool_version(record) if "handler" in record else None)


def version_label(record):
    """`3f2a9c1e0b7d (b.py:B, batch 32)`: a version as status and errors name it."""
    h = record.get("handler", {})
    return (f"{version_of(record)} ({h.get('file')}:{h.get('class')}, "
            f"batch {record.get('batch_size')})")


def refuse_other_version(existing, record, handler_spec):
    """pool create of a pool that exists: refused in one line when `record` is another version
    (`pool deploy` changes it); True when it is the same one (nothing to change)."""
    if existing is None or version_of(existing) is None:   # none, or an EC2 create cut short
        return False
    if version_of(existing) != record["version"]:
        batch = (f" --batch-size {record['batch_size']}"
                 if existing.get("batch_size") != record["batch_size"] else "")
        raise UserError(f"pool {record['model']} runs version {version_label(existing)}, not "
                        f"{version_label(record)}: nothing changed ---> HINT: {command()} pool "
                        f"deploy --model {record['model']} --handler {handler_spec}{batch} "
                        "replaces its workers")
    return True


def include_snapshot(include):
    """(tar.gz bytes, file count) of [local, relative path] pairs, byte-identical for the same files
    (a re-created pool keeps its digest); at most INCLUDE_MAX_BYTES."""
    members = {}
    for local, rel in include:
        if not os.path.exists(local):
            raise UserError(f"include {local}: not found ---> HINT: name a file or folder that exists here")
        rel = os.path.normpath(rel)
        if rel.startswith("..") or os.path.isabs(rel):
            raise UserError(f"include {local}: its place {rel} is outside the handler's folder")
        if os.path.isdir(local):
            for root, dirs, names in os.walk(local):
                dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
                for name in names:
                    full = os.path.join(root, name)
                    members[os.path.normpath(os.path.join(rel, os.path.relpath(full, local)))] = full
        else:
            members[rel] = local
    total = sum(os.path.getsize(p) for p in members.values())
    if total > INCLUDE_MAX_BYTES:
        raise UserError(f"include: {len(members)} files of {total / 2**20:.1f} MiB, over the "
                        f"{INCLUDE_MAX_BYTES >> 20} MiB a pool snapshots with its handler ---> HINT: put large data "
                        f"in a folder the workers see (--volume) or in the store, and read it in @enter")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for rel in sorted(members):   # a link as what it points to; no times, no owners
            info = tarfile.TarInfo(rel)
            info.size, info.mode = os.path.getsize(members[rel]), os.stat(members[rel]).st_mode & 0o755
            with open(members[rel], "rb") as f:
                tar.addfile(info, f)
    return gzip.compress(raw.getvalue(), mtime=0), len(members)


def include_paths(paths, handler_spec):
    """--include PATH options as [local, relative path]: its place beside the handler."""
    folder = os.path.dirname(os.path.abspath(parse_handler_spec(handler_spec)[0]))
    out = []
    for path in paths or ():
        rel = os.path.relpath(os.path.abspath(path), folder)
        out.append([os.path.abspath(path), os.path.basename(path.rstrip("/")) if rel.startswith("..") else rel])
    return out


def unpack_include(store, include, folder):
    """Unpack include_snapshot's tar.gz (sha256 checked) as `folder` unless it is there: into a new
    folder renamed in place, so that a worker starting beside never sees half of it."""
    if os.path.isdir(folder):
        return
    blob = store.get(include["key"])
    if hashlib.sha256(blob).hexdigest() != include["sha256"]:
        raise UserError(f"include snapshot {include['key']} does not match the pool record's "
                        f"sha256: recreate the pool")
    fresh = f"{folder}.tmp-{os.getpid()}"
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        tar.extractall(fresh, filter="data")
    try:
        os.rename(fresh, folder)
    except OSError:   # another worker's came first: the same files
        shutil.rmtree(fresh, ignore_errors=True)


def list_summaries(backend, run_id, after_claim=None):
    """The run's summary keys in key order; with `after_claim`, only those after that claim's."""
    start_after = summary_key(run_id, after_claim) if after_claim is not None else None
    return [k for k in backend.store.list(f"runs/{run_id}/summaries/", start_after) if k.endswith(".json")]


def summary_claims(backend, run_id):
    """The claims of the run that have a summary (one LIST; no summary is read)."""
    return {key.rsplit("/", 1)[1][:-len(".json")] for key in list_summaries(backend, run_id)}


def read_run(backend, run_id):
    if not SAFE_ID.match(run_id):
        raise UserError(f"run id {run_id!r} is not a run id: see `{command()} runs list`")
    try:
        return _run_defaults(read_json(backend, run_key(run_id)))
    except NotFound:
        raise UserError(f"no run {run_id} in {backend.describe()}: see `{command()} runs list`")


def _run_defaults(run):
    """A run record as read: an older one without `sent` or `staged` had them all, and kept its
    --id-field and plan beside its `options`."""
    run.setdefault("sent", len(run["claims"]))
    run.setdefault("staged", True)
    run.setdefault("options", {key: run[key] for key in ("id_field", "plan") if run.get(key)})
    return run


def update_run(backend, run, **fields):
    """Set `fields` in the stored run record, read again first (a cancel is kept); `run` too."""
    stored = read_json(backend, run_key(run["run_id"]))
    stored.update(fields)
    write_json(backend, run_key(run["run_id"]), stored)
    run.update(stored)
    return run


def list_runs(backend, model=None):
    """Every run record in the store (only `model`'s when given), oldest first."""
    runs = []
    for folder in backend.store.list("runs/"):
        if model is None or run_slug(folder.rsplit("/", 1)[1]) == slug(model):
            with contextlib.suppress(NotFound):
                runs.append(_run_defaults(read_json(backend, folder + "/run.json")))
    return sorted(runs, key=lambda r: r["created_at"])


def latest_runs(backend, named):
    """`named` (a run id or a list of them), each "latest" replaced by the id of the store's newest run."""
    if "latest" not in ([named] if isinstance(named, str) else named):
        return named
    runs = list_runs(backend)
    if not runs:
        raise UserError(f"no runs in {backend.describe()}: `latest` names none ---> HINT: {command()} submit first")
    swap = lambda run_id: runs[-1]["run_id"] if run_id == "latest" else run_id   # noqa: E731
    return swap(named) if isinstance(named, str) else [swap(r) for r in named]


def claim_items(run, index):
    """The number of items in the run's claim `index`: claim_size each, the last one the rest, or
    as `claim_counts` says (media cut claims short at CLAIM_BYTES)."""
    if "claim_counts" in run:
        return run["claim_counts"][index]
    return min(run["claim_size"], run["items"] - index * run["claim_size"])


def claim_sizes(run):
    """[[size, count], ...] of the run's claims in order, equal neighbours counted together."""
    lengths = []
    for size in (claim_items(run, k) for k in range(len(run["claims"]))):
        if lengths and lengths[-1][0] == size:
            lengths[-1][1] += 1
        else:
            lengths.append([size, 1])
    return lengths


def format_sizes(lengths, shown=8):
    """[[size, count], ...] as '2x75, 2x38, 1x6' (the first `shown` groups)."""
    more = f", ... ({len(lengths) - shown} more)" if len(lengths) > shown else ""
    return ", ".join(f"{count}x{size}" for size, count in lengths[:shown]) + more


def claims_progress(backend, run_id, claims):
    """{claim: items done} of these running claims, from their workers' progress records."""
    reported = {key.rsplit("/", 1)[1][:-5] for key in backend.store.list(f"runs/{run_id}/progress/")}
    done = {}
    for claim in reported & set(claims):
        with contextlib.suppress(NotFound, ValueError, KeyError):
            done[claim] = read_json(backend, progress_key(run_id, claim))["done"]
    return done


def read_summaries(backend, run_id):
    """The run's summaries in key order: STORE_WRITERS GETs at a time on S3 (each waits on the
    network), one at a time locally (a read is CPU: threads would contend)."""
    keys = list_summaries(backend, run_id)
    if backend.kind == "local":
        return [read_json(backend, k) for k in keys]
    with ThreadPoolExecutor(STORE_WRITERS) as readers:
        return list(readers.map(lambda key: read_json(backend, key), keys))


def read_worker_stats(backend, model):
    return [read_json(backend, k) for k in backend.store.list(worker_stats_prefix(model)) if k.endswith(".json")]


def queue_depth(backend, name):
    """{visible, in_flight} of a queue, or None when it does not exist (a half-made pool)."""
    try:
        return backend.queues.open_queue(name).counts()
    except NotFound:
        return None

# ---- the scaling decision both paths follow (local supervisor, EC2 step policy) and what it is fed
SCALE_MEASURED_CLAIMS = 50              # latest claim summaries the drain rate is measured on
SCALE_IDLE_MINUTES = 5.0                # idle window of a pool with a floor below its ceiling


class Scale(typing.NamedTuple):
    """The decision's inputs and output, logged together: a desired count between lo and hi."""
    visible: int
    in_flight: int
    current: int
    seconds_per_claim: float | None     # measured (recent summaries); None: not measured yet
    target_drain: float                 # s the backlog should take to drain
    lo: int
    hi: int
    idle_window: float                  # s of surplus before the pool shrinks
    surplus_since: float | None         # since when the pool has more workers than it needs
    now: float
    desired: int = 0

    def line(self):
        spc = "unmeasured" if self.seconds_per_claim is None else f"{self.seconds_per_claim:.3g} s/claim"
        return (f"scale: backlog {self.visible}+{self.in_flight} in flight, {spc}, drain target "
                f"{self.target_drain:g} s, bounds {self.lo}..{self.hi}: {self.current} -> {self.desired}")


def desired_count(visible, in_flight, current, seconds_per_claim, target_drain, lo, hi, idle_window,
                  surplus_since, now):
    """How many workers a pool should have: enough to drain the backlog (visible + in flight) in
    `target_drain` s at the measured seconds per claim, no fewer than hold claims (a pipelined
    worker holds two: claims in flight never grow it), at most the claims, within lo..hi. Growing
    is immediate; shrinking waits for `idle_window` s of surplus. Pure: the caller passes back the
    returned Scale's `surplus_since`."""
    backlog = visible + in_flight
    need = backlog if seconds_per_claim is None else min(backlog, math.ceil(backlog * seconds_per_claim /
                                                                              target_drain))
    need = max(lo, min(hi, max(need, min(in_flight, current), min(backlog, 1))))
    since = None if need >= current else (now if surplus_since is None else surplus_since)
    desired = current if since is not None and now - since < idle_window else need
    return Scale(visible, in_flight, current, seconds_per_claim, target_drain, lo, hi, idle_window,
                 since if desired == current else None, now, desired)


def recent_summaries(backend, model, limit=SCALE_MEASURED_CLAIMS):
    """Up to `limit` summaries of claims the pool's workers ran, newest run first; of a longer run,
    ten stretches of five consecutive claims spread over it: the run measured whole (its first
    claims share the cores with submit's staging), with its workers and their gaps between claims."""
    found = []
    for run_id in sorted((f.rsplit("/", 1)[1] for f in backend.store.list("runs/")), reverse=True):
        keys = list_summaries(backend, run_id) if run_slug(run_id) == slug(model) else []
        take = min(SCALE_MEASURED_CLAIMS, limit - len(found))
        step = max(5, math.ceil(len(keys) / (take // 5 or 1)))    # five claims in each tenth of it
        keys = [key for at in range(0, len(keys), step) for key in keys[at:at + 5]][:take]
        found += [s for s in (read_json(backend, key) for key in keys)
                  if s.get("mode") == "pool" and not s.get("error") and s.get("items")]
        if len(found) >= limit:
            break
    return found


def measured_seconds(summaries):
    """(seconds per claim, per item) of the drain in these summaries, @enter left out."""
    seconds = sum(max(0.0, s["claim_seconds"] - s.get("enter_seconds_paid", 0.0)) for s in summaries)
    items = sum(s["items"] for s in summaries)
    return (seconds / len(summaries), seconds / items) if items else (None, None)


def pool_bounds(count, lo, hi, idle_minutes, noun):
    """(lo, hi, idle window s or None) of --{noun} N, --min-{noun} A, --max-{noun} B and
    --scale-to-zero-after: N alone is A = B = N; a window or a ceiling alone floors at 0; a floor
    below the ceiling gets SCALE_IDLE_MINUTES."""
    if count is not None and hi is not None and count != hi:
        raise UserError(f"--{noun} {count} and --max-{noun} {hi}: two ceilings ---> HINT: --{noun} "
                        f"N alone (a fixed N), or --min-{noun} A --max-{noun} B")
    if count is not None and count < 0:
        raise UserError(f"--{noun} {count}: must be 0 or more")
    ceiling = f"--{noun}" if hi is None else f"--max-{noun}"
    hi = count if hi is None else hi
    if hi is None or hi < 0 or (lo is not None and not 0 <= lo <= hi):
        given = [f"{f} {v}" for f, v in ((f"--min-{noun}", lo), (ceiling, hi)) if v is not None]
        raise UserError(f"{' '.join(given)}: give 0 <= min <= max ---> HINT: e.g. --min-{noun} 0 "
                        f"--max-{noun} 4")
    if idle_minutes is not None and not (math.isfinite(idle_minutes) and idle_minutes > 0):
        raise UserError(f"--scale-to-zero-after {idle_minutes}: not a number of minutes above 0 "
                        f"---> HINT: e.g. --scale-to-zero-after 10 (fractions allowed: 0.5)")
    if lo is None:
        lo = 0 if idle_minutes is not None or count is None else hi
    if lo == hi and idle_minutes is None:
        return lo, hi, None
    return lo, hi, 60.0 * (SCALE_IDLE_MINUTES if idle_minutes is None else idle_minutes)



# ------------------------------------------------------------------------------------------------
# 5. submit and runs: read items, stage and send claims, wait on summaries, cancel, redrive, report
def read_items(path, columns=None):
    """Items from a JSONL file ('-': stdin), each a JsonText, read as staged but its first block at
    once (a bad line there is refused first). A .npy or .npz file is numeric (ArrayItems); a Parquet
    or Arrow file, folder or glob is a table (TableItems) of which `columns` are read; a folder or
    glob of other files, or an s3:// prefix or glob, is one item a file (FileItems)."""
    if path.endswith((".npy", ".npz")):
        return ArrayItems.load(path)
    folder = glob.has_magic(path) or os.path.isdir(path)
    if not path.startswith("s3://") and (path.endswith(TABLE_SUFFIXES) or folder and _holds_tables(path)):
        return TableItems.open(path, columns)
    if folder or path.startswith("s3://"):
        return FileItems.open(path, columns)
    if columns:
        raise UserError(f"--columns applies to Parquet or Arrow input, not {path}")
    try:
        stream = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise unreadable_items(path, e) from None
    blocks = jsonl_blocks(stream, path)
    return itertools.chain(next(blocks), itertools.chain.from_iterable(blocks))


def unreadable_items(path, error):
    """The UserError for an items file that cannot be opened (missing, a folder, no permission)."""
    where = "" if os.path.isabs(path) else f", relative to {os.getcwd()}"
    return UserError(f"cannot read items file {path}: {error.strerror or error} ---> HINT: give "
                     f"the path of a JSONL, .npy or .npz file, of a Parquet or Arrow file or "
                     f"folder, of a folder of files or a quoted glob (or - for stdin){where}")


def jsonl_blocks(stream, path):
    """The items of a JSONL stream, a list per block (READ_FIRST bytes, doubling to READ_BLOCK). A
    bad line is a UserError naming path:line; so is a stream without items."""
    lineno, rest, count, size = 1, b"", 0, READ_FIRST
    with stream:
        while True:
            try:
                block = stream.read1(size)   # what is there, up to a block: a pipe's lines
                size = min(2 * size, READ_BLOCK)
            except OSError as e:
                raise UserError(f"cannot read items file {path}: {e.strerror}") from None
            data = rest + block
            if block:
                cut = data.rfind(b"\n") + 1
                data, rest = data[:cut], data[cut:]
            items = [checked_line(line, path, n) for n, line in text_lines(data, path, lineno) if line.strip()]
            lineno += data.count(b"\n")
            if items:
                count += len(items)
                yield items
            if not block:
                break
    if not count:
        raise UserError(f"{path} holds no items: give one JSON item per line")


class JsonText(str):
    """An item as its JSONL line, checked and trimmed: its manifest takes the text as it is."""
    __slots__ = ()


def checked_line(line, path, lineno):
    """The JsonText of one JSONL line, or a UserError naming path:lineno (submit refuses a bad line,
    no worker dead-letters it). An item nested deeper than ITEM_DEPTH_MAX is refused too: its
    manifest nests it deeper, and json.loads stops near 1000 levels."""
    try:
        item = checked_json(line)
        deep = (len(line) > ITEM_DEPTH_MAX and line.count("[") + line.count("{") > ITEM_DEPTH_MAX
                and json_depth(item) > ITEM_DEPTH_MAX)
    except RecursionError:
        deep = True
    except ValueError as e:   # a JSONDecodeError, or an integer over Python's 4300 digits
        raise UserError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)}): "
                        f"one JSON item per line") from None
    if deep:
        raise UserError(f"{path}:{lineno}: nested deeper than {ITEM_DEPTH_MAX} levels ---> HINT: "
                        f"flatten the item (calque nests it inside a manifest)")
    return JsonText(line.strip(" \t\r"))   # JSON's whitespace (a valid line has no other)


def json_depth(value):
    """Levels of nested arrays and objects in a parsed JSON value, walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node)]
    return deepest


class ArrayItems:
    """Numeric items from a .npy file (item i = {"input": a[i]}) or a .npz file, array `k` [N, ...]
    the field k of every item; `k_offsets` (N+1 indices) makes `k` ragged. Staged as .npy objects
    per claim and field, which the worker maps as views: no per-item parsing, no pickle."""

    def __init__(self, fields, count, source):
        self.fields, self.count, self.source = fields, count, source   # name -> (values, offsets)

    def __len__(self):
        return self.count

    @classmethod
    def load(cls, path):
        return cls.from_arrays(read_arrays(path), path)

    def chunks(self, sizes):
        """(start, stop, None, 0) of each claim (sizes: ClaimSizes): the arrays are sliced when staged."""
        start = 0
        while start < self.count:
            stop = min(start + sizes.next(self.count - start), self.count)
            yield start, stop, None, 0
            start = stop

    @classmethod
    def from_arrays(cls, arrays, path):
        """From {name: array}; `path` names them in errors."""
        import numpy as np
        arrays = {name: np.asarray(values) for name, values in arrays.items()}
        fields, counts = {}, {}
        for name, values in arrays.items():
            if name.endswith("_offsets") and name[:-len("_offsets")] in arrays:
                continue
            if values.dtype.hasobject or values.dtype.kind not in "biuf":
                raise UserError(f"{path}: array {name!r} has dtype {values.dtype}: only numeric arrays are items")
            offsets = arrays.get(name + "_offsets")
            if offsets is not None:
                if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 1 or offsets[0] != 0 \
                        or offsets[-1] != len(values) or (np.diff(offsets) < 0).any() or values.ndim != 1:
                    raise UserError(f"{path}: {name}_offsets must be N+1 increasing ints from 0 to "
                                    f"len({name}) over a 1-D {name}")
                counts[name] = len(offsets) - 1
            else:
                if values.ndim == 0:
                    raise UserError(f"{path}: array {name!r} is a scalar: its first axis must index the items")
                counts[name] = values.shape[0]
            fields[name] = (np.ascontiguousarray(values), offsets)
        if len(set(counts.values())) > 1:
            raise UserError(f"{path}: fields disagree on the item count: {counts}")
        count = next(iter(counts.values()), 0)
        if count == 0:
            raise UserError(f"{path} holds no items")
        return cls(fields, count, path)

    def stage(self, backend, run_id, claim, start, stop):
        """Write this claim's slice of every field as .npy; the manifest's `arrays`."""
        fields = {}
        for name, (values, offsets) in self.fields.items():
            if offsets is None:
                fields[name] = {"values": values[start:stop]}
            else:
                fields[name] = {"values": values[offsets[start]:offsets[stop]],
                                "offsets": offsets[start:stop + 1] - offsets[start]}
        return stage_arrays(backend, run_id, claim, fields)


def stage_arrays(backend, run_id, claim, fields):
    """Write each field's {role: array} (values, offsets, valid) as .npy objects; returns the
    manifest's `arrays` ({field: {role: key}}), keys numbered (a column name need not be safe)."""
    import numpy as np
    entry = {}
    for number, (name, roles) in enumerate(fields.items()):
        entry[name] = {}
        for role, array in roles.items():
            buf = io.BytesIO()
            np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
            key = f"runs/{run_id}/inputs/{claim}/{number}.{role}.npy"
            backend.store.put(key, buf.getvalue())
            entry[name][role] = key
    return entry


def read_arrays(path):
    """{name: array} of a .npy ({"input": a}) or .npz file; any fault is a UserError naming it."""
    import numpy as np
    try:
        # a .npy is mapped: each claim's slice is paged in as it is staged (an .npz member is read)
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return {"input": loaded}
        with loaded:   # an NpzFile reads each member on access: read them all inside this try
            return {k: loaded[k] for k in loaded.files}
    except OSError as e:
        raise unreadable_items(path, e) from None
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        reason = str(e).split(". ")[0].rstrip(".") or type(e).__name__
        raise UserError(f"{path}: not a numeric .npy or .npz file ({reason}) ---> HINT: save plain numeric arrays "
                        f"with numpy.save or numpy.savez (object arrays would need pickle)") from None


TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")   # tables (as a folder or glob of .parquet)


class TableItems:
    """Items from Arrow tables, one a row ({column: value}): Parquet (a file, folder or glob), Arrow
    IPC, or a pyarrow.Table, pandas DataFrame or datasets.Dataset, streamed a claim at a time.
    Numeric columns (and lists of numbers) are staged as .npy (a null: None); others go as JSON in
    the manifest, dates and times as ISO text, binary values (an HF Image's struct<bytes, path>)
    as bytes (stage_bytes); a type JSON cannot hold is refused up front. A Parquet path with binary
    columns is staged by reference (row ranges) where media_form says the workers can read it."""

    def __init__(self, schema, count, batches, source, files=None):
        import pyarrow as pa
        self.count, self.batches, self.source, self.files = count, batches, source, files
        self.numeric, self.json, self.binary = [], [], []
        for field in schema:
            kind = _column_kind(pa, field.type)
            if kind is None:
                raise UserError(f"{source}: column {field.name!r} is {field.type}, which has no JSON "
                                f"form ---> HINT: leave it out with --columns, or cast it (to "
                                f"string) before submitting")
            (self.numeric if kind == "numeric" else self.json).append(field.name)
            if _holds_binary(pa, field.type):
                self.binary.append(field.name)
        self.columns, self.media, self.by_reference = schema.names, bool(self.binary), False
        if not count:
            raise UserError(f"{source} holds no items")

    def __len__(self):
        return self.count

    @classmethod
    def open(cls, source, columns=None, where=None):
        """From a path (TABLE_SUFFIXES, folder, glob) or a table-like object; only `columns`."""
        import pyarrow as pa
        where = where or (source if isinstance(source, str) else type(source).__name__)
        if isinstance(source, str):
            return cls._open_path(source, columns, where)
        module = type(source).__module__.split(".")[0]
        if module == "pandas":
            source = pa.Table.from_pandas(source, preserve_index=False)
        elif module == "datasets":   # a Hugging Face Dataset: its Arrow rows, its own iterator
            schema = _select(source.features.arrow_schema, columns, where)
            arrow = source.with_format("arrow")
            return cls(schema, len(source), lambda rows: itertools.chain.from_iterable(
                t.select(schema.names).to_batches() for t in arrow.iter(batch_size=rows)), where)
        table = pa.table(source)   # a Table as it is; a RecordBatch
        schema = _select(table.schema, columns, where)
        table = table.select(schema.names)
        return cls(schema, table.num_rows, lambda rows: iter(table.to_batches(rows)), where)

    @classmethod
    def _open_path(cls, path, columns, where):
        import pyarrow as pa
        import pyarrow.parquet as pq
        if path.endswith((".arrow", ".feather")):
            try:
                reader = pa.ipc.open_file(pa.memory_map(path))   # batches paged in as staged
            except (OSError, pa.ArrowInvalid) as e:
                raise UserError(f"{path}: not an Arrow IPC file ({e}) ---> HINT: write it with "
                                f"pyarrow.feather.write_feather or pyarrow.ipc.new_file") from None
            schema = _select(reader.schema, columns, where)
            count = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            return cls(schema, count, lambda rows: (reader.get_batch(i).select(schema.names)
                                                    for i in range(reader.num_record_batches)), where)
        files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True) if os.path.isdir(path)
                       else glob.glob(path, recursive=True) if glob.has_magic(path) else [path])
        if not files:
            raise UserError(f"{path}: no .parquet file there ---> HINT: give a Parquet file, a "
                            f"folder of them or a quoted glob such as 'data/*.parquet'")
        # malloc gives back what the readers free (mimalloc kept ~20 MiB more); read page by
        # page through a 1 MiB buffer, not a row group at once
        opened, pool = [], pa.default_memory_pool()
        pa.set_memory_pool(pa.system_memory_pool())
        try:
            for file in files:
                try:   # stat first: a by-reference claim names the file as it was before it was read
                    seen = os.stat(file)
                    opened.append((file, pq.ParquetFile(file, pre_buffer=False, buffer_size=1 << 20), seen))
                except FileNotFoundError as e:
                    raise unreadable_items(file, e) from None
                except (OSError, pa.ArrowInvalid) as e:
                    raise UserError(f"{file}: not a Parquet file ({e})") from None
        finally:
            pa.set_memory_pool(pool)
        schema = _select(opened[0][1].schema_arrow, columns, where)
        for file, f, _ in opened:
            theirs = f.schema_arrow
            if any(name not in theirs.names or theirs.field(name).type != schema.field(name).type
                   for name in schema.names):
                raise UserError(f"{file}: its columns differ from {files[0]}'s ---> HINT: give "
                                f"files of one schema, or pick shared columns with --columns")
        return cls(schema, sum(f.metadata.num_rows for _, f, _ in opened), lambda rows: (
            b for _, f, _ in opened for b in f.iter_batches(rows, columns=schema.names, use_threads=False)),
            where, opened)

    def chunks(self, claim_sizes):
        """(start, stop, table, media bytes) of each claim (claim_sizes: ClaimSizes), fewer rows where
        their media bytes pass CLAIM_BYTES, cut as the batches are read (by reference: _ranges)."""
        import pyarrow as pa
        if self.by_reference:
            yield from self._ranges(claim_sizes)
            return
        size = claim_sizes.next(self.count)
        held, rows, start, sizes = [], 0, 0, []   # sizes: the held rows' media bytes (media only)
        for batch in itertools.chain(self.batches(self._read_rows(claim_sizes.fixed or claim_sizes.hi)), [None]):
            if batch is not None:
                held.append(batch)
                rows += batch.num_rows
                if self.media:
                    sizes += self._row_bytes(batch, start + len(sizes))
            while rows >= size or (batch is None and rows) or (self.media and sum(sizes) >= CLAIM_BYTES):
                table = pa.Table.from_batches(held)
                take = _fitting(sizes[:size]) if self.media else min(size, rows)
                yield start, start + take, table.slice(0, take), sum(sizes[:take])
                held, rows, start, sizes = table.slice(take).to_batches(), rows - take, start + take, sizes[take:]
                size = claim_sizes.next(self.count - start)

    def _read_rows(self, size):
        """Rows a read takes: a claim's, fewer for a Parquet file of media, so that one read holds
        about a quarter of CLAIM_BYTES by its row groups' sizes."""
        if not (self.media and self.files):
            return size
        total = sum(f.metadata.row_group(g).total_byte_size for _, f, _ in self.files
                    for g in range(f.metadata.num_row_groups))
        return max(1, min(size, CLAIM_BYTES // 4 * self.count // max(total, 1)))

    def _row_bytes(self, batch, first):
        """Each row's media bytes (its binary values'); a row over ITEM_BYTES_MAX is refused."""
        import numpy as np
        sizes = sum((_binary_sizes(batch.column(name)) for name in self.binary), np.zeros(batch.num_rows, np.int64))
        over = np.flatnonzero(sizes > ITEM_BYTES_MAX)
        if len(over):
            raise _too_large(f"{self.source}: row {first + int(over[0])}", int(sizes[over[0]]))
        return sizes.tolist()

    def _ranges(self, claim_sizes):
        """(start, stop, [[file URI, size, mtime ns, first row, stop row], ...], 0) of each claim
        (claim_sizes), fewer rows where its row groups' bytes pass CLAIM_BYTES: metadata only."""
        segments, rows, held, start = [], 0, 0.0, 0
        size = claim_sizes.next(self.count)
        for path, f, seen in self.files:
            uri, at = "file://" + os.path.abspath(path), 0
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                per_row = f.metadata.row_group(g).total_byte_size / max(n, 1)
                if per_row > ITEM_BYTES_MAX:
                    raise _too_large(f"{path}: the rows of row group {g}", int(per_row))
                while n:
                    take = min(size - rows, n, int((CLAIM_BYTES - held) // per_row) if per_row else n)
                    take = max(take, 0 if rows else 1)
                    if take and segments and segments[-1][0] == uri and segments[-1][4] == at:
                        segments[-1][4] += take
                    elif take:
                        segments.append([uri, seen.st_size, seen.st_mtime_ns, at, at + take])
                    rows, held, at, n = rows + take, held + take * per_row, at + take, n - take
                    if n or rows == size:   # full: the next rows go in the next claim
                        yield start, start + rows, segments, 0
                        segments, rows, held, start = [], 0, 0.0, start + rows
                        size = claim_sizes.next(self.count - start)
        if rows:
            yield start, start + rows, segments, 0

    def stage(self, backend, run_id, claim, start, table):
        """A claim's manifest fields: JSON columns as `items` (their bytes beside: `bytes`), numeric
        ones as `arrays`; by reference, its row ranges (`rows`)."""
        import pyarrow as pa
        if self.by_reference:
            return {"rows": {"columns": self.columns, "files": table}}
        fields = {name: _numeric_column(table.column(name).combine_chunks(), name, start, self.source)
                  for name in self.numeric}
        staged = {"arrays": stage_arrays(backend, run_id, claim, fields)} if fields else {}
        if self.json:
            blob, columns = Blob(), []
            for name in self.json:   # binary values straight from Arrow's buffers, where they can be
                column = table.column(name)
                if name in self.binary:
                    firsts = itertools.accumulate((len(c) for c in column.chunks), initial=0)
                    bare = [_without_binary(c, [name], blob, k) for c, k in zip(column.chunks, firsts)]
                    column = column if None in bare else pa.chunked_array(bare, pa.null() if not bare else None)
                columns.append(_json_column(column))
            items = [dict(zip(self.json, row)) for row in zip(*columns)]
            staged.update(stage_bytes(backend, run_id, claim, items, blob) if self.media else {"items": items})
        return staged


def _select(schema, columns, where):
    """The schema of the `columns` asked for (all when None); an unknown one is a UserError."""
    if not columns:
        return schema
    for name in columns:
        if name not in schema.names:
            raise UserError(f"{where}: no column {name!r}{did_you_mean(name, schema.names)} ---> "
                            f"HINT: its columns: {', '.join(schema.names)}")
    import pyarrow as pa
    return pa.schema([schema.field(name) for name in columns])


def _is_number(pa, t):
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_list(pa, t):
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _column_kind(pa, t):
    """"numeric" (.npy), "json" (in the manifest) or None (no JSON form) for an Arrow type."""
    if _is_number(pa, t) or (_is_list(pa, t) and _is_number(pa, t.value_type)):
        return "numeric"
    return "json" if pa.types.is_temporal(t) or _json_type(pa, t) else None


def _json_type(pa, t):
    """True for a type whose to_pylist values are JSON or bytes (or lists, structs, dicts of them)."""
    if _is_number(pa, t) or pa.types.is_null(t) or pa.types.is_string(t) or pa.types.is_large_string(t) \
            or _is_binary(pa, t):
        return True
    if pa.types.is_dictionary(t) or _is_list(pa, t):
        return _json_type(pa, t.value_type)
    return pa.types.is_struct(t) and all(_json_type(pa, t.field(i).type) for i in range(t.num_fields))


def _is_binary(pa, t):
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
        or pa.types.is_binary_view(t)


def _holds_binary(pa, t):
    """Whether an Arrow type is binary or holds binary (a struct's field, a list's values)."""
    if _is_binary(pa, t):
        return True
    if pa.types.is_struct(t):
        return any(_holds_binary(pa, t.field(i).type) for i in range(t.num_fields))
    return (_is_list(pa, t) or pa.types.is_dictionary(t)) and _holds_binary(pa, t.value_type)


def _binary_sizes(array):
    """The bytes of the binary values in each row of an Arrow array (in structs and lists too), as
    a numpy int64 array: what a row of media weighs."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    t, rows = array.type, len(array)
    if _is_binary(pa, t):
        return np.asarray(pc.binary_length(array).fill_null(0), np.int64)
    if pa.types.is_struct(t):
        return sum((_binary_sizes(child) for child in array.flatten()), np.zeros(rows, np.int64))
    if _is_list(pa, t) and _holds_binary(pa, t.value_type):
        parents = np.asarray(pc.list_parent_indices(array), np.int64)
        return np.bincount(parents, _binary_sizes(array.flatten()), rows).astype(np.int64)
    return np.zeros(rows, np.int64)


def _json_column(column):
    """A column's values as Python values for JSON (dates and times as ISO text)."""
    import pyarrow as pa
    if pa.types.is_temporal(column.type):
        return [None if v is None else v.isoformat() for v in column.to_pylist()]
    return column.to_pylist()


def _numeric_column(array, name, start, source):
    """A claim's numeric column as {role: numpy array}: values, offsets (lists), valid (nulls); a
    null inside a list is a UserError."""
    import numpy as np
    import pyarrow as pa
    roles = {}
    if array.null_count:
        roles["valid"] = _to_numpy(array.is_valid())
    if _is_list(pa, array.type):
        if array.null_count:
            array = array.fill_null(pa.scalar([0] * array.type.list_size if pa.types.is_fixed_size_list(array.type)
                                              else [], array.type))
        values = array.flatten()
        if values.null_count:
            lengths = np.cumsum(array.value_lengths().to_numpy())
            row = int(np.searchsorted(lengths, np.flatnonzero(_to_numpy(values.is_null()))[0], side="right"))
            raise UserError(f"{source}: row {start + row}, column {name!r}: a null inside a list of numbers ---> "
                            f"HINT: fill it (pyarrow.compute.fill_null) or leave the column out with --columns")
        values = _to_numpy(values)
        if pa.types.is_fixed_size_list(array.type):
            roles["values"] = values.reshape(len(array), array.type.list_size)
        else:
            offsets = array.offsets.to_numpy()
            roles["values"], roles["offsets"] = values, (offsets - offsets[0]).astype(np.int64)
    else:
        roles["values"] = _to_numpy(array.fill_null(False if pa.types.is_boolean(array.type) else 0)
                                    if array.null_count else array)
    return roles


def _to_numpy(array):
    """A numeric Arrow array without nulls as a numpy view (bools through uint8); no pandas."""
    import numpy as np
    import pyarrow as pa
    if pa.types.is_boolean(array.type):
        return _to_numpy(array.cast(pa.uint8())).view(bool)
    dtype = np.dtype({"halffloat": "float16", "float": "float32", "double": "float64"}.get(str(array.type),
                                                                                          str(array.type)))
    return np.frombuffer(array.buffers()[1], dtype, len(array), array.offset * dtype.itemsize)


# ---- media: bytes in items, one item a file, and by reference (docs/contract.md, "Media")
def _holds_tables(path):
    """Whether a folder holds a .parquet file, or a glob's first match is one."""
    pattern = os.path.join(path, "**", "*.parquet") if os.path.isdir(path) else path
    first = next(glob.iglob(pattern, recursive=True), None)
    return first is not None and first.endswith(".parquet")


def _too_large(name, size):
    return UserError(f"{name}: {size_text(size)} of media, over the limit of {size_text(ITEM_BYTES_MAX)} an item "
                     f"---> HINT: leave it out, or split it into smaller items")


def _media_size(value):
    """The bytes of the bytes values in a Python item (in its dicts and lists too)."""
    kind = type(value)
    if kind is dict:
        return sum(map(_media_size, value.values())) if value else 0
    if kind is list or kind is tuple:
        return sum(map(_media_size, value))
    return memoryview(value).nbytes if kind in (bytes, bytearray, memoryview) else 0


def _fitting(sizes):
    """How many of the first items fit in CLAIM_BYTES (one at least)."""
    total = 0
    for k, size in enumerate(sizes):
        total += size
        if total > CLAIM_BYTES and k:
            return k
    return len(sizes)


def _cut(start, chunk, sizes):
    """(start, stop, items, media bytes) of a claim's chunk cut so that each holds CLAIM_BYTES of
    media at most (one item at least); an item over ITEM_BYTES_MAX is refused."""
    for k, size in enumerate(sizes):
        if size > ITEM_BYTES_MAX:
            raise _too_large(f"item {start + k}", size)
    at = 0
    while at < len(chunk):
        take = _fitting(sizes[at:])
        yield start + at, start + at + take, chunk[at:at + take], sum(sizes[at:at + take])
        at += take


class Blob:
    """A claim's bytes in the bytes form as they are gathered: views of them (one copy: the join),
    and `at`, where each goes ([item, path, start, stop])."""

    def __init__(self):
        self.parts, self.size, self.at = [], 0, []

    def add(self, data):
        """Append bytes (or a view); returns where they start."""
        start = self.size
        self.parts.append(data)
        self.size += memoryview(data).nbytes
        return start


def stage_bytes(backend, run_id, claim, items, blob=None):
    """A claim's items in the bytes form: every bytes value (at any depth of dicts and lists) is
    None in `items` and staged in one object beside the manifest, `at` saying where each goes;
    returns those manifest fields. Never JSON text, never base64, never pickle."""
    blob = blob or Blob()
    items = [_take_bytes(item, k, [], blob) for k, item in enumerate(items)]
    key = f"runs/{run_id}/inputs/{claim}/bytes"
    backend.store.put(key, b"".join(blob.parts))
    return {"items": items, "bytes": {"key": key, "at": blob.at}}


def _take_bytes(value, k, path, blob):
    """`value` with each bytes value None, added to the blob (a function, not a closure: a
    recursive closure is a reference cycle, which kept a claim's bytes alive until a GC ran)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        start = blob.add(value)
        blob.at.append([k, path, start, blob.size])
        return None
    if isinstance(value, dict):   # JSON makes a key text: the path names it so
        return {key: _take_bytes(v, k, path + [str(key)], blob) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_take_bytes(v, k, path + [i], blob) for i, v in enumerate(value)]
    return value


def _without_binary(array, path, blob, first=0):
    """An Arrow array with its binary values (top level, or in structs) null, each added to the blob
    straight from Arrow's buffer (no Python bytes a value: malloc kept those, submit's peak grew
    with the file); None where binary sits deeper (in a list: _take_bytes takes it)."""
    import numpy as np
    import pyarrow as pa
    t = array.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if pa.types.is_fixed_size_binary(t):
            offsets = (np.arange(len(array) + 1) + array.offset) * t.byte_width
            data = array.buffers()[1]
        else:
            kind = np.int64 if pa.types.is_large_binary(t) else np.int32
            offsets = np.frombuffer(array.buffers()[1], kind, len(array) + 1, array.offset * kind().itemsize)
            data = array.buffers()[2]
        base = blob.add(memoryview(data)[offsets[0]:offsets[-1]] if data is not None else b"") - int(offsets[0])
        for k in np.flatnonzero(np.asarray(array.is_valid())).tolist():
            blob.at.append([first + k, path, base + int(offsets[k]), base + int(offsets[k + 1])])
        return pa.nulls(len(array))
    if pa.types.is_struct(t) and _holds_binary(pa, t):
        children = [_without_binary(child, path + [t.field(i).name], blob, first)
                    for i, child in enumerate(array.flatten())]
        if any(child is None for child in children):
            return None
        return pa.StructArray.from_arrays(children, fields=[pa.field(t.field(i).name, c.type) for i, c in
                                                             enumerate(children)], mask=array.is_null())
    return None if _holds_binary(pa, t) else array


def _glob_regex(pattern):
    """A regex of a glob over '/'-separated paths: * and ? within a name, [...] a class, ** any
    folders (fnmatch's * would cross a '/')."""
    out, parts = [], pattern.split("/")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".+" if last else "(?:[^/]+/)*")
            continue
        k = 0
        while k < len(part):
            c, end = part[k], part.find("]", k + 2)
            if c == "[" and end > 0:
                body = part[k + 1:end]
                out.append("[" + ("^" + body[1:] if body[0] == "!" else body).replace("\\", "\\\\") + "]")
                k = end
            else:
                out.append("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c))
            k += 1
        out.append("" if last else "/")
    return re.compile("".join(out))


def walk_folder(folder, prefix=""):
    """(path under `folder`, size, mtime in ns) of each file below it in path order, a folder's
    names read at a time; hidden files and folders (a name starting with '.') skipped, links to
    files followed, links to folders not (no cycles)."""
    try:
        with os.scandir(os.path.join(folder, prefix)) as entries:
            names = sorted((e.name + "/" if e.is_dir(follow_symlinks=False) else e.name)
                           for e in entries if not e.name.startswith("."))
    except OSError as e:
        raise UserError(f"cannot read folder {os.path.join(folder, prefix)}: {e.strerror}") from None
    for name in names:
        if name.endswith("/"):
            yield from walk_folder(folder, prefix + name)
            continue
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):   # gone, or a dangling link
            seen = os.stat(os.path.join(folder, prefix, name))
            if stat.S_ISREG(seen.st_mode):
                yield prefix + name, seen.st_size, seen.st_mtime_ns


class FileItems:
    """One item a file, {"path": its path under the folder, glob root or prefix given, "bytes": its
    content}: a local folder or glob, or an s3:// prefix or glob, listed as a stream in path order
    (a prefix of a million objects: claims go out while the listing goes on), hidden files and
    folders skipped. By reference (`refs`) where the workers can read the source, else copied
    (`bytes`, CLAIM_BYTES a claim): media_form decides."""
    media, by_reference = True, True

    def __init__(self, where, bucket, root, pattern):
        self.where, self.bucket, self.root, self.pattern = where, bucket, root, pattern
        self.source = None if bucket else LocalStore(root or ".", Requests())

    @classmethod
    def open(cls, path, columns=None):
        if columns:
            raise UserError(f"--columns applies to Parquet or Arrow input, not to the files of {path}")
        bucket, key = path[len("s3://"):].partition("/")[::2] if path.startswith("s3://") else (None, path)
        parts = key.split("/")
        magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        root, pattern = "/".join(parts[:magic]), "/".join(parts[magic:])
        if bucket is None and not os.path.isdir(root or "."):
            raise unreadable_items(path, FileNotFoundError(2, "no such folder"))
        return cls(path, bucket, root.rstrip("/") if bucket is not None or root != "/" else root,
                   _glob_regex(pattern) if pattern else None)

    def uri(self):
        """The source as a manifest's `refs` names it: its folder or prefix, ending in '/'."""
        if self.bucket is not None:
            return f"s3://{self.bucket}/{self.root}/" if self.root else f"s3://{self.bucket}/"
        return "file://" + os.path.join(os.path.abspath(self.root or "."), "")

    def entries(self):
        """(path, size, version: ETag or mtime ns) of each file; none at all is a UserError."""
        listed = self.source.walk() if self.bucket is not None else walk_folder(self.source.root)
        found = (e for e in listed if e[0] and not e[0].endswith("/") and  # an S3 folder marker is no file
                 not any(p.startswith(".") for p in e[0].split("/")) and
                 (self.pattern is None or self.pattern.fullmatch(e[0])))
        try:
            first = next(found, None)
        except Exception as e:   # a bucket misspelt, or one this machine may not list
            if _aws_error_info(e).get("Code") not in ("NoSuchBucket", "AccessDenied"):
                raise
            raise UserError(f"{self.where}: {aws_error_line(e)} ---> HINT: check the bucket's name, and that "
                            f"this machine's credentials may list it") from None
        if first is None:
            raise UserError(f"{self.where}: no file there (hidden ones are skipped) ---> HINT: give a folder "
                            f"of files, a quoted glob such as 'photos/**/*.jpg', or an s3:// prefix")
        return itertools.chain([first], found)

    def chunks(self, sizes):
        """(start, stop, entries, media bytes) of each claim (sizes: ClaimSizes, the listing read
        ahead to count the rest), fewer where copied files pass CLAIM_BYTES; a file over
        ITEM_BYTES_MAX refused by name."""
        it, start = Lookahead(self.entries(), sizes.ahead()), 0
        while chunk := list(itertools.islice(it, sizes.next(it.left()))):
            for name, n, _ in chunk:
                if n > ITEM_BYTES_MAX:
                    raise _too_large(f"{self.where}: {name}", n)
            yield from _cut(start, chunk, [0 if self.by_reference else n for _, n, _ in chunk])
            start += len(chunk)

    def stage(self, backend, run_id, claim, start, chunk):
        """By reference: `refs`, the objects named with their size and version; else their bytes."""
        if self.by_reference:
            return {"refs": {"source": self.uri(), "objects": [list(e) for e in chunk]}}
        items = []
        for name, _, _ in chunk:
            try:
                items.append({"path": name, "bytes": self.source.get(name)})
            except NotFound:
                raise UserError(f"{self.where}: {name} vanished while submit read it") from None
        return stage_bytes(backend, run_id, claim, items)


def media_form(backend, record, items):
    """Stage media by reference where the workers can read it (a local folder or Parquet file with
    the local store, an s3:// prefix with an s3:// store), else copied, said in one line; on an
    EC2 pool, an s3:// prefix its role cannot read yet is granted (or refused) here."""
    if isinstance(items, TableItems):
        items.by_reference = bool(items.media and items.files and backend.kind == "local")
        if items.media and items.files and not items.by_reference:
            print(f"calque: {items.source}: its media are copied into the store: the workers of {backend.describe()} "
                  f"cannot read this machine's files", file=sys.stderr)
        return
    if not isinstance(items, FileItems):
        return
    if items.bucket is None:
        items.by_reference = backend.kind == "local"
        if not items.by_reference:
            print(f"calque: {items.where}: its files are copied into the store: the workers of "
                  f"{backend.describe()} cannot read this machine's folder ---> HINT: upload it (aws s3 sync) "
                  f"and submit its s3:// prefix to have it read where it is", file=sys.stderr)
        return
    if backend.kind != "aws":
        raise UserError(f"{items.where}: an s3:// input needs an s3:// store, whose workers read it where it is "
                        f"---> HINT: CALQUE_STORE=s3://bucket/prefix, or copy the files here and submit the folder")
    inside = backend.store.uri("")
    if items.uri().startswith(inside) or inside.startswith(items.uri()):
        raise UserError(f"{items.where}: it overlaps the calque store {backend.describe()}: a run reads no "
                        f"other run's objects ---> HINT: keep inputs under another prefix")
    items.source = S3Store(backend.store.s3, items.bucket, items.root, backend.requests,
                           backend.store.endpoint_retry)
    if record.get("ec2"):
        from calque_ec2 import grant_read
        grant_read(backend, record, items.uri())


def rows_items(rows):
    """The items of a by-reference Parquet row range (a manifest's `rows`), as a staged table's
    would arrive; each row of a file that changed or vanished since submit is an Unavailable
    naming it. A worker imports pyarrow for such claims only."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    items = []
    for uri, size, mtime_ns, start, stop in rows["files"]:
        if not uri.startswith("file:///"):
            raise ValueError(f"{uri!r} is not a file:// URI")
        path = uri[len("file://"):]
        try:
            unchanged(os.stat(path), size, mtime_ns)
            table = _row_range(pq.ParquetFile(path), start, stop, rows["columns"])
            unchanged(os.stat(path), size, mtime_ns)   # and after: a file replaced meanwhile too
            items += table_items(table, start, path)
        except FileNotFoundError:
            items += [Unavailable(f"{path}: vanished since submit")] * (stop - start)
        except Changed as e:
            items += [Unavailable(f"{path}: changed since submit ({e})")] * (stop - start)
        except (OSError, pa.ArrowException, UserError) as e:
            items += [Unavailable(f"{path}: cannot read rows {start}-{stop - 1} ({e})")] * (stop - start)
    return items


def _row_range(f, start, stop, columns):
    """Rows [start, stop) of a ParquetFile: only the row groups that hold them are read, a batch
    at a time."""
    import pyarrow as pa
    groups, first, at = [], None, 0
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if at < stop and at + n > start:
            groups.append(g)
            first = at if first is None else first
        at += n
    batches, skip, want = [], start - (first or 0), stop - start
    for batch in f.iter_batches(row_groups=groups, columns=columns, use_threads=False):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        batches.append(batch.slice(skip, want))
        skip, want = 0, want - batches[-1].num_rows
        if not want:
            break
    if want:
        raise Changed(f"rows {start}-{stop - 1} are no longer all there")
    return pa.Table.from_batches(batches, pa.schema([f.schema_arrow.field(c) for c in columns]))


def table_items(table, start, source):
    """A table's rows as items, as TableItems stages them and a worker receives them: numeric
    columns as numpy values, the rest as Python values (binary as bytes, times as ISO text)."""
    import pyarrow as pa
    numeric = [n for n in table.column_names if _column_kind(pa, table.schema.field(n).type) == "numeric"]
    json = [n for n in table.column_names if n not in numeric]
    items = ([dict(zip(json, row)) for row in zip(*(_json_column(table.column(n)) for n in json))] if json
             else [{} for _ in range(table.num_rows)])
    fields = {}
    for name in numeric:
        roles = _numeric_column(table.column(name).combine_chunks(), name, start, source)
        fields[name] = (roles["values"], roles.get("offsets"), roles.get("valid"))
    return merge_fields(items, fields)


class SubmitInterrupted(BaseException):
    """SIGINT or SIGTERM while submit or runs resume stages or sends claims; a BaseException."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt():
    """Inside the block SIGINT and SIGTERM raise SubmitInterrupted once; a second one is ignored, so
    that recording what was sent is not cut short."""
    fired = []

    def on_signal(signum, frame):
        if not fired:
            fired.append(signum)
            raise SubmitInterrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block is done (blocked for this thread meanwhile)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def wait_seconds(conf, seconds, run=None):
    """How long to wait for a run: --timeout, else the run's own (its submit's --timeout, kept in
    its options), else CALQUE_TIMEOUT; a finite number of seconds, 0 or more."""
    if seconds is None and run:
        seconds = run["options"].get("timeout")
    if seconds is None:
        seconds = setting_number(conf, "CALQUE_TIMEOUT", float, 0)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise UserError(f"--timeout {seconds}: not a number of seconds, 0 or more ---> HINT: e.g. "
                        f"--timeout 600 (CALQUE_TIMEOUT sets the default)")
    return seconds


def run_options(id_field=None, timeout=None, wait_for_workers=False, plan=None):
    """The submit options a run keeps, given ones only: its record's `options`, written before its
    first claim is sent, so that runs resume, redrive and its results honour them after any Ctrl-C
    (docs/contract.md, "A run keeps its options")."""
    given = {"id_field": id_field, "timeout": timeout, "wait_for_workers": wait_for_workers,
             "plan": plan}
    return {name: value for name, value in given.items() if value not in (None, False)}


class ClaimSizes:
    """Each claim's size, asked claim by claim as a run is cut (claim_chunks): `fixed` (--claim-size,
    CALQUE_CLAIM_SIZE), else factoring: stages of `workers` claims of ceil(rest / (2 workers)) items
    each, within [lo, hi], so every worker stays busy to the end and the last claims are the shortest;
    the last stage splits the rest evenly (claims of lo/2 at least) where less than lo would be left.
    Counted in whole batches of `unit` items where a batch fits within hi: a claim of 75 items in
    batches of 32 pays for three generate calls, 96 for the same three.
    `why` is the run record's one-line reason (runs show prints it)."""

    def __init__(self, fixed=None, workers=1, lo=1, hi=CLAIM_SIZE_MAX, unit=1, why=""):
        self.fixed, self.workers, self.why = fixed, max(1, workers), why
        self.unit = unit if 1 <= unit <= hi else 1
        self.hi = max(1, hi // self.unit) * self.unit
        self.lo = min(max(1, lo), self.hi)   # the claim duration target wins over the overhead floor
        self.size, self.given = None, 0

    def next(self, left):
        """The next claim's size; `left`: the items not cut yet, None where more than `ahead()` are."""
        if self.fixed:
            return self.fixed
        if self.given % self.workers == 0:   # a new stage, in units
            lo, hi, w = -(-self.lo // self.unit), self.hi // self.unit, self.workers
            rest = None if left is None else -(-left // self.unit)
            self.size = hi if rest is None else min(hi, max(lo, -(-rest // (2 * w))))
            if rest is not None and rest - w * self.size < lo:   # the last stage: the rest split evenly,
                shares = max(1, min(w, rest // max(1, lo // 2)))   # claims of lo/2 at least: none left alone
                self.size = max(1, min(hi, -(-rest // shares)))   # (none left: a table's cut asks once more)
        self.given += 1
        return self.size * self.unit

    def plan(self, total):
        """The sizes of a run of `total` items (where no media cuts a claim short)."""
        if self.fixed:
            return [self.fixed] * (total // self.fixed) + ([total % self.fixed] if total % self.fixed else [])
        fresh, sizes, left = ClaimSizes(None, self.workers, self.lo, self.hi, self.unit), [], total
        while left > 0:
            sizes.append(min(fresh.next(left), left))
            left -= sizes[-1]
        return sizes

    def ahead(self):
        """Items a stream is read ahead of its claims, so that `left` is known where it matters."""
        return 0 if self.fixed else min(CLAIM_LOOKAHEAD_MAX, 2 * self.workers * self.hi)


def as_sizes(size):
    """A ClaimSizes from an int (a fixed size) or a ClaimSizes."""
    return size if isinstance(size, ClaimSizes) else ClaimSizes(fixed=size)


class Lookahead:
    """An iterator that reads `n` items ahead of its consumer: `left()` counts the rest once the
    source ends within them (None before), for a stream's claim sizes."""

    def __init__(self, source, n):
        self.source, self.n, self.held, self.ended = iter(source), n, collections.deque(), n == 0

    def __iter__(self):
        return self

    def __next__(self):
        if not self.held:
            self._fill()
        if self.held:
            return self.held.popleft()
        return next(self.source)   # n == 0: the source as it is

    def left(self):
        self._fill()
        return len(self.held) if self.ended else None

    def _fill(self):
        while not self.ended and len(self.held) < self.n:
            try:
                self.held.append(next(self.source))
            except StopIteration:
                self.ended = True


def claim_chunks(items, size):
    """(start, stop, items or None, media bytes) of each claim, sized by `size` (an int or a
    ClaimSizes), fewer where their bytes values pass CLAIM_BYTES (arrays, tables, files: their own)."""
    sizes = as_sizes(size)
    if isinstance(items, (ArrayItems, TableItems, FileItems)):
        yield from items.chunks(sizes)
        return
    start = 0
    if isinstance(items, list):
        it, left = iter(items), lambda: len(items) - start
    else:
        it = Lookahead(items, sizes.ahead())
        left = it.left
    while chunk := list(itertools.islice(it, sizes.next(left()))):
        yield from _cut(start, chunk, [0 if type(item) is JsonText else _media_size(item) for item in chunk])
        start += len(chunk)


class HoldsBytes(Exception):
    """A Python item holds bytes: its claim is staged in the bytes form (stage_bytes)."""


def _no_bytes(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise HoldsBytes
    return to_jsonable(value)


def stage_claim(backend, run, items, claim, start, stop, chunk):
    """Write one claim's manifest (JSON items inside, numeric items beside it as .npy, bytes values
    beside it in one object; by reference, what the worker fetches)."""
    manifest = {"run_id": run["run_id"], "claim": claim, "model": run["model"], "first_index": start,
                "count": stop - start}
    if chunk is None:
        manifest["arrays"] = items.stage(backend, run["run_id"], claim, start, stop)
    elif isinstance(items, (TableItems, FileItems)):
        manifest.update(items.stage(backend, run["run_id"], claim, start, chunk))
    elif all(type(item) is JsonText for item in chunk):   # checked JSONL lines: joined as they are
        body = dumps(manifest)
        backend.store.put(manifest_key(run["run_id"], claim), f'{body[:-1]},"items":[{",".join(chunk)}]}}')
        return
    else:
        try:
            body = json.dumps(dict(manifest, items=chunk), default=_no_bytes, separators=(",", ":"))
        except HoldsBytes:
            manifest.update(stage_bytes(backend, run["run_id"], claim, chunk))
        else:
            return backend.store.put(manifest_key(run["run_id"], claim), body)
    backend.store.put(manifest_key(run["run_id"], claim), dumps(manifest))


def stage_run(backend, record, items, claim_size, queue, mode, run_id=None, options=None):
    """Stage the items as a stream, sending each claim once its manifest has landed; returns the
    run, its claims sized by `claim_size` (an int, or a ClaimSizes). The run record comes first
    (`staged: false`, with the submit `options` it keeps: run_options); claims are cut as items
    are read, manifests PUT on STORE_WRITERS threads (LOCAL_WRITERS locally) and sent in order,
    SEND_BATCH a request, with at most STAGE_AHEAD manifests a writer unsent (bounded memory).
    SIGINT or SIGTERM stops the sending, not the staging (`runs resume` sends the rest), then
    raises SubmitInterrupted. Another error before a claim was sent deletes what was staged;
    after, the run keeps the claims sent."""
    run_id = run_id or new_run_id(record["model"])
    media_form(backend, record, items)
    known = len(items) if isinstance(items, (ArrayItems, TableItems, list)) else None
    sizes = as_sizes(claim_size)
    planned = sizes.plan(known) if known else []
    claim_size = sizes.fixed or sizes.hi   # the largest claim
    run = {"run_id": run_id, "model": record["model"], "mode": mode, "items": known or 0,
           "claims": [claim_id(i) for i in range(len(planned))], "claim_size": claim_size,
           "queue": queue.name, "backend": backend.kind, "store": backend.describe(),
           "created_at": now_iso(), "sent": 0, "staged": False, "options": options or {},
           **_claim_counts(planned, claim_size)}
    if record.get("version"):   # the only version whose workers run its claims
        run["version"] = record["version"]
    if sizes.why:
        run["sizing"] = sizes.why
    landed, pending, count, sending, counts = [], collections.deque(), 0, True, []
    # signals wait until the end (sigpending between two claims): a claim is never half cut
    with signals_deferred():
        try:
            write_json(backend, run_key(run_id), run)
            writer_count = LOCAL_WRITERS if backend.kind == "local" else STORE_WRITERS
            with ThreadPoolExecutor(writer_count) as writers:
                for index, (start, stop, chunk, media) in enumerate(claim_chunks(items, sizes)):
                    claim, count = claim_id(index), stop
                    if index == len(run["claims"]):   # a stream's, or one more where media cut a claim short
                        run["claims"].append(claim)
                    counts.append(stop - start)
                    pending.append((claim, writers.submit(stage_claim, backend, run, items, claim, start, stop,
                                                          chunk), media))
                    sending = sending and not {signal.SIGINT, signal.SIGTERM} & signal.sigpending()
                    first = sending and run["sent"] == 0 and not landed
                    full = len(pending) >= writer_count * STAGE_AHEAD or sum(p[2] for p in pending) >= STAGE_BYTES
                    _send_landed(backend, run, queue, pending, landed, sending, wait=first or full, flush=first)
                if not count:
                    raise UserError("no items to submit")
                while pending or landed:
                    _send_landed(backend, run, queue, pending, landed, sending, wait=True, flush=True)
            update_run(backend, run, claims=run["claims"][:len(counts)], items=count, sent=run["sent"],
                       staged=True, **_claim_counts(counts, claim_size))
        except BaseException as e:
            if not run["sent"]:
                backend.store.delete_prefix(f"runs/{run_id}/")   # a cold run's handler too: no run
                raise
            kept = sum(counts[:run["sent"]])
            update_run(backend, run, claims=run["claims"][:run["sent"]], items=kept, sent=run["sent"], staged=True,
                       **_claim_counts(counts[:run["sent"]], claim_size))
            if isinstance(e, (UserError, StoreFault)):
                raise type(e)(f"run {run_id} stopped after queueing {run['sent']} claim(s) (items "
                              f"0 to {kept - 1}; the run keeps them): {e}") from None
            raise
    return run


def _claim_counts(counts, claim_size):
    """The run record's `claim_counts` where claims differ from claim_size (sized to the run, or
    media cut them short: claim_items)."""
    return {"claim_counts": counts} if any(n != claim_size for n in counts[:-1]) else {}


def _send_landed(backend, run, queue, pending, landed, sending, wait, flush):
    """Move the landed manifests at the head of `pending` to `landed` (the head one awaited when
    `wait`), then send them in order, SEND_BATCH a request (a partial batch when `flush`)."""
    while pending and (wait or pending[0][1].done()):
        claim, future, _ = pending.popleft()
        future.result()
        landed.append(claim)
        wait = False
    while sending and landed and (len(landed) >= SEND_BATCH or flush):
        batch, landed[:SEND_BATCH] = landed[:SEND_BATCH], []
        send_batch(backend, run, queue, batch)
        run["sent"] += len(batch)
    if not sending:
        landed.clear()


def send_batch(backend, run, queue, claims, resume=False):
    """One queue request (SendMessageBatch on SQS) for these claims of the run."""
    run_id = run["run_id"]
    queue.send_batch([make_message(run_id, run["model"], backend.store.uri(manifest_key(run_id, c)), c,
                                   resume, run.get("version")) for c in claims])


def send_claims(backend, run, queue, skip=(), resume=False):
    """Send the run's claims from run["sent"] on, but `skip`, recording how far it got whatever
    stops it. A claim sent twice (after a kill -9) is acked by its worker as a duplicate."""
    try:
        while run["sent"] < len(run["claims"]):
            with signals_deferred():   # a send and its count are one step
                batch = run["claims"][run["sent"]:run["sent"] + SEND_BATCH]
                todo = [claim for claim in batch if claim not in skip]
                if todo:
                    send_batch(backend, run, queue, todo, resume)
                run["sent"] += len(batch)
    finally:
        update_run(backend, run, sent=run["sent"])


def interrupted(backend, run_id, signum):
    """Say what an interrupted submit or runs resume left; returns 128 + the signal."""
    try:
        run = _run_defaults(read_json(backend, run_key(run_id)))
    except NotFound:
        print(f"calque: interrupted while staging run {run_id}: nothing was queued ---> HINT: submit again",
              file=sys.stderr)
    else:
        total = len(run["claims"])
        print(f"calque: interrupted: run {run_id}: {run['sent']} of {total} claim(s) queued (they "
              f"finish without you), {total - run['sent']} not sent ---> HINT: {command()} "
              f"runs resume {run_id}", file=sys.stderr)
    return 128 + signum


def interrupted_waiting(run_id):
    """Say that a submit or runs resume interrupted while it waits leaves the run going on."""
    print(f"calque: interrupted while waiting: run {run_id}: its claims are queued and finish without "
          f"you ---> HINT: {command()} runs show {run_id}", file=sys.stderr)
    return 128 + signal.SIGINT


def run_dlq_name(run):
    """The dead-letter queue of the run's claims: its pool's, or a cold run's own."""
    return dlq_name(run["model"]) if run["mode"] == "pool" else run_queue_names(run["run_id"])[1]


def receive_all(queue, count):
    """Up to `count` messages of the queue, received (hidden until deleted or released)."""
    messages = []
    while len(messages) < count and (message := queue.receive(DLQ_SCAN_WAIT)) is not None:
        messages.append(message)
    return messages


def release(queue, messages):
    """Make received messages visible again at once (a stale receipt's message is back already)."""
    for message in messages:
        with contextlib.suppress(LeaseLost):
            queue.change_visibility(message, 0)


def dead_letter_of(message):
    """(run id, claim, reason) of a dead-letter message, or None when its body names no claim."""
    try:
        letter = json.loads(message.body)
        if isinstance(letter, dict) and "body" not in letter:   # moved as sent, by SQS (the backstop)
            letter = {"body": message.body, "reason": "moved by the queue's redrive policy (the "
                      "backstop): received that many times and no worker ended it; their logs say why"}
        original = parse_message(letter["body"])
        return original["run_id"], original["claim"], str(letter.get("reason", "?"))
    except (ValueError, KeyError, TypeError):
        return None


class DeadLetters:
    """The claims of one run in its dead-letter queue ({claim: reason}), found by receiving and
    releasing every message; rescanned only when the depth changed or others held messages."""

    def __init__(self, backend, run):
        self.backend, self.run_id, self.name = backend, run["run_id"], run_dlq_name(run)
        self.queue, self.depth, self.found = None, None, {}

    def claims(self):
        try:
            self.queue = self.queue or self.backend.queues.open_queue(self.name)
        except NotFound:   # deleted (an ended cold run's, a deleted pool's): it holds nothing
            return {}
        counts = self.queue.counts()
        if counts["visible"] + counts["in_flight"] != self.depth or counts["in_flight"]:
            self.depth = counts["visible"] + counts["in_flight"]
            messages = receive_all(self.queue, counts["visible"])
            release(self.queue, messages)
            letters = [dead_letter_of(m) for m in messages]
            self.found = {c: why for rid, c, why in filter(None, letters) if rid == self.run_id}
        return self.found


def wait_for_run(backend, run, timeout, progress=True, stop_if=None, interrupted=()):
    """Poll the run's summaries until every claim has one, nothing can run the rest, or timeout;
    returns (summaries, timed_out). `run` follows its stored record; stop_if() may raise, and a
    non-empty `interrupted` (sigint_noted) raises KeyboardInterrupt. Each LIST
    starts after the last claim below which all are done; its gap grows from SUMMARY_POLL_MIN by
    half while none land, up to SUMMARY_WAIT_MAX, and after new ones is what SUMMARY_BATCH more take
    at the rate so far. The run record and the DLQ are read only on a stall (run_recheck)."""
    from tqdm import tqdm
    started = time.monotonic()
    deadline, progressed, recheck = started + timeout, started, run_recheck(started, started)
    done, dead = {}, DeadLetters(backend, run)
    in_key_order, below = sorted(run["claims"], key=lambda c: summary_key(run["run_id"], c)), 0
    delay = SUMMARY_POLL_MIN
    wait_max = min(SUMMARY_WAIT_MAX, LOCAL_SUMMARY_WAIT if backend.kind == "local" else math.inf)
    bar = tqdm(total=run["items"], unit="item", file=sys.stderr, disable=not progress, leave=False,
               desc=f"run {run['run_id']}")
    finished, running = 0, {}   # items of the claims done; {claim: items done} of long running ones
    try:
        while True:
            while below < len(in_key_order) and in_key_order[below] in done:
                below += 1
            found = 0
            for key in list_summaries(backend, run["run_id"], in_key_order[below - 1] if below else None):
                claim = key.rsplit("/", 1)[1][:-5]
                if claim not in done:
                    done[claim] = read_json(backend, key)
                    finished += done[claim]["items"]
                    running.pop(claim, None)
                    found += 1
            if found:
                bar.update(finished + sum(running.values()) - bar.n)
            now = time.monotonic()
            if len(done) == len(run["claims"]) or now >= deadline:
                break
            if found:
                progressed, recheck = now, run_recheck(now, now)
                rate = len(done) / max(now - started, SUMMARY_POLL_MIN)   # claims a second
                expected = min(SUMMARY_BATCH, len(run["claims"]) - len(done))
                delay = min(max(expected / rate, SUMMARY_POLL_FLOOR), wait_max)
            else:
                delay = min(delay * 1.5, wait_max)   # quick at first (idle round trip)
            if now >= recheck:
                recheck = run_recheck(progressed, now)
                if progress:   # a long claim's items done count too (claims_progress)
                    running = claims_progress(backend, run["run_id"], [c for c in run["claims"] if c not in done])
                    bar.update(finished + sum(running.values()) - bar.n)
                if nothing_left_to_run(backend, run, done, dead):
                    break
                if stop_if:
                    stop_if()
            if interrupted:
                raise KeyboardInterrupt
            time.sleep(min(delay, deadline - now))
    finally:
        bar.close()
    return [done[c] for c in run["claims"] if c in done], len(done) < len(run["claims"])


@contextlib.contextmanager
def sigint_noted():
    """SIGINT raises KeyboardInterrupt and is noted in the list yielded: Python drops an exception
    raised inside a callback (an import lock's, at garbage collection), so a wait checks the note."""
    noted = []

    def on_sigint(signum, frame):
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)


def run_recheck(progressed, now):
    """When wait_for_run next looks at the run record: RUN_RECHECK s after the last new summary,
    then at gaps doubling with the time stalled, up to RUN_RECHECK_MAX."""
    return max(progressed + RUN_RECHECK, now + min(max(now - progressed, RUN_RECHECK), RUN_RECHECK_MAX))


def nothing_left_to_run(backend, run, done, dead):
    """True when no worker can take a claim without a summary: the run was cancelled, or each such
    claim was never sent or is dead-lettered (`dead`). Reads the run record again, into `run`."""
    run.update(_run_defaults(read_json(backend, run_key(run["run_id"]))))
    if run.get("cancelled"):
        return True
    try:
        letters = dead.claims()
    except StoreFault:
        if backend.kind != "local":
            raise
        letters = dead.claims()   # the local queue file was replaced: reopened now
    waiting = [claim for index, claim in enumerate(run["claims"])
               if claim not in done and index < run["sent"] and claim not in letters]
    lost = claims_in_no_queue(backend, run, waiting) if waiting and run["mode"] == "pool" else []
    return len(lost) == len(waiting)


def cancel_run(backend, run, reason):
    """Mark the run cancelled with a `cancelled` summary for each claim without one (a worker acks
    such a claim unrun; one finished meanwhile keeps its own). Returns the claims marked."""
    have = summary_claims(backend, run["run_id"])
    if all(claim in have for claim in run["claims"]):
        return []
    at = time.time()
    update_run(backend, run, cancelled={"reason": reason, "at": now_iso(at)})

    def mark(claim):
        key = summary_key(run["run_id"], claim)
        if backend.store.exists(key):
            return False
        summary = claim_summary(
            run_id=run["run_id"], claim=claim, model=run["model"], worker_id="submitter",
            mode=run["mode"], backend=backend.kind, receive_count=0, enter_count=0, started=at,
            finished=at, requests={}, notes=[f"cancelled ({reason}): the claim was not run"])
        write_json(backend, key, dict(summary, status="cancelled", reason=reason))
        return True

    missing = [claim for claim in run["claims"] if claim not in have]
    with ThreadPoolExecutor(STORE_WRITERS) as writers:
        return [claim for claim, marked in zip(missing, writers.map(mark, missing)) if marked]


def cancel_pool_runs(backend, model):
    """pool delete --force: cancel each unfinished run of the pool; {run id: claims marked}."""
    cancelled = {}
    for run in list_runs(backend, model):
        if run["model"] == model and run["mode"] == "pool":
            marked = cancel_run(backend, run, "pool deleted")
            if marked:
                cancelled[run["run_id"]] = marked
    return cancelled


def live_claims(backend, run):
    """The run's claims queued or running: what deleting it would strand."""
    states = claim_states(backend, run, read_summaries(backend, run["run_id"]))
    return [claim for claim, (state, _) in states.items() if state == "queued or running"]


def check_deletable(backend, run):
    """Refuse to delete a run with claims queued or running (they would be dead-lettered)."""
    live = live_claims(backend, run)
    if live:
        raise UserError(f"run {run['run_id']} has {len(live)} claim(s) queued or running: deleting it would strand "
                        f"them ---> HINT: wait (runs show {run['run_id']}), runs cancel it, or pass --force")


def delete_run(conf, backend, run):
    """Delete a run's objects (and its cold workers' logs here); returns (objects, bytes)."""
    freed = backend.store.delete_prefix(f"runs/{run['run_id']}/")
    shutil.rmtree(os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "runs", run["run_id"]), ignore_errors=True)
    return freed


def parse_age(text):
    """Seconds of an age such as 7d, 12h, 30m, 90s or 2w."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if not match:
        raise UserError(f"--older-than {text!r}: not an age ---> HINT: a number and a unit: 90s, 30m, 12h, 7d, 2w")
    return float(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match[2]]


def runs_to_prune(backend, older_than, keep=0, model=None):
    """The runs over `older_than` s old (of `model` if given), but each model's `keep` newest."""
    runs = list_runs(backend, model)
    kept = {r["run_id"] for m in {r["model"] for r in runs}
            for r in [r for r in runs if r["model"] == m][::-1][:keep]}
    cutoff = time.time() - older_than
    return [r for r in runs if r["run_id"] not in kept and
            datetime.datetime.fromisoformat(r["created_at"]).timestamp() < cutoff]


def redrive(backend, record, runs):
    """Send the dead-lettered claims of `runs` back to the pool queue, marked resume: its failure
    summary is deleted first (else a worker would ack it as done), then it is sent, then its DLQ
    copies deleted. Idempotent. Returns {run id: [claims sent]}."""
    queue, dlq = backend.queues.open_queue(record["queue"]), backend.queues.open_queue(record["dlq"])
    letters = receive_all(dlq, dlq.counts()["visible"])
    copies, deleted, sent = {}, set(), {}
    for message in letters:
        found = dead_letter_of(message)
        if found and found[0] in runs:
            copies.setdefault(found[:2], []).append(message)
    try:
        for run_id, run in runs.items():
            summaries = {s["claim"]: s for s in read_summaries(backend, run_id)}
            for claim in run["claims"]:
                s = summaries.get(claim)
                failure = s is not None and s["status"] == "failed" and bool(s.get("error"))
                if failure or (s is None and (run_id, claim) in copies):
                    if failure:
                        backend.store.delete(summary_key(run_id, claim))
                    uri = backend.store.uri(manifest_key(run_id, claim))
                    queue.send(make_message(run_id, run["model"], uri, claim, True,
                                            run.get("version")))
                    sent.setdefault(run_id, []).append(claim)
                for message in copies.get((run_id, claim), []):
                    dlq.delete(message)
                    deleted.add(message.receipt)
    finally:
        release(dlq, [m for m in letters if m.receipt not in deleted])
    return sent


def claim_parts(backend, run_id, claim, count):
    """The claim's result parts in item order (a calque 0.2 claim's one results object instead)."""
    try:
        return read_claim_parts(backend.store, run_id, claim, count)
    except ResultsIncomplete:
        if backend.store.list(results_prefix(run_id, claim)):
            raise
        try:
            lines = backend.store.get(results_key(run_id, claim)).decode().splitlines(keepends=True)
        except NotFound:
            raise ResultsIncomplete(f"run {run_id} claim {claim}: no result part under "
                                    f"{results_prefix(run_id, claim)}")
        if len(lines) != count or not lines[-1].endswith("\n"):
            raise ResultsIncomplete(f"run {run_id} claim {claim}: {results_key(run_id, claim)} is "
                                    f"truncated ({len(lines)} of {count} lines)")
        return [Part(lines, [])]


def claim_results(backend, run_id, claim, count):
    """The claim's result lines, in item order, as JSONL prints them."""
    return [ln for p in claim_parts(backend, run_id, claim, count) for ln in result_lines(p)]


def claim_ids(backend, run, claim, field, manifest=None):
    """The `field` of each of the claim's items, read from its manifest (by reference: a file's
    path, a Parquet column's values; a bytes value reads as null)."""
    manifest = manifest or json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
    if "refs" in manifest:
        return [name for name, _, _ in manifest["refs"]["objects"]]
    items = (rows_items(dict(manifest["rows"], columns=[field])) if "rows" in manifest else
             array_items(backend.store, manifest) if "arrays" in manifest else manifest["items"])
    values = [item[field] if isinstance(item, dict) else None for item in items]   # else: Unavailable
    return [getattr(v, "tolist", lambda v=v: v)() for v in values]   # numpy values as plain ones


def claim_column(parts, field):
    """(offsets, values) of the items whose result holds `field` (None: the result itself): typed
    arrays stacked (bfloat16 as float32), else as numpy.array makes them; ValueError on shapes."""
    import numpy as np
    blocks, lines, at = [], [], 0
    for part in parts:
        blocks += [b._replace(rows=b.rows + at) for b in part.blocks if b.field == field]
        lines += part.lines
        at += len(part.lines)
    if blocks:
        if any(b.dtype == BYTES for b in blocks):
            raise ValueError("its values are bytes")
        if any(b.shapes is not None for b in blocks) or len({b.values.shape[1:] for b in blocks}) > 1:
            raise ValueError("its arrays differ in shape from item to item")
        if len(blocks) == 1:
            return blocks[0].rows, blocks[0].widen()
        rows, values = np.concatenate([b.rows for b in blocks]), np.concatenate([b.widen() for b in blocks])
        order = np.argsort(rows, kind="stable")
        return rows[order], values[order]
    rows, values = [], []
    for k, line in enumerate(map(orjson.loads, lines)):
        value = line.get("result")
        value = value if field is None else value.get(field) if isinstance(value, dict) else None
        if line["ok"] and value is not None:
            rows.append(k)
            values.append(value)
    values = np.array(values)
    if values.dtype.kind not in NUMERIC_KINDS:
        raise ValueError(f"its values are not numbers: numpy makes {values.dtype} of them")
    return np.array(rows, dtype=np.int64), values


def typed_fields(parts):
    """The fields the parts' typed blocks hold (None: the result itself), in the order first met."""
    return list(dict.fromkeys(b.field for part in parts for b in part.blocks))


def result_fields(parts):
    """{field: whether it holds numbers} of the parts' ok results, as first met: their dicts' keys
    (typed ones too: null in the lines), None for a result that is no dict."""
    arrays, fields = {b.field for part in parts for b in part.blocks if b.dtype != BYTES}, {}
    for line in map(orjson.loads, (line for part in parts for line in part.lines)):
        if line["ok"]:
            result = line["result"]
            for key, value in result.items() if isinstance(result, dict) else [(None, result)]:
                fields[key] = fields.get(key) or key in arrays or holds_numbers(value)
    return fields


def holds_numbers(value):
    """A JSON value that stacks into a numeric array: a number, or a list of them (nested)."""
    while isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def with_parts(backend, run, claims):
    """(index, claim, its parts) for each (index, claim) of `claims`."""
    for index, claim in claims:
        yield index, claim, claim_parts(backend, run["run_id"], claim, claim_items(run, index))


def run_array(run, claims, field=None, fill=None):
    """One array of `field` (None: the result, or its only array) over `claims` ((index, claim,
    parts)); a row without it is `fill` (default NaN for floats, else a UserError)."""
    import numpy as np
    pieces, missing, choose, there = [], 0, field is None, {}
    for index, claim, parts in claims:
        if choose and typed_fields(parts):      # the first claim with arrays says which
            choose, names = False, typed_fields(parts)
            if len(names) > 1 and None not in names:
                raise UserError(f"run {run['run_id']}: results hold several arrays ({', '.join(names)}) "
                                f"---> HINT: name one: to_numpy({names[0]!r}), or runs results --field {names[0]}")
            field = None if None in names else names[0]
        try:
            rows, values = claim_column(parts, field)
        except ValueError as e:
            raise UserError(f"run {run['run_id']} claim {claim}: {field or 'the result'} cannot stack into one array "
                            f"({e}) ---> HINT: read it with to_arrow() or runs results --format parquet")
        pieces.append((claim_items(run, index), rows, values))
        missing += claim_items(run, index) - len(rows)
        if field is not None and not len(rows):   # what it has instead, should no claim have it
            there.update(result_fields(parts))
    if field is not None and not any(len(rows) for _, rows, _ in pieces):
        names = [f for f in there if f is not None]
        have, numbers = ", ".join(map(repr, names)), [f for f in names if there[f]]
        why = (f"its results have {have} ---> HINT: to_numpy({numbers[0]!r}), or {command()} runs "
               f"results {run['run_id']} --format npy --field {numbers[0]}" if numbers else
               f"its results have {have}, none of them numbers ---> HINT: read them with "
               f"to_arrow() or `{command()} runs results {run['run_id']}`" if names else
               "its results are not dicts ---> HINT: to_numpy() reads the result itself" if None in there else
               f"no item succeeded ---> HINT: {command()} runs show {run['run_id']}")
        raise UserError(f"run {run['run_id']}: no result has the field {field!r}: {why}")
    shape, dtype = next(((v.shape[1:], v.dtype) for _, _, v in pieces if len(v)), ((), np.dtype("float64")))
    if missing and fill is None and dtype.kind != "f":
        raise UserError(f"run {run['run_id']}: {missing} items have no {field or 'result'} (failed, or none in "
                        f"their result) and {dtype} has no NaN for their rows ---> HINT: pass "
                        f"fill= (runs results --fill), or read the ok column with to_arrow()")
    out, at = np.empty((sum(n for n, _, _ in pieces), *shape), dtype=dtype), 0
    for count, rows, values in pieces:
        if len(values) and values.shape[1:] != shape:
            raise UserError(f"run {run['run_id']}: {field or 'the result'} is {values.shape[1:]} "
                            f"in some claims, {shape} in others ---> HINT: read it with to_arrow()")
        if len(rows) == count:          # every item has it: rows are 0..count-1 in order
            out[at:at + count] = values
        else:
            out[at:at + count] = fill if fill is not None else np.nan if dtype.kind == "f" else 0
            if len(rows):
                out[at + rows] = values
        at += count
    return out


def _arrow_column(pa, values):
    """A pyarrow array of stacked numpy values: a fixed-size list level per inner dimension."""
    column = pa.array(values.reshape(-1))
    for size in reversed(values.shape[1:]):
        column = pa.FixedSizeListArray.from_arrays(column, size)
    return column


def claim_batch(backend, run, claim, parts):
    """The claim's results as a pyarrow.RecordBatch: i, ok, error, the id field, then a column a key
    where every result is a dict (a clash gets "result."), else `result`. Typed arrays become
    fixed-size lists; JSON values as pyarrow infers them, else their JSON text."""
    import numpy as np
    import pyarrow as pa
    lines = orjson.loads("[" + ",".join(line[:-1] for part in parts for line in part.lines) + "]")
    count = len(lines)
    columns = {"i": pa.array([line["i"] for line in lines], pa.int64()),
               "ok": pa.array([line["ok"] for line in lines]),
               "error": pa.array([line.get("error") for line in lines], pa.string())}
    field = run["options"].get("id_field")
    if field:
        columns[field] = pa.array(claim_ids(backend, run, claim, field))
    typed, results = typed_fields(parts), [line["result"] for line in lines if line["ok"]]
    keyed = results and None not in typed and all(isinstance(r, dict) for r in results)
    for field in dict.fromkeys(k for r in results for k in r) if keyed else [None] if results else []:
        name = "result" if field is None else field if field not in columns else f"result.{field}"
        def value(line, field=field):
            result = line.get("result")
            return result if field is None else (result or {}).get(field)
        if field in typed:
            try:
                rows, stacked = claim_column(parts, field)
            except ValueError:      # shapes that differ: one list a row, below
                rows = None
            if rows is not None and (len(rows) == count or not any(
                    value(lines[k]) is not None for k in set(range(count)) - set(rows.tolist()))):
                columns[name] = _arrow_column(pa, stacked)
                if len(rows) < count:   # the items without it (failed) are nulls
                    where = np.full(count, -1)
                    where[rows] = np.arange(len(rows))
                    columns[name] = columns[name].take(pa.array(where, mask=where < 0))
                continue
        values = [value(line) for line in lines]
        for row, array in zip(*claim_column_rows(parts, field)):
            values[row] = array if isinstance(array, bytes) else array.tolist()
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            columns[name] = pa.array([None if v is None else bytes_text(v) if isinstance(v, bytes) else dumps(v)
                                      for v in values], pa.string())
    return pa.record_batch(columns)


def claim_column_rows(parts, field):
    """(offsets, arrays) of the claim's typed values of `field`, one array a row."""
    rows, arrays, at = [], [], 0
    for part in parts:
        for block in part.blocks:
            if block.field == field:
                rows += (block.rows + at).tolist()
                arrays += block.arrays()
        at += len(part.lines)
    return rows, arrays


def run_table(batches):
    """One pyarrow.Table of claim batches, columns unified (a field lacking is null there)."""
    import pyarrow as pa
    tables = [pa.Table.from_batches([b]) for b in batches]
    if not tables:
        return pa.table({"i": pa.array([], pa.int64()), "ok": pa.array([], pa.bool_()),
                         "error": pa.array([], pa.string())})
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UserError(f"the claims' results do not fit one table ({e}) ---> HINT: read them "
                        f"claim by claim (Run.iter_batches()), or as JSONL")


CLAIM_STATES = ("done", "failed", "dead-lettered", "cancelled", "queued or running", "in no queue",
                "not queued")
ITEM_OUTCOME = {"queued or running": "pending", "in no queue": "pending", "not queued": "pending",
                "dead-lettered": "dead_lettered", "cancelled": "cancelled"}   # claims not run
NOT_RUN = {   # what becomes of the claims of each state that did not run (format_run)
    "queued or running": "still pending; the run goes on",
    "in no queue": "were lost by the pool's queue (removed, recreated or purged): nothing will run them",
    "not queued": "were never sent: nothing will run them",
    "dead-lettered": "were dead-lettered: nothing will run them",
    "cancelled": "were cancelled{why}: nothing will run them",
}


def claim_states(backend, run, summaries, dead_letters=True):
    """{claim: (state, detail)}, state one of CLAIM_STATES (in no queue: its queue lost it), the
    detail the dead-letter or cancel reason. Without dead_letters: no DLQ scan, no queue look."""
    by_claim = {s["claim"]: s for s in summaries}
    cancelled = run.get("cancelled")
    pending = not cancelled and any(claim not in by_claim for claim in run["claims"])
    letters = DeadLetters(backend, run).claims() if pending and dead_letters else {}
    states = {}
    for index, claim in enumerate(run["claims"]):
        s = by_claim.get(claim)
        if s is not None and s["status"] == "cancelled":
            states[claim] = ("cancelled", s["reason"])
        elif s is not None and s.get("error"):
            states[claim] = ("dead-lettered", s["error"])
        elif s is not None:
            states[claim] = ("failed" if s["status"] == "failed" else "done", "")
        elif cancelled:
            states[claim] = ("cancelled", cancelled["reason"])
        elif claim in letters:
            states[claim] = ("dead-lettered", f"{letters[claim]} (its copy in the dead-letter queue; no summary)")
        else:
            states[claim] = ("not queued" if index >= run["sent"] else "queued or running", "")
    waiting = [claim for claim, (state, _) in states.items() if state == "queued or running"]
    if waiting and run["mode"] == "pool" and dead_letters:
        for claim in claims_in_no_queue(backend, run, waiting):
            states[claim] = ("in no queue", "")
    return states


def claims_in_no_queue(backend, run, waiting):
    """The claims of `waiting` that no queue holds (it is gone, newer than the run, purged)."""
    try:
        queue = backend.queues.open_queue(run["queue"])
        depth = queue.counts()
        created = datetime.datetime.fromtimestamp(queue.created_at(), datetime.timezone.utc)
        if depth["visible"] + depth["in_flight"] and created <= _parse_time(run["created_at"], "created_at"):
            return []
    except NotFound:
        pass
    done = summary_claims(backend, run["run_id"])
    return [claim for claim in waiting if claim not in done]


def run_view(backend, run, summaries, dead_letters=True):
    """A report's view of a run: each claim's state, claims per state, items per outcome (they add
    up to the run's items, always) and the queue's depth while claims wait."""
    states = claim_states(backend, run, summaries, dead_letters)
    by_claim = {s["claim"]: s for s in summaries}
    items = dict.fromkeys(("ok", "failed", "pending", "dead_lettered", "cancelled"), 0)
    for index, claim in enumerate(run["claims"]):
        state = states[claim][0]
        if state in ("done", "failed"):
            items["ok"] += by_claim[claim]["ok"]
            items["failed"] += len(by_claim[claim]["failed"])
        else:
            items[ITEM_OUTCOME[state]] += claim_items(run, index)
    counts = Counter(state for state, _ in states.values())
    waiting = {claim: index for index, claim in enumerate(run["claims"]) if states[claim][0] == "queued or running"}
    reported = claims_progress(backend, run["run_id"], waiting) if waiting else {}
    running = sum(min(n, claim_items(run, waiting[claim])) for claim, n in reported.items())
    queue = None
    if counts["queued or running"]:
        with contextlib.suppress(NotFound):
            queue = backend.queues.open_queue(run["queue"]).counts()
    view = {"complete": counts["done"] + counts["failed"] == len(run["claims"]),
            "claims": {claim: {"state": state, "detail": detail} for claim, (state, detail) in states.items()},
            "claim_counts": {state: counts[state] for state in CLAIM_STATES}, "items": items, "queue": queue,
            "items_running_done": running}
    return dict(view, state=run_state(run, view))


RUN_STATES = ("running", "done", "done with failures", "failed", "cancelled", "dead-lettered",
              "interrupted")


def run_state(run, view):
    """The run's one state of RUN_STATES, from its record and run_view's claims and items: the one
    word every view gives a run (runs list, runs show, the dashboard; docs/contract.md)."""
    counts, items = view["claim_counts"], view["items"]
    if counts["cancelled"] or run.get("cancelled"):
        return "cancelled"
    if not run["staged"]:   # submit still cuts claims
        return "running"
    if counts["not queued"] or counts["in no queue"]:   # nothing runs those before runs resume
        return "interrupted"
    if counts["queued or running"]:
        return "running"
    if counts["dead-lettered"]:
        return "dead-lettered"
    if not items["failed"]:
        return "done"
    return "failed" if not items["ok"] else "done with failures"


def claim_list(claims):
    """Claims as short text, consecutive ones as a span: 'c00001, c00003..c00009'."""
    spans = []
    for claim in claims:
        if spans and int(claim[1:]) == int(spans[-1][1][1:]) + 1:
            spans[-1][1] = claim
        else:
            spans.append([claim, claim])
    return ", ".join(first if first == last else f"{first}..{last}" for first, last in spans)


def next_step(run, state):
    """What the user can do about the run's claims in `state`, one that did not run."""
    if state == "queued or running":
        return f"wait, or read it later: {command()} runs show {run['run_id']}"
    if state == "cancelled" or run["mode"] == "cold":   # a cold run's queue is gone once it ends
        return "submit those items again"
    if state == "not queued":
        return f"{command()} runs resume {run['run_id']} (or runs cancel {run['run_id']})"
    if state == "in no queue":
        return (f"{command()} runs resume {run['run_id']} re-sends them (first `pool create` "
                f"again if the pool is gone)")
    return f"{command()} runs redrive {run['run_id']}"


def format_run(run, summaries, view, results_uri, names):
    """The lines `submit` and `runs show` print: items per outcome and the run's state, claims per
    state, the claim table, dead letters, errors (failed items by `names`), the results' place,
    what becomes of claims not run."""
    items, counts, queue = view["items"], view["claim_counts"], view["queue"]
    per_state = [f"{n} {state}" for state, n in counts.items() if n]
    if queue:
        per_state = [p + f" ({run['queue']}: {queue['visible']} visible, {queue['in_flight']} in flight)"
                     if p.endswith("queued or running") else p for p in per_state]
    running = f" ({view['items_running_done']} of them done in running claims)" if view["items_running_done"] else ""
    lines = [f"run {run['run_id']} ({run['mode']}, model {run['model']}): {items['ok']} items ok, "
             f"{items['failed']} failed, {items['pending']} pending{running}, {items['dead_lettered']} "
             f"dead-lettered, {items['cancelled']} cancelled (of {run['items']} items); "
             f"state: {view['state']}",
             "  claims: " + ", ".join(per_state),
             f"  claim sizes: {format_sizes(claim_sizes(run))} ({run.get('sizing') or 'a fixed size'})"
             + (f"; version {run['version']}" if run.get("version") else ""),
             f"  {'claim':<8} {'worker':<28} {'warm':<5} {'enter_s':>8} {'ok':>6} {'failed':>6} {'seconds':>8}  status"]
    by_claim, claims, index = {s["claim"]: s for s in summaries}, run["claims"], 0
    while index < len(claims):
        state = view["claims"][claims[index]]["state"]
        if state in ("done", "failed"):
            s = by_claim[claims[index]]
            lines.append(f"  {s['claim']:<8} {s['worker_id'][:28]:<28} {'yes' if s['warm_hit'] else 'no':<5} "
                         f"{s['enter_seconds_paid']:>8.3f} {s['ok']:>6} {len(s['failed']):>6} "
                         f"{s['claim_seconds']:>8.3f}  {s['status']}")
            index += 1
            continue
        last = index
        while last + 1 < len(claims) and view["claims"][claims[last + 1]]["state"] == state:
            last += 1
        span = f" (through {claims[last]}: {last - index + 1} claims)" if last > index else ""
        lines.append(f"  {claims[index]:<8} {'-':<28} {'-':<5} {'-':>8} {'-':>6} {'-':>6} {'-':>8}  {state}{span}")
        index = last + 1
    lines += [f"  claim {claim} dead-lettered: {v['detail']}" for claim, v in view["claims"].items()
              if v["state"] == "dead-lettered"]
    lines += format_item_errors(run, summaries, names)
    lines.append(f"  results: {results_uri}  ({command()} runs results {run['run_id']})")
    cancelled = sorted({v["detail"] for v in view["claims"].values() if v["state"] == "cancelled"})
    why = f" ({'; '.join(cancelled)})"
    for state, what in NOT_RUN.items():
        if counts[state]:
            lines.append(f"  not finished: {counts[state]} claim(s) {what.format(why=why)} ---> "
                         f"HINT: {next_step(run, state)}")
    return lines


def item_errors(summaries):
    """[(message, [item indices])] of the failed items' kept messages, one group per distinct
    message (its count exact), the most frequent first."""
    groups = {}
    for s in summaries:
        for index, message in s.get("errors", {}).items():
            groups.setdefault(message, []).append(int(index))
    return sorted(groups.items(), key=lambda g: (-len(g[1]), min(g[1])))


def first_items(groups, count):
    """Indices of the items a report names: the first few of each of its first `count` groups."""
    return [i for _, indices in groups[:count] for i in sorted(indices)[:FIRST_ITEMS_SHOWN]]


def item_names(backend, run, summaries, indices):
    """{index: name} of these failed items: their --id-field value, else a file's path (one read of
    the manifest of each claim holding some), else their index."""
    claim_of = {int(i): s["claim"] for s in summaries for i in s.get("errors", {})}
    wanted, names = collections.defaultdict(list), dict(zip(indices, indices))
    for i in indices:
        wanted[claim_of[i]].append(i)
    for claim, items in wanted.items():
        with contextlib.suppress(NotFound):   # a manifest deleted: its items keep their indices
            manifest = json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
            field = run["options"].get("id_field")
            ids = (claim_ids(backend, run, claim, field, manifest) if field else
                   [name for name, _, _ in manifest["refs"]["objects"]] if "refs" in manifest else
                   [item.get("path") if isinstance(item, dict) else None
                    for item in manifest["items"]] if "bytes" in manifest else [])   # a copied file
            for i in items:
                k = i - manifest["first_index"]
                if k < len(ids) and ids[k] is not None:
                    names[i] = ids[k]
    return names


def format_item_errors(run, summaries, names):
    """The report's failed items by error: count, message, its first items (by `names`)."""
    failed = sum(len(s["failed"]) for s in summaries)
    if not failed:
        return []
    groups = item_errors(summaries)
    lines = [f"  failed items by error ({failed} failed):"]
    for message, indices in groups[:ERROR_GROUPS_SHOWN]:
        first = ", ".join(str(names.get(i, i)) for i in sorted(indices)[:FIRST_ITEMS_SHOWN]) + (
            ", ..." if len(indices) > FIRST_ITEMS_SHOWN else "")
        lines.append(f"    {len(indices):>6} x {message}  (items {first})")
    if len(groups) > ERROR_GROUPS_SHOWN:
        lines.append(f"    (+{len(groups) - ERROR_GROUPS_SHOWN} more errors: --json lists every kept message)")
    unkept = failed - sum(len(indices) for _, indices in groups)
    if unkept:
        lines.append(f"    (+{unkept} failed items whose messages were not kept: {ERRORS_KEPT} are kept per claim)")
    lines.append(f"    their tracebacks: {command()} runs results {run['run_id']} --failed")
    return lines


def listed_run(backend, run):
    """`runs list`'s record of a run: its record with its state and its items ok and failed (its
    summaries read; no dead-letter scan, as the dashboard's)."""
    view = run_view(backend, run, read_summaries(backend, run["run_id"]), dead_letters=False)
    return dict(run, state=view["state"], ok=view["items"]["ok"], failed=view["items"]["failed"])


def format_runs_list(runs, model=None):
    """`runs list`: a header line, then a line a run (listed_run's), oldest first."""
    if not runs:
        return ["no runs" + (f" of model {model}" if model else "") + " in this store"]
    run_w, model_w = (max(len(field), *(len(r[field]) for r in runs)) for field in ("run_id", "model"))
    state_w = max(len(r["state"]) for r in runs)
    return [f"{'run':<{run_w}}  {'mode':<5} {'model':<{model_w}} {'items':>9} {'claims':>7} "
            f"{'ok':>9} {'failed':>9}  {'state':<{state_w}}  created"] + [
        f"{r['run_id']:<{run_w}}  {r['mode']:<5} {r['model']:<{model_w}} {r['items']:>9,} "
        f"{len(r['claims']):>7,} {r['ok']:>9,} {r['failed']:>9,}  {r['state']:<{state_w}}  "
        f"{r['created_at']}" for r in runs]


def report_run(backend, run, summaries, as_json, out=sys.stdout):
    """Print the run (format_run, or JSON); exit code 0 when every item of every claim ran ok."""
    view = run_view(backend, run, summaries)
    if as_json:
        print(json.dumps({"run": run, "summaries": summaries, **view}, indent=1), file=out)
    else:
        shown = first_items(item_errors(summaries), ERROR_GROUPS_SHOWN)
        results = backend.store.uri(f"runs/{run['run_id']}/results/")
        names = item_names(backend, run, summaries, shown)
        print("\n".join(format_run(run, summaries, view, results, names)), file=out)
    all_ok = all(s["status"] == "ok" and not s["failed"] for s in summaries)
    return EXIT_OK if view["complete"] and all_ok else EXIT_FAILED


# ------------------------------------------------------------------------------------------------
# 6. local workers: a pool supervisor's state here, as calque reads it (calque_supervisor.py: the process)
SUPERVISOR_TICK = 0.2                   # s between two looks of the supervisor (and of a follower)
SCALE_INTERVAL = 0.5                    # s between two looks at a self-sizing pool's queue
COLD_EXIT_WAIT = 5.0                    # s a cold run's drained worker has to exit before SIGTERM
STOPPED_SHOWN = 5                       # stopped workers `pool status` lists (the rest: --json)
LOCAL_WORKERS_DEFAULT = 1               # local workers `pool create` starts without --workers
WARM_WAIT = 1800.0                      # s `pool create` waits for its workers' @enter
DEPLOY_POLL = 2.0                       # s between two looks of `pool deploy` at its runs in flight
VERSION_CHECK = 30.0                    # s between two reads of the pool record by an idle worker
                                        # (deployed elsewhere: it restarts on it, EXIT_REPLACED)
WORKER_START_GRACE = 2.0                # s submit looks again for a worker that started this instant
                                        # (`warmd --model M &` then submit: its first stats take ~0.2 s)
LIVE_STATES = ("starting", "running")   # a worker's stats state while it is alive: @enter, then claims
WORKER_LOST_AFTER = 120.0               # s of silence that makes a live worker elsewhere lost
                                        # (4 of warmd's stats intervals; it writes after claims too)


def supervisor_module():
    """calque_supervisor.py: imported only by the verbs that start or stop workers or follow their output."""
    import calque_supervisor
    return calque_supervisor


def state_dir(conf, model):
    return os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "pools", slug(model))


def read_state(path, parse, default=None):
    """A file of a pool's state folder, parsed; `default` when it is missing or unreadable."""
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, ValueError):
        return default


def read_supervisor(conf, model):
    """The supervisor's status file, or None when no live supervisor runs the pool here."""
    status = read_state(os.path.join(state_dir(conf, model), "supervisor.json"), json.loads)
    return status if status and pid_alive(status["pid"]) else None


def read_desired(folder):
    """The worker count `pool create` / `pool scale` last asked for (0 when unreadable)."""
    return read_state(os.path.join(folder, "desired"), lambda text: int(text.strip() or 0), 0)


def read_scaling(folder):
    """The bounds of a pool that sizes itself (scaling.json), or None for a fixed count."""
    return read_state(os.path.join(folder, "scaling.json"), json.loads)


def child_env(conf):
    """The environment of a process we start: every setting as resolved here (pool.env included: the
    child runs in the kit's folder, not ours), with absolute store and state paths."""
    env = dict(os.environ, **{key: conf[key] for key in DEFAULTS})
    store = conf["CALQUE_STORE"]
    env["CALQUE_STORE"] = store if store.startswith("s3://") else os.path.abspath(store)
    env["CALQUE_STATE"] = os.path.abspath(conf["CALQUE_STATE"])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie still answers kill(0); /proc tells (and a process reaped since has no entry)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def gpu_devices(conf):
    """The GPU indices this machine's workers share: CALQUE_GPUS when set (tests fake devices so),
    else CUDA_VISIBLE_DEVICES when set, else every device NVML counts ([] without NVML or a GPU)."""
    listed = conf.get("CALQUE_GPUS") or os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        import pynvml   # lazy: NVML only where a GPU may be
        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:   # no nvidia-ml-py, no driver, no device: the workers run on the CPU
        return []


# ------------------------------------------------------------------------------------------------
# 7. the cost model
# Per claim a worker pays fixed (@enter paid + acquisition) and variable (the drain) seconds at its
# instance's rate, plus its requests. A warm pool pays `fixed` once per worker; the cold
# counterfactual prices the same run as fresh acquisitions. Formulas: docs/cost.md.
RATES_VERSION = 1                                     # rates.json schema this code reads
LADDER_ITEMS = (10, 100, 1_000, 10_000, 100_000)      # item counts the crossover ladder prices
LADDER_MIN_CLAIMS = 3                                 # finished claims a run's ladder extrapolates from: one
                                                      # or two measure their start and writes more than c
TIE_REL = 1e-9                                        # costs this close are a tie (float noise)


def load_rates(path=None):
    """Read and validate a rates file (default: the bundled one); a UserError names a bad field."""
    path = str(path or package_file("calque_data", "rates.json"))
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"rates file {path} not found ---> HINT: pass --rates FILE, or restore rates.json") from None
    except OSError as e:
        raise UserError(f"rates file {path}: cannot read it ({e.strerror})") from None
    try:
        rates = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"rates file {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    _check_rates(rates, path)
    rates["_file"] = path  # for error messages that list known names
    return rates


def _field_name(keys):
    """('ec2', 'instances', 'g5.xlarge', 'usd_per_hour') -> ec2.instances['g5.xlarge'].usd_per_hour."""
    out = ""
    for k in keys:
        out += f"['{k}']" if "." in k else (f".{k}" if out else k)
    return out


_NUMBER_CHECKS = {  # kind: (test, what the message asks for)
    "positive": (lambda v: v > 0, "a positive number"),
    "nonneg": (lambda v: v >= 0, "a number >= 0"),
    "fraction": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
}


def _rates_field(rates, keys, file, kind=None):
    """The value at `keys`, checked: a _NUMBER_CHECKS name, a type (str, int, bool, dict) or None."""
    node = rates
    for i, k in enumerate(keys):
        if not isinstance(node, dict) or k not in node:
            raise UserError(f"rates file {file}: missing field {_field_name(keys[:i + 1])}")
        node = node[k]
    if isinstance(kind, str):
        test, want = _NUMBER_CHECKS[kind]
        number = isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node)
        if not (number and test(node)):
            raise UserError(f"rates file {file}: {_field_name(keys)} must be {want}, got {node!r}")
    elif kind is not None and (not isinstance(node, kind) or (kind is int and isinstance(node, bool))):
        raise UserError(f"rates file {file}: {_field_name(keys)} must be a {kind.__name__}, got {node!r}")
    return node


def _check_sourced(rates, keys, file):
    """Every figure says where it came from and when."""
    _rates_field(rates, keys + ("source",), file, str)
    _rates_field(rates, keys + ("as_of",), file, str)


def _check_rates(rates, file):
    if not isinstance(rates, dict):
        raise UserError(f"rates file {file}: top level must be a JSON object")
    version = _rates_field(rates, ("version",), file, int)
    if version != RATES_VERSION:
        raise UserError(f"rates file {file}: version {version} is not supported (this calque reads "
                        f"version {RATES_VERSION})")
    _rates_field(rates, ("updated",), file, str)
    instances = _rates_field(rates, ("ec2", "instances"), file, dict)
    cards = _rates_field(rates, ("serverless", "cards"), file, dict)
    for name, found in (("ec2.instances", instances), ("serverless.cards", cards)):
        if not found:
            raise UserError(f"rates file {file}: {name} is empty")
    for name in instances:
        keys = ("ec2", "instances", name)
        _rates_field(rates, keys + ("usd_per_hour",), file, "positive")
        gpus = _rates_field(rates, keys + ("gpus",), file, int)
        if gpus < 0:
            raise UserError(f"rates file {file}: {_field_name(keys + ('gpus',))} must be >= 0, got {gpus}")
        _check_sourced(rates, keys, file)
        if not gpus:   # a CPU instance: its serverless stand-in is a container of its size
            _rates_field(rates, keys + ("vcpus",), file, "positive")
            _rates_field(rates, keys + ("memory_gib",), file, "positive")
            continue
        _rates_field(rates, keys + ("gpu",), file, str)
        card = _rates_field(rates, keys + ("serverless_card",), file, str)
        if card not in cards:
            raise UserError(f"rates file {file}: {_field_name(keys + ('serverless_card',))} "
                            f"{card!r} is not in serverless.cards ({', '.join(cards)})")
    for name in ("spot_fraction", "savings_plan_fraction"):
        _rates_field(rates, ("ec2", name, "value"), file, "fraction")
        _check_sourced(rates, ("ec2", name), file)
    for name in cards:
        _rates_field(rates, ("serverless", "cards", name, "usd_per_second"), file, "positive")
        _check_sourced(rates, ("serverless", "cards", name), file)
    _rates_field(rates, ("serverless", "gpu_rate_includes_cpu_memory"), file, bool)
    for name in ("cpu_usd_per_core_second", "memory_usd_per_gib_second"):
        _rates_field(rates, ("serverless", name, "value"), file, "positive")
        _check_sourced(rates, ("serverless", name), file)
    _rates_field(rates, ("serverless", "container_per_gpu", "cpu_cores"), file, "nonneg")
    _rates_field(rates, ("serverless", "container_per_gpu", "memory_gib"), file, "nonneg")
    for name in ("sqs_usd_per_million", "s3_put_usd_per_thousand", "s3_get_usd_per_thousand"):
        _rates_field(rates, ("requests", name, "value"), file, "positive")
        _check_sourced(rates, ("requests", name), file)
    optional = ("cpu_instance_type",) if "cpu_instance_type" in rates.get("defaults", {}) else ()
    for name in ("instance_type", *optional):
        default_type = _rates_field(rates, ("defaults", name, "value"), file, str)
        if default_type not in instances:
            raise UserError(f"rates file {file}: defaults.{name} {default_type!r} is not in ec2.instances")
    _rates_field(rates, ("defaults", "acquisition_seconds", "value"), file, "nonneg")


def _known(names):
    return ", ".join(sorted(names, key=str.lower))


def instance_rate_per_second(rates, instance_type, spot=False, savings_plan=False):
    """$/s for one instance: on-demand, or scaled by the file's spot or savings-plan fraction."""
    instances = rates["ec2"]["instances"]
    if instance_type not in instances:
        raise UserError(f"no rate for instance type {instance_type!r} in {rates.get('_file', 'the rates file')}; "
                        f"known: {_known(instances)} ---> HINT: pick one, or add it to a --rates FILE")
    if spot and savings_plan:
        raise UserError("an instance is priced as spot or under a savings plan, not both")
    option = "spot_fraction" if spot else "savings_plan_fraction" if savings_plan else None
    fraction = rates["ec2"][option]["value"] if option else 1.0
    return instances[instance_type]["usd_per_hour"] * fraction / 3600.0


def serverless_rate_per_second(rates, card, count=1):
    """$/s for `count` serverless GPUs of `card` (any case), plus the CPU and memory a container
    reserves per GPU when the card rate excludes them (Modal bills them apart)."""
    cards = rates["serverless"]["cards"]
    key = next((k for k in cards if k.lower() == str(card).lower()), None)
    if key is None:
        raise UserError(f"no serverless rate for GPU card {card!r} in "
                        f"{rates.get('_file', 'the rates file')}; known: {_known(cards)}")
    per_gpu = cards[key]["usd_per_second"]
    if not rates["serverless"]["gpu_rate_includes_cpu_memory"]:
        shape = rates["serverless"]["container_per_gpu"]
        per_gpu += (shape["cpu_cores"] * rates["serverless"]["cpu_usd_per_core_second"]["value"]
                    + shape["memory_gib"] * rates["serverless"]["memory_usd_per_gib_second"]["value"])
    return count * per_gpu


def serverless_stand_in(rates, instance_type):
    """($/s, what it is) of the serverless container standing in for this instance: its GPUs (the
    card and count), or a CPU container of its cores (vCPUs / 2) and memory."""
    instance_rate_per_second(rates, instance_type)  # same unknown-type error
    inst, per = rates["ec2"]["instances"][instance_type], rates["serverless"]
    if inst["gpus"]:
        return (serverless_rate_per_second(rates, inst["serverless_card"], inst["gpus"]),
                f"{inst['gpus']}x {inst['serverless_card']}")
    return (inst["vcpus"] / 2 * per["cpu_usd_per_core_second"]["value"]
            + inst["memory_gib"] * per["memory_usd_per_gib_second"]["value"],
            f"{inst['vcpus'] / 2:g} cores + {inst['memory_gib']:g} GiB")


def price_label(rates, instance_type, spot=False, savings_plan=False):
    """'g5.xlarge (1x A10G) on-demand $1.006/h, rates.json 2026-11-29': what a cost is priced as."""
    per_hour = instance_rate_per_second(rates, instance_type, spot, savings_plan) * 3600
    inst = rates["ec2"]["instances"][instance_type]
    option = "spot" if spot else "savings plan" if savings_plan else "on-demand"
    shape = f"{inst['gpus']}x {inst['gpu']}" if inst["gpus"] else f"{inst['vcpus']} vCPU, no GPU"
    return (f"{instance_type} ({shape}) {option} {_usd(per_hour)}/h, "
            f"{rates.get('_file', 'rates')} {rates['updated']}")


def request_counts(requests):
    """All REQUEST_KEYS, missing ones as 0 (an older worker). An unknown key is a ValueError: the
    worker and this model share these names, and a typo must fail a test rather than go unpriced."""
    requests = requests or {}
    unknown = set(requests) - set(REQUEST_KEYS)
    if unknown:
        raise ValueError(f"unknown request counter(s) {sorted(unknown)}; known: {', '.join(REQUEST_KEYS)}")
    counts = {}
    for k in REQUEST_KEYS:
        v = requests.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"request counter {k} must be a count >= 0, got {v!r}")
        counts[k] = v
    return counts


def _add_counts(many):
    total = dict.fromkeys(REQUEST_KEYS, 0)
    for counts in many:
        for k, v in request_counts(counts).items():
            total[k] += v
    return total


def request_cost(rates, requests):
    """$ for these request counts at SQS + S3 Standard prices, whatever the backend (as if on AWS)."""
    n = request_counts(requests)
    r = rates["requests"]
    sqs = n["queue_receives"] + n["queue_empty_receives"] + n["queue_other"]
    return (sqs * r["sqs_usd_per_million"]["value"] / 1e6
            + n["store_gets"] * r["s3_get_usd_per_thousand"]["value"] / 1e3
            + (n["store_puts"] + n["store_lists"]) * r["s3_put_usd_per_thousand"]["value"] / 1e3)


def _seconds(record, key, what, default=None):
    v = record.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UserError(f"{what}: field {key!r} is missing or not a number >= 0 (got {v!r})")
    return float(v)


def _claim_label(summary):
    return f"summary of claim {summary.get('claim', '?')} of run {summary.get('run_id', '?')}"


def claim_cost(summary, rate_per_s, rates):
    """One claim's fixed (@enter paid + acquisition) and variable (drain) seconds, priced."""
    what = _claim_label(summary)
    enter = _seconds(summary, "enter_seconds_paid", what)
    acquisition = _seconds(summary, "acquisition_seconds", what, default=0.0)
    claim_seconds = _seconds(summary, "claim_seconds", what)
    fixed = enter + acquisition
    variable = max(0.0, claim_seconds - enter)  # clamp: clocks read at different points can cross
    request_usd = request_cost(rates, summary.get("requests"))
    return {
        "enter_seconds": enter, "acquisition_seconds": acquisition,
        "fixed_seconds": fixed, "variable_seconds": variable, "instance_seconds": fixed + variable,
        "fixed_usd": fixed * rate_per_s, "variable_usd": variable * rate_per_s,
        "request_usd": request_usd, "total_usd": (fixed + variable) * rate_per_s + request_usd,
    }


def _check_numbers(**values):
    for name, v in values.items():
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")


def measured_enter_seconds(worker_stats):
    """Mean @enter seconds over every @enter the pool's workers recorded, or None if none has."""
    count = sum(w.get("enter_count", 0) for w in worker_stats)
    return sum(w.get("enter_seconds", 0.0) for w in worker_stats) / count if count else None


def run_cost(summaries, rate_per_s, rates, enter_seconds, acquisition_seconds, *,
             enter_status="measured", acquisition_status="assumed", shards=1,
             expected_claims=None, backend="aws"):
    """Price a run from its claim summaries: actual, warm, cold (`shards` fresh acquisitions) and
    the saving (docs/cost.md); fewer summaries than expected_claims is partial."""
    if backend not in ("aws", "local"):
        raise ValueError(f"backend must be 'aws' or 'local', got {backend!r}")
    _check_numbers(enter_seconds=enter_seconds, acquisition_seconds=acquisition_seconds)
    claims = [claim_cost(s, rate_per_s, rates) for s in summaries]
    items = sum(int(_seconds(s, "items", _claim_label(s))) for s in summaries)
    ok = sum(int(_seconds(s, "ok", _claim_label(s))) for s in summaries)
    fixed = sum(c["fixed_seconds"] for c in claims)
    variable = sum(c["variable_seconds"] for c in claims)
    requests = _add_counts(s.get("requests") for s in summaries)
    request_usd = request_cost(rates, requests)
    total = sum(c["total_usd"] for c in claims)
    cold_fixed = shards * (acquisition_seconds + enter_seconds)
    cold_usd = (cold_fixed + variable) * rate_per_s + request_usd
    saving = cold_usd - total if abs(cold_usd - total) >= 1e-8 else 0.0   # less: float noise
    notes = []
    partial = expected_claims is not None and len(summaries) < expected_claims
    if partial:
        notes.append(f"partial: {len(summaries)} of {expected_claims} claims have finished; figures cover those only")
    missing = [str(s.get("claim", "?")) for s in summaries if "requests" not in s]
    if missing:
        notes.append(f"claim(s) {', '.join(missing)} recorded no request counts: priced as 0 requests")
    if any(s.get("receive_count", 1) > 1 for s in summaries):
        notes.append("some claims were redelivered: work lost with a dropped lease is in no summary and not priced")
    if backend == "local":
        notes.append("seconds and requests are priced as if on AWS; the local backend itself pays nothing")
    return {
        "claims": len(summaries), "expected_claims": expected_claims, "partial": partial,
        "items": items, "ok": ok, "failed": items - ok,
        "warm_hits": sum(1 for s in summaries if s.get("warm_hit")), "rate_per_second": rate_per_s,
        "fixed_seconds": fixed, "variable_seconds": variable, "instance_seconds": fixed + variable,
        "enter_seconds_paid": sum(c["enter_seconds"] for c in claims),
        "acquisition_seconds": sum(c["acquisition_seconds"] for c in claims),
        "fixed_usd": fixed * rate_per_s, "variable_usd": variable * rate_per_s,
        "requests": requests, "request_usd": request_usd,
        "requests_basis": "billed on SQS + S3" if backend == "aws" else "as if on SQS + S3",
        "total_usd": total, "usd_per_1000_items": total / items * 1000 if items else None,
        "seconds_per_item": variable / items if items else None,  # the ladder's c
        "warm_usd": variable * rate_per_s + request_usd,
        "cold": {"shards": shards, "acquisition_seconds": acquisition_seconds,
                 "enter_seconds": enter_seconds, "fixed_seconds": cold_fixed, "variable_seconds": variable,
                 "instance_seconds": cold_fixed + variable, "fixed_usd": cold_fixed * rate_per_s,
                 "usd": cold_usd},
        "saving_usd": saving, "saving_fraction": saving / cold_usd if cold_usd > 0 else None,
        "inputs": {"instance rate": "published (rates file)", "claim seconds": "measured",
                   "request counts": "measured", "@enter seconds": enter_status,
                   "acquisition seconds": acquisition_status},
        "notes": notes,
    }


def _tie(x, y):
    return math.isclose(x, y, rel_tol=TIE_REL, abs_tol=1e-15)


def _first_int_above(x):
    """Smallest integer n > x, reading an x within float noise of an integer k as exactly k."""
    k = round(x)
    return k + 1 if _tie(x, k) else math.floor(x) + 1


def _last_int_below(x):
    k = round(x)
    return k - 1 if _tie(x, k) else math.ceil(x) - 1


def _cheaper_interval(fx, sx, fy, sy):
    """Open interval (lo, hi) of real n where fx + sx*n < fy + sy*n, or None if there is none."""
    a, b = fy - fx, sy - sx  # cost_y - cost_x = a + b*n
    if _tie(sx, sy):
        return (-math.inf, math.inf) if a > 0 and not _tie(fx, fy) else None
    n0 = -a / b
    return (n0, math.inf) if b > 0 else (-math.inf, n0)


def _pair(name_x, x, name_y, y):
    """Break-even between two options (fixed $, $ per item) and who is cheaper on each side."""
    (fx, sx), (fy, sy) = x, y
    out = {"a": name_x, "b": name_y, "break_even_items": None}
    if _tie(sx, sy):
        cheaper = None if _tie(fx, fy) else (name_x if fx < fy else name_y)
        out.update(cheaper_below=cheaper, cheaper_above=cheaper, wins_from=None,
                   text=(f"{name_x} = {name_y} at every n" if cheaper is None else
                         f"{cheaper} cheaper at every n: same $ per item, {_usd(abs(fx - fy))} less up front"))
        return out
    n0 = (fy - fx) / (sx - sy)  # fx + sx*n0 == fy + sy*n0
    below, above = (name_x, name_y) if sx > sy else (name_y, name_x)
    out.update(break_even_items=n0, cheaper_below=below, cheaper_above=above,
               wins_from=max(1, _first_int_above(n0)))
    last, tie = _last_int_below(n0), (f" (tie at {round(n0):,})" if _tie(n0, round(n0)) else "")
    if n0 <= 0:
        out["text"] = f"{above} cheaper at every n: no more up front and less per item"
    elif last < 1:   # items are whole: no fraction of one is shown
        out["text"] = f"{above} cheaper from the first item" if not tie else f"{above} cheaper from 2 items{tie}"
    else:
        out["text"] = f"{below} cheaper up to {_items(last)}, {above} from {out['wins_from']:,}{tie}"
    return out


def _items(n):
    return f"{n:,} item" + ("" if n == 1 else "s")


def crossover_ladder(c, E, A, instance_rate, serverless_rate, item_counts=LADDER_ITEMS, request_usd_per_item=0.0):
    """Cost of n items warm, cold and serverless, and the n where each starts to win.
    c: seconds per item, E: @enter s, A: acquisition s, rates in $/s, request_usd_per_item: the
    pool's requests per item. Each option is a line fixed + slope*n (docs/cost.md); an option wins
    at n when it is strictly cheaper than both others, so ties win nothing."""
    _check_numbers(c=c, E=E, A=A, request_usd_per_item=request_usd_per_item)
    for name, v in (("instance_rate", instance_rate), ("serverless_rate", serverless_rate)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive rate, got {v!r}")
    r, R, q = instance_rate, serverless_rate, request_usd_per_item
    # name: (fixed $, $ per item)
    options = {"warm": (0.0, r * c + q), "cold": (r * (A + E), r * c + q), "serverless": (R * E, R * c)}
    names, rows = list(options), []
    for n in item_counts:
        cost = {k: f + s * n for k, (f, s) in options.items()}
        low = min(cost.values())
        rows.append({"items": n, **{f"{k}_usd": v for k, v in cost.items()},
                     "cheapest": " = ".join(k for k in names if _tie(cost[k], low))})
    pairs = [_pair(x, options[x], y, options[y]) for i, x in enumerate(names) for y in names[i + 1:]]
    wins = {}
    for x in names:
        lo, hi, reasons = 0.0, math.inf, []  # items are integers n >= 1, i.e. n > 0
        for y in (y for y in names if y != x):
            span = _cheaper_interval(*options[x], *options[y])
            reasons.append(_span_reason(x, options[x], y, options[y], span))
            lo, hi = (math.inf, -math.inf) if span is None else (max(lo, span[0]), min(hi, span[1]))
        first = _first_int_above(lo) if math.isfinite(lo) else None
        last = _last_int_below(hi) if math.isfinite(hi) else None
        if first is None or (last is not None and first > last):
            wins[x] = {"from": None, "until": None, "reason": "never: " + "; ".join(r for r in reasons if r)}
        else:
            wins[x] = {"from": first, "until": last, "reason": None}
    return {
        "inputs": {"c": c, "E": E, "A": A, "instance_rate": r, "serverless_rate": R, "request_usd_per_item": q},
        "options": {k: {"fixed_usd": f, "usd_per_item": s} for k, (f, s) in options.items()},
        "rows": rows, "pairs": pairs, "wins": wins,
        "assumptions": [
            f"warm excludes the pool's idle time between runs: see `{command()} pool cost` for what idling costs",
            "serverless runs at the same seconds per item on the like-for-like card, pays @enter on one "
            "cold start, no acquisition, no per-request fee, and no idle tail after the last item",
        ],
    }


def _span_reason(x, fx_sx, y, fy_sy, span):
    """How x's cheaper-than-y span limits where x can win ('' when x beats y at every n >= 1)."""
    (fx, sx), (fy, sy) = fx_sx, fy_sy
    if span is None:
        if _tie(fx, fy):
            return f"ties with {y} at every n"
        return f"same $ per item as {y} but {_usd(fx - fy)} more up front"
    lo, hi = span
    if math.isinf(hi):
        return "" if lo < 1 else f"cheaper than {y} only from {_items(_first_int_above(lo))}"
    if hi <= 0:
        return f"{y} costs no more up front ({_usd(fy)} vs {_usd(fx)}) and less per item ({_usd(sy)} vs {_usd(sx)})"
    if _last_int_below(hi) < 1:   # cheaper only below one item: items are whole
        return (f"{y} cheaper from the first item ({_usd(sy)} vs {_usd(sx)} per item outweighs "
                f"{_usd(fy - fx)} up front)")
    return f"cheaper than {y} only up to {_items(_last_int_below(hi))}"


def _parse_time(text, what):
    try:
        t = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise UserError(f"{what}: {text!r} is not an ISO-8601 time (e.g. 2026-11-29T10:00:00Z)") from None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)  # a bare time is UTC


def pool_cost(worker_stats, rate_per_s, rates, cold_enter_seconds, acquisition_seconds, since=None,
              cold_starts=None, acquisition_status="assumed"):
    """What a pool paid, idle included, against serving its traffic cold, and its idle budget
    (docs/cost.md). N: the claims unless cold_starts; E: the measured mean @enter. With `since`,
    an earlier worker is prorated by time and its @enter falls outside."""
    enter_status = "measured" if cold_enter_seconds is None else "given"
    if cold_enter_seconds is None:
        cold_enter_seconds = measured_enter_seconds(worker_stats)
        if cold_enter_seconds is None:
            cold_enter_seconds, enter_status = 0.0, "unknown: no worker has recorded an @enter yet (0 used)"
    since_t = _parse_time(since, "--since") if since is not None else None
    notes, t = [], dict(workers=0, alive=0.0, busy=0.0, enter=0.0, enter_count=0, claims=0.0,
                        warm_hits=0.0, items=0.0)
    window_requests, prorated = [], False
    for i, w in enumerate(worker_stats):
        what = f"stats of worker {w.get('worker_id', i)}"
        share, enter_in_window = 1.0, True
        if since_t is not None:
            started = _parse_time(w.get("started_at"), what + ": started_at")
            updated = _parse_time(w.get("updated_at"), what + ": updated_at")
            if updated < since_t:
                continue
            if started < since_t:
                life = (updated - started).total_seconds()
                share = (updated - since_t).total_seconds() / life if life > 0 else 0.0
                enter_in_window, prorated = False, True
                notes.append(f"worker {w.get('worker_id', i)} started before --since: counters prorated to {share:.0%}")
        t["workers"] += 1
        t["alive"] += share * _seconds(w, "alive_seconds", what)
        t["busy"] += share * _seconds(w, "busy_seconds", what)
        if enter_in_window:
            t["enter"] += _seconds(w, "enter_seconds", what, default=0.0)
            t["enter_count"] += int(_seconds(w, "enter_count", what, default=0))
        for k in ("claims", "warm_hits", "items"):
            t[k] += share * _seconds(w, k, what, default=0)
        window_requests.append({k: share * v for k, v in request_counts(w.get("requests")).items()})
    requests = _add_counts(window_requests)
    request_usd = request_cost(rates, requests)
    idle = max(0.0, t["alive"] - t["busy"])
    drain = max(0.0, t["busy"] - t["enter"])
    n_cold = t["claims"] if cold_starts is None else cold_starts
    per_start = acquisition_seconds + cold_enter_seconds
    pool_usd = t["alive"] * rate_per_s + request_usd
    cold_usd = (n_cold * per_start + drain) * rate_per_s + request_usd
    budget = n_cold * per_start - t["enter"]
    if t["workers"] == 0:
        notes.append("no worker stats in the window")
    return {
        "workers": t["workers"], "instance_seconds": t["alive"], "busy_seconds": t["busy"],
        "drain_seconds": drain, "enter_seconds": t["enter"], "enter_count": t["enter_count"],
        "idle_seconds": idle, "busy_fraction": t["busy"] / t["alive"] if t["alive"] else None,
        "claims": t["claims"], "warm_hits": t["warm_hits"], "items": t["items"],
        "requests": requests, "request_usd": request_usd, "usd": pool_usd,
        "usd_per_1000_items": pool_usd / t["items"] * 1000 if t["items"] else None,
        "drain_usd_per_1000_items": drain * rate_per_s / t["items"] * 1000 if t["items"] else None,
        "cold": {"starts": n_cold, "acquisition_seconds": acquisition_seconds,
                 "enter_seconds": cold_enter_seconds, "usd": cold_usd},
        "warm_beats_cold": pool_usd < cold_usd, "idle_budget_seconds": budget,
        "idle_headroom_seconds": budget - idle,
        "idle_budget_per_claim_seconds": budget / n_cold / t["workers"] if n_cold and t["workers"] else None,
        "idle_per_claim_seconds": idle / n_cold / t["workers"] if n_cold and t["workers"] else None,
        "inputs": {
            "instance rate": "published (rates file)",
            "alive/busy seconds, claims, items": "measured (prorated)" if prorated else "measured",
            "@enter seconds": enter_status, "acquisition seconds": acquisition_status,
            "cold starts": "assumed: one per claim" if cold_starts is None else "given",
        },
        "notes": notes,
    }


class Pricing(typing.NamedTuple):
    """What a cost is priced with: rates, instance type, its $/s and label, the purchase option,
    whether the user named the type (else work that used no GPU is priced as CPU: choose_pricing),
    and the serverless container standing in for the instance: its $/s and what it is."""
    rates: dict
    instance_type: str
    rate_per_s: float
    label: str
    spot: bool = False
    savings_plan: bool = False
    chosen: bool = True
    serverless_rate: float = 0.0
    serverless: str = ""


def pricing(rates_file=None, instance_type=None, spot=False, savings_plan=False, rates=None):
    """The Pricing of a rates file and an instance type (defaults: the bundled file, its type)."""
    rates = rates or load_rates(rates_file)
    chosen, instance_type = instance_type is not None, instance_type or rates["defaults"]["instance_type"]["value"]
    rate = instance_rate_per_second(rates, instance_type, spot=spot, savings_plan=savings_plan)
    return Pricing(rates, instance_type, rate, price_label(rates, instance_type, spot=spot, savings_plan=savings_plan),
                   spot, savings_plan, chosen, *serverless_stand_in(rates, instance_type))


def used_no_gpu(records):
    """True when the workers of these claim summaries, or these workers' stats, said they saw no GPU
    (NVML absent or without a device), every one that says (a cancelled or dead-lettered claim's
    summary, run by no worker, does not)."""
    said = [(r.get("gpu_utilisation") or {}).get("reason") or r.get("no_gpu") or "" for r in records
            if "gpu_utilisation" in r or "no_gpu" in r]
    return bool(said) and all(reason.startswith("no ") for reason in said)


def choose_pricing(price, records):
    """The one choice of instance and serverless stand-in that plan, submit, cost, pool cost, the
    dashboard and the report all price with: `price` (the cost options given) for the work that
    `records` (claim summaries or worker stats) describe. Default-priced work is priced as the one
    EC2 instance type its workers ran on (an EC2 pool's or cold run's); else, where it saw no GPU,
    as the rates file's defaults.cpu_instance_type, or, without one, its label says a GPU price was
    assumed."""
    if price.chosen:
        return price
    ran_on = {r.get("instance_type") for r in records} - {None}
    if len(ran_on) == 1 and next(iter(ran_on)) in price.rates["ec2"]["instances"]:
        priced = pricing(instance_type=ran_on.pop(), spot=price.spot, savings_plan=price.savings_plan,
                         rates=price.rates)
        return priced._replace(label=f"{priced.label}: the type the workers ran on (--instance-type prices "
                                     "another)", chosen=False)
    if not used_no_gpu(records):
        return price
    cpu = price.rates["defaults"].get("cpu_instance_type", {}).get("value")
    if cpu is None:
        return price._replace(label=f"{price.label}; a GPU price assumed for work that used no "
                                    "GPU (the rates file names no defaults.cpu_instance_type)")
    priced = pricing(instance_type=cpu, spot=price.spot, savings_plan=price.savings_plan, rates=price.rates)
    return priced._replace(label=f"{priced.label}: no worker saw a GPU (--instance-type prices another)",
                           chosen=False)


def pool_cost_report(worker_stats, price, since=None):
    """(report, label) of a pool from its workers' stats: pool_cost at choose_pricing's price, A the
    rates file's acquisition (assumed), E the workers' measured mean."""
    price = choose_pricing(price, worker_stats)
    report = pool_cost(worker_stats, price.rate_per_s, price.rates, None,
                       price.rates["defaults"]["acquisition_seconds"]["value"], since=since)
    return report, price.label


def run_cost_report(backend, run, summaries, price):
    """(report, ladder, label, status) of a run. E is measured; A is the rates file's assumption
    for a pool run, and its measured start-up for a cold one (its own counterfactual)."""
    price = choose_pricing(price, summaries)
    rates, rate = price.rates, price.rate_per_s
    if run["mode"] == "cold":
        paid = [s for s in summaries if s["enter_seconds_paid"] > 0]
        if paid:
            enter = sum(s["enter_seconds_paid"] for s in paid) / len(paid)
            acquisition = sum(s["acquisition_seconds"] for s in paid) / len(paid)
            enter_status = acquisition_status = "measured (this cold run)"
        else:
            enter, acquisition, enter_status, acquisition_status = 0.0, 0.0, "unknown (no claim paid one)", "unknown"
        shards = max(1, len({s["worker_id"] for s in paid}))
    else:
        enter = measured_enter_seconds(read_worker_stats(backend, run["model"]))
        enter_status = "measured (pool workers' mean)" if enter is not None else "unknown (no worker stats; 0 used)"
        enter, shards = enter or 0.0, 1
        acquisition = rates["defaults"]["acquisition_seconds"]["value"]
        acquisition_status = "assumed (rates.json defaults: a fresh EC2 instance)"
    report = run_cost(summaries, rate, rates, enter, acquisition, enter_status=enter_status,
                      acquisition_status=acquisition_status, shards=shards,
                      expected_claims=len(run["claims"]), backend=backend.kind)
    ladder = None
    if report["seconds_per_item"] is not None:
        ladder = crossover_ladder(report["seconds_per_item"], enter, acquisition, rate, price.serverless_rate,
                                  request_usd_per_item=report["request_usd"] / report["items"])
        ladder["too_few_claims"] = (f"not enough claims to extrapolate: {report['claims']} finished, the "
                                    f"ladder needs {LADDER_MIN_CLAIMS}" if report["claims"] < LADDER_MIN_CLAIMS
                                    else None)
    status = {"c": "measured", "E": enter_status.split(" ")[0], "A": acquisition_status.split(" ")[0],
              "q": "measured", "R": f"published, {price.serverless}"}
    return report, ladder, price.label, status


def _usd(x):
    """Dollars: cents from $100, else 6 significant figures; $0 below a millionth of a cent."""
    if abs(x) < 1e-8:
        return "$0"
    sign, x = ("-" if x < 0 else ""), abs(x)
    if x >= 100:
        return f"{sign}${x:,.2f}"
    digits = max(2, 5 - math.floor(math.log10(x)))
    text = f"{x:.{digits}f}".rstrip("0")
    if len(text.split(".")[1]) < 2:
        text = f"{x:.2f}"
    return f"{sign}${text}"


def _inputs_line(inputs):
    return "  inputs    " + "; ".join(f"{k}: {v}" for k, v in inputs.items())


def format_run_cost(report, priced_as):
    """The lines `submit` and `calque.py cost RUN` print."""
    cold, n = report["cold"], report["requests"]
    per_1000 = report["usd_per_1000_items"]
    lines = [
        f"cost      priced as {priced_as}" + ("  [PARTIAL]" if report["partial"] else ""),
        f"  fixed     {report['acquisition_seconds']:.2f} s acquisition + {report['enter_seconds_paid']:.2f} s "
        f"@enter paid = {report['fixed_seconds']:.2f} s  {_usd(report['fixed_usd'])}",
        f"  variable  {report['variable_seconds']:.2f} s (drain)  {_usd(report['variable_usd'])}",
        f"  requests  {n['queue_receives'] + n['queue_empty_receives'] + n['queue_other']:,} queue "
        f"({n['queue_empty_receives']:,} empty receives), {n['store_gets']:,} gets, "
        f"{n['store_puts'] + n['store_lists']:,} puts/lists  "
        f"{_usd(report['request_usd'])} ({report['requests_basis']})",
        f"  total     {_usd(report['total_usd'])} for {report['items']:,} items ({report['claims']} claims, "
        f"{report['warm_hits']} warm hits)" + (f" = {_usd(per_1000)} per 1,000 items" if per_1000 is not None else ""),
        f"  cold      {_usd(cold['usd'])} as a fresh acquisition: its fixed + the same variable and requests",
        f"    fixed   {cold['shards']} x ({cold['acquisition_seconds']:.2f} s acquisition + "
        f"{cold['enter_seconds']:.2f} s @enter) = {cold['fixed_seconds']:.2f} s  {_usd(cold['fixed_usd'])}",
    ]
    if report["saving_fraction"] is not None:
        lines.append(f"  saving    {_usd(report['saving_usd'])} ({report['saving_fraction']:.1%}) against cold; "
                     f"on an already-warm pool this work costs {_usd(report['warm_usd'])}")
    lines.append(_inputs_line(report["inputs"]))
    lines += [f"  note      {note}" for note in report["notes"]]
    return lines


def format_ladder(ladder, status):
    """The crossover table; `status` labels each input, e.g. {"c": "measured", "A": "assumed"}."""
    i = ladder["inputs"]
    lines = [
        f"ladder    c = {i['c']:.4g} s/item ({status.get('c', 'assumed')}), E = {i['E']:.4g} s @enter "
        f"({status.get('E', 'assumed')}), A = {i['A']:.4g} s acquisition ({status.get('A', 'assumed')})",
        f"          instance {_usd(i['instance_rate'] * 3600)}/h, serverless {_usd(i['serverless_rate'] * 3600)}/h "
        f"({status.get('R', 'published')}), requests {_usd(i['request_usd_per_item'])}/item "
        f"({status.get('q', 'measured')})",
    ]
    if ladder.get("too_few_claims"):
        return lines + [f"  {ladder['too_few_claims']}"]
    lines.append(f"  {'items':>9}  {'warm':>13}  {'cold':>13}  {'serverless':>13}  cheapest")
    for row in ladder["rows"]:
        lines.append(f"  {row['items']:>9,}  {_usd(row['warm_usd']):>13}  {_usd(row['cold_usd']):>13}  "
                     f"{_usd(row['serverless_usd']):>13}  {row['cheapest']}")
    for name, w in ladder["wins"].items():
        if w["from"] is None:
            lines.append(f"  {name:<10}  {w['reason']}")
        else:
            span = (f"from {w['from']:,} to {w['until']:,} items" if w["until"] is not None else
                    "at every n" if w["from"] == 1 else f"from {w['from']:,} items on")
            lines.append(f"  {name:<10}  cheapest {span}")
    lines += [f"  {p['a']} vs {p['b']}: {p['text']}" for p in ladder["pairs"]]
    lines += [f"  assumes   {a}" for a in ladder["assumptions"]]
    return lines


def format_cost_table(run_reports, priced_as):
    """`calque.py cost RUN RUN ...`: one comparison line per (run record, run_cost report)."""
    width = max(len(run["run_id"]) for run, _ in run_reports)
    lines = [f"priced as {priced_as}",
             f"  {'run':<{width}} {'mode':<5} {'claims':>6} {'warm':>5} {'items':>7} "
             f"{'fixed_s':>8} {'drain_s':>8} {'total':>13} {'per 1,000 items':>16}"]
    for run, report in run_reports:
        lines.append(f"  {run['run_id']:<{width}} {run['mode']:<5} {report['claims']:>6} {report['warm_hits']:>5} "
                     f"{report['items']:>7} {report['fixed_seconds']:>8.2f} {report['variable_seconds']:>8.3f} "
                     f"{_usd(report['total_usd']):>13} {_usd(report['usd_per_1000_items'] or 0):>16}"
                     + ("  [partial]" if report["partial"] else ""))
    return lines


def format_pool_cost(report, priced_as, model):
    """The lines `calque.py pool cost --model M` prints."""
    if report["workers"] == 0:
        return [f"pool cost {model}: no worker stats in the window"]
    per_1000, drain_1000 = report["usd_per_1000_items"], report["drain_usd_per_1000_items"]
    cold = report["cold"]
    lines = [
        f"pool cost {model}, priced as {priced_as}",
        f"  paid      {report['instance_seconds']:,.0f} instance-s over {report['workers']} "
        f"workers = {_usd(report['usd'])} (requests {_usd(report['request_usd'])})",
        f"  busy      {report['busy_fraction']:.1%} ({report['drain_seconds']:,.0f} s drain + "
        f"{report['enter_seconds']:,.0f} s @enter x{report['enter_count']}; {report['idle_seconds']:,.0f} s idle)",
        f"  traffic   {report['claims']:,.0f} claims, {report['warm_hits']:,.0f} warm hits, "
        f"{report['items']:,.0f} items",
    ]
    if per_1000 is not None:
        lines.append(f"  per 1,000 {_usd(per_1000)} with idle, {_usd(drain_1000)} drain only")
    start = cold["acquisition_seconds"] + cold["enter_seconds"]
    lines.append(f"  cold      {_usd(cold['usd'])} for {cold['starts']:,.0f} cold starts x "
                 f"({cold['acquisition_seconds']:.2f} s acquisition + {cold['enter_seconds']:.2f} s @enter) = "
                 f"{cold['starts'] * start:,.2f} s + the same drain: "
                 + ("warm is cheaper" if report["warm_beats_cold"] else "COLD would have been cheaper"))
    per_claim = report["idle_budget_per_claim_seconds"]
    lines.append(f"  idle      budget {report['idle_budget_seconds']:,.0f} instance-s, used "
                 f"{report['idle_seconds']:,.0f}, headroom {report['idle_headroom_seconds']:,.0f}"
                 + (f"; between claims the pool may idle {per_claim:,.0f} s, it idled "
                    f"{report['idle_per_claim_seconds']:,.0f} s" if per_claim is not None else ""))
    lines.append(_inputs_line(report["inputs"]))
    lines += [f"  note      {note}" for note in report["notes"]]
    return lines


def run_cost_lines(backend, run, summaries, price):
    report, _, label, _ = run_cost_report(backend, run, summaries, price)
    return format_run_cost(report, label)


# ------------------------------------------------------------------------------------------------
# 9. across both paths: a Modal app's pool options, the cold baseline, pools' status, the planner
def modal_gpu(gpu):
    """(card, count) of a Modal gpu= value ("H100:8", "a10g", or a list of fallbacks: the first)."""
    if isinstance(gpu, (list, tuple)):
        gpu = gpu[0] if gpu else None
    if not isinstance(gpu, str):
        return None, 0
    card, _, count = gpu.upper().rstrip("!").partition(":")
    return MODAL_GPU_ALIASES.get(card, card), int(count or 1)


def suggest_instance(rates, card, count):
    """The cheapest instance type in the rates with at least `count` GPUs of `card`, or None."""
    fits = [(i["usd_per_hour"], name) for name, i in rates["ec2"]["instances"].items()
            if i.get("serverless_card") == card and i["gpus"] >= count]
    return min(fits)[1] if fits else None


def modal_options(handler_spec, params=(), secrets=(), volumes=(), gpus_per_worker=None, batch_size=None,
                  workers_here=True):
    """What a Modal handler's pool needs from its app file, imported here: (the record's "modal"
    entry, the max_deliveries / batch_timeout / instance_type its retries=, timeout= and gpu=
    suggest, notes); (None, {}, []) for a calque handler. `workers_here`: pip packages checked."""
    path, name = parse_handler_spec(handler_spec)
    with open(path, "rb") as f:
        if not imports_modal(f.read(), path):
            if params or secrets or volumes:
                raise UserError(f"--param, --secret and --volume apply to a Modal app handler; {path} imports no modal")
            return None, {}, []
    shim, target, method = import_modal_app(path, name)
    options, notes, suggested = target.options, shim.ignored(target.options), {}
    given = key_values(params, "--param")
    declared = target.parameters() if method else {}
    for key, value in given.items():
        if key not in declared:
            raise UserError(f"--param {key}: {target.__name__} has no modal.parameter() {key} "
                            f"(it has: {', '.join(declared) or 'none'})")
        modal_param(target.user_cls, key, value)
    missing = [k for k, default in declared.items() if default is inspect.Parameter.empty and k not in given]
    if missing:
        raise UserError(f"{target.__name__}.{missing[0]} is a modal.parameter() without a default "
                        f"---> HINT: pool create --param {missing[0]}=VALUE")
    image = image_plan(options.get("image"), path)
    image["env"].update({k: str(v) for k, v in (options.get("env") or {}).items() if v is not None})
    if image["steps"]:
        where = "this Python" if workers_here else "the instance's venv, the image's packages installed at boot"
        notes.append(f"image= {' + '.join(step[0] for step in image['steps'])}: not built; the workers run in {where}")
    if workers_here:
        unmet = {req: why for req in image["pip"] if (why := pip_unmet(req))}
        if unmet:
            listed = ", ".join(f"{req} ({why})" for req, why in unmet.items())
            raise UserError(f"{path}: the image's pip_install {listed} in the workers' Python "
                            f"({sys.executable}) ---> HINT: {sys.executable} -m pip install "
                            f"{' '.join(shlex.quote(m) for m in unmet)}")
    secret_files = {k: os.path.abspath(v) for k, v in key_values(secrets, "--secret").items()}
    for secret in options["secrets"]:
        if secret.name and secret.name not in secret_files:
            notes.append(f"secret {secret.name}: no --secret {secret.name}=FILE: its variables "
                         "must be in the workers' environment (pool.env)")
    mounts = modal_volumes(options["volumes"], volumes, workers_here, notes)
    card, count = modal_gpu(options.get("gpu"))
    if count > (gpus_per_worker or 1):
        raise UserError(f"gpu={options['gpu']!r} asks {count} GPUs per container; this pool gives "
                        f"each worker {gpus_per_worker or 1} ---> HINT: --gpus-per-worker {count}")
    if card:
        suggested["instance_type"] = suggest_instance(load_rates(), card, count)
        notes.append(f"gpu={options['gpu']!r}: EC2 instance type for --instances: "
                     f"{suggested['instance_type'] or 'none in rates.json'}")
    retries = options.get("retries")
    if retries is not None:
        suggested["max_deliveries"] = 1 + (retries if isinstance(retries, int) else retries.max_retries)
    if options.get("timeout"):   # a batch is one call of a @modal.batched, else one call per item
        fn = getattr(target.user_cls, method) if method else target.raw_f
        per_batch = 1 if getattr(fn, "_modal_role", {}).get("kind") == "batched" else batch_size
        suggested["batch_timeout"] = float(options["timeout"]) * (per_batch or 1)
    record = {"params": given, "secrets": secret_files, "volumes": mounts, "image": image,
              "declared": {"gpu": options.get("gpu")}}
    return record, suggested, notes


def modal_volumes(declared, volumes, workers_here, notes):
    """{mount path: folder} of the app's volumes: the --volume NAME=PATH folder, or for a
    create_if_missing volume of local workers a new one in CALQUE_STATE/volumes, as Modal does."""
    folders = key_values(volumes, "--volume")
    for name, folder in folders.items():
        if "://" in folder:
            raise UserError(f"--volume {name}={folder}: only a local folder is supported ---> HINT: copy the prefix "
                            f"to a folder the workers see (aws s3 sync), and name that")
        folders[name] = os.path.abspath(folder)
    for mount, vol in declared.items():
        if vol.name in folders:
            continue
        if not (vol.create_if_missing and workers_here):
            raise UserError(f"volume {vol.name} (mounted at {mount}) has no folder ---> HINT: --volume "
                            f"{vol.name}=PATH (pool create or modal run: a local folder the workers see at {mount})")
        folders[vol.name] = os.path.join(os.path.abspath(settings()["CALQUE_STATE"]), "volumes", slug(vol.name))
        os.makedirs(folders[vol.name], exist_ok=True)
        notes.append(f"volume {vol.name}: create_if_missing: the folder {folders[vol.name]}, at {mount} in workers")
    return {mount: folders[vol.name] for mount, vol in declared.items()}


def image_plan(image, app_path):
    """What an Image chain asks of the workers: {steps, pip, apt, env, files ([local path, place in
    the handler's folder] of add_local_*; Modal's /root is that folder)}."""
    plan = {"steps": [], "pip": [], "apt": [], "env": {}, "files": []}
    for name, args, kwargs in (image.steps if image is not None else ()):
        plan["steps"].append([name, [a if isinstance(a, (str, int, float, list, dict)) else str(a) for a in args],
                              {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool))}])
        flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
        if name in ("pip_install", "uv_pip_install"):
            plan["pip"] += [str(x) for x in flat]
        elif name == "apt_install":
            plan["apt"] += [str(x) for x in flat]
        elif name == "env":
            plan["env"].update({k: str(v) for a in args for k, v in a.items()})
        elif name in ("add_local_file", "add_local_dir"):
            local, remote = str(args[0]), str(args[1] if len(args) > 1 else kwargs["remote_path"])
            beside_app = os.path.join(os.path.dirname(os.path.abspath(app_path)), local)
            local = local if os.path.exists(local) or not os.path.exists(beside_app) else beside_app
            plan["files"].append([os.path.abspath(local), modal_remote_place(remote, local)])
        elif name == "add_local_python_source":
            for source in (python_source(module, app_path) for module in flat):
                plan["files"].append([source, os.path.basename(source)])
    return plan


def modal_remote_place(remote, local):
    """A Modal container path as a place in the handler's folder: /root/x is x, another absolute
    path loses its leading slash, and a path ending in / takes the local file's name."""
    place = remote[len("/root/"):] if remote.startswith("/root/") else remote.lstrip("/")
    return os.path.join(place, os.path.basename(local)) if remote.endswith("/") else place


def python_source(module, app_path):
    """The file or package folder of `module`, found as the app file's own imports find it."""
    top = module.split(".")[0]
    for folder in (os.path.dirname(os.path.abspath(app_path)), os.getcwd(), *sys.path):
        for candidate in (os.path.join(folder, top), os.path.join(folder, top + ".py")):
            if os.path.exists(candidate):
                return candidate
    raise UserError(f"{app_path}: add_local_python_source({module!r}): no module {top} beside the app or on sys.path")


def pip_unmet(requirement):
    """None when a pip requirement ("scikit-learn~=1.5.0") is met in this Python, else why not
    ("not installed", "1.4.2 installed"); without packaging, only == and >= are checked."""
    import importlib.metadata
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        try:
            req = Requirement(requirement)
            name, wanted = req.name, lambda v: req.specifier.contains(v, prereleases=True)
        except InvalidRequirement:   # a URL, a path: only its leading name is checked
            name, wanted = re.match(r"[A-Za-z0-9._-]*", requirement.strip())[0], lambda v: True
    except ImportError:
        parts = re.match(r"\s*([\w.-]*)\s*(?:\[.*?\])?\s*(?:(==|>=)\s*([0-9.]+)\s*$)?", requirement)
        name, op, pin = parts.groups()
        number = lambda v: [int(x) for x in re.findall(r"\d+", v)]   # noqa: E731
        wanted = lambda v: not op or (number(v) >= number(pin) if op == ">="   # noqa: E731
                                      else number(v) == number(pin))
    try:
        version = importlib.metadata.version(name) if name else None
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        return "not installed"
    return None if wanted(version) else f"{version} installed"


def cold_run(conf, backend, items, *, model, handler=None, shards=1, batch_size=None, claim_size=None, timeout,
             progress=True, ec2=None, dry_run=False, yes_spend_money=False, options=None):
    """The baseline: fresh workers (warmd.py here, EC2 with `ec2`) pay @enter, drain this run's
    queue and exit; the run keeps `options` (run_options). Returns (run, summaries, timed_out);
    (None, [], False) for an EC2 dry run."""
    if isinstance(items, FileItems) and items.bucket is not None and ec2:
        raise UserError(f"{items.where}: a cold run on EC2 cannot read an s3:// prefix (its shared role may not) "
                        f"---> HINT: run it on a pool: pool create --instances N --read {items.uri()}")
    record = None if handler else load_pool(   # no handler named: reuse the pool's snapshot
        backend, model, f"give the cold run its code: submit --model {model} --handler file.py:Class ITEMS")
    run_id = new_run_id(model)
    queue_name, dlq = run_queue_names(run_id)
    cold = {"model": model, "slug": slug(model), "queue": queue_name, "dlq": dlq, "ephemeral": True,
            "workdir": os.getcwd(),   # the workers run where submit ran (warmd.enter_workdir)
            **pool_settings(conf, batch_size=batch_size or (record or {}).get("batch_size")), "created_at": now_iso()}
    prefix = f"runs/{run_id}/"
    stage = not (ec2 and dry_run)    # an EC2 dry run prints the launch and writes nothing
    if handler:                      # (the handler file is still checked)
        cold["handler"] = snapshot_handler(handler, prefix, backend.store.put if stage else lambda key, data: None)
    else:
        theirs = record["handler"]
        mine = cold["handler"] = dict(theirs, key=f"{prefix}handler/{theirs['file']}")
        copies = [(mine, theirs)]
        if "include" in theirs:
            mine["include"] = dict(theirs["include"], key=f"{prefix}handler/include.tar.gz")
            copies.append((mine["include"], theirs["include"]))
        for new, old in copies if stage else ():
            backend.store.put(new["key"], backend.store.get(old["key"]))
    cold["version"] = pool_version(cold)
    shards = max(1, shards)

    def launch():   # one-shot instances that drain the run's queue and terminate themselves
        from calque_ec2 import cold_launch
        return cold_launch(backend, cold, run_id, shards, ec2, timeout=timeout, dry_run=dry_run,
                           yes_spend_money=yes_spend_money)

    if not stage:
        launch()
        return None, [], False
    queue = backend.queues.create_queue(queue_name, cold["visibility_timeout"])
    backend.queues.create_queue(dlq, cold["visibility_timeout"])
    if not claim_size and isinstance(items, FileItems):   # a listing is a stream: not counted twice
        claim_size = claim_sizing(conf, backend, None, None, workers=shards)
    elif not claim_size:   # one claim per shard: the items are counted first (a stream read in)
        items = items if isinstance(items, (ArrayItems, TableItems, list)) else list(items)
        claim_size = max(1, -(-len(items) // shards))
    write_json(backend, cold_record_key(run_id), cold)
    procs, instance_ids = [], []
    try:
        run = stage_run(backend, cold, items, claim_size, queue, "cold", run_id, options)
        if ec2:
            instance_ids = launch()
        else:        # fresh local processes
            folder = os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "runs", run_id)
            os.makedirs(folder, exist_ok=True)
            for shard in range(shards):
                with open(os.path.join(folder, f"worker-{shard}.log"), "ab") as log:
                    argv = [sys.executable, WARMD, "--run", run_id, "--spawned-at", repr(time.time())]
                    procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                  env=child_env(conf), cwd=HERE))
            print(f"run {run_id}: cold, {len(run['claims'])} claim(s) of {run['items']} items, "
                  f"{shards} fresh worker(s); logs in {folder}", file=sys.stderr)

        def exited():   # every local worker gone, claims left (a handler that failed to load): none runs them
            if not procs or any(proc.poll() is None for proc in procs):
                return
            if len(summary_claims(backend, run_id)) < len(run["claims"]):   # listed after the exits: none missed
                with open(os.path.join(folder, "worker-0.log"), errors="replace") as f:
                    last = ([line.strip() for line in f if line.strip()] or ["its log is empty"])[-1]
                raise WorkersFailed(f"run {run_id}: every cold worker exited with claims left: {last} "
                                    f"---> HINT: see {folder}")
        summaries, timed_out = wait_for_run(backend, run, timeout, progress=progress, stop_if=exited)
    finally:
        # a drained worker exits within a poll; one still running gets SIGTERM, releasing its claim
        for proc in procs:
            try:
                proc.wait(COLD_EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
        if instance_ids:
            from calque_ec2 import cold_cleanup
            cold_cleanup(backend, instance_ids)
        backend.queues.delete_queue(queue_name)
        backend.queues.delete_queue(cold["dlq"])
        with contextlib.suppress(NotFound):   # no run record: stopped while staging, nothing queued
            # the queue is gone: a claim without a summary will never run; the run record says so
            cancel_run(backend, read_json(backend, run_key(run_id)), "the cold run ended before it finished")
    return run, summaries, timed_out


def list_pools(backend):
    """The models of the pools whose records are in the store."""
    models = []
    for folder in backend.store.list("pools/"):
        with contextlib.suppress(NotFound):
            models.append(read_json(backend, folder + "/pool.json")["model"])
    return models


def pool_status(conf, backend, model):
    """What `pool status` shows, as data: record, queues, supervisor, workers, an EC2 fleet."""
    record = load_pool(backend, model)
    if "ec2" in record:     # the fleet's status reads the queues and the worker stats: not twice
        from calque_ec2 import pool_status as fleet_status
        ec2 = fleet_status(backend, record)
        queue, dlq, stats = ec2["queue"], ec2["dlq"], ec2["workers"]
    else:
        ec2 = None
        queue, dlq = queue_depth(backend, record["queue"]), queue_depth(backend, record["dlq"])
        stats = read_worker_stats(backend, model)
    supervisor = read_supervisor(conf, model)
    local = [dict(w, alive=bool(w["pid"]) and pid_alive(w["pid"]))
             for w in (supervisor["workers"] if supervisor else [])]
    stats = mark_lost_workers(stats)
    return {"model": model, "version": version_of(record), "record": record, "queue": queue,
            "dlq": dlq, "ec2": ec2,
            "supervisor": {k: supervisor[k] for k in ("pid", "desired", "restarts")} if supervisor else None,
            "scaling": read_scaling(state_dir(conf, model)) if supervisor else None,
            "local_workers": local, "workers": stats}


def mark_lost_workers(stats, now=None):
    """The stats, a "running" or "starting" worker that is gone marked {"state": "lost", "lost": why}:
    its pid gone here, or elsewhere its stats older than WORKER_LOST_AFTER (a long claim may look lost)."""
    now = time.time() if now is None else now
    host, marked = socket.gethostname(), []
    for w in stats:
        if w.get("state") in LIVE_STATES:
            if w.get("host") == host and isinstance(w.get("pid"), int):
                why = None if pid_alive(w["pid"]) else f"pid {w['pid']} is gone"
            else:
                age = now - datetime.datetime.fromisoformat(w["updated_at"]).timestamp()
                why = f"no stats for {age:.0f} s" if age > WORKER_LOST_AFTER else None
            w = dict(w, state="lost", lost=why) if why else w
        marked.append(w)
    return marked


def worker_counts(workers):
    """'3 (1 running, 2 lost)': the workers with stats, by state ('1 starting' while one is)."""
    states = Counter(w.get("state") for w in workers)
    starting = f"{states['starting']} starting, " if states["starting"] else ""
    return f"{len(workers)} ({starting}{states['running']} running, {states['lost']} lost)"


def format_pool_status(status, store_description):
    """pool_status as `pool status` prints it: queues, fleet, local workers, a table of workers."""
    q, d = status["queue"], status["dlq"]
    lines = [f"pool {status['model']}  ({status['record']['queue']} on {store_description})",
             f"  queue: {q['visible'] if q else '?'} visible, {q['in_flight'] if q else '?'} in "
             f"flight;  dead-letter: {d['visible'] if d else '?'}",
             f"  version: {version_label(status['record'])}; each worker's is in its row"]
    if status["ec2"]:
        import calque_ec2 as ec2
        lines += ["    " + line for line in ec2.format_status(status["ec2"])]
    sup = status["supervisor"]
    if sup:
        alive = sum(w["alive"] for w in status["local_workers"])
        lines.append(f"  local workers: {alive} alive of {sup['desired']} desired (supervisor pid "
                     f"{sup['pid']}, {sup['restarts']} restart(s))")
        if status["scaling"]:
            b = status["scaling"]
            lines.append(f"  sizes itself: {b['lo']}..{b['hi']} workers on its backlog (drain target "
                         f"{b['target_drain']:g} s; after {b['idle_window'] / 60:g} idle min -> {b['lo']})")
        lines += [format_local_worker(w) for w in status["local_workers"]]
    else:
        lines.append("  local workers: none on this machine")
    running = [w for w in status["workers"] if w.get("state") in LIVE_STATES]
    lines.append(f"  workers with stats: {worker_counts(status['workers'])}")
    fallback = [w for w in running if w.get("fastbatch") == "reference"]
    if fallback:   # never silently numpy on a GPU pool
        lines.append(f"  note: {len(fallback)} running worker(s) collate with fastbatch's numpy fallback, not its C "
                     f"build: see their logs (`pool logs`) or the instance's bootstrap report")
    # every worker that ran keeps its stats (pool cost reads them); the table shows the running ones
    # and the few last stopped, so a pool that restarted often still prints a short table
    stopped = sorted((w for w in status["workers"] if w.get("state") not in LIVE_STATES), key=lambda w: w["updated_at"])
    shown = running + stopped[-STOPPED_SHOWN:]
    if shown:
        lines.append(f"    {'worker':<30} {'version':<12} {'state':<8} {'claims':>6} {'warm':>5} "
                     f"{'enter#':>6} "
                     f"{'enter_s':>8} {'items':>7} {'busy%':>6}")
        for w in sorted(shown, key=lambda w: w["started_at"]):
            busy = 100.0 * w["busy_seconds"] / w["alive_seconds"] if w["alive_seconds"] else 0.0
            lines.append(f"    {w['worker_id'][:30]:<30} {w.get('version') or '-':<12} "
                         f"{w['state']:<8} {w['claims']:>6} {w['warm_hits']:>5} "
                         f"{w['enter_count']:>6} {w['enter_seconds']:>8.2f} {w['items']:>7} {busy:>5.1f}%")
    if len(stopped) > STOPPED_SHOWN:
        lines.append(f"    (+{len(stopped) - STOPPED_SHOWN} older stopped workers: --json lists them all)")
    return lines


def format_local_worker(w):
    """One local worker's `pool status` line: slot, pid, state, GPUs, restarts, its last exit."""
    state = ("warm" if w.get("warm") else "loading") if w["alive"] else "restarting"
    gpus = f"GPU {','.join(w['gpus'])}" if w.get("gpus") else "no GPU"
    threads = f"{w['threads']} thread(s)" if w.get("threads") else "threads: its libraries' default"
    line = f"    slot {w['slot']}: pid {w['pid'] or '-'} {state}, {gpus}, {threads}, {w['restarts']} restart(s)"
    last = w.get("last_exit")
    if last:
        kind = last.get("kind") or f"{'after' if last['warm'] else 'before'} warm"
        restart = "restarted at once" if not last.get("restart_delay") else f"restart after {last['restart_delay']:g} s"
        line += f"; last exit {now_iso(last['at'])[11:19]} ({kind}, {restart}): {last['reason']}"
    return line


def format_pool_list(pools, local_workers, store_description):
    """`pool list`: each pool's queue, local workers here, EC2 fleet, or a hint when orphaned."""
    if not pools:
        return [f"no pools in {store_description}"]
    lines = []
    for p in pools:
        fleet = f"EC2 {p['in_service']}/{p['desired']} in service ({p['asg']})" if p["asg"] else "no EC2 fleet"
        orphan = "" if p["record"] else "  [no pool record: half-created? `pool delete --model M --yes` cleans it up]"
        lines.append(f"{p['model']:<40} {pool_queue_name(p['model']):<50} "
                     f"local workers here: {local_workers.get(p['model'], 0)}; {fleet}{orphan}")
    return lines


def pool_record_to_delete(backend, model, force):
    """The record `pool delete` works from. A missing one on S3 may be a half-created EC2 pool:
    {"model"} finds the rest by name and tag. A corrupt one goes only with --force."""
    try:
        return load_pool(backend, model, f"nothing to delete (`{command()} pool list` lists the pools)")
    except StoreFault:
        if not force:
            raise
    except UserError:
        if backend.kind != "aws":
            raise
    if backend.kind == "aws":
        return {"model": model}
    return {"model": model, "slug": slug(model), "queue": pool_queue_name(model), "dlq": dlq_name(model)}


# ---- the planner: a run's wall time and cost for 1..B workers before it starts, and after
PLAN_GAP_MAX = 2.0                      # s between two claims of a worker past which it idled
PLAN_RUNS_READ = 5                      # run records read for the time to a run's first claim
PLAN_CLAIMS_READ = 200                  # claim summaries it reads, over the newest runs (50 a run)
PLAN_MIN_CLAIMS = 10                    # claims that measure a worker count, where another count has them
PLAN_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$")
PLAN_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def claim_sizing(conf, backend, record, claim_size, workers=None):
    """The ClaimSizes of a run on the pool `record` (None: unmeasured): --claim-size, else a set
    CALQUE_CLAIM_SIZE, else factoring over `workers` (default: the pool's ceiling), its claims at
    most CALQUE_CLAIM_SECONDS long and CLAIM_SIZE_MAX items, at least CLAIM_OVERHEAD_SHARE of
    overhead: both from the pool's claims so far (claim_costs), once it has some."""
    if claim_size:
        return ClaimSizes(fixed=claim_size, why="--claim-size")
    if conf["CALQUE_CLAIM_SIZE"].strip():
        return ClaimSizes(fixed=setting_number(conf, "CALQUE_CLAIM_SIZE", int, 1), why="CALQUE_CLAIM_SIZE")
    target = setting_number(conf, "CALQUE_CLAIM_SECONDS", float, 0.001)
    workers = workers or pool_ceiling(conf, backend, record)[1]
    per_item, fixed = claim_costs(backend, record) if record else (None, None)
    if per_item is None:
        hi, lo, measured = CLAIM_SIZE_MAX, CLAIM_SIZE_FLOOR, "the pool has no measured claim yet"
    else:
        hi = max(1, min(CLAIM_SIZE_MAX, math.floor(target / per_item + 1e-6)))   # (a fit's rounding)
        lo = max(CLAIM_SIZE_FLOOR, math.ceil(fixed / CLAIM_OVERHEAD_SHARE / per_item - 1e-6))   # (f + g: 0 unseen)
        measured = (f"{per_item * 1000:.3g} ms an item and {fixed * 1000:.3g} ms a claim measured: {target:g} s "
                    f"at most, {CLAIM_OVERHEAD_SHARE:.0%} overhead at most")
    sizes = ClaimSizes(workers=workers, lo=lo, hi=hi, unit=(record or {}).get("batch_size", 1))
    sizes.why = (f"sized to the run: {workers} worker(s), claims of {sizes.lo} to {sizes.hi} items"
                 f"{f' in whole batches of {sizes.unit}' if sizes.unit > 1 else ''} ({measured})")
    return sizes


def claim_costs(backend, record):
    """(s an item, s a claim) of the pool's claims: claim seconds = fixed + items x per item, fitted
    by least squares over the sums its workers keep in their stats (`claim_fit`; claims of one size:
    all per item), plus their mean gap between two claims (`claim_gaps`); (None, None) before any
    claim. A LIST and a GET a worker, as pool_liveness reads at each submit."""
    stats = read_worker_stats(backend, record["model"])
    n, sx, sy, sxx, sxy = (sum(w.get("claim_fit", [0] * 5)[k] for w in stats) for k in range(5))
    if not sx:
        return None, None
    spread = n * sxx - sx * sx
    per_item = (n * sxy - sx * sy) / spread if spread > 1e-9 * n * sxx else 0.0
    fixed = (sy - per_item * sx) / n
    if per_item <= 0 or fixed < 0:   # one size, or noise: all of it per item
        per_item, fixed = sy / sx, 0.0
    gaps = [sum(w.get("claim_gaps", [0, 0.0])[k] for w in stats) for k in range(2)]
    return max(per_item, 1e-9), fixed + (gaps[1] / gaps[0] if gaps[0] else 0.0)


def parse_duration(text):
    """Seconds of '90', '90s', '20m', '2h', '1.5d'."""
    found = PLAN_DURATION.match(str(text))
    if not found or float(found[1]) <= 0:
        raise UserError(f"--deadline {text!r}: a duration such as 45m, 2h or 90s")
    return float(found[1]) * PLAN_UNITS[found[2]]


def plan_seconds(claim_seconds, starts):
    """The wall time of claims (seconds each, in queue order) on workers free from `starts` (s
    from now): each claim to the worker free first, as workers pull from a queue."""
    free, end = sorted(starts), 0.0
    for seconds in claim_seconds:
        end = max(end, free[0] + seconds)
        heapq.heapreplace(free, free[0] + seconds)
    return end


def pool_ceiling(conf, backend, record):
    """(A, B, noun, running): the pool's floor and ceiling of workers or instances, how many run."""
    stats = mark_lost_workers(read_worker_stats(backend, record["model"]))
    warm = sum(w.get("state") == "running" for w in stats)
    if record.get("ec2"):
        hi, lo = max(1, record["ec2"]["instances"]), record["ec2"].get("min_instances")
        return (hi if lo is None else min(hi, lo)), hi, "instances", warm
    folder = state_dir(conf, record["model"])
    bounds = read_scaling(folder) or {"lo": max(1, read_desired(folder)), "hi": read_desired(folder)}
    return bounds["lo"], max(1, bounds["hi"]), "workers", warm


def claim_overheads(backend, summaries):
    """(s between a worker's claims, s from a run's creation to its first claim), from these
    summaries (two claims of a worker are consecutive when every claim between them was read; a
    gap over PLAN_GAP_MAX is idle) and their runs' records; 0.0 when unknown."""
    by_worker, gaps, first, read = {}, [], {}, {(s["run_id"], s["claim"]) for s in summaries}
    for summary in summaries:
        started = _parse_time(summary["started_at"], "started_at")
        finished = _parse_time(summary["finished_at"], "finished_at")
        spans = by_worker.setdefault((summary["run_id"], summary["worker_id"]), [])
        spans.append((started, finished, int(summary["claim"][1:])))
        first[summary["run_id"]] = min(first.get(summary["run_id"], started), started)
    for (run_id, _), spans in by_worker.items():
        spans.sort()
        between = ((b[0] - a[1]).total_seconds() for a, b in zip(spans, spans[1:])
                   if all((run_id, claim_id(i)) in read for i in range(a[2] + 1, b[2])))
        gaps += [g for g in between if 0 <= g <= PLAN_GAP_MAX]
    latencies = [(started - _parse_time(read_run(backend, run_id)["created_at"], "created_at"))
                 .total_seconds() for run_id, started in list(first.items())[:PLAN_RUNS_READ]]
    return (statistics.median(gaps) if gaps else 0.0), min(latencies, default=0.0)   # min: warm


def per_item_by_count(summaries):
    """{n: seconds per item} of these summaries (each run's together, as recent_summaries gives them)
    by how many workers ran their run (on shared cores a claim's time depends on it): at each count,
    its newest runs whole, to SCALE_MEASURED_CLAIMS; a count with fewer than PLAN_MIN_CLAIMS (a plan's
    sample claim) only where none has more: it is then scaled from one that has."""
    groups = {}
    for run in (list(run) for _, run in itertools.groupby(summaries, key=lambda s: s["run_id"])):
        group = groups.setdefault(len({s["worker_id"] for s in run}), [])
        group += run if len(group) < SCALE_MEASURED_CLAIMS else []
    enough = {n: group for n, group in groups.items() if len(group) >= PLAN_MIN_CLAIMS} or groups
    return {n: measured_seconds(group)[1] for n, group in enough.items()}


def per_item_at(measured, n, cores):
    """Seconds an item at n workers: as measured at n, else at the nearest count m, times
    max(n, cores) / max(m, cores) (beyond a worker a core, they share the cores)."""
    m = min(measured, key=lambda c: (abs(c - n), -c))
    return measured[m] * max(n, cores) / max(m, cores)


def make_plan(backend, conf, record, items, claim_size, price, summaries):
    """The plan of `items` in claims sized by `claim_size` (ClaimSizes: as submit cuts them, or an
    int): per count 1..B its wall time and cost, from
    measured per-item seconds, overheads and start-up; beside it, cold and serverless."""
    price = choose_pricing(price, summaries)   # the claims it measured: as `cost` prices their runs
    rates, itype = price.rates, price.instance_type
    rate, spot_rate = (instance_rate_per_second(rates, itype, spot=spot) for spot in (False, True))
    measured = per_item_by_count(summaries)
    stats = read_worker_stats(backend, record["model"])
    enter = measured_enter_seconds(stats) or 0.0
    paid = [w["acquisition_seconds"] for w in stats if w.get("acquisition_seconds")]
    acquisition = sum(paid) / len(paid) if paid else 0.0
    _, ceiling, noun, warm = pool_ceiling(conf, backend, record)
    start = enter + acquisition + SCALE_INTERVAL
    if noun == "instances":
        import calque_ec2 as ec2
        start = enter + ec2.BOOT_ESTIMATE
    gap, latency = claim_overheads(backend, summaries)
    sizes = as_sizes(claim_size).plan(items)
    shared = noun == "workers" and not gpu_devices(conf)     # CPU workers share the cores
    cores = len(os.sched_getaffinity(0)) if shared else math.inf
    options = []
    for n in range(1, ceiling + 1):
        running, per_item = min(n, warm), per_item_at(measured, n, cores)
        claims = [size * per_item + gap for size in sizes]
        # a worker not running yet starts while submit stages (announce_run): the later of the two
        seconds = plan_seconds(claims, [latency] * running + [max(latency, start)] * (n - running))
        options.append({noun: n, "seconds": seconds, "cost_usd": n * seconds * rate,
                        "spot_cost_usd": n * seconds * spot_rate, "starting": n - running,
                        "seconds_per_item": per_item, "measured": n in measured})
    drain = sum(claims)   # cold and serverless counterfactuals: B at once, at B's seconds per item
    cold_acquisition = rates["defaults"]["acquisition_seconds"]["value"]
    return {"model": record["model"], "items": items, "claims": len(claims), "claim_size": max(sizes),
            "claim_sizes": claim_sizes({"claims": sizes, "claim_counts": sizes}),
            "sizing": getattr(claim_size, "why", ""),
            "seconds_per_item": options[-1]["seconds_per_item"], "measured_claims": len(summaries),
            "enter_seconds": enter, "claim_gap_seconds": gap, "first_claim_seconds": latency,
            "start_seconds": start, "running": warm, "noun": noun, "instance_type": itype,
            "priced_as": price.label, "options": options,
            "cold": {noun: ceiling, "seconds": plan_seconds(claims, [cold_acquisition + enter] * ceiling),
                     "cost_usd": (ceiling * (cold_acquisition + enter) + drain) * rate},
            "serverless": {"container": price.serverless, "seconds": plan_seconds(claims, [enter] * ceiling),
                           "cost_usd": (drain + ceiling * enter) * price.serverless_rate}}


def pick_option(plan, deadline=None, budget=None):
    """The option of the fewest workers that meets the deadline (s) and the budget ($), or None."""
    return next((o for o in plan["options"] if (deadline is None or o["seconds"] <= deadline)
                 and (budget is None or o["cost_usd"] <= budget)), None)


def format_plan(plan):
    noun = plan["noun"]
    sizes = plan["claim_sizes"]
    lines = [f"plan: {plan['items']:,} items in {plan['claims']} claim(s) of "
             f"{sizes[0][0] if len(sizes) == 1 else format_sizes(sizes)} "
             f"on pool {plan['model']}: {plan['seconds_per_item'] * 1000:.3g} ms an item (measured "
             f"over {plan['measured_claims']} recent claim(s)), {plan['claim_gap_seconds']:.3g} s "
             f"between claims, first claim after {plan['first_claim_seconds']:.3g} s; "
             f"{plan['running']} {noun} running, a new one starts in {plan['start_seconds']:.3g} s",
             f"  priced as {plan['priced_as']}; claims {plan['sizing'] or 'of a fixed size'}",
             f"  {noun:>9}  {'wall':>10}  {'on-demand':>10}  {'spot':>10}"]
    for o in plan["options"]:
        scaled = "" if o["measured"] else "  (scaled from another count)"
        lines.append(f"  {o[noun]:>9}  {_duration(o['seconds']):>10}  {_usd(o['cost_usd']):>10}  "
                     f"{_usd(o['spot_cost_usd']):>10}{scaled}")
    cold, serverless = plan["cold"], plan["serverless"]
    lines.append(f"  cold start ({cold[noun]} fresh {noun}, each paying acquisition + @enter): "
                 f"{_duration(cold['seconds'])}, {_usd(cold['cost_usd'])}")
    lines.append(f"  serverless ({serverless['container']} per container, {cold[noun]} containers): "
                 f"{_duration(serverless['seconds'])}, {_usd(serverless['cost_usd'])}")
    return lines


def _duration(seconds):
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def plan_against_actual(run, summaries):
    """'predicted X on N workers, actual Y (+d %)' for a finished planned run, naming claims redelivered."""
    plan = run["options"].get("plan")
    if not plan or len(summaries) < len(run["claims"]) or not summaries:
        return None
    ended = max(_parse_time(s["finished_at"], "finished_at") for s in summaries)
    actual = (ended - _parse_time(run["created_at"], "created_at")).total_seconds()
    redelivered = ", ".join(s["claim"] for s in summaries if s["receive_count"] > 1)
    return (f"plan: predicted {_duration(plan['seconds'])} and {_usd(plan['cost_usd'])} on "
            f"{plan['count']} {plan['noun'] if plan['count'] != 1 else plan['noun'][:-1]}; actual "
            f"{_duration(actual)} ({(actual - plan['seconds']) / plan['seconds']:+.0%})" + (redelivered and
            f"; waited out the visibility timeout (a worker died holding it), unpriced by a plan: {redelivered}"))


# ------------------------------------------------------------------------------------------------
# 10. the Python API: what a notebook imports, and what the CLI verbs below call.
#   pool = calque.Pool("demo"); pool.create(handler="my_model.py:MyModel", workers=2)
#   run = calque.submit(items, pool="demo")   # items: an iterable, a JSONL path, numpy arrays
#   for result in run.results(): ...          # in item order, each claim's as soon as it ends
def _context(store=None):
    """(settings, backend) for an API call, as the CLI reads them; `store` overrides CALQUE_STORE."""
    conf = settings()
    if store is not None:
        conf["CALQUE_STORE"] = store
    return conf, open_backend(conf["CALQUE_STORE"])


def wait_warm(conf, model, workers, since, progress=False, timeout=WARM_WAIT, then=None):
    """Wait until `workers` local workers have finished @enter. One that dies before it is warm
    (an exit after `since`, epoch s) raises WorkersFailed, the pool's local workers scaled to 0;
    `then`: what to do once the handler is fixed (default: pool deploy it)."""
    folder, started, shown = state_dir(conf, model), time.monotonic(), ""
    try:
        while True:
            status = read_supervisor(conf, model)
            if status is None:
                raise WorkersFailed(f"pool {model}: its supervisor exited ---> HINT: see {folder}/supervisor.log")
            died = [w for w in status["workers"] if (w.get("last_exit") or {}).get("at", 0) >= since
                    and not w["last_exit"]["warm"]]
            if died:
                scale_local(conf, model, 0)
                raise WorkersFailed(f"pool {model}: {died_line(died[0])}; its local workers are stopped ---> HINT: "
                                    f"fix the handler (or install what it imports), then "
                                    f"{then or f'{command()} pool deploy --model {model} --handler F.py:C'}")
            warm = sum(bool(w.get("warm")) for w in status["workers"])
            line = f"pool {model}: {warm} of {workers} local worker(s) warm ({time.monotonic() - started:.0f} s)"
            if progress and line != shown:
                print("\r" + line, end="", file=sys.stderr, flush=True)
                shown = line
            if warm >= workers:
                return
            if time.monotonic() - started > timeout:
                raise WorkersFailed(f"pool {model}: {warm} of {workers} worker(s) warm after {timeout:g} s (still in "
                                    f"@enter?); they keep loading ---> HINT: {command()} pool logs --model {model}")
            time.sleep(SUPERVISOR_TICK)
    finally:
        if shown:
            print(file=sys.stderr)


def died_line(worker):
    """'worker 0 died before it was warm: <its error line> (log <path>)'."""
    return (f"worker {worker['slot']} died before it was warm: {worker['last_exit']['reason']} "
            f"(log {worker['log']})")


def crash_looping(conf, model):
    """The first death line when every local worker here keeps dying before it is warm, or None."""
    status = read_supervisor(conf, model)
    workers = status["workers"] if status else []
    if workers and all(not w.get("warm") and (w.get("last_exit") or {}).get("warm") is False for w in workers):
        return died_line(workers[0])
    return None


def announce_run(conf, model, items, sizes, run_id):
    """Tell a self-sizing local pool the claims run `run_id` brings (sizes: a ClaimSizes or an int): it
    starts workers while they stage."""
    folder = state_dir(conf, model)
    bounds = read_scaling(folder)
    if bounds is not None:
        claims = len(as_sizes(sizes).plan(len(items))) if hasattr(items, "__len__") and len(items) else 1
        wake = {"at": time.time(), "claims": claims, "run": run_id}
        write_file_atomic(os.path.join(folder, "scaling.json"), json.dumps(dict(bounds, wake=wake)))


def pool_liveness(conf, backend, record):
    """("live" | "starting" | "crashing" | "none", why) for a submit: a worker warm anywhere, every
    local one dying before warm, workers loading or waking on work, or none to claim the run."""
    model = record["model"]
    status = read_supervisor(conf, model)
    local = status["workers"] if status else []
    if any(w.get("warm") for w in local):
        return "live", ""
    stats = mark_lost_workers(read_worker_stats(backend, model))
    if any(w.get("state") == "running" for w in stats):
        return "live", ""
    crashing = crash_looping(conf, model)
    if crashing:
        return "crashing", f"pool {model}: every local worker dies before it is warm: {crashing}"
    starting = max(len(local), sum(w.get("state") == "starting" for w in stats))
    if starting:
        return "starting", (f"pool {model}: {starting} worker{'s' * (starting > 1)} starting (@enter); "
                            "the run waits for them")
    if status and read_scaling(state_dir(conf, model)):
        return "starting", f"pool {model} sizes itself: its supervisor starts workers for the run"
    if "ec2" in record and backend.kind == "aws":
        import calque_ec2 as ec2
        hint = ec2.cold_wait_hint(backend, record)
        if hint is None:
            return "starting", f"pool {model}: instances in service, no worker running yet (bootstrapping)"
        asg = ec2.describe_asg(ec2.AwsCalls.for_backend(backend), ec2.resource_names(model)["asg"])
        wakes = asg is not None and not asg["DesiredCapacity"] and record["ec2"].get("scale_to_zero_after")
        return ("starting" if wakes else "none"), hint
    died = unwarmed_death(stats)
    return "none", f"pool {model} has no live worker (no supervisor on this machine, no worker running elsewhere" + (
        f"; {died})" if died else ")")


def unwarmed_death(stats, since=""):
    """'worker W died before it was warm: why' for the newest worker stats that say so (updated
    after the ISO time `since`), else None: a worker started by hand, on any machine."""
    died = [w for w in stats if w.get("state") == "stopped" and not w.get("entered_at") and w.get("exit")
            and w["updated_at"] > since]
    last = max(died, key=lambda w: w["updated_at"], default=None)
    return last and f"worker {last['worker_id']} died before it was warm: {last['exit']}"


def scale_local(conf, model, workers, gpus_per_worker=None, bounds=None, threads_per_worker=None):
    """Set the pool's local worker count here; 0 stops its supervisor. With `bounds` (lo, hi, idle
    s) the supervisor sizes the pool itself and stays up at 0. Returns its pid (None at 0)."""
    if workers < 0:
        raise UserError(f"--workers {workers}: must be 0 or more")
    folder = state_dir(conf, model)
    if bounds:
        os.makedirs(folder, exist_ok=True)
        write_file_atomic(os.path.join(folder, "scaling.json"), json.dumps(
            {"lo": bounds[0], "hi": bounds[1], "idle_window": bounds[2],
             "target_drain": setting_number(conf, "CALQUE_TARGET_DRAIN", float, 0.001)}))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, "scaling.json"))
    if workers or bounds:
        return supervisor_module().start_supervisor(conf, model, workers, gpus_per_worker,
                                                    threads_per_worker)
    if os.path.isdir(folder):
        write_file_atomic(os.path.join(folder, "desired"), "0")
    supervisor_module().stop_supervisor(conf, model, stop_seconds(conf) + 10)
    return None


class Pool:
    """One model's pool of local workers: create, scale, status, delete."""

    def __init__(self, model, *, store=None, context=None):
        self.model = model
        self.conf, self.backend = context or _context(store)

    def create(self, handler, workers=LOCAL_WORKERS_DEFAULT, *, batch_size=None, visibility_timeout=None,
               max_deliveries=None, batch_timeout=None, gpus_per_worker=None, threads_per_worker=None, wait=True,
               progress=False, modal=None, include=()):
        """Create the pool (one of the same version is left as it is, another refused: `pool
        deploy`), then start `workers` local workers, waited for unless wait=False. `modal`:
        modal_options' record; `include`: [local, relative path] files."""
        defaults = pool_settings(self.conf, batch_size, visibility_timeout, max_deliveries)
        if batch_timeout is not None and not (math.isfinite(batch_timeout) and batch_timeout > 0):
            raise UserError(f"--batch-timeout {batch_timeout}: must be a number of seconds above 0")
        record = new_pool_record(self.backend, self.model, defaults, batch_timeout)
        record["workdir"] = os.getcwd()
        if modal:
            record["modal"] = modal
        snapshot = {}   # checked whole before the store has any of it: a bad handler writes nothing
        files = list(include) + (modal or {}).get("image", {}).get("files", [])
        record["handler"] = snapshot_handler(handler, f"pools/{record['slug']}/", snapshot.__setitem__, files)
        record["version"] = pool_version(record)
        with pool_name_claimed(self.backend, self.model, (record["queue"], record["dlq"])):
            same = refuse_other_version(check_slug_free(self.backend, self.model), record, handler)
            if same:   # nothing changes: its record and snapshot stay; a lost queue is made again
                record = load_pool(self.backend, self.model)
            for key, data in ({} if same else snapshot).items():
                self.backend.store.put(key, data)
            queues, vt = self.backend.queues, record["visibility_timeout"]
            if self.backend.kind == "aws":
                for name in (record["dlq"], record["queue"]):
                    wait_queue_reusable(self.backend.store, name, queues.sleep)
            dlq = queues.create_queue(record["dlq"], vt)
            queues.create_queue(record["queue"], vt, dead_letter=(dlq, record["max_deliveries"]))
            if not same:
                write_json(self.backend, pool_key(self.model), record)
        if workers:
            self.scale(workers, gpus_per_worker=gpus_per_worker, threads_per_worker=threads_per_worker, wait=wait,
                       progress=progress)
        return record

    def scale(self, workers, *, gpus_per_worker=None, threads_per_worker=None, wait=True, progress=False,
              bounds=None, then=None):
        """Set the local workers here (0 stops them), waiting until warm unless wait=False; `bounds`
        (lo, hi, idle s) lets the pool size itself; `then`: wait_warm's. Returns the supervisor's
        pid (None at 0)."""
        load_pool(self.backend, self.model)
        since = time.time()
        pid = scale_local(self.conf, self.model, workers, gpus_per_worker, bounds, threads_per_worker)
        if pid and wait and workers:
            wait_warm(self.conf, self.model, workers, since, progress, then=then)
        return pid

    def deploy(self, handler, *, batch_size=None, include=(), wait=True, progress=False):
        """Change the pool's version to `handler` (and `batch_size`): wait until no run of its
        version is in flight (SIGINT meanwhile: a UserError, nothing changed), or none has started
        while no worker of it is warm (runs_to_adopt: they move to the new version), then replace
        its workers: this machine's stopped and started again on it, other machines' (EC2)
        restart on it themselves (warmd, EXIT_REPLACED). Returns (old record, new record), the
        same record twice when the version is the pool's already."""
        old = load_pool(self.backend, self.model)
        batch_size = old["batch_size"] if batch_size is None else batch_size
        new = dict(old, batch_size=pool_settings(self.conf, batch_size)["batch_size"])
        new.pop("modal", None)   # a Modal app's options come with pool create (--param ...)
        blobs = {}
        new["handler"] = snapshot_handler(handler, f"pools/{old['slug']}/", blobs.__setitem__,
                                          include)
        new["version"] = pool_version(new)
        if new["version"] == version_of(old):
            return old, old
        busy, said = runs_in_flight(self.backend, old), None
        try:
            while busy and not runs_to_adopt(self.backend, old, busy):
                if busy != said:
                    print(f"pool {self.model}: waiting for {len(busy)} run(s) of version "
                          f"{version_of(old)} to finish before its workers are replaced: "
                          f"{', '.join(busy[:5])} (Ctrl-C leaves the pool as it was)",
                          file=sys.stderr, flush=True)
                    said = busy
                time.sleep(DEPLOY_POLL)
                busy = runs_in_flight(self.backend, old)
        except KeyboardInterrupt:
            raise UserError(f"pool deploy interrupted: nothing changed, pool {self.model} runs "
                            f"version {version_label(old)} ---> HINT: run it again once its runs "
                            f"are done (runs list --model {self.model})") from None
        folder, here = state_dir(self.conf, self.model), read_supervisor(self.conf, self.model)
        since, noted = time.time(), []
        # a signal waits until the replacement is done: noted, not blocked (a mask is inherited
        # by the processes started)
        previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if here and not supervisor_module().stop_supervisor(self.conf, self.model,
                                                                stop_seconds(self.conf) + 15):
                raise UserError(f"pool {self.model}: its supervisor did not stop: nothing changed; "
                                f"see {folder}/supervisor.log, then retry")
            for run_id in busy:   # none has started: the new version runs them whole
                update_run(self.backend, {"run_id": run_id}, version=new["version"])
                print(f"pool {self.model}: run {run_id} had not started: it runs on version "
                      f"{version_of(new)}", file=sys.stderr)
            for key, data in blobs.items():
                self.backend.store.put(key, data)
            write_json(self.backend, pool_key(self.model), dict(new, deployed_at=now_iso()))
            if here:   # its count, bounds, GPUs and threads as they were
                per_worker = [read_state(os.path.join(folder, name), str.strip, "")
                              for name in ("gpus-per-worker", "threads-per-worker")]
                supervisor_module().start_supervisor(self.conf, self.model, read_desired(folder),
                                                     *[int(v) if v else None for v in per_worker])
        finally:
            for sig, was in previous.items():
                signal.signal(sig, was)
        desired = read_desired(folder)
        if here and wait and not noted and desired:   # a death before warm: the pool is on `new`
            wait_warm(self.conf, self.model, desired, since, progress,
                      then=f"{command()} pool deploy it again; pool {self.model} runs version "
                           f"{version_label(new)} now (or {command()} pool scale --model "
                           f"{self.model} --workers {desired} to start it as it is)")
        return old, new

    def status(self):
        """pool_status: record, queue depths, this machine's workers, every worker's stats."""
        return pool_status(self.conf, self.backend, self.model)

    def delete(self, force=False):
        """Stop the local workers, delete the queues and the pool's store folder (runs are kept).
        Refused while claims are queued unless force (which cancels the pool's unfinished runs)."""
        record = pool_record_to_delete(self.backend, self.model, force)
        if not force:   # deleting the queue would drop claims nobody has finished
            depth = queue_depth(self.backend, record["queue"])
            if depth and (depth["visible"] or depth["in_flight"]):
                raise UserError(f"pool {self.model} still has {depth['visible']} queued and "
                                f"{depth['in_flight']} in-flight claim(s): wait for them (runs "
                                "show RUN), or pass --force to delete them with the pool")
        if not supervisor_module().stop_supervisor(self.conf, self.model, stop_seconds(self.conf) + 15):
            raise UserError(f"pool {self.model}: its supervisor did not stop; "
                            f"see {state_dir(self.conf, self.model)}/supervisor.log, then retry")
        cancelled = cancel_pool_runs(self.backend, self.model) if force else {}
        for role in ("queue", "dlq"):
            self.backend.queues.delete_queue(record[role])
            if self.backend.kind == "aws":    # a create within the minute waits (SQS still deletes)
                note_queue_deleted(self.backend.store, record[role])
        self.backend.store.delete_prefix(f"pools/{record['slug']}/")
        return cancelled


def runs_in_flight(backend, record):
    """Ids of the pool's runs of its version that a worker may still run a claim of: staging, or
    with a claim queued or running (a run from before versions counts as the pool's)."""
    version, busy = version_of(record), []
    for run in list_runs(backend, record["model"]):
        if (run["model"] != record["model"] or run["mode"] != "pool" or run.get("cancelled")
                or run.get("version", version) != version):
            continue
        unfinished = len(summary_claims(backend, run["run_id"])) < len(run["claims"])
        if not run.get("staged", True) or (unfinished and live_claims(backend, run)):
            busy.append(run["run_id"])
    return busy


def runs_to_adopt(backend, record, busy):
    """True when no run of `busy` has started (no summary, result part or attempt record) and no
    worker of the record's version is warm (say, each dies in @enter): the new version of `pool
    deploy` may run them whole (warmd reads a run record's version where a claim's differs)."""
    version = version_of(record)
    warm = [w for w in mark_lost_workers(read_worker_stats(backend, record["model"]))
            if w.get("state") == "running" and w.get("version", version) == version]
    started = (backend.store.list(f"runs/{run_id}/results/") or summary_claims(backend, run_id)
               for run_id in busy)
    return not warm and not any(started)


def new_pool_record(backend, model, defaults, batch_timeout=None):
    """A pool record before its handler snapshot: names, settings, when and where."""
    record = {"model": model, "slug": slug(model), "queue": pool_queue_name(model), "dlq": dlq_name(model),
              **defaults, "created_at": now_iso(), "store": backend.describe()}
    if batch_timeout is not None:   # absent: the workers' CALQUE_BATCH_TIMEOUT applies
        record["batch_timeout"] = batch_timeout
    return record


def as_items(items, columns=None):
    """What stage_run takes, from what a user holds: a path (read_items), a table (TableItems),
    arrays (ArrayItems), a list, or any iterable (staged as it yields, a claim at a time)."""
    if isinstance(items, (str, os.PathLike)):
        return read_items(os.fspath(items), columns)
    if type(items).__module__.split(".")[0] in ("pyarrow", "pandas", "datasets"):
        return TableItems.open(items, columns)
    if columns:
        raise UserError("columns= applies to a path of Parquet or Arrow input, or a table")
    if isinstance(items, (ArrayItems, TableItems, FileItems)):
        return items
    if hasattr(items, "dtype") and hasattr(items, "shape"):
        return ArrayItems.from_arrays({"input": items}, "the array")
    if isinstance(items, dict):
        return ArrayItems.from_arrays(items, "the arrays")
    if isinstance(items, list) and not items:
        raise UserError("no items to submit")
    return items


def check_claim_size(claim_size):
    if claim_size is not None and claim_size < 1:
        raise UserError(f"--claim-size {claim_size}: must be at least 1")


RESULT_FIELDS = ("i", "ok", "result", "error", "trace")   # a result line's own: never an --id-field


def check_id_field(items, field):
    """Refuse an --id-field that is a result's own field or an item lacks (a stream: as read)."""
    if field in RESULT_FIELDS:
        raise UserError(f"--id-field {field!r} is a result line's own field ---> HINT: name another item field")
    if isinstance(items, (ArrayItems, TableItems, FileItems)):
        names = (list(items.fields) if isinstance(items, ArrayItems) else ["path"] if isinstance(items, FileItems)
                 else items.numeric + items.json)
        if field not in names:
            raise UserError(f"--id-field {field!r}: no {'array' if isinstance(items, ArrayItems) else 'column'} of "
                            f"that name ({', '.join(names)})")
        return items
    checked = map(_has_id_field, itertools.repeat(field), itertools.count(), items)
    return list(checked) if isinstance(items, list) else checked


def _has_id_field(field, index, item):
    value = json_line(item) if type(item) is JsonText else item   # a JSONL line: parsed only here
    if not isinstance(value, dict) or field not in value:
        raise UserError(f"--id-field {field!r}: item {index} has no such field ---> HINT: give "
                        "every item one, or drop --id-field")
    return item


def submit(items, pool=None, *, model=None, handler=None, claim_size=None, id_field=None, wait_for_workers=False,
           shards=1, batch_size=None, timeout=None, progress=False, store=None, context=None, run_id=None,
           columns=None, plan=None):
    """Run `items` on the warm pool `pool` (the Run returns once queued), or with `model`, as a
    cold run on `shards` fresh local workers (returns once ended). No live worker: a UserError
    unless wait_for_workers; every local worker dying before warm: WorkersFailed. The run keeps
    id_field, timeout (what Run.wait waits), wait_for_workers and `plan` (the count `submit
    --deadline` picked, for runs resume and runs show): run_options."""
    conf, backend = context or _context(store)
    items = as_items(items, columns)
    if id_field:
        items = check_id_field(items, id_field)
    check_claim_size(claim_size)
    options = run_options(id_field, timeout, wait_for_workers, plan)
    if not pool:
        if not model:
            raise UserError("submit needs --pool M (a warm pool) or --model M (a cold run)")
        run, _, _ = cold_run(conf, backend, items, model=model, handler=handler, shards=shards, batch_size=batch_size,
                             claim_size=claim_size, timeout=wait_seconds(conf, timeout),
                             progress=progress, options=options)
        return Run(run["run_id"], context=(conf, backend))
    record = load_pool(backend, pool)
    queue = backend.queues.open_queue(record["queue"])   # first: a missing queue says so
    state, why = pool_ready(conf, backend, record, wait_for_workers, "this run",
                            "submit --wait-for-workers")
    sizes = claim_sizing(conf, backend, record, claim_size)
    run_id = run_id or new_run_id(pool)   # before staging: announce_run names it
    if state == "starting":   # ("none" with wait_for_workers: what the caller asked for)
        print(f"calque: {why}", file=sys.stderr)
        announce_run(conf, pool, items, sizes, run_id)
    run = stage_run(backend, record, items, sizes, queue, "pool", run_id, options)
    return Run(run["run_id"], context=(conf, backend))


def pool_ready(conf, backend, record, wait_for_workers, run, anyway):
    """(state, why) of pool_liveness for `run` about to be queued: every local worker dying unwarmed
    raises WorkersFailed; no live worker (looked for WORKER_START_GRACE s) a UserError naming
    `anyway`, the command that queues it all the same, unless wait_for_workers."""
    state, why = pool_liveness(conf, backend, record)
    grace = time.monotonic() + WORKER_START_GRACE
    while state == "none" and not wait_for_workers and time.monotonic() < grace:
        time.sleep(WORKER_START_GRACE / 8)
        state, why = pool_liveness(conf, backend, record)
    pool = record["model"]
    if state == "crashing":
        raise WorkersFailed(f"{why} ---> HINT: {command()} pool logs --model {pool}; fix the "
                            "handler, then pool deploy it")
    if state == "none" and not wait_for_workers:
        raise UserError(why if "--->" in why else f"{why}: nothing would claim {run} ---> HINT: "
                        f"{command()} pool scale --model {pool} --workers 1 (or --instances N), or "
                        f"{anyway} to queue it anyway")
    return state, why


class Run:
    """A submitted run: wait for it, read its status, results and failures, cancel it, price it."""

    def __init__(self, run_id, *, store=None, context=None):
        self.conf, self.backend = context or _context(store)
        self.record = read_run(self.backend, run_id)
        self.run_id = run_id
        self.waited = []   # the summaries the last wait() read

    def __repr__(self):
        return f"Run({self.run_id!r})"

    def wait(self, timeout=None, progress=False, interrupted=()):
        """Wait until every claim has a summary, nothing can run the rest, or `timeout` s: True when
        all have one (`waited` keeps them); WorkersFailed when every local worker dies unwarmed.
        No `timeout`: the run's own (submit's), else CALQUE_TIMEOUT."""
        timeout = wait_seconds(self.conf, timeout, self.record)
        self.waited, timed_out = wait_for_run(self.backend, self.record, timeout, progress,
                                              stop_if=self._crashing, interrupted=interrupted)
        return not timed_out

    def _crashing(self):
        if self.record["mode"] == "pool":
            looping = crash_looping(self.conf, self.record["model"])
            why = f"every local worker dies before it is warm: {looping}" if looping else self._starter_died()
            if why:
                raise WorkersFailed(f"run {self.run_id}: pool {self.record['model']}: {why}; the run stays queued "
                                    f"---> HINT: fix the handler, pool deploy it, then runs show "
                                    f"{self.run_id}")

    def _starter_died(self):
        """Why no worker will come: none runs or starts anywhere, and one died unwarmed since the run."""
        stats = mark_lost_workers(read_worker_stats(self.backend, self.record["model"]))
        if not any(w.get("state") in LIVE_STATES for w in stats) and not read_supervisor(
                self.conf, self.record["model"]):
            return unwarmed_death(stats, self.record["created_at"])
        return None

    def summaries(self):
        return read_summaries(self.backend, self.run_id)

    def status(self):
        """run_view: each claim's state, the claims per state, the items per outcome, queue depth."""
        self.record = read_run(self.backend, self.run_id)
        return run_view(self.backend, self.record, self.summaries())

    def results(self, failed_only=False, poll=SUMMARY_POLL_MAX):
        """Every item's result dict, in item order, each claim's as it finishes. A claim that will
        not run raises ResultsIncomplete there: never a short read that looks whole."""
        for lines in follow_results(self.backend, self.record, poll):
            for line in lines:
                result = json_line(line) if '"$bytes"' not in line else with_bytes(json_line(line))
                if not (failed_only and result.get("ok")):
                    yield result

    def iter_batches(self, poll=SUMMARY_POLL_MAX):
        """Each claim's results as a pyarrow.RecordBatch, in item order, as each claim finishes."""
        for _, claim, parts in with_parts(self.backend, self.record, follow_claims(self.backend, self.record, poll)):
            yield claim_batch(self.backend, self.record, claim, parts)

    def to_arrow(self):
        """Every item's result as one pyarrow.Table in item order (iter_batches, columns unified)."""
        return run_table(self.iter_batches())

    def to_numpy(self, field=None, fill=None):
        """`field` of every result (None: the result or its only array) stacked; a failed item's
        row is `fill` (default NaN for floats, else a UserError). bfloat16 comes as float32."""
        return run_array(self.record, with_parts(self.backend, self.record, follow_claims(self.backend, self.record)),
                         field, fill)

    def to_pandas(self):
        """to_arrow() as a pandas DataFrame (pandas must be installed)."""
        if importlib.util.find_spec("pandas") is None:
            raise UserError("to_pandas() needs pandas, which is not installed ---> HINT: pip "
                            "install pandas, or use to_arrow()")
        return self.to_arrow().to_pandas()

    def failures(self):
        """The failed items' results (i, error, trace), in item order, once the run has finished."""
        self.wait()
        return list(self.results(failed_only=True))

    def cancel(self):
        """Cancel the run: its claims without a summary will not run. Returns the claims marked."""
        return cancel_run(self.backend, self.record, "cancelled from the API")

    def cost(self, instance_type=None, spot=False, savings_plan=False, rates=None):
        """run_cost_report of the claims finished so far."""
        summaries = self.summaries()
        if not summaries:
            raise UserError(f"run {self.run_id} has no finished claim yet: nothing to price")
        return run_cost_report(self.backend, self.record, summaries,
                               pricing(rates, instance_type, spot, savings_plan))


def follow_results(backend, run, poll=SUMMARY_POLL_MAX):
    """Each claim's result lines (with the run's id_field), in claim order, as each finishes."""
    for index, claim in follow_claims(backend, run, poll):
        lines = claim_results(backend, run["run_id"], claim, claim_items(run, index))
        yield with_ids(backend, run, claim, lines)


def follow_claims(backend, run, poll=SUMMARY_POLL_MAX):
    """(index, claim) as each claim is summarised, in order; one that will not run raises."""
    recheck = 0.0
    for index, claim in enumerate(run["claims"]):
        while True:
            if claim in summary_claims(backend, run["run_id"]):
                s = read_json(backend, summary_key(run["run_id"], claim))
                state = "cancelled" if s["status"] == "cancelled" else "dead-lettered" if s.get("error") else "done"
                detail = s.get("reason") or s.get("error") or ""
                break
            if time.monotonic() >= recheck:   # claim_states may scan the DLQ: not every poll
                recheck = time.monotonic() + RUN_RECHECK
                run.update(read_run(backend, run["run_id"]))
                state, detail = claim_states(backend, run, [])[claim]
                if state != "queued or running":
                    break
            time.sleep(poll)
        if state != "done":
            raise ResultsIncomplete(f"run {run['run_id']}: no results for claim {claim} ({state}"
                                    f"{': ' + detail if detail else ''}) ---> HINT: {next_step(run, state)}")
        yield index, claim


def with_ids(backend, run, claim, lines):
    """The claim's result lines with each item's --id-field (if the run has one) copied in from the
    claim's manifest."""
    field = run["options"].get("id_field")
    if not field:
        return lines
    ids = claim_ids(backend, run, claim, field)
    return [dumps(dict(json.loads(line), **{field: ids[k]})) + "\n" for k, line in enumerate(lines)]


# ------------------------------------------------------------------------------------------------
# 11. the CLI: printing helpers, then one cmd_* per verb in the parser's order, build_parser, main
def emit(args, data, text, *text_args):
    """Print `data` as JSON with --json, else the lines of text(*text_args); the exit code."""
    print(json.dumps(data, indent=1) if args.json else "\n".join(text(*text_args)))
    return EXIT_OK


def _pricing(args):
    """The Pricing the cost options every cost-printing verb takes ask for."""
    return pricing(args.rates, args.instance_type, args.spot, args.savings_plan)


def print_cancelled(model, cancelled):
    for run_id, marked in cancelled.items():
        print(f"pool {model}: run {run_id} cancelled: {len(marked)} claim(s) without a summary will not run")


def print_redriven(record, sent):
    for run_id, claims in sent.items():
        print(f"run {run_id}: {len(claims)} dead-lettered claim(s) sent back to {record['queue']} "
              f"({claim_list(claims)})")


def report_submitted(backend, run, summaries, timed_out, args):
    """The end of submit and runs resume: the run's report and cost lines; returns the exit code."""
    if timed_out:   # what the store says now (a cancel, claims a cold run finished last)
        run, summaries = read_run(backend, run["run_id"]), read_summaries(backend, run["run_id"])
    code = report_run(backend, run, summaries, args.json)
    if not args.json and summaries:
        for line in run_cost_lines(backend, run, summaries, _pricing(args)):
            print("  " + line)
    return code


def write_results(out, lines, failed_only):
    """Result lines (only the failed ones with failed_only) to the binary stream `out`, flushed for
    a follower; how many."""
    lines = [line for line in lines if not failed_only or not json.loads(line)["ok"]]
    out.write("".join(lines).encode())
    out.flush()
    return len(lines)


class NoPandas:
    """An import finder refusing pandas: pyarrow asks for it once, then does without."""
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas":
            raise ImportError("pandas is not needed here")


def print_lost(e):
    print(f"calque: error: {e} ---> HINT: the store lost these results: submit the claim's items "
          "again", file=sys.stderr)
    return EXIT_FAILED


def write_binary_results(out, backend, run, claims, args):
    """The results of `claims` as one Parquet table or .npy array to `out`: (exit code, rows);
    EXIT_FAILED when a claim's part cannot be read (on stderr)."""
    def readable():
        nonlocal code
        for index, claim in claims:
            try:
                yield index, claim, claim_parts(backend, run["run_id"], claim, claim_items(run, index))
            except ResultsIncomplete as e:
                code = print_lost(e)
    code = EXIT_OK
    if args.files is not None:
        return code, write_result_files(backend, run, readable(), args.files, args.field)
    if args.format == "npy":
        import numpy as np
        array = run_array(run, readable(), args.field, args.fill)
        np.save(out, array, allow_pickle=False)
        return code, len(array)
    import pyarrow as pa
    import pyarrow.parquet as pq
    if "pandas" not in sys.modules:   # pyarrow would import it (a third of the time)
        sys.meta_path.insert(0, NoPandas)
        try:
            pa.array([None])
        finally:
            sys.meta_path.remove(NoPandas)
    table = run_table(claim_batch(backend, run, claim, parts) for _, claim, parts in readable())
    if args.failed:
        import pyarrow.compute as pc
        table = table.filter(pc.invert(table["ok"]))
    pq.write_table(table, out)
    return code, table.num_rows


# runs results --files: a file's extension told from its first bytes (.bin where none matches)
MAGIC_EXTENSIONS = [(re.compile(magic, re.S), ext) for magic, ext in (
    (rb"\x89PNG\r\n\x1a\n", ".png"), (rb"\xff\xd8\xff", ".jpg"), (rb"GIF8[79]a", ".gif"),
    (rb"RIFF....WEBP", ".webp"), (rb"RIFF....WAVE", ".wav"), (rb"fLaC", ".flac"),
    (rb"ID3|\xff[\xfb\xf3\xf2]", ".mp3"), (rb"OggS", ".ogg"), (rb"%PDF-", ".pdf"))]


def file_extension(data):
    """The extension of a file of these bytes: its kind's, told from its magic number, else .bin."""
    return next((ext for magic, ext in MAGIC_EXTENSIONS if magic.match(data)), ".bin")


def write_result_files(backend, run, claims, folder, field):
    """`field` of each ok result (None: the result itself) as one file in `folder`, named by the run's
    id field (made a safe name, unique) or else the item's index, zero-padded; the count, said on
    stderr with the bytes and the items skipped (failed, or without it). Not bytes: a UserError."""
    what, width = "the result" if field is None else f"field {field!r}", len(str(max(run["items"] - 1, 0)))
    files = size = skipped = without = 0
    taken, fields, held = set(), {}, {}   # held: the result fields that hold bytes
    id_field = run["options"].get("id_field")
    for _, claim, parts in claims:
        ids = claim_ids(backend, run, claim, id_field) if id_field else None
        typed = dict(zip(*claim_column_rows(parts, field)))
        held.update(dict.fromkeys(b.field for part in parts for b in part.blocks
                                  if b.dtype == BYTES and b.field not in (None, field)))
        hint = (f"--field {next(iter(held))} (its bytes)" if held else "no field of its results "
                f"holds bytes: read them with `{command()} runs results {run['run_id']}`")
        for k, line in enumerate(map(orjson.loads, (line for part in parts for line in part.lines))):
            result = line.get("result")
            value = typed.get(k, result if field is None else
                              result.get(field) if isinstance(result, dict) else None)
            if line["ok"] and not isinstance(value, bytes) and value is not None:
                raise UserError(f"run {run['run_id']}: {what} is not bytes (item {line['i']}: "
                                f"{type(value).__name__}), and --files writes bytes "
                                f"---> HINT: {hint}")
            if value is None:
                skipped += 1
                without += line["ok"]
                fields.update(dict.fromkeys(result if isinstance(result, dict) else ()))
                continue
            index, ext = f"{line['i']:0{width}d}", file_extension(value)
            stem = re.sub(r"[^A-Za-z0-9._-]+", "_", str(ids[k])).strip("._-")[:120] if ids else ""
            name = stem if stem.lower().endswith(ext) else stem + ext   # an id "a.wav" of WAV bytes: a.wav
            while not stem or name.lower() in taken:   # no id, or a name met before: the index tells apart
                stem = f"{stem}-{index}" if stem else index
                name = stem + ext
            taken.add(name.lower())
            os.makedirs(folder, exist_ok=True)   # at the first file: a refusal leaves no folder behind
            with open(os.path.join(folder, name), "wb") as f:
                f.write(value)
            files, size = files + 1, size + len(value)
    if not files and without:
        have = ", ".join(map(repr, fields)) or "no fields"
        raise UserError(f"run {run['run_id']}: no result has the field {field!r}: its results have {have} "
                        f"---> HINT: {hint}")
    gone = f"; skipped {skipped:,} (failed, or without {what})" if skipped else ""
    print(f"runs results: wrote {files:,} files, {size:,} bytes, to {folder}{gone}", file=sys.stderr)
    return files


@contextlib.contextmanager
def results_output(path):
    """Where `runs results` writes: stdout's bytes, or the file at `path` (opened first, removed on
    failure, and what was written said on stderr: rows, bytes, path). Yields a list to add rows to."""
    if path is None:
        yield sys.stdout.buffer, []
        return
    rows = []
    with open_output(path) as out:
        try:
            yield out, rows
        except BaseException:
            os.unlink(path)
            raise
    print(f"runs results: wrote {sum(rows):,} rows, {os.path.getsize(path):,} bytes, to {path}", file=sys.stderr)


def open_output(path):
    try:
        return open(path, "wb")
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}) ---> HINT: pick a path in a folder you can write to")


def plan_run(conf, backend, model, items, claim_size, price):
    """make_plan of `items` on the pool; with no measured claim, one sample claim runs first."""
    record = load_pool(backend, model)
    check_claim_size(claim_size)
    sizes = claim_sizing(conf, backend, record, claim_size)
    if isinstance(items, FileItems):
        raise UserError(f"{items.where}: a plan counts the items first, and files are listed as they are "
                        f"staged ---> HINT: submit without --plan, --deadline or --budget")
    first = list(itertools.islice(iter(items), sizes.fixed or sizes.hi)) if not hasattr(items, "__len__") else None
    count = len(items) if first is None else len(first) + sum(1 for _ in items)
    summaries = recent_summaries(backend, model, PLAN_CLAIMS_READ)
    if not summaries:
        first = first if first is not None else items[:sizes.fixed or sizes.hi]
        run = submit(first, model, claim_size=len(first), context=(conf, backend))   # or refused
        print(f"plan: pool {model} has no measured claim yet: ran one sample claim of {len(first)} "
              f"item(s) first (run {run.run_id}) to measure it", file=sys.stderr)
        if not run.wait():
            raise UserError(f"plan: the sample claim (run {run.run_id}) did not finish within "
                            f"CALQUE_TIMEOUT ---> HINT: {command()} runs show {run.run_id}")
        summaries = recent_summaries(backend, model, PLAN_CLAIMS_READ)
        sizes = claim_sizing(conf, backend, record, claim_size)   # measured now
    return make_plan(backend, conf, record, count, sizes, price, summaries)


def planned_count(conf, backend, record, plan, args):
    """The option to run at: fewest workers meeting --deadline / --budget, else the pool's own."""
    if args.deadline is not None or args.budget is not None:
        deadline = parse_duration(args.deadline) if args.deadline is not None else None
        option = pick_option(plan, deadline, args.budget)
        if option is None:
            fastest, cheapest = plan["options"][-1], min(plan["options"], key=lambda o: o["cost_usd"])
            limits = ("--deadline " + args.deadline if deadline else "") + (
                " --budget " + str(args.budget) if args.budget is not None else "")
            raise UserError(f"no count of 1..{len(plan['options'])} {plan['noun']} meets {limits}: "
                            f"the fastest takes {_duration(fastest['seconds'])}, the cheapest "
                            f"costs {_usd(cheapest['cost_usd'])} ---> HINT: loosen it, or raise "
                            "the pool's ceiling")
        return option
    lo, hi, _, _ = pool_ceiling(conf, backend, record)
    spc = plan["seconds_per_item"] * plan["items"] / plan["claims"]   # an average claim
    want = desired_count(plan["claims"], 0, 0, spc, setting_number(conf, "CALQUE_TARGET_DRAIN", float, 0.001), lo,
                         hi, 0.0, None, 0.0).desired
    return plan["options"][max(1, want) - 1]


def confirm(question, yes):
    """True on --yes or a terminal's y; a stdin that is not a terminal cannot answer: refused."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError("submit --plan asks before it spends, and stdin is not a terminal ---> "
                        "HINT: add --yes to run at the plan printed above")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def apply_count(conf, backend, record, plan, verb):
    """Give the run its planned count (its options' `plan`) once its claims are queued: a local
    pool that sizes itself keeps at least that many workers while its backlog lasts; an EC2
    group's desired capacity is raised to it."""
    noun, count = plan["noun"], plan["count"]
    if noun == "instances":
        import calque_ec2 as ec2
        names = ec2.resource_names(record["model"])
        calls = ec2.AwsCalls.for_backend(backend)
        asg = ec2.describe_asg(calls, names["asg"])
        if asg and asg["DesiredCapacity"] < count:
            calls.call("autoscaling", "SetDesiredCapacity", AutoScalingGroupName=names["asg"], DesiredCapacity=count)
    else:
        folder = state_dir(conf, record["model"])
        bounds = read_scaling(folder)
        if bounds:
            write_file_atomic(os.path.join(folder, "scaling.json"), json.dumps(dict(bounds, boost=count)))
    print(f"{verb}: running at {count} {noun if count != 1 else noun[:-1]} (predicted "
          f"{_duration(plan['seconds'])}, {_usd(plan['cost_usd'])} on-demand)", file=sys.stderr)


def cmd_pool_create(conf, backend, args):
    batch_size = pool_settings(conf, args.batch_size)["batch_size"]
    modal, suggested, notes = modal_options(args.handler, args.param, args.secret, args.volume, args.gpus_per_worker,
                                            batch_size, workers_here=args.instances is None)
    include = include_paths(args.include, args.handler)
    for note in notes:
        print(f"pool {args.model}: {note}")
    for key in ("max_deliveries", "batch_timeout"):   # the app's retries=, timeout=; if not given
        if getattr(args, key) is None:
            setattr(args, key, suggested.get(key))
    if args.instances is not None or args.max_instances is not None:   # EC2: each step idempotent
        snapshot_handler(args.handler, "", lambda key, data: None, include)   # before any AWS call
        record = new_pool_record(backend, args.model, pool_settings(conf, args.batch_size, args.visibility_timeout,
                                                                    args.max_deliveries), args.batch_timeout)
        if modal:
            record["modal"] = modal
        args.instance_type = args.instance_type or suggested.get("instance_type")       # the app's gpu=
        import calque_ec2 as ec2
        options = ec2.pool_options(args.instances, args.instance_type, min_instances=args.min_instances,
                                   ami=args.ami, spot=args.spot, subnet=args.subnet, key_name=args.key_name,
                                   scale_to_zero_after=args.scale_to_zero_after, max_instances=args.max_instances,
                                   reads=args.read)
        with contextlib.nullcontext() if args.dry_run else pool_name_claimed(backend, args.model):
            ec2.pool_create(backend, record, args.handler, options, dry_run=args.dry_run, include=include,
                            yes_spend_money=args.yes_spend_money)
        return EXIT_OK
    if args.dry_run:
        raise UserError("--dry-run applies to AWS calls (pool create --instances on an s3:// store)")
    if args.read:
        raise UserError("--read grants an EC2 pool's instance role (--instances); local workers read what you can")
    count = args.workers
    if count is None and args.max_workers is None:
        count = LOCAL_WORKERS_DEFAULT if args.min_workers is None else args.min_workers
    lo, hi, idle = pool_bounds(count, args.min_workers, args.max_workers, args.scale_to_zero_after, "workers")
    new = not backend.store.exists(pool_key(args.model))   # a failed create leaves it not there
    pool = Pool(args.model, context=(conf, backend))
    existed = check_slug_free(backend, args.model)
    record = pool.create(args.handler, 0, batch_size=args.batch_size, visibility_timeout=args.visibility_timeout,
                         max_deliveries=args.max_deliveries, batch_timeout=args.batch_timeout, modal=modal,
                         include=include)
    counted = idle is not None or any(n is not None
                                      for n in (args.workers, args.min_workers, args.max_workers))
    if existed and version_of(existed):   # the same version: pool.create refuses another
        here = read_supervisor(conf, args.model)   # none: workers start as at a first create
        kept = here and not counted and (
            f"; its {here['desired']} local worker(s) here are left as they are ---> HINT: "
            f"{command()} pool scale --model {args.model} --workers N changes the count")
        print(f"pool {args.model}: exists, version {version_label(record)}: nothing changed{kept or ''}")
        if here and not counted:
            return EXIT_OK
    else:
        print(f"pool {args.model}: queue {record['queue']}, dead-letter {record['dlq']}, version "
              f"{version_label(record)}, visibility {record['visibility_timeout']}s, max "
              f"deliveries {record['max_deliveries']}; workers run in {record['workdir']}")
    if not counted:
        print(f"pool {args.model}: --workers not given: starting {lo} local worker (--workers 0 for none)")
    if idle is not None:
        pid = scale_local_verb(conf, pool, lo, args, (lo, hi, idle), new)
        print(f"pool {args.model}: sizes itself between {lo} and {hi} local worker(s) on its "
              f"backlog (drain target {conf['CALQUE_TARGET_DRAIN']} s; idle {idle / 60:g} min -> "
              f"{lo}), supervisor pid {pid}; logs: {command()} pool logs --model {args.model}")
    elif lo:
        pid = scale_local_verb(conf, pool, lo, args, new=new)
        print(f"pool {args.model}: {lo} local worker(s) {'started' if args.no_wait else 'warm'} under supervisor "
              f"pid {pid}; logs: {command()} pool logs --model {args.model} ({state_dir(conf, args.model)})")
    return EXIT_OK


def scale_local_verb(conf, pool, workers, args, bounds=None, new=False):
    """pool create / scale: set the local workers, waiting until warm unless --no-wait. A `new` pool
    whose workers cannot start, or all die before warm, is deleted again: a failed create leaves no
    pool (the worker logs its error names stay)."""
    try:
        return pool.scale(workers, gpus_per_worker=args.gpus_per_worker, wait=not args.no_wait,
                          threads_per_worker=args.threads_per_worker, progress=sys.stderr.isatty(),
                          bounds=bounds, then=f"{command()} pool create again" if new else None)
    except (UserError, WorkersFailed):
        if new and read_supervisor(conf, pool.model) is None:   # none left loading (a warm timeout)
            with contextlib.suppress(Exception):   # the error being raised is the one to report
                pool.delete(force=True)
        raise
    except KeyboardInterrupt:   # Ctrl-C while waiting for warm: the pool and its workers go on
        print(f"calque: interrupted while waiting: pool {pool.model}: its workers go on loading ---> "
              f"HINT: {command()} pool status --model {pool.model}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT)


def cmd_pool_scale(conf, backend, args):
    record = load_pool(backend, args.model)
    keys = ("workers", "instances", "min_workers", "max_workers", "min_instances", "max_instances")
    given = [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k) is not None]
    pairs = (["--min-workers", "--max-workers"], ["--min-instances", "--max-instances"])
    if len(given) != 1 and given not in pairs:
        raise UserError(f"pool scale {' '.join(given) or 'without a count'}: give --workers N, "
                        f"--instances N, --min-workers A --max-workers B, or --min-instances A "
                        f"--max-instances B ---> HINT: e.g. pool scale --model {args.model} "
                        f"--min-workers 0 --max-workers 2")
    if args.min_instances is not None or args.max_instances is not None:
        import calque_ec2 as ec2
        ec2.pool_scale_bounds(backend, record, args.min_instances, args.max_instances,
                              dry_run=args.dry_run, yes_spend_money=args.yes_spend_money)
        return EXIT_OK
    if args.min_workers is not None or args.max_workers is not None:  # one keeps the other
        had = read_scaling(state_dir(conf, args.model)) or {}
        lo = had.get("lo", 0) if args.min_workers is None else args.min_workers
        hi = had.get("hi") if args.max_workers is None else args.max_workers
        minutes = args.scale_to_zero_after or (had.get("idle_window", 0) / 60 or None)
        lo, hi, idle = pool_bounds(None, lo, hi, minutes, "workers")
        pid = scale_local_verb(conf, Pool(args.model, context=(conf, backend)), lo, args,
                               (lo, hi, idle) if idle else None)
        print(f"pool {args.model}: sizes itself between {lo} and {hi} local worker(s)"
              f"{f' (idle {idle / 60:g} min -> {lo})' if idle else ''}, supervisor pid {pid}")
        return EXIT_OK
    if args.instances is not None:
        import calque_ec2 as ec2
        ec2.pool_scale(backend, record, args.instances, dry_run=args.dry_run, yes_spend_money=args.yes_spend_money)
        return EXIT_OK
    if args.workers == 0:
        scale_local(conf, args.model, 0)
        print(f"pool {args.model}: scaled to 0 local workers")
        return EXIT_OK
    pid = scale_local_verb(conf, Pool(args.model, context=(conf, backend)), args.workers, args)
    print(f"pool {args.model}: {args.workers} local worker(s) "
          f"{'starting' if args.no_wait else 'warm'} (supervisor pid {pid})")
    return EXIT_OK


def cmd_pool_deploy(conf, backend, args):
    if modal_options(args.handler)[0]:
        raise UserError(f"pool deploy takes a calque handler; {args.handler} is a Modal app "
                        f"---> HINT: pool delete --model {args.model}, then pool create it with "
                        "its --param options")
    old, new = Pool(args.model, context=(conf, backend)).deploy(
        args.handler, batch_size=args.batch_size, include=include_paths(args.include, args.handler),
        wait=not args.no_wait, progress=sys.stderr.isatty())
    pool = f"pool {args.model}"
    if old is new:
        idle = "ec2" not in old and not read_supervisor(conf, args.model)
        print(f"{pool}: already runs version {version_label(old)}: nothing changed" + (
            f"; no local worker runs it here ---> HINT: {command()} pool scale --model "
            f"{args.model} --workers N" if idle else ""))
        return EXIT_OK
    print(f"{pool}: version {version_label(new)} replaces {version_label(old)}; runs submitted "
          "from now on run on it")
    if "ec2" in new:
        print(f"{pool}: each instance's worker restarts on it when idle (within "
              f"{VERSION_CHECK:g} s) or at its next claim; `pool status` shows each one's version")
    elif read_supervisor(conf, args.model):
        print(f"{pool}: its local workers here were replaced "
              f"({'starting' if args.no_wait else 'warm'})")
    else:
        print(f"{pool}: no local workers here ---> HINT: {command()} pool scale --model "
              f"{args.model} --workers N starts them")
    late = runs_in_flight(backend, old)   # submitted to the old version while it changed
    if late:
        print(f"{pool}: run(s) {', '.join(late)} reached version {version_of(old)} during the "
              "change: their claims are dead-lettered, naming both versions ---> HINT: submit "
              "their items again", file=sys.stderr)
    return EXIT_OK


def cmd_pool_status(conf, backend, args):
    status = pool_status(conf, backend, args.model)
    return emit(args, status, format_pool_status, status, backend.describe())


def cmd_pool_list(conf, backend, args):
    if backend.kind == "aws":   # records in the store, plus fleets found only by their tags (a half-created pool)
        import calque_ec2 as ec2
        pools = ec2.pool_list(backend)
    else:
        pools = [{"model": model, "record": True, "asg": None} for model in list_pools(backend)]
    local_workers = {p["model"]: (read_supervisor(conf, p["model"]) or {}).get("desired", 0)
                     for p in pools} if not args.json else {}
    return emit(args, pools, format_pool_list, pools, local_workers, backend.describe())


def cmd_pool_delete(conf, backend, args):
    record = pool_record_to_delete(backend, args.model, args.force)
    if "ec2" in record or "queue" not in record:
        if not args.yes and not args.dry_run:
            raise UserError(f"pool delete {args.model}: an EC2 pool is deleted only with --yes "
                            f"(or previewed with --dry-run)")
        supervisor_module().stop_supervisor(conf, args.model, stop_seconds(conf) + 15)
        if args.force and not args.dry_run:
            print_cancelled(args.model, cancel_pool_runs(backend, args.model))
        import calque_ec2 as ec2
        ec2.pool_delete(backend, record, yes=args.yes, dry_run=args.dry_run)
        return EXIT_OK
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"pool delete {args.model}: refusing without --yes (no terminal to ask)")
        answer = input(f"delete pool {args.model}: stop its local workers, "
                       f"delete {record['queue']} and {record['dlq']}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return EXIT_FAILED
    print_cancelled(args.model, Pool(args.model, context=(conf, backend)).delete(args.force))
    print(f"pool {args.model}: local workers stopped")
    for role in ("queue", "dlq"):
        print(f"pool {args.model}: deleted queue {record[role]}")
    print(f"pool {args.model}: deleted its record, handler snapshot and worker stats; its runs remain in the store "
          f"---> HINT: {command()} runs prune --model {args.model} --older-than 0s (or runs delete RUN) deletes them")
    return EXIT_OK


def cmd_pool_cost(conf, backend, args):
    load_pool(backend, args.model)
    report, label = pool_cost_report(read_worker_stats(backend, args.model), _pricing(args), args.since)
    return emit(args, {"model": args.model, "priced_as": label, "cost": report},
                format_pool_cost, report, label, args.model)


def cmd_pool_redrive(conf, backend, args):
    """Send the dead-lettered claims of the pool's runs (not cancelled ones) back to its queue."""
    record = load_pool(backend, args.model)
    runs = {run["run_id"]: run for run in list_runs(backend, args.model)
            if run["model"] == args.model and run["mode"] == "pool" and not run.get("cancelled")}
    other = [r for r in runs if runs[r].get("version", version_of(record)) != version_of(record)]
    if other:   # their claims would be dead-lettered again (check_run_version)
        print(f"pool {args.model}: {len(other)} run(s) of an earlier version not redriven "
              f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): submit their items "
              "again")
        runs = {r: run for r, run in runs.items() if r not in other}
    sent = redrive(backend, record, runs)
    print_redriven(record, sent)
    if not sent:
        print(f"pool {args.model}: no dead-lettered claim in its {len(runs)} run(s): nothing to redrive")
    return EXIT_OK


def cmd_pool_logs(conf, backend, args):
    """The pool's worker logs here, each under a '==> path <==' header (--follow: until Ctrl-C)."""
    record = load_pool(backend, args.model)
    if "ec2" in record:
        print(f"pool {args.model} runs on EC2: each instance's worker log is its journal (`journalctl -u calque-warmd` "
              f"on the instance; the bootstrap's in /var/log/cloud-init-output.log); `pool status --model "
              f"{args.model}` lists the instances")
        return EXIT_OK
    folder = state_dir(conf, args.model)
    name = "worker-*.log" if args.worker is None else f"worker-{args.worker}.log"
    paths = sorted(glob.glob(os.path.join(folder, name)), key=lambda p: int(re.findall(r"\d+", p)[-1]))
    if not paths:
        raise UserError(f"pool {args.model}: no {name} in {folder}: no local worker ran here"
                        + (" in that slot" if args.worker is not None else "")
                        + f" ---> HINT: {command()} pool scale --model {args.model} --workers 1")
    offsets, first = dict.fromkeys(paths, 0), True
    while first or args.follow:
        for path in paths:
            with open(path, "rb") as f:
                f.seek(offsets[path])
                text = f.read()
                offsets[path] = f.tell()
            if text or first:
                print(f"==> {path} <==\n{text.decode(errors='replace')}", end="", flush=True)
        first = False
        time.sleep(SUPERVISOR_TICK if args.follow else 0)
    return EXIT_OK


def cmd_submit(conf, backend, args):
    wait_seconds(conf, args.timeout)   # checked before anything is read (the run keeps a given one)
    items = read_items(args.items, args.columns and [c.strip() for c in args.columns.split(",") if c.strip()])
    if isinstance(items, (TableItems, FileItems)):
        few_malloc_arenas()
    progress = not args.json and sys.stderr.isatty()
    planned = args.plan or args.deadline is not None or args.budget is not None
    kept = None   # a planned run's plan: the count picked, its predicted time and cost
    if args.pool:
        if args.shards > 1:
            raise UserError("--pool with --shards > 1: a pool submission is claims against an already-running pool; "
                            "scale the pool instead (pool scale), or drop --pool for a cold run")
        if planned:
            items = items if hasattr(items, "__len__") or isinstance(items, FileItems) else list(items)
            plan = plan_run(conf, backend, args.pool, items, args.claim_size, _pricing(args))
            print("\n".join(format_plan(plan)), file=sys.stderr)
            record = load_pool(backend, args.pool)
            option = planned_count(conf, backend, record, plan, args)
            noun = "instances" if record.get("ec2") else "workers"
            kept = dict(count=option[noun], noun=noun, seconds=option["seconds"],
                        cost_usd=option["cost_usd"])
            if args.plan and not confirm(f"run {plan['items']:,} items at {option[plan['noun']]} {plan['noun']}, "
                                         f"{_usd(option['cost_usd'])} predicted?", args.yes):
                print("submit: not run", file=sys.stderr)
                return EXIT_FAILED
            if record.get("ec2"):     # before anything is queued: the group grows for the run
                from calque_ec2 import refuse_spending
                refuse_spending(f"submit --pool {args.pool} at {option['instances']} instances", dry_run=False,
                                yes_spend_money=args.yes_spend_money)
        run_id = new_run_id(args.pool)
        follow = args.follow_logs and not args.no_wait
        output = supervisor_module().WorkerOutput(backend, {args.pool: args.pool}) if follow else None
        try:
            with signals_interrupt():
                run = submit(items, args.pool, claim_size=args.claim_size, id_field=args.id_field,
                             wait_for_workers=args.wait_for_workers or args.no_wait,
                             timeout=args.timeout, context=(conf, backend), run_id=run_id,
                             plan=kept)
        except SubmitInterrupted as e:
            return interrupted(backend, run_id, e.signum)
        if kept:   # once its claims are queued: a local pool's boost lasts while they wait
            apply_count(conf, backend, record, kept, "submit")
        if backend.kind == "aws":   # an EC2 pool's backlog steps follow the claims it ran
            from calque_ec2 import refresh_backlog_steps
            refresh_backlog_steps(backend, load_pool(backend, args.pool))
        if args.no_wait:
            print(run.run_id)
            return EXIT_OK
        try:   # every claim is queued: an interrupt leaves the run to go on without us
            with sigint_noted() as noted:
                depth = backend.queues.open_queue(run.record["queue"]).counts()
                print(f"run {run.run_id}: {len(run.record['claims'])} claim(s) of {run.record['items']} "
                      f"items sent to {run.record['queue']} ({depth['visible']} visible, "
                      f"{depth['in_flight']} in flight)", file=sys.stderr, flush=True)
                timed_out = not run.wait(args.timeout, progress, interrupted=noted)
        except KeyboardInterrupt:
            return interrupted_waiting(run.run_id)
        finally:
            if output:
                output.stop()
        run, summaries = run.record, run.waited
    else:
        if not args.model:
            raise UserError("submit needs --pool M (a warm pool) or --model M (a cold run)")
        if planned:
            raise UserError("--plan, --deadline and --budget plan a pool run ---> HINT: submit --pool M")
        if args.no_wait:
            raise UserError("--no-wait applies to --pool runs; a cold run's workers live only while submit waits")
        check_claim_size(args.claim_size)
        if args.id_field:
            items = check_id_field(items, args.id_field)
        ec2 = None   # fresh local processes, unless the flags ask for EC2 instances
        if backend.kind == "aws" and (args.ami or args.yes_spend_money or args.dry_run):
            from calque_ec2 import ColdLaunch
            ec2 = ColdLaunch(args.ami, args.instance_type, spot=args.spot, subnet=args.subnet, key_name=args.key_name)
        try:
            with signals_interrupt():   # a SIGTERM too ends its workers and deletes its queues
                run, summaries, timed_out = cold_run(
                    conf, backend, items, model=args.model, handler=args.handler, shards=args.shards,
                    batch_size=args.batch_size, claim_size=args.claim_size,
                    timeout=wait_seconds(conf, args.timeout), progress=progress, ec2=ec2,
                    dry_run=args.dry_run, yes_spend_money=args.yes_spend_money,
                    options=run_options(args.id_field, args.timeout))
        except SubmitInterrupted as e:
            print("calque: interrupted: the cold run is cancelled (its workers and queues are "
                  "gone) ---> HINT: submit again", file=sys.stderr)
            return 128 + e.signum
        if run is None:   # --dry-run on EC2: the calls were printed, nothing was staged
            return EXIT_OK
    return report_submitted(backend, run, summaries, timed_out, args)


def cmd_plan(conf, backend, args):
    plan = plan_run(conf, backend, args.pool, read_items(args.items), args.claim_size, _pricing(args))
    return emit(args, plan, format_plan, plan)


def few_malloc_arenas():
    """Two glibc malloc arenas: per-thread ones keep what store writers freed (submit's peak); and
    blocks of 1 MiB or more mapped, so given back when freed: glibc's threshold otherwise rises to
    the largest block freed, and a Parquet of images grew submit's peak with its size."""
    with contextlib.suppress(OSError, AttributeError):   # not glibc: nothing to limit
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 2)         # M_ARENA_MAX
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD


def cmd_runs_list(conf, backend, args):
    runs = [listed_run(backend, run) for run in list_runs(backend, args.model)]
    return emit(args, runs, format_runs_list, runs, args.model)


def cmd_runs_show(conf, backend, args):
    run, summaries = read_run(backend, args.run), read_summaries(backend, args.run)
    code = report_run(backend, run, summaries, args.json)
    if not args.json and plan_against_actual(run, summaries):
        print(plan_against_actual(run, summaries))
    return code


def cmd_runs_results(conf, backend, args):
    """Every item's result in item order, as JSONL (--follow: as each claim ends), Parquet or .npy;
    a claim without all its results is an error line and exit 1, never a short read."""
    if args.files is not None:
        given = {"--format": args.format, "--output": args.output, "--follow": args.follow,
                 "--failed": args.failed, "--fill": args.fill}
        clash = next((flag for flag, value in given.items() if value is not None and value is not False), None)
        if clash:
            raise UserError(f"--files writes one file an item into a folder: not with {clash} ---> HINT: drop one")
        if os.path.exists(args.files) and not os.path.isdir(args.files):
            raise UserError(f"--files {args.files}: that is a file, not a folder ---> HINT: name a folder "
                            f"(made if missing)")
    args.format = args.format or "jsonl"
    binary = args.format != "jsonl" or args.files is not None
    if binary and args.follow:
        raise UserError(f"--follow prints JSONL as each claim ends; --format {args.format} is one file written once "
                        f"---> HINT: drop --follow (runs show {args.run} says when the run is done)")
    if args.format != "npy" and args.files is None and (args.field or args.fill is not None):
        raise UserError("--field and --fill choose the array of --format npy (--field: the bytes of --files), "
                        f"not of {args.format} ---> HINT: add --format npy, or drop them")
    if args.format == "npy" and args.failed:
        raise UserError("--failed with --format npy: an array has no room for errors ---> HINT: "
                        "--format jsonl or parquet")
    if binary and args.files is None and args.output is None and sys.stdout.isatty():
        raise UserError(f"--format {args.format} writes binary: not to a terminal ---> HINT: --output PATH")
    run = read_run(backend, args.run)
    with results_output(args.output) as (out, rows):
        if args.follow:
            try:
                for lines in follow_results(backend, run):
                    rows.append(write_results(out, lines, args.failed))
            except ResultsIncomplete as e:
                print(f"calque: error: {e}", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        view = run_view(backend, run, read_summaries(backend, args.run))
        code, not_run, done = EXIT_OK, {}, []
        for index, claim in enumerate(run["claims"]):
            state = view["claims"][claim]["state"]
            if state not in ("done", "failed"):
                not_run.setdefault(state, []).append(claim)
                continue
            try:
                lines = claim_results(backend, args.run, claim, claim_items(run, index)) if not binary else None
            except ResultsIncomplete as e:
                code = print_lost(e)
                continue
            if binary:
                done.append((index, claim))
            else:
                rows.append(write_results(out, with_ids(backend, run, claim, lines), args.failed))
        if binary:
            written = write_binary_results(out, backend, run, done, args)
            code = max(code, written[0])
            rows.append(written[1])
    for state, claims in not_run.items():
        print(f"calque: error: run {args.run}: no results for {len(claims)} claim(s) {state} "
              f"({claim_list(claims)}) ---> HINT: {next_step(run, state)}", file=sys.stderr)
    return EXIT_FAILED if not_run else code


def cmd_runs_resume(conf, backend, args):
    """Send the claims an interrupted submit did not, and again those in no queue, then wait, as its
    submit would have (its options: --timeout and --wait-for-workers unless given here)."""
    wait_seconds(conf, args.timeout)   # a bad CALQUE_TIMEOUT is said before anything is read
    run = read_run(backend, args.run)
    if run["mode"] != "pool":
        raise UserError(f"run {args.run} is a cold run: its workers and queues lived only while "
                        "its submit waited ---> HINT: submit its items again")
    if run.get("cancelled"):
        raise UserError(f"run {args.run} was cancelled ({run['cancelled']['reason']}): nothing to "
                        "resume ---> HINT: submit its items again")
    if not run["staged"]:   # submit killed while staging: past `sent`, manifests may be missing
        raise UserError(f"run {args.run} was stopped while staging: {run['sent']} claim(s) were "
                        f"queued, the rest may have no manifest ---> HINT: runs cancel {args.run}, "
                        f"then submit the items from {sum(claim_items(run, k) for k in range(run['sent']))} on again")
    try:
        record = load_pool(backend, run["model"])
        queue = backend.queues.open_queue(record["queue"])
    except NotFound:
        raise UserError(f"run {args.run}: pool {run['model']}'s queue is gone ---> HINT: pool create --model "
                        f"{run['model']} ... again (it is idempotent), then runs resume {args.run}") from None
    check_run_version(run, record, "runs resume")
    done = summary_claims(backend, args.run)
    if len(done) < len(run["claims"]):   # claims left to run: a worker to run them, as its submit
        pool_ready(conf, backend, record, args.no_wait or run["options"].get("wait_for_workers"),
                   f"run {args.run}", f"runs resume {args.run} --no-wait")
    unsent = [claim for claim in run["claims"][run["sent"]:] if claim not in done]
    lost = [claim for claim, (state, _) in claim_states(backend, run, read_summaries(backend, args.run)).items()
            if state == "in no queue"]
    try:
        with signals_interrupt():
            for start in range(0, len(lost), SEND_BATCH):   # a copy still queued: a duplicate
                send_batch(backend, run, queue, lost[start:start + SEND_BATCH], resume=True)
            send_claims(backend, run, queue, skip=done, resume=True)
    except SubmitInterrupted as e:
        return interrupted(backend, args.run, e.signum)
    try:   # every claim is queued: an interrupt leaves the run to go on without us
        with sigint_noted() as noted:
            print(f"run {args.run}: {len(unsent)} claim(s) not sent before now sent to {queue.name}"
                  + (f"; {len(lost)} claim(s) in no queue sent again ({claim_list(lost)})" if lost else ""),
                  file=sys.stderr, flush=True)
            if run["options"].get("plan") and (unsent or lost):   # its submit's boost ended with them
                apply_count(conf, backend, record, run["options"]["plan"], "runs resume")
            if args.no_wait:
                return EXIT_OK
            summaries, timed_out = wait_for_run(backend, run, wait_seconds(conf, args.timeout, run),
                                                not args.json and sys.stderr.isatty(), interrupted=noted)
    except KeyboardInterrupt:
        return interrupted_waiting(args.run)
    return report_submitted(backend, run, summaries, timed_out, args)


def check_run_version(run, record, verb):
    """A run keeps its version: `verb` of a run of a version its pool no longer runs is refused."""
    if run.get("version", version_of(record)) != version_of(record):
        raise UserError(f"run {run['run_id']} was submitted to version {run['version']}; pool "
                        f"{run['model']} runs {version_label(record)} now (pool deploy): {verb} "
                        "would run none of its claims ---> HINT: submit its items again")


def cmd_runs_cancel(conf, backend, args):
    """Cancel a run: its claims without a summary will not run (cancel_run)."""
    run = read_run(backend, args.run)
    marked = cancel_run(backend, run, "runs cancel")
    if marked:
        print(f"run {args.run}: cancelled: {len(marked)} claim(s) without a summary will not run")
    elif run.get("cancelled"):
        print(f"run {args.run}: already cancelled ({run['cancelled']['reason']}): nothing left to cancel")
    else:
        print(f"run {args.run}: every claim has a summary: nothing to cancel")
    return EXIT_OK


def size_text(size):
    """Bytes in the largest unit that leaves at least 1 of it: 512 B, 13.4 KiB, 1.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,} B" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024


def cmd_runs_delete(conf, backend, args):
    """Delete runs from the store: every one is checked before the first is deleted."""
    runs = [read_run(backend, run_id) for run_id in args.run]
    for run in runs if not args.force else ():
        check_deletable(backend, run)
    return print_freed(conf, backend, runs)


def print_freed(conf, backend, runs):
    """Delete the runs, a line each, then the total freed."""
    total = [0, 0]
    for run in runs:
        objects, size = delete_run(conf, backend, run)
        total = [total[0] + objects, total[1] + size]
        print(f"run {run['run_id']}: deleted ({objects} object(s), {size_text(size)})")
    print(f"freed {size_text(total[1])} in {total[0]} object(s) of {len(runs)} run(s)")
    return EXIT_OK


def cmd_runs_prune(conf, backend, args):
    """Delete the runs older than --older-than but each model's --keep newest; skip live ones."""
    if args.keep < 0:
        raise UserError(f"--keep {args.keep}: must be 0 or more")
    runs = []
    for run in runs_to_prune(backend, parse_age(args.older_than), args.keep, args.model):
        live = [] if args.force else live_claims(backend, run)
        if live:
            print(f"run {run['run_id']}: kept: {len(live)} claim(s) queued or running ---> HINT: "
                  "--force deletes it anyway")
        else:
            runs.append(run)
    return print_freed(conf, backend, runs)


def cmd_runs_redrive(conf, backend, args):
    """Send a run's dead-lettered claims back to its pool's queue (redrive)."""
    run = read_run(backend, args.run)
    if run["mode"] != "pool":
        raise UserError(f"run {args.run} is a cold run: its queues are gone ---> HINT: submit its items again")
    if run.get("cancelled"):
        raise UserError(f"run {args.run} was cancelled ({run['cancelled']['reason']}): nothing to "
                        "redrive ---> HINT: submit its items again")
    record = load_pool(backend, run["model"])
    check_run_version(run, record, "runs redrive")
    sent = redrive(backend, record, {args.run: run})
    print_redriven(record, sent)
    if not sent:
        print(f"run {args.run}: no dead-lettered claim: nothing to redrive")
    return EXIT_OK


def dashboard_module():
    """calque_dashboard.py: imported only by `dashboard` and `runs report`."""
    import calque_dashboard
    return calque_dashboard


def cmd_runs_report(conf, backend, args):
    run_id = read_run(backend, args.run)["run_id"]
    view = dashboard_module().write_report(conf, backend, run_id, args.html, _pricing(args))
    print(f"run {args.run}: report written to {args.html} ({view['items']['ok']} items ok, "
          f"{view['items']['failed']} failed, {view['items']['pending']} pending)")
    return EXIT_OK


def cmd_dashboard(conf, backend, args):
    dashboard_module().serve(conf, backend, args.host, args.port, args.token, _pricing(args))
    return EXIT_OK


def cmd_cost(conf, backend, args):
    """One run: its cost lines and the crossover ladder. Several: one comparison line each."""
    reports, price = [], _pricing(args)
    for run_id in args.run:
        run = read_run(backend, run_id)
        summaries = read_summaries(backend, run_id)
        if not summaries:
            raise UserError(f"run {run_id} has no finished claim yet ({len(run['claims'])} "
                            "pending): nothing to price; try again later")
        reports.append((run, *run_cost_report(backend, run, summaries, price)))
    if args.json:
        print(json.dumps([{"run_id": run["run_id"], "priced_as": label, "cost": report, "ladder": ladder}
                          for run, report, ladder, label, _ in reports], indent=1))
        return EXIT_OK
    if len(reports) == 1:
        run, report, ladder, label, status = reports[0]
        print(f"run {run['run_id']} ({run['mode']}, model {run['model']})")
        for line in format_run_cost(report, label) + (format_ladder(ladder, status) if ladder else []):
            print("  " + line)
        if plan_against_actual(run, summaries):
            noun = run["options"]["plan"]["noun"][:-1]
            print(f"  {plan_against_actual(run, summaries)}; its claims cost {_usd(report['total_usd'])} "
                  f"(the plan prices every {noun} for the whole wall time)")
        return EXIT_OK
    labels = list(dict.fromkeys(label for _, _, _, label, _ in reports))   # one per run kind
    print("\n".join(format_cost_table([(run, report) for run, report, *_ in reports], "; ".join(labels))))
    return EXIT_OK


class ModalEntrypointFailed(Exception):
    """A remote call of `calque modal run`'s entrypoint failed: one line, exit 1."""


class ModalRun:
    """Where `calque modal run` sends calls: each target's items go to its pool (--pool M, or an
    ephemeral one made at the first call, deleted by close()); returns Run.results()."""

    def __init__(self, context, path, pool, workers, volumes=(), secrets=()):
        self.context, self.path, self.workers, self.volumes, self.secrets = context, path, workers, volumes, secrets
        self.pools, self.created, self.runs, self.lock = {}, [], [], threading.Lock()
        record = load_pool(context[1], pool) if pool else None
        if record:
            self.pools[(record["handler"]["class"], self._key(record.get("modal", {}).get("params", {})))] = pool
        labels = {pool: record["handler"]["class"]} if record else {}
        self.output = supervisor_module().WorkerOutput(context[1], labels)

    @staticmethod
    def _key(params):
        return json.dumps({k: str(v) for k, v in params.items()}, sort_keys=True)

    def __call__(self, target, params, items):
        key = (target, self._key(params))
        with self.lock:   # .aio calls come from threads: one pool per target, one submit at a time
            if key not in self.pools:
                self.pools[key] = self._ephemeral(target, params)
            try:
                run = submit(items, pool=self.pools[key], context=self.context)
            except TypeError as e:   # json_default's: an argument that is no JSON value
                error = TypeError(f"{target}'s arguments travel as JSON values (Modal pickles "
                                  f"them): {e}")
                raise load_modal_shim().app_error(error) from None
            self.runs.append(run)
        return run.results()

    def streamed(self, target, params, stream, after=None, done=False):
        """The chunks a .remote_gen worker wrote after key `after`: [(key, chunk)]; `done` deletes."""
        store = self.context[1].store
        prefix = stream_prefix(self.pools[(target, self._key(params))], stream)
        if done:
            return store.delete_prefix(prefix)
        return [(key, json.loads(store.get(key))) for key in store.list(prefix, after)]

    def _ephemeral(self, target, params):
        spec = f"{self.path}:{target}"
        batch_size = pool_settings(self.context[0])["batch_size"]
        modal, suggested, notes = modal_options(spec, [f"{k}={v}" for k, v in params.items()], self.secrets,
                                                self.volumes, batch_size=batch_size)
        model = f"modal-{os.path.basename(self.path)[:-3]}-{target.replace('.', '-')}-{secrets.token_hex(3)}"
        print(f"calque: ephemeral pool {model} for {target}: {self.workers} local worker(s)", file=sys.stderr)
        for note in notes:
            print(f"calque: {target}: {note}", file=sys.stderr)
        self.created.append(model)
        folder = state_dir(self.context[0], model)   # `owner`: its supervisor deletes the pool
        os.makedirs(folder, exist_ok=True)            # once this process is gone (kill -9)
        write_file_atomic(os.path.join(folder, "owner"), str(os.getpid()))
        self.output.add(model, target)
        conf = dict(self.context[0], CALQUE_GRACE="0")   # a signal: let go a call nobody awaits
        Pool(model, context=(conf, self.context[1])).create(
            spec, self.workers, modal=modal, max_deliveries=suggested.get("max_deliveries"),
            batch_timeout=suggested.get("batch_timeout"))
        return model

    def close(self, wait):
        """Delete the ephemeral pools; with `wait`, once every call made is done (a .spawn nobody
        waited for still runs rather than being lost)."""
        try:
            if wait:
                for run in self.runs:
                    run.wait()
        finally:   # a second SIGTERM or Ctrl-C waits for the pools' deletion
            handlers = {sig: signal.signal(sig, signal.SIG_IGN)
                        for sig in (signal.SIGTERM, signal.SIGINT)}
            self.output.stop()
            try:
                for model in self.created:
                    with contextlib.suppress(NotFound):
                        Pool(model, context=self.context).delete(force=True)
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)


MODAL_ARG_TYPES = (int, float, str)   # entrypoint parameter types Modal's CLI parses


def entrypoint_parser(fn, prog):
    """Modal's CLI for a local entrypoint: one --name option a parameter, typed by annotation."""
    parser = Parser(prog=prog)
    hints = typing.get_type_hints(fn)
    for name, param in inspect.signature(fn).parameters.items():
        kind, flag = hints.get(name, str), f"--{name.replace('_', '-')}"
        optional = [k for k in typing.get_args(kind) if k is not type(None)]
        if len(optional) == 1 and type(None) in typing.get_args(kind):   # `str | None`: a str
            kind = optional[0]
        required = param.default is param.empty
        default = None if required else param.default
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                required=required)
        elif kind in MODAL_ARG_TYPES:
            parser.add_argument(flag, dest=name, type=kind, default=default, required=required)
        else:
            raise UserError(f"entrypoint {fn.__name__}: parameter {name} is a {kind}: Modal's CLI "
                            "and calque's take int, float, str and bool")
    return parser


def cmd_modal_run(conf, backend, args):
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)   # --pool etc. after app.py
    own.add_argument("--pool")
    own.add_argument("--workers", type=int)
    for flag in ("--volume", "--secret"):
        own.add_argument(flag, action="append")
    _, args.args = own.parse_known_args(args.args, namespace=args)   # args' values are the defaults
    path, _, name = args.app.partition("::")
    if not os.path.isfile(path):
        raise UserError(f"modal run {args.app}: file {path} not found ---> HINT: give the app file's path "
                        "(modal run path/app.py[::function])")
    if args.workers < 1:
        raise UserError(f"--workers {args.workers}: an ephemeral pool needs at least 1")
    shim, module = import_modal_file(path)
    fn, name = modal_run_target(shim, module, path, name)
    kwargs = vars(entrypoint_parser(fn, f"{command()} modal run {args.app}").parse_args(args.args))
    shim.runner = runner = ModalRun((conf, backend), path, args.pool, args.workers, args.volume, args.secret)
    done = False
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        out = fn(**kwargs)
        if inspect.iscoroutine(out):
            import asyncio
            asyncio.run(out)
        done = True
    except shim.RemoteError as e:
        where = f" (at {e.where})" if getattr(e, "where", None) else ""
        raise ModalEntrypointFailed(f"entrypoint {name}: an item failed: {type(e).__name__}: {one_line(e)}{where} "
                                    f"---> HINT: map(..., return_exceptions=True) to go on past failed items")
    except (UserError, StoreFault, WorkersFailed, ResultsIncomplete):
        raise
    except Exception as e:   # the entrypoint's own code failed: where, in one line
        if kit_fault(e, path):
            raise
        raise ModalEntrypointFailed(f"entrypoint {name} failed: {user_code_error(path, e)}")
    finally:
        shim.runner = None
        try:
            runner.close(wait=done)
        finally:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def modal_run_target(shim, module, path, name):
    """(callable, name) `modal run app.py[::name]` runs: a local entrypoint, else (as Modal's CLI)
    a function or Cls.method called once with its parameters as options."""
    entrypoints, functions = {}, {}
    for app in [v for v in vars(module).values() if isinstance(v, shim.App)]:
        entrypoints.update(app.entrypoints)
        for key, obj in app.registered.items():
            if isinstance(obj, shim.Function) and not getattr(obj.raw_f, "_modal_role", {}).get("web"):
                functions[key] = obj
            elif isinstance(obj, shim.Cls):
                functions.update({f"{key}.{m}": obj for m in obj.methods()})
    if not name:
        found = entrypoints or functions
        if len(found) != 1:
            raise UserError(f"{path} has {len(entrypoints)} local entrypoints and {len(functions)} functions "
                            f"({', '.join(found) or 'none'}) ---> HINT: name one: modal run {path}::NAME")
        name = next(iter(found))
    if name in entrypoints:
        return entrypoints[name], name
    if name not in functions:
        raise UserError(f"{path} has no @app.local_entrypoint() or function {name} "
                        f"(it has: {', '.join([*entrypoints, *functions]) or 'none'})")
    top, _, method = name.partition(".")
    handle = getattr(functions[name](), method) if method else functions[name]
    fn = getattr(functions[name].user_cls, method) if method else functions[name].raw_f
    call = functools.wraps(fn)(lambda **kwargs: handle.remote(**kwargs))
    if method:   # the options are the method's own parameters, without self
        signature = inspect.signature(fn)
        call.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    return call, name


class Parser(argparse.ArgumentParser):
    """argparse as calque's other errors: one line naming the command as it was run (no usage
    block), a `did you mean` for a mistyped verb or option, a UserError (exit 2). No option is
    taken by a prefix of its name: `--worker 2` is a mistake, not `--workers 2`."""
    unknown = None   # the first option given that this parser does not take

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's; an argument left over is an error here, where this verb's options are known
        (argparse would name the top command)."""
        args = sys.argv[1:] if args is None else list(args)
        self.unknown = next((arg.partition("=")[0] for arg in args if re.match(r"-+[^-\d.]", arg)
                             and arg.partition("=")[0] not in self._option_string_actions), None)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unexpected argument {extras[0]!r}")
        return namespace, extras

    def error(self, message):
        if self.unknown:   # the mistake to name: argparse may report its effect (--model missing)
            self.fail(self.unknown, "no such option", self.unknown, self._option_string_actions)
        self.fail("", message)

    def fail(self, given, message, typed=None, known=()):
        """Raise `PROG GIVEN: message`, naming the `known` words `typed` begins, or its closest."""
        close = [w for w in known if typed and w.startswith(typed)][:3] or difflib.get_close_matches(
            typed or "", list(known), 1)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        where = f"{self.prog} {given}" if given else self.prog
        raise UserError(f"{where}: {message} ---> HINT: {guess}see `{self.prog} --help`")

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            if action.option_strings:
                self.fail(f"{action.option_strings[0]} {value}", f"not one of {choices}", value,
                          action.choices)
            self.fail(value, f"no such command ({choices})", value, action.choices)


class VersionAction(argparse.Action):
    """--version, importing importlib.metadata only when asked (it is slow to import)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print calque's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"calque {calque_version()}")
        parser.exit()


def build_parser():
    shared = {   # options several verbs take alike
        "--model": dict(required=True, help="the pool's model name"),
        "--json": dict(action="store_true", help="print JSON instead of text"),
        "run": dict(help="the run id (see `runs list`; `latest`: the newest)"),
        "--timeout": dict(type=float,
                          help="seconds to wait for the summaries (default CALQUE_TIMEOUT)"),
        "--key-name": dict(help="EC2 key pair for SSH (none by default)"),
        "--yes-spend-money": dict(action="store_true", help="allow starting paid EC2 instances"),
    }

    def add(group, *flags):
        for flag in flags:
            group.add_argument(flag, **shared[flag])

    def switch(group, flag, help):
        group.add_argument(flag, action="store_true", help=help)

    def local_options(p):   # pool create's and pool scale's, for local workers
        switch(p, "--no-wait", "return once the workers are started, before they are warm")
        p.add_argument("--gpus-per-worker", type=int, metavar="K", help="CUDA devices per local "
                       "worker, round-robin (default 1 where CUDA devices exist, else 0)")
        p.add_argument("--threads-per-worker", type=int, metavar="N", help="torch/OpenMP/MKL "
                       "threads per local worker (default: a CPU worker's share of the cores, "
                       "cores / workers, unless OMP_NUM_THREADS etc. are set; a GPU worker: its "
                       "libraries' default)")

    def verb(verbs, name, func, *flags, cost=False, **kw):
        p = verbs.add_parser(name, parents=[priced] if cost else [], **kw)
        add(p, *flags)
        p.set_defaults(func=func)
        return p

    parser = Parser(prog=command(),
                    description="Sticky warm-worker pools for batch model inference.")
    parser.add_argument("--version", action=VersionAction)
    priced = Parser(add_help=False)   # what every verb printing a cost takes
    priced.add_argument("--instance-type",
                        help="price as this EC2 instance type (default: rates.json defaults)")
    switch(priced, "--spot", "price at the rates file's spot fraction")
    switch(priced, "--savings-plan", "price at the rates file's savings-plan fraction")
    priced.add_argument("--rates", metavar="FILE", help="a rates file, not the bundled rates.json")
    verbs = parser.add_subparsers(dest="verb", required=True,
                                  metavar="{pool,submit,plan,runs,cost,dashboard,modal}")
    pool = verbs.add_parser("pool", help="create, scale, inspect and delete pools").add_subparsers(
        dest="pool_verb", required=True,
        metavar="{create,scale,status,list,delete,cost,redrive,logs}")
    p = verb(pool, "create", cmd_pool_create, help="create a pool: queue + dead-letter queue, pool "
             "record, handler snapshot, local workers")
    p.add_argument("--model", required=True, help="the model name: the pool's identity")
    p.add_argument("--handler", required=True,
                   help="path/to/handler.py:ClassName (snapshotted into the store)")
    p.add_argument("--workers", type=int, help="local warmd.py processes to start under a "
                   f"supervisor, waited for until warm (default {LOCAL_WORKERS_DEFAULT})")
    p.add_argument("--min-workers", type=int, metavar="A",
                   help="floor of a pool that sizes itself on its backlog")
    p.add_argument("--max-workers", type=int, metavar="B",
                   help="its ceiling (with no floor given: floor 0)")
    p.add_argument("--scale-to-zero-after", type=float, metavar="MINUTES",
                   help="idle window (fractions allowed) before the pool shrinks to its floor "
                        f"(0 unless given); default {SCALE_IDLE_MINUTES:g} with a floor below "
                        "the ceiling")
    local_options(p)
    p.add_argument("--batch-size", type=int,
                   help="items per handler.batch() call (default CALQUE_BATCH_SIZE)")
    p.add_argument("--include", action="append", metavar="PATH",
                   help="a file or folder the handler needs beside it, snapshotted with it "
                        "(modules, data)")
    p.add_argument("--visibility-timeout", type=int,
                   help="seconds a claim stays invisible; the heartbeat renews it")
    p.add_argument("--max-deliveries", type=int,
                   help="deliveries before a claim goes to the dead-letter queue")
    p.add_argument("--batch-timeout", type=float, metavar="SECONDS",
                   help="seconds one handler.batch() call may run before the worker gives up on it "
                        "(default: the workers' CALQUE_BATCH_TIMEOUT)")
    modal_flags = p.add_argument_group("a Modal app handler (docs/modal.md)")
    modal_flags.add_argument("--param", action="append", metavar="KEY=VALUE",
                             help="a modal.parameter() of the class")
    modal_flags.add_argument("--secret", action="append", metavar="NAME=FILE",
                             help="the KEY=value file modal.Secret.from_name(NAME) reads")
    modal_flags.add_argument("--volume", action="append", metavar="NAME=PATH",
                             help="the folder modal.Volume.from_name(NAME) is, linked at its "
                                  "mount path")
    ec2 = p.add_argument_group("EC2 cohort (s3:// store)")
    ec2.add_argument("--instances", type=int,
                     help="run the pool on N EC2 instances of an Auto Scaling group")
    ec2.add_argument("--instance-type",
                     help="EC2 instance type, e.g. g5.xlarge (required with --instances)")
    ec2.add_argument("--ami", help="AMI id (default: the current deep-learning GPU AMI, from its "
                                   "public SSM parameter)")
    switch(ec2, "--spot", "spot capacity: cheaper, may be interrupted at 2 minutes' notice")
    ec2.add_argument("--read", action="append", metavar="S3_PREFIX",
                     help="an s3:// prefix its runs read by reference: its instance role may read it (a run "
                          "naming another grants it then); repeat for several")
    ec2.add_argument("--min-instances", type=int, help="floor the group keeps (default: "
                     "--instances; 0 with --scale-to-zero-after or --max-instances)")
    ec2.add_argument("--max-instances", type=int,
                     help="ceiling of a group that sizes itself on its backlog")
    ec2.add_argument("--subnet", help="subnet id(s), comma-separated (default: the default VPC's)")
    add(ec2, "--key-name", "--yes-spend-money")
    switch(ec2, "--dry-run", "print every AWS call that would change something; change nothing")
    p = verb(pool, "deploy", cmd_pool_deploy, "--model",
             help="change a live pool's handler: waits for the runs in flight, then replaces its "
                  "workers")
    p.add_argument("--handler", required=True, help="path/to/handler.py:ClassName, the new version")
    p.add_argument("--batch-size", type=int,
                   help="items per handler.batch() call (default: the pool's)")
    p.add_argument("--include", action="append", metavar="PATH",
                   help="a file or folder the handler needs beside it, snapshotted with it")
    switch(p, "--no-wait", "return once the workers start, not when warm")
    p = verb(pool, "scale", cmd_pool_scale, "--model",
             help="set the number of local workers, or of EC2 instances")
    p.add_argument("--workers", type=int, help="local warmd.py processes on this machine")
    p.add_argument("--instances", type=int, help="EC2 instances of the pool's Auto Scaling group")
    for noun in ("workers", "instances"):
        p.add_argument(f"--min-{noun}", type=int, metavar="A",
                       help=f"new floor of a pool that sizes itself ({noun})")
        p.add_argument(f"--max-{noun}", type=int, metavar="B", help="its new ceiling")
    p.add_argument("--scale-to-zero-after", type=float, metavar="MINUTES",
                   help="local: its new idle window")
    local_options(p)
    add(p, "--yes-spend-money")
    switch(p, "--dry-run", "print the AWS calls; change nothing")
    verb(pool, "status", cmd_pool_status, "--model", "--json",
         help="queue depths, live workers, per-worker claims, warm hits, enter_count")
    verb(pool, "list", cmd_pool_list, "--json", help="the pools in this store")
    p = verb(pool, "delete", cmd_pool_delete, "--model",
             help="stop local workers, delete the queues and the pool record")
    switch(p, "--yes", "do not ask for confirmation")
    switch(p, "--force", "delete even with claims still queued or in flight (they are lost)")
    switch(p, "--dry-run", "EC2 pools: print the AWS calls; change nothing")
    p = verb(pool, "cost", cmd_pool_cost, "--model", cost=True,
             help="what the pool paid, idle included, against cold starts")
    p.add_argument("--since", metavar="T",
                   help="only from this ISO-8601 time on (e.g. 2026-11-29T10:00:00Z)")
    add(p, "--json")
    verb(pool, "redrive", cmd_pool_redrive, "--model",
         help="send the dead-lettered claims of every run of the pool back to its queue")
    p = verb(pool, "logs", cmd_pool_logs, "--model",
             help="the pool's worker logs on this machine (EC2: where they are)")
    switch(p, "--follow", "keep printing what the workers write (Ctrl-C stops)")
    p.add_argument("--worker", type=int, metavar="W", help="only worker slot W")

    p = verb(verbs, "submit", cmd_submit, cost=True, help="run items: against a warm pool (--pool) "
             "or as a cold fresh acquisition (--model)")
    p.add_argument("items", help="a JSONL file (one JSON item per line), - for stdin, a .npy/.npz "
                   "file of numeric items, or a Parquet/.arrow/.feather file, folder or quoted "
                   "glob (one item a row)")
    p.add_argument("--columns", metavar="A,B", help="Parquet/Arrow input: read only these columns")
    p.add_argument("--pool", metavar="M", help="submit claims to the warm pool of model M")
    p.add_argument("--model", help="cold run: the model whose handler to use (the pool record's, "
                                   "or --handler)")
    p.add_argument("--handler",
                   help="cold run: path/to/handler.py:ClassName instead of a pool's handler")
    p.add_argument("--shards", type=int, default=1,
                   help="cold run: fresh workers to start (default 1)")
    p.add_argument("--batch-size", type=int, help="cold run: items per handler.batch() call")
    p.add_argument("--claim-size", type=int,
                   help="items per claim (default CALQUE_CLAIM_SIZE; cold: items/shards)")
    add(p, "--timeout")
    switch(p, "--no-wait", "print the run id and return at once")
    switch(p, "--wait-for-workers",
           "queue the run even when the pool has no live worker (else: exit 2 at once)")
    p.add_argument("--id-field", metavar="FIELD",
                   help="copy this item field into each item's result line")
    switch(p, "--follow-logs", "print what the pool's workers print during the run (on stderr)")
    planned = p.add_argument_group("a planned pool run (calque plan)")
    switch(planned, "--plan", "print the plan and ask before running it")
    switch(planned, "--yes", "run at the plan without asking")
    planned.add_argument("--deadline", metavar="DURATION",
                         help="run at the fewest workers that finish within it (45m, 2h)")
    planned.add_argument("--budget", type=float, metavar="USD",
                         help="run at the fewest workers that cost at most this")
    cold_ec2 = p.add_argument_group(
        "cold run on EC2 (s3:// store; --instance-type and --spot above pick the instances)")
    cold_ec2.add_argument("--ami",
                          help="the AMI of the one-shot instances (required for a cold run on EC2)")
    cold_ec2.add_argument("--subnet", help="subnet id (default: the default VPC's)")
    add(cold_ec2, "--key-name", "--yes-spend-money")
    switch(cold_ec2, "--dry-run", "print the AWS calls; change nothing")
    add(p, "--json")

    p = verb(verbs, "plan", cmd_plan, cost=True,
             help="a pool run's wall time and cost for 1..B workers, before it starts")
    p.add_argument("items", help="the JSONL (or .npy/.npz) file submit would take")
    p.add_argument("--pool", metavar="M", required=True, help="the pool of model M")
    p.add_argument("--claim-size", type=int, help="items per claim (default CALQUE_CLAIM_SIZE)")
    add(p, "--json")

    runs = verbs.add_parser("runs", help="read runs (list, show, results, report); resume, cancel, "
                            "redrive, delete, prune them")
    runs = runs.add_subparsers(
        dest="runs_verb", required=True,
        metavar="{list,show,results,resume,cancel,redrive,report,delete,prune}")
    p = verb(runs, "list", cmd_runs_list, "--json", help="every run in the store, oldest first")
    p.add_argument("--model", help="only this model's runs")
    verb(runs, "show", cmd_runs_show, "run", "--json",
         help="a run's claims: worker, warm hit, @enter paid, items, seconds")
    p = verb(runs, "results", cmd_runs_results, "run",
             help="a run's results in item order: JSONL, Parquet or .npy")
    switch(p, "--failed", "only the failed items (with their last traceback frames)")
    switch(p, "--follow", "wait for the claims, printing each one's results as it ends")
    p.add_argument("--format", choices=("jsonl", "parquet", "npy"),
                   help="jsonl (default; arrays as lists, bytes as {\"$bytes\": base64}), parquet (a table: "
                        "i, ok, error, result columns) or npy (one result array, stacked)")
    p.add_argument("--output", metavar="PATH", help="write the results there (default: stdout)")
    p.add_argument("--files", metavar="DIR",
                   help="write each item's bytes (the result, or --field) as a file in DIR, named by id or index")
    p.add_argument("--field",
                   help="npy: the result's key to stack (default: the result, or its only array); "
                        "--files: the key holding the bytes")
    p.add_argument("--fill", type=float,
                   help="npy: the row of a failed item (default NaN, for a float dtype)")
    p = verb(runs, "resume", cmd_runs_resume, "run", "--timeout", cost=True,
             help="send the claims an interrupted submit did not, and those in no queue, then wait")
    switch(p, "--no-wait", "return once the claims are sent")
    add(p, "--json")
    verb(runs, "cancel", cmd_runs_cancel, "run",
         help="cancel a run: its claims without a summary will not run")
    verb(runs, "redrive", cmd_runs_redrive, "run",
         help="send a run's dead-lettered claims back to its pool's queue")
    p = verb(runs, "report", cmd_runs_report, "run", cost=True,
             help="a run's page as one self-contained HTML file")
    p.add_argument("--html", required=True, metavar="FILE", help="the file to write (no script)")
    p = verb(runs, "delete", cmd_runs_delete,
             help="delete runs from the store (inputs, results, summaries), saying what it freed")
    p.add_argument("run", nargs="+", help="run ids (see `runs list`; `latest`: the newest)")
    switch(p, "--force", "also a run with claims queued or running")
    p = verb(runs, "prune", cmd_runs_prune,
             help="delete the runs older than an age, but the newest --keep of each model")
    p.add_argument("--older-than", required=True, metavar="AGE", help="e.g. 7d, 12h, 30m")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="keep each model's N newest runs (default 0)")
    p.add_argument("--model", help="only this model's runs")
    switch(p, "--force", "also runs with claims queued or running")

    p = verb(verbs, "cost", cmd_cost, cost=True,
             help="a run's cost, its cold counterfactual and the crossover ladder")
    p.add_argument("run", nargs="+", help="one run for the details, several for a comparison table "
                                          "(`latest`: the newest)")
    add(p, "--json")
    p = verb(verbs, "dashboard", cmd_dashboard, cost=True,
             help="a read-only live web page of the store")
    p.add_argument("--port", type=int, default=8265, help="default 8265; 0: any free port")
    p.add_argument("--host", default="127.0.0.1", help="default loopback; another needs --token")
    p.add_argument("--token", help="a secret every request must carry (?token= once, or Bearer)")

    modal = verbs.add_parser("modal", help="run an unmodified Modal app on calque pools")
    modal = modal.add_subparsers(dest="modal_verb", required=True, metavar="{run}")
    p = verb(modal, "run", cmd_modal_run,
             help="run the app's @app.local_entrypoint() here; its .map/.remote/.spawn go to pools")
    p.add_argument("app", help="app.py or app.py::entrypoint")
    p.add_argument("--pool", help="a pool serving one of the app's targets (default: an "
                                  "ephemeral pool per target)")
    p.add_argument("--workers", type=int, default=LOCAL_WORKERS_DEFAULT,
                   help="local workers of each ephemeral pool")
    for flag, metavar in (("--volume", "NAME=PATH"), ("--secret", "NAME=FILE")):
        p.add_argument(flag, action="append", metavar=metavar,
                       help="as pool create's, for the ephemeral pools")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="the entrypoint's own options (--name value)")
    return parser


KIT_PACKAGES = ("numpy", "torch", "tqdm", "boto3", "orjson")   # what the CLI and its workers import


def kit_python(argv, script):
    """Make sure this interpreter has the kit's packages; one missing, re-run the command under the
    kit's .venv (os.execv) if there is one, else a UserError. Already under it (sys.prefix): no loop."""
    missing = [name for name in KIT_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    venv = os.path.join(HERE, ".venv", "bin", "python")
    in_venv = os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(HERE, ".venv"))
    if os.path.exists(venv) and not in_venv:
        os.execv(venv, [venv, script, *argv])
    raise UserError(f"this Python ({sys.executable}) lacks the package {missing[0]!r} ---> HINT: run `make setup` in "
                    f"{HERE}, then use {venv} (or `pip install -e {HERE}` into this Python's environment)")


def main(argv=None):
    conf = {"CALQUE_STORE": "?"}
    backend = None
    try:
        if argv is None:   # a command line, not a call: check the interpreter before anything else
            kit_python(sys.argv[1:], os.path.abspath(__file__))
        args = build_parser().parse_args(argv)
        conf = settings()
        backend = open_backend(conf["CALQUE_STORE"])
        if isinstance(getattr(args, "run", None), (str, list)):   # `runs show latest`: the store's newest run
            args.run = latest_runs(backend, args.run)
        return args.func(conf, backend, args)
    except UserError as e:
        print(f"calque: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (StoreFault, WorkersFailed, ModalEntrypointFailed, ResultsIncomplete) as e:
        print(f"calque: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # the reader went away (`runs results RUN | head`): stop quietly; stdout to /dev/null, so
        # that the interpreter's flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except sqlite3.Error as e:   # the embedded queue: its file unwritable, full or damaged
        print(f"calque: error: the local queue in {conf['CALQUE_STORE']} failed ({e}) ---> HINT: "
              "check that the folder is writable and has free space, then retry", file=sys.stderr)
        return EXIT_FAILED
    except NotFound as e:   # something the pool record names is gone (a queue deleted by hand, say)
        region = getattr(backend, "region", None)
        if region:   # on AWS, usually: the pool's queues are in another region
            print(f"calque: error: {e} not found in region {region} ({conf['CALQUE_STORE']}) ---> HINT: if the pool "
                  f"was created in another region, set AWS_REGION (or the profile's region in ~/.aws/config) to it; "
                  f"else recreate the pool (pool create is idempotent) or delete it", file=sys.stderr)
        else:
            print(f"calque: error: {e} not found in {conf['CALQUE_STORE']}: recreate the pool "
                  "(pool create is idempotent) or delete it", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # steps that leave work behind say what they left; this is any other moment (safe to rerun)
        print(f"calque: interrupted ---> HINT: run the command again; `{command()} runs list` "
              "shows the runs already queued", file=sys.stderr)
        return 130
    except OSError as e:
        if e.filename is None:
            raise   # not the file system: a bug, whose traceback is the report
        print(f"calque: error: {e.filename}: {e.strerror} ---> HINT: check its permissions and free space, then retry",
              file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:
        if type(e).__module__.startswith("botocore"):   # AWS refused or is unreachable: one line
            print(f"calque: error: AWS: {aws_error_line(e)}: check credentials, permissions "
                  "(docs/aws.md) and region", file=sys.stderr)
            return EXIT_FAILED
        raise   # anything else is a bug: the traceback is the report


if __name__ == "__main__":
    sys.exit(main())
