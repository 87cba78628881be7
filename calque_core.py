"""calque's ground floor: what every role stands on, importing none of them (docs/contract.md).
The handler API; 1. settings, errors and paths; 2. the contract: names, store keys, message,
summary, result parts, handler loading; 3. the store and queue backends; 4. the records. Each
section uses only those above it. calque.py, warmd.py, the fleets and the dashboard import it."""
import argparse, ast, base64, contextlib, datetime, difflib, enum, fcntl, functools, gzip, hashlib
import importlib.util, inspect, io, json, math, os, re, secrets, shutil, sqlite3, struct, tarfile
import itertools, posixpath, threading, time, traceback, typing, uuid, zipfile, sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import calque_values


try:
    import orjson   # submit's check of JSONL lines (checked_json); a worker's result lines
except ImportError:   # a Python without the kit's packages: main() re-runs under the .venv
    orjson = None


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
QUEUE_PROTOCOL_TRIES = 3                # tries of a local queue statement SQLite gave up on (~10 s each): see
                                        # PatientConnection
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
PLAN_GAP_MAX = 2.0                      # s between two claims of a worker past which it idled
VERSION_CHECK = 30.0                    # s between two reads of the pool record by an idle worker
                                        # (deployed elsewhere: it restarts on it, EXIT_REPLACED)
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
    env_file = os.environ.get("CALQUE_ENV", ENV_FILE)
    merged = dict(DEFAULTS, **read_env_file(env_file, env_file))
    return dict(merged, **{key: os.environ[key] for key in DEFAULTS if key in os.environ})


def read_env_file(path, where):
    """The KEY=value lines of pool.env or a --secret file; none where it is absent (an EC2 pool's
    env has a secret's)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}) ---> HINT: fix it, or name another file")
    return dict(filter(None, (env_line(line, f"{where}:{n}") for n, line in text_lines(data, path))))


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


def state_dir(conf, model):
    """This machine's folder of a pool: its supervisor's state and its workers' logs and spools."""
    return os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "pools", slug(model))


# ------------------------------------------------------------------------------------------------
# 2. THE CONTRACT: names, store keys, message, summary, result parts, handler loading, numeric
# views, AWS errors. warmd.py imports these; change them with care (docs/contract.md).
POOL_PREFIX, DLQ_PREFIX = "calque-pool-", "calque-dlq-"
RUN_QUEUE_PREFIX, RUN_DLQ_PREFIX = "calque-run-", "calque-rundlq-"
QUEUE_NAME_MAX = 80                     # SQS's limit on a queue name
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # run and claim ids: safe path parts


def slug(model, prefix=POOL_PREFIX):
    """The queue-safe form of a model name, cut so that prefix + slug fits in 80 characters."""
    s = re.sub(r"[^a-z0-9_]+", "-", model.lower()).strip("-")   # a run of others: one '-'
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


def volume_key(name):
    """The store prefix of modal.Volume.from_name(name): its files are the keys below it."""
    return f"volumes/{slug(name)}/"


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
    runs = (list(run) for _, run in itertools.groupby(enumerate(rows), lambda at: at[1] - at[0]))
    return [[run[0][1], run[-1][1] + 1] for run in runs]   # a run: rows one apart


def npy_bytes(array):
    """An array as .npy bytes, C-ordered and without pickle (npy_view reads them back)."""
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
            z.writestr(f"b{k}.npy", npy_bytes(stacked))
            if not uniform:
                shapes = np.array([a.shape for a in arrays], dtype=np.int64)
                z.writestr(f"b{k}.shapes.npy", npy_bytes(shapes))
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
        import numpy as np   # each kept row's values: its size repeated in a mask
        flat = self.values[np.repeat(keep, self.shapes.prod(axis=1))]
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
    optional = {"version": version, "resume": bool(resume)}
    return json.dumps({"run_id": run_id, "model": model, "manifest_uri": manifest_uri,
                       "claim": claim, **{key: value for key, value in optional.items() if value}})


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
    status = ("failed" if error is not None or failed and len(failed) == items
              else "partial" if failed else "ok")
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
    {"start": index, "values": [...]} (in the typed encoding: calque_values, classes `allowed`),
    the first at once, then every STREAM_FLUSH s."""

    def __init__(self, streams, stream, allowed):
        ok = streams and isinstance(stream, str) and re.fullmatch(r"[0-9a-f]{32}", stream)
        self.store = streams[0] if ok else None
        self.prefix = stream_prefix(streams[1], stream) if ok else None
        self.sent, self.at, self.timer, self.lock = 0, -STREAM_FLUSH, None, threading.Lock()
        self.allowed = allowed

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
            chunk["values"] = calque_values.encode_result(chunk["values"], self.allowed)
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


def load_handler(path, cls, modal=None, container=False, streams=None):
    """(instance, enter, batch, collate or None) of the handler class in a file; a Modal app file
    gives a ModalHandler (`modal`: the pool's modal options; `container`: in a worker; `streams`:
    ModalHandler's)."""
    with open(path, "rb") as f:
        if imports_modal(f.read(), path):
            os.environ.update((modal or {}).get("image", {}).get("env", {}))   # before the app runs
            _, target, method = import_modal_app(path, cls, container)
            handler = ModalHandler(target, method, modal or {}, streams)
            return handler, handler.enter, handler.batch, handler.collate
    module = import_file(path, "calque_handler_" + re.sub(r"\W", "_", os.path.basename(path)[:-3]))
    obj = getattr(module, cls)()
    methods = {role: getattr(obj, attr) for attr in dir(type(obj))
               if (role := getattr(getattr(type(obj), attr), "_calque_role", None))}
    missing = [f"@calque.{r}" for r in ("enter", "batch") if r not in methods]
    if missing:
        raise UserError(f"handler {path}:{cls} lacks {' and '.join(missing)} (its own or a base class's)")
    return obj, methods["enter"], methods["batch"], getattr(obj, "collate", None)


# ------------------------------------------------------------------------------------------------
# Modal app files as handlers: the stand-in `modal` (modal_shim/modal.py) records what the
# decorators declare; ModalHandler gives it a handler's shape (docs/modal.md).
MODAL_CALL_KEY = "__modal_call__"    # a `modal run` call's item: {key: [args, kwargs(, stream)]},
                                     # typed (calque_values) where JSON could not say them
STREAM_FLUSH = 0.5                   # s between two chunks of a .remote_gen call's items (Streamed)
VOLUME_INDEX_SAVE = 1.0              # s between two saves of a volume copy's index while it
                                     # fetches: one killed -9 fetches again only what came after
# a Modal gpu= card as rates.json's cards ("any": the cards Modal's "any" picks from)
MODAL_GPU_ALIASES = {"A100": ("A100-40GB",), "A100-40G": ("A100-40GB",), "A100-80G": ("A100-80GB",),
                     "ANY": ("T4", "L4", "A10G")}


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


def web_endpoint(path, name, web):
    """The one line refusing a web endpoint as a pool's handler or `modal run`'s target."""
    return UserError(f"{path}:{name}: {name} is a @modal.{web} web endpoint: a calque pool serves "
                     f"batch claims, not HTTP ---> HINT: name a plain @app.function or "
                     f"@modal.method")


def import_modal_app(path, name, container=False, module=None):
    """(shim, registered object, method name or None) of `name` in a Modal app file (`module`:
    the file as imported already, by modal run: its module-level code runs once, as Modal's)."""
    shim, module = (load_modal_shim(), module) if module else import_modal_file(path, container)
    top, _, method = name.partition(".")
    target = getattr(module, top, None)
    if isinstance(target, shim.Function):
        web = getattr(target.raw_f, "_modal_role", {}).get("web")
        if web:
            raise web_endpoint(path, top, web)
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


class StoredVolume:
    """modal.Volume.from_name(name) as calque keeps it: the keys under `prefix` of `store`, and
    `folder`, what a mount links to: on a local store the prefix's own folder; on s3:// (`cached`)
    this machine's copy, which its workers share: sync() fills it, commit() uploads it, under one
    lock (beside it: .lock; .json, the index: key -> [size, mtime ns, ETag] at the last sync;
    .part, the object being fetched)."""

    def __init__(self, name, store, prefix, folder, cached=False):
        self.name, self.store, self.prefix, self.folder = name, store, prefix, folder
        self.cached = cached

    @staticmethod
    def _key(path):
        """A volume path ("/", "/a/b.txt", "a/b.txt") as a key under the prefix ("", "a/b.txt")."""
        return posixpath.normpath("/" + str(path)).lstrip("/")

    def _files(self, key):
        """[(suffix, size, mtime s)] of the file `key` names (suffix "") or of the files under it
        ("/name"); FileNotFoundError where there is neither."""
        under = [("/" + k, size, mtime) for k, size, _, mtime in
                 self.store.walk(self.prefix + key + "/" if key else self.prefix, dated=True)]
        if under or not key:
            return under
        found = [(k, size, mtime) for k, size, _, mtime in
                 self.store.walk(self.prefix + key, dated=True) if k == ""]
        if not found:
            raise FileNotFoundError(f"volume {self.name}: no file or folder {key}")
        return found

    def entries(self, path, recursive):
        """(path, is a folder, mtime s, size) of the file `path` names or of what is in the folder,
        `recursive`ly or one level down; the folders are those its keys imply."""
        key, out = self._key(path), {}
        base = key + "/" if key else ""
        for suffix, size, mtime in self._files(key):
            if not suffix:   # the file `path` names
                return [(key, False, mtime, size)]
            parts = suffix[1:].split("/")
            for cut in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = base + "/".join(parts[:cut])
                out[folder] = (folder, True, max(mtime, out.get(folder, (0, 0, 0))[2]), 0)
            if recursive or len(parts) == 1:
                out[base + suffix[1:]] = (base + suffix[1:], False, mtime, size)
        return sorted(out.values())

    def read(self, path):
        try:
            return self.store.get(self.prefix + self._key(path))
        except NotFound:
            raise FileNotFoundError(f"volume {self.name}: no file {self._key(path)}") from None

    def _tree(self, key, recursive, call):
        """_files(key), where it is a folder only if `recursive`, as Modal's `call` refuses it."""
        files = self._files(key)
        if files and files[0][0] and not recursive:
            raise IsADirectoryError(f"volume {self.name}: {key or '/'} is a folder ---> HINT: "
                                    f"{call}(..., recursive=True)")
        return files

    def remove(self, path, recursive=False):
        key = self._key(path)
        files = self._tree(key, recursive, "remove_file")
        if files and files[0][0]:
            self.store.delete_prefix(self.prefix + key + "/" if key else self.prefix)
        elif files:
            self.store.delete(self.prefix + key)

    def copy(self, sources, destination, recursive=False):
        """As cp (-r: `recursive`): into `destination` where it is a folder (or several are
        copied), else as it."""
        target = self._key(destination)
        into = len(sources) > 1 or not target or any(s for s, *_ in self._files_or_none(target))
        for source in sources:
            key = self._key(source)
            place = posixpath.join(target, posixpath.basename(key)) if into else target
            for suffix, *_ in self._tree(key, recursive, "copy_files"):
                data = self.store.get(self.prefix + key + suffix)
                self.store.put(self.prefix + place + suffix, data)

    def _files_or_none(self, key):
        with contextlib.suppress(FileNotFoundError):
            return self._files(key)
        return []

    def upload(self, files, force=False):
        """batch_upload's files, {volume path: local path or readable file}; without `force` one
        that exists refuses them all (FileExistsError), as Modal's."""
        keys = {self._key(path): source for path, source in files.items()}
        taken = [] if force else [k for k in keys if self._files_or_none(k)]
        if taken:
            raise FileExistsError(f"volume {self.name}: {taken[0]} exists ---> HINT: "
                                  f"batch_upload(force=True) overwrites")
        for key, source in keys.items():
            data = source.read() if hasattr(source, "read") else open(source, "rb").read()
            self.store.put(self.prefix + key, data)

    @contextlib.contextmanager
    def _locked(self):
        """The machine's copy to change, its index: one process at a time (the others wait)."""
        os.makedirs(self.folder, exist_ok=True)
        with open(self.folder + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self.folder + ".json") as f:
                    index = json.load(f)
            except FileNotFoundError:
                index = {}
            try:
                yield index
            finally:
                self._save(index)

    def _save(self, index):
        write_file_atomic(self.folder + ".json", json.dumps(index))

    def _seen(self, key):
        with contextlib.suppress(FileNotFoundError):
            seen = os.stat(os.path.join(self.folder, key))
            return [seen.st_size, seen.st_mtime_ns]

    def sync(self):
        """Bring the machine's copy up to the prefix (Modal's reload): fetch what is new or changed
        there, drop what was removed there; a file changed here and not committed stays. Returns
        the bytes fetched."""
        fetched = 0
        if not self.cached:
            return fetched
        with self._locked() as index:
            listed = {key: etag for key, _, etag in self.store.walk(self.prefix)}
            saved = time.monotonic()
            for key, etag in listed.items():
                entry = index.get(key)
                if entry is None or entry[2] != etag and self._seen(key) == entry[:2]:
                    data = self.store.get(self.prefix + key)
                    path = os.path.join(self.folder, key)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(self.folder + ".part", "wb") as f:   # beside the copy: a kill
                        f.write(data)                                # leaves no part in it
                    os.replace(f.name, path)
                    index[key], fetched = self._seen(key) + [etag], fetched + len(data)
                    if time.monotonic() - saved > VOLUME_INDEX_SAVE:
                        self._save(index)
                        saved = time.monotonic()
            for key in set(index) - set(listed):
                if self._seen(key) == index[key][:2]:
                    os.remove(os.path.join(self.folder, key))
                if self._seen(key) is None:
                    del index[key]
        return fetched

    def commit(self):
        """Upload what changed in the machine's copy since the last sync and delete from the prefix
        what was removed here, then sync, as Modal's commit."""
        if not self.cached:
            return
        with self._locked() as index:
            here = {os.path.relpath(os.path.join(d, f), self.folder)
                    for d, _, files in os.walk(self.folder) for f in files}
            for key in here:
                seen = self._seen(key)
                if seen and index.get(key, [None, None])[:2] != seen:
                    with open(os.path.join(self.folder, key), "rb") as f:
                        index[key] = seen + [self.store.put(self.prefix + key, f.read())]
            for key in set(index) - here:
                self.store.delete(self.prefix + key)
                del index[key]
        self.sync()


def open_volume(conf, store, name, folder=None, cached=True):
    """Volume `name` where it lives: the --volume `folder` given, else the store's prefix
    volume_key(name), mounted from this machine's copy on s3:// (`cached`: CALQUE_STATE/volumes)."""
    if folder:
        return StoredVolume(name, LocalStore(folder, Requests()), "", folder)
    key = volume_key(name)
    where = store.uri(key)
    if where.startswith("file://"):   # the local store: the prefix is a folder
        return StoredVolume(name, store, key, os.path.normpath(where[len("file://"):]))
    root = hashlib.sha256(store.uri("").encode()).hexdigest()[:12]   # one copy per store
    place = os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "volumes", root, slug(name))
    return StoredVolume(name, store, key, place, cached)


def mount_volume(mount, folder, name):
    """Make the app's volume mount path (/data) show `folder`: a symlink where nothing is, or a
    folder holding no file was (made by an import of the app elsewhere: pool create's, `modal
    run`'s, setting HF_HUB_CACHE in it)."""
    if os.path.exists(mount) and os.path.samefile(mount, folder):
        return
    if os.path.isdir(mount) and not os.path.islink(mount) and not any(
            files for _, _, files in os.walk(mount)):
        for inner, _, _ in os.walk(mount, topdown=False):
            with contextlib.suppress(OSError):   # a link to a folder in it: refused below
                os.rmdir(inner)
    try:
        os.makedirs(os.path.dirname(mount), exist_ok=True)
        os.symlink(folder, mount)
    except FileExistsError:
        if os.path.exists(mount) and os.path.samefile(mount, folder):   # another worker's link
            return
        what = f"is a link to {os.readlink(mount)}" if os.path.islink(mount) else "holds files"
        raise UserError(f"volume {name}: its mount {mount} exists and {what} "
                        f"---> HINT: move it away, or make it the volume: --volume {name}={mount}")
    except OSError as e:
        raise UserError(f"volume {name}: cannot link {mount} to {folder} ({e.strerror}) ---> "
                        f"HINT: sudo ln -s {folder} {mount} on the worker machine")


def unlink_volumes(links):
    """Remove the links an ephemeral pool's workers made at its volumes' mounts ({mount: [folder,
    a folder was there]}), where they still point at that folder; a folder a link replaced is
    made again."""
    for mount, (folder, was_folder) in links.items():
        if os.path.islink(mount) and os.readlink(mount) == folder:
            os.remove(mount)
            if was_folder:
                os.mkdir(mount)


def serve_volumes(conf, store, mounts=None, folders=None):
    """Give the stand-in modal its volumes (the Volume methods), and mount `mounts` (a pool
    record's {path: {"name", "folder"?}}), each filled first: in a worker, before its app is
    imported, as Modal mounts. `folders`: `modal run --volume`'s."""
    opened, folders = {}, folders or {}
    for mount, spec in (mounts or {}).items():
        volume = opened[spec["name"]] = open_volume(conf, store, spec["name"], spec.get("folder"))
        try:
            os.makedirs(volume.folder, exist_ok=True)
        except OSError as e:   # a --volume NAME=PATH this machine cannot make
            raise UserError(f"volume {volume.name}: cannot make its folder {volume.folder} "
                            f"({e.strerror}) ---> HINT: --volume {volume.name}=PATH naming a "
                            "folder the workers can write") from None
        fetched = volume.sync()
        if fetched:
            print(f"calque: volume {volume.name}: {size_text(fetched)} fetched into "
                  f"{volume.folder}", file=sys.stderr)
        mount_volume(mount, volume.folder, volume.name)
    load_modal_shim().volume = lambda name: opened.get(name) or open_volume(
        conf, store, name, folders.get(name), cached=False)


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
    def __init__(self, target, method, options, streams=None):
        self.target, self.method, self.options = target, method, options
        self.streams = streams   # (store, model) in a pool worker: where .remote_gen calls' items go (Streamed)
        self.instance, self.replay, self.loop = None, {}, None
        self.raw = target.user_cls if method else target.raw_f
        app_file = os.path.realpath(sys.modules[self.raw.__module__].__file__)
        self.folder = os.path.join(os.path.dirname(app_file), "")
        self.allowed = calque_values.app_modules(self.folder)   # classes rebuilt: the app's, stdlib

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
            try:
                for k in range(0, len(payloads), size):   # a list per parameter, as Modal's
                    columns = zip(*(self._args(item)[0] for item in payloads[k:k + size]))
                    out += self._call([list(c) for c in columns], {})
            except Exception as e:   # warmd retries item by item: each item's line says where
                self._outcome(payloads[0], False, e)
                raise
            if len(out) != len(payloads):   # warmd names the count
                return out
            return [self._out(p, v) for p, v in zip(payloads, out)]
        if len(payloads) == 1 and id(payloads[0]) in self.replay:   # warmd retrying one item
            ok, value = self.replay.pop(id(payloads[0]))
            if ok:
                return [value]
            raise value
        outcomes = [self._outcome(p, *one) for p, one in zip(payloads, self._each(payloads))]
        if all(ok for ok, _ in outcomes):
            return [value for _, value in outcomes]
        if len(payloads) > 1:   # warmd retries a failed batch item by item: replay, not a 2nd call
            self.replay = {id(p): outcome for p, outcome in zip(payloads, outcomes)}
        raise next(value for ok, value in outcomes if not ok)

    def _args(self, item):
        """(args, kwargs) of an item: a `modal run` call's own, else the item (a list splatted)."""
        if isinstance(item, dict) and len(item) == 1 and MODAL_CALL_KEY in item:
            args, kwargs, *stream = calque_values.decode_result(item[MODAL_CALL_KEY], self.allowed)
            return args, kwargs, *stream[:1]
        required = [p for p in inspect.signature(self.fn).parameters.values() if p.default is p.empty]
        return (item if len(required) > 1 and isinstance(item, list) else [item]), {}

    def _out(self, item, value):
        """A `modal run` call's result in the typed encoding (calque.ModalRun decodes it); a
        submitted item's as before (plain JSON, a tuple as a list)."""
        if calque_values.plain(value) or not (isinstance(item, dict) and MODAL_CALL_KEY in item):
            return value   # plain JSON (checked first: a call less) or a submitted item's
        return calque_values.encode_result(value, self.allowed)

    def _outcome(self, item, ok, value):
        """(ok, result) of one item's call, its result encoded (a value that does not travel fails
        the item); a `modal run` call's exception gets `calque_raised`: itself, typed, and the
        app's innermost frame, which `modal run` names (warmd puts it in the result line)."""
        if ok:
            try:
                return True, self._out(item, value)
            except calque_values.Refused as e:
                return False, TypeError(f"its result: {e}")
        if isinstance(item, dict) and MODAL_CALL_KEY in item:
            frames = [f for f in traceback.extract_tb(value.__traceback__)
                      if os.path.realpath(f.filename).startswith(self.folder)]
            frames = [f for f in frames if not kit_file(f.filename)]
            value.calque_raised = raised = {}
            if frames:
                at = frames[-1]
                raised["where"] = f"{os.path.basename(at.filename)}:{at.lineno} in {at.name}"
            with contextlib.suppress(calque_values.Refused):   # then its type and message only
                raised["exception"] = calque_values.Encoder(self.allowed, True).encode(value)
        return False, value

    def _call(self, args, kwargs, stream=None):
        out = self._run(self.fn(*args, **kwargs))   # an async @modal.batched's awaited
        if not hasattr(out, "__next__"):
            return out
        items = Streamed(self.streams, stream, self.allowed)
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
                        stream = call[2] if len(call) > 2 else None
                        items = Streamed(self.streams, stream, self.allowed)
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


def cli_error(error, prog, aws_hint, *failed):
    """A command's exit status for `error`, said in one line: a UserError exits 2; one of `failed`
    or AWS refusing (`aws_hint`: what to check) exits 1. Anything else is a bug: raised again,
    its traceback the report."""
    usage = isinstance(error, UserError)
    if usage or isinstance(error, failed):
        line = str(error)
    elif type(error).__module__.startswith("botocore"):
        line = f"AWS: {aws_error_line(error)}: {aws_hint}"
    else:
        raise error
    print(f"{prog}: error: {line}", file=sys.stderr)
    return EXIT_USAGE if usage else EXIT_FAILED


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
class Message(typing.NamedTuple):
    body: str
    receipt: str
    receive_count: int


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
        count in no tally until its tally block ends (a summary taken now counts its own)."""
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
        path = os.path.realpath(uri[len("file://"):])
        if not uri.startswith("file://") or not path.startswith(self.root + os.sep):
            return None
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _fault(self, doing, key, error):
        return StoreFault(f"store {self.root}: cannot {doing} {key} ({error.strerror or error}) "
                          f"---> HINT: check that the folder is writable and has free space, "
                          f"then retry")

    def get(self, key, size=None, mtime_ns=None):
        """The object's bytes. Read by reference (fetch), Changed unless it has the size and mtime
        (ns) that submit listed."""
        self.requests["store_gets"] += 1
        try:
            with open(self._path(key), "rb") as f:
                if size is not None:
                    unchanged(os.fstat(f.fileno()), size, mtime_ns)
                return f.read()
        except FileNotFoundError:
            raise NotFound(key)
        except OSError as e:
            raise self._fault("read", key, e) from None

    fetch = get

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

    def walk(self, prefix="", dated=False):
        """(key under `prefix`, size, mtime ns[, mtime s: `dated`]) of each file under it, or of
        the file it names (key ""), in key order, as S3Store.walk."""
        top = self._path(prefix)
        found = [("", top)] if os.path.isfile(top) else sorted(
            (os.path.relpath(os.path.join(d, f), top).replace(os.sep, "/"), os.path.join(d, f))
            for d, _, files in os.walk(top) for f in files if ".tmp-" not in f)
        for key, path in found:
            with contextlib.suppress(FileNotFoundError):   # removed meanwhile
                seen = os.stat(path)
                yield (key, seen.st_size, seen.st_mtime_ns) + (int(seen.st_mtime),) * dated

    def list(self, prefix, start_after=None):
        """Keys under a prefix, one level deep, in order; with `start_after`, only those that
        sort after it (as S3's StartAfter)."""
        self.requests["store_lists"] += 1
        folder, _, start = prefix.rpartition("/")   # a prefix may end inside a name, as S3's
        try:
            names = os.listdir(self._path(folder))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._fault("list", prefix, e) from None
        head = prefix[:len(prefix) - len(start)]
        keys = sorted(head + n for n in names if n.startswith(start) and ".tmp-" not in n
                      and head + n > (start_after or ""))
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

    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS queues ("
        "    name TEXT PRIMARY KEY, visibility_timeout REAL NOT NULL, created_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS messages ("
        "    id INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, body TEXT NOT NULL,"
        "    visible_at REAL NOT NULL, receive_count INTEGER NOT NULL DEFAULT 0, receipt TEXT, sent_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue, visible_at)")
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
        conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, factory=PatientConnection)  # autocommit
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")   # durable across process crashes, not power loss
        for statement in self.SCHEMA:
            conn.execute(statement)
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


class PatientConnection(sqlite3.Connection):
    """A connection that tries a statement again when SQLite gives up with SQLITE_PROTOCOL: in WAL mode a
    transaction's start that loses the lock race for ~10 s (a process stopped or starved while it holds a lock of
    the -shm index) raises it before changing anything, and SQLite's documentation calls it safe to retry."""

    def execute(self, *args):
        for tries_left in reversed(range(QUEUE_PROTOCOL_TRIES)):
            try:
                return super().execute(*args)
            except sqlite3.OperationalError as e:
                if e.sqlite_errorcode != sqlite3.SQLITE_PROTOCOL or not tries_left:
                    raise


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


def whole_answer(operation_model, response_dict, **_):
    """botocore reads an answer's body without checking its Content-Length: one cut short by a dropped
    connection parses as an empty answer (a LIST of nothing, an answer without its fields). Raised
    here as the dropped connection it is, so that endpoint_retried retries it."""
    import botocore.exceptions
    body, length = response_dict["body"], response_dict["headers"].get("content-length")
    if isinstance(body, bytes) and length and operation_model.http["method"] != "HEAD" and len(body) != int(length):
        raise botocore.exceptions.ConnectionClosedError(
            endpoint_url=f"{operation_model.name}'s answer, {len(body)} of its {length} bytes")


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
    def get(self, key, size=None, etag=None):
        """The object's bytes. Read by reference (fetch: If-Match its ETag), Changed unless it is
        the one submit listed; a refusal (403: the role cannot read it yet, IAM is eventually
        consistent) is a StoreFault, which lets the claim go and come back: no item fails."""
        self.requests["store_gets"] += 1
        match = {"IfMatch": etag} if etag is not None else {}
        try:
            found = self.s3.get_object(Bucket=self.bucket, Key=self._key(key), **match)
            data = found["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            raise NotFound(key)
        except Exception as e:
            code = _aws_error_code(e)
            if match and code in ("PreconditionFailed", "412"):
                raise Changed(f"its ETag is no longer {etag}") from None
            if match and code in ("AccessDenied", "403"):
                raise StoreFault(f"cannot read {self.uri(key)}: {aws_error_line(e)}") from None
            raise
        if size is not None and len(data) != size:
            raise Changed(f"size {size} -> {len(data)}")
        return data

    fetch = get

    def walk(self, prefix="", dated=False):
        """(key under `prefix`, size, ETag[, mtime s: `dated`]) of every object under it, in key
        order, a LIST page (1000 keys) at a time as they come: a prefix of any size is never held
        whole."""
        strip = len(self._key(prefix))
        for page in self._pages(Prefix=self._key(prefix)):
            for o in page.get("Contents", []):
                found = o["Key"][strip:], o["Size"], o["ETag"]
                yield found + (_epoch(o["LastModified"]),) * dated

    def _pages(self, **params):
        """The LIST pages of these list_objects_v2 parameters, each one request, read as needed."""
        while True:
            page = self._page(**params)
            yield page
            if not page.get("IsTruncated"):
                return
            params["ContinuationToken"] = page["NextContinuationToken"]

    @endpoint_retried
    def _page(self, **params):
        self.requests["store_lists"] += 1
        return self.s3.list_objects_v2(Bucket=self.bucket, **params)

    @endpoint_retried
    def put(self, key, data):
        """Write the object; its ETag."""
        self.requests["store_puts"] += 1
        return self.s3.put_object(Bucket=self.bucket, Key=self._key(key),
                                  Body=data if isinstance(data, bytes) else data.encode())["ETag"]

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

    def list(self, prefix, start_after=None):
        """Keys and folders one level under a prefix, as LocalStore.list."""
        keys = []
        more = {"StartAfter": self._key(start_after)} if start_after is not None else {}
        for page in self._pages(Prefix=self._key(prefix), Delimiter="/", **more):
            keys += [o["Key"] for o in page.get("Contents", [])]
            keys += [p["Prefix"].rstrip("/") for p in page.get("CommonPrefixes", [])]
        strip = len(self._key(""))
        self.keys_listed += len(keys)
        return sorted(k[strip:] for k in keys)

    @endpoint_retried
    def delete_prefix(self, prefix):
        """Delete every key under the prefix, a DeleteObjects a page; returns (objects, bytes)."""
        count = size = 0
        for page in self._pages(Prefix=self._key(prefix)):
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


def _epoch(modified):
    """An S3 listing's LastModified (text from the data session, else a datetime) in seconds."""
    if isinstance(modified, str):
        modified = datetime.datetime.fromisoformat(modified.replace("Z", "+00:00"))
    return int(modified.timestamp())


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
        self.session = boto3.session.Session()   # EC2, IAM...: pool create's and the fleet's
        self.session.events.register("before-parse", whole_answer)
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
        core.register("before-parse", whole_answer)
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
        except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError) as e:
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
    existed = check_slug_free(backend, model)
    if not backend.store.put_new(name_key(model), json.dumps({"model": model})):
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
    if (existing.get("model") or model) != model:
        raise slug_clash(model, existing["model"])
    return existing


def slug_clash(model, owner):
    """The error of a model whose slug (queue names, store folder) is another model's."""
    return UserError(f"model {model!r} shares its queue name {pool_queue_name(model)} with the pool "
                     f"of {owner!r} ---> HINT: use that exact name, or one that differs in more "
                     f"than case or punctuation")


# Modal's bounds of modal.Retries' fields (its docs): a value outside is refused at pool create
RETRY_BOUNDS = {"max_retries": (0, 10), "backoff_coefficient": (1.0, 10.0),
                "initial_delay": (0.0, 60.0), "max_delay": (1.0, 60.0)}


def retry_policy(max_retries, backoff_coefficient=2.0, initial_delay=1.0, max_delay=60.0):
    """A pool's retries of an item whose call raised, as Modal's modal.Retries (its defaults and
    bounds; retries=N is max_retries=N): retry r waits min(initial_delay * backoff_coefficient **
    (r - 1), max_delay) s (warmd's ClaimRun.retry)."""
    policy = {"max_retries": max_retries, "backoff_coefficient": backoff_coefficient,
              "initial_delay": initial_delay, "max_delay": max_delay}
    for key, (lo, hi) in RETRY_BOUNDS.items():
        value = policy[key]
        whole = key == "max_retries"
        if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
                or not lo <= value <= hi):
            raise UserError(f"retries: {key}={value!r}: must be {'a whole' if whole else 'a'} "
                            f"number from {lo:g} to {hi:g} (Modal's bounds)")
    return policy


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
    """Every run record in the store (only `model`'s when given: listed by its slug, as IAM lets
    a worker list the runs of the pools it calls), oldest first."""
    runs = []
    for folder in backend.store.list(f"runs/{slug(model)}." if model else "runs/"):
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
    sizes = (claim_items(run, k) for k in range(len(run["claims"])))
    return [[size, len(list(same))] for size, same in itertools.groupby(sizes)]


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


def read_summaries(backend, run_id, keys=None):
    """The run's summaries (those at `keys`) in key order: STORE_WRITERS GETs at a time on S3 (each
    waits on the network), one at a time locally (a read is CPU: threads would contend)."""
    keys = list_summaries(backend, run_id) if keys is None else keys
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
        import importlib.metadata
        try:   # its package metadata, else (a checkout) its pyproject.toml's
            version = importlib.metadata.version("calque")
        except importlib.metadata.PackageNotFoundError:
            version = pyproject()["project"]["version"]
        print(f"calque {version}")
        parser.exit()


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


def _parse_time(text, what):
    try:
        t = datetime.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise UserError(f"{what}: {text!r} is not an ISO-8601 time (e.g. 2026-11-29T10:00:00Z)") from None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)  # a bare time is UTC


def size_text(size):
    """Bytes in the largest unit that leaves at least 1 of it: 512 B, 13.4 KiB, 1.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,} B" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024


