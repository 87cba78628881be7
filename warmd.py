"""warmd: the sticky worker. Loads its pool's model once (@enter), then claims batch after batch.

    python warmd.py --model demo                 # a pool worker (foreground; what the supervisor and EC2 run)
    python warmd.py --run demo.20261129-101500-ab12cd   # a cold run's ephemeral worker: pays @enter, drains, exits
    CALQUE_STORE=s3://bucket/prefix python warmd.py --model Qwen/Qwen2.5-1.5B-Instruct

Everything it needs comes from the pool record in the store (handler snapshot, batch size, visibility
timeout, max deliveries, batch timeout); handler code is never taken from a message. Per claim: long poll,
manifest, drain in batches, result parts, summary, then ack. Claims are pipelined (CALQUE_PIPELINE=0 turns it
off): k's summary and ack go out on the `finisher` thread while k+1 is received and drains, and on S3 + SQS
(CALQUE_AHEAD=1 or 0 decides on any backend), while the last batch of claim k runs, claim k+1 is received and
accepted (duplicate check, manifest) on the `ahead` thread. Acks
go ACK_BATCH to a request, within ACK_WAIT s, and at once when the queue runs empty.
SIGTERM (or a spot interruption notice) stops claiming, gives a claim received ahead back at once, and finishes
the running claim within CALQUE_GRACE seconds, else releases it; a second SIGTERM/SIGINT releases it at once.
SIGUSR1 (the supervisor scaling in) stops claiming too, but lets the running claim finish however long it takes.
On an EC2 pool instance the worker protects its instance from scale-in while it holds a claim. Exit 0 on a
graceful stop.

Nothing lost, nothing stuck:
- Checkpoints: results go to the store in parts (calque.part_key) once CALQUE_CHECKPOINT_SECONDS of drain AND
  CALQUE_CHECKPOINT_BATCHES batches have passed, and at the end (a short claim: one part, no extra request).
  Under churn (this worker or its pool saw a death) on Young's interval (commit_interval).
  A redelivery, or a message with "resume": true, lists the parts and resumes after the prefix they cover.
- Poison: a redelivery whose last delivery died (the attempt record holds no "released") runs the rest one item
  at a time, writing the attempt record (calque.attempt_key) before each. A death counts against the item the
  record names when the record is the previous delivery's and the item is not in a part yet; an item that
  runs alone and returns is cleared. POISON_DEATHS deaths with no return between quarantine it as poison: a
  poison item kills every time, while a chaos kill -9 must land on the same item twice in a row to blame it. One
  death more once the pool is seen churning (an item cleared after a death: mark_churn, churning).
- Dead letters: past max_deliveries, a claim is dead-lettered only when its last max_deliveries deliveries made
  no progress: no new part, no death pinned on an item, no quarantine. A crashing infrastructure slows a good
  claim down; deaths that nothing can pin (a crash before any item runs) and store outages past their retries
  still end in the dead-letter queue.
- Hung batches: a handler call past batch_timeout commits what is done, marks its items suspect, releases the
  claim and exits EXIT_HUNG (no thread can stop one stuck in a handler); a lone suspect is then quarantined
  as timed out, a suspect batch is re-run one item at a time.
- Faults: store writes are retried (WRITE_RETRY); past that, or on a read or queue fault, the claim is let go
  for RELEASE_DELAY doubling per delivery (up to the visibility timeout), never at once.
- Results are strict JSON: NaN, Infinity, a type json cannot take or nesting too deep fails that item alone. A
  numeric array or tensor (the result, or a value of its dict) is kept in binary: the part is then an .npz
  (calque.encode_part).
- A claim ahead: at most one, received only as the running claim's last batch starts, only when the finisher
  is done with the claim before (two claims held at most) and the latest handler call took under AHEAD_HOLD/2 s;
  given back (visibility 0) when it has not started AHEAD_HOLD s after it was accepted (a clock that stands
  still while a store write is retried), or at once on SIGTERM, so that it is not kept from an idle worker of
  the pool; a delivery given back unstarted is not held against max_deliveries. kill -9 loses nothing: a claim
  held ahead comes back after its visibility timeout like any other.
- The claim's last result part is written on the worker's own thread, its summary and ack on the finisher: a
  worker whose writes the store refuses takes no further claim while it retries, so another worker takes it.
"""
import argparse
import contextlib
import faulthandler
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import calque
from calque import orjson   # a claim's result lines, ~6x json's encoder (None only until main() re-runs this under
                            # the kit's .venv, which has it: calque.KIT_PACKAGES)

# ------------------------------------------------------------------------------------------------
# defaults (the pool record and CALQUE_* settings override the per-pool ones)
STATS_INTERVAL = 30.0       # s between two worker-stats writes, busy or idle (pool status and pool cost read them)
STATS_IDLE_WAIT = 0.2       # s of the first poll after a claim; an empty one writes the stats (SQS waits 1 s)
COLD_POLL_WAIT = 0.2        # s of one long poll for a cold run's worker, which exits once its queue is empty (SQS: 1)
GPU_SAMPLE_INTERVAL = 0.1   # s between two NVML utilisation samples during a claim
ERROR_BACKOFF = (1.0, 30.0) # s: first wait after a failed receive, doubling up to this cap
PREFETCH = True             # a pipeline thread gathers batch k+1 while the model runs k
RING_SLOTS = 3              # host buffers: the batch in the model, the one being gathered, one spare
RING_WAIT = 60.0            # s the prefetch thread waits for a free ring slot before failing the batch
PIPELINE = True             # claims pipelined: the finisher writes summary and ack; AHEAD
AHEAD = None                # receive the next claim beside the last batch; None: where a request
                            # crosses a network (S3 + SQS), not on the local backend
AHEAD_HOLD = 2.0            # s a claim received ahead waits to start, at most
AHEAD_TICK = 0.05           # s between two looks, while a claim is held ahead, at whether the worker stops
ACK_BATCH = 10              # acks per request (SQS's DeleteMessageBatch takes at most 10)
ACK_WAIT = 1.0              # s an ack waits for others, at most (and <= visibility/4)
WRITE_RETRY = (0.5, 5)      # a failed store write of a claim: first wait (s), doubling, and retries (15.5 s in all)
RELEASE_DELAY = 5.0         # s a claim let go on a fault stays invisible, doubling per delivery up to its timeout
POISON_DEATHS = 2           # deaths while an item ran alone before it is quarantined as poison (+1 under churn)
CHURN_MEMORY = 600.0        # s an innocent death (an item died alone, then ran and returned) marks the pool as churning
WATCHDOG_TICK = 1.0         # s between two checks of the running handler call (a quarter of batch_timeout if less)
OVERRUN_COMMIT_WAIT = 1.0   # s the watchdog waits for each finished batch's serialisation before its last commit
OUTPUT_FLUSH = 1.0          # s between two chunks of what handler code prints, written to the store
OUTPUT_CHUNK = 64 << 10     # characters of a chunk at most; past 4 unwritten, the oldest go
OUTPUT_KEPT = 64            # chunks a worker keeps in the store (it deletes the older ones)
EXIT_HUNG = 3               # exit status after a handler call overran batch_timeout (the supervisor restarts us)

log = logging.getLogger("warmd")


class Interrupted(BaseException):
    """Raised by the signal handler to break out of an idle long poll."""


class ReleaseNow(BaseException):
    """Raised by a second signal during a claim: release the claim now. BaseException, so that a
    handler's `except Exception` cannot swallow it."""


class Claim:
    """One accepted claim on its way through drain and finish. Offsets are positions in the claim; a run
    index is `first` + offset."""

    def __init__(self, message, run_id, claim, items, first, received):
        self.message, self.run_id, self.claim_id, self.items, self.first = message, run_id, claim, items, first
        self.received = received                        # time.time() when the claim arrived
        self.enter_paid = self.acquisition = 0.0        # what a cold worker paid inside this claim
        self.gpu = None                                 # GpuSampler.stop()'s reading
        self.start = self.committed = 0     # [0, start): earlier deliveries' parts; [start, committed): this one's
        self.parts, self.failed, self.errors = [], [], {}   # every part [start, stop]; failed run indices; messages
        self.resumed_failed = 0                         # of `failed`, those taken from earlier parts
        self.formatted = []             # (stop offset, future of format_outcome) per batch run and not yet in a part
        self.kind = None                # how its batches are prepared: Collator.claim_kind, once, as its drain starts
        self.batches, self.last_commit = 0, 0.0         # batches run since the last part, and when it was written
        self.model_seconds = self.wait_seconds = 0.0
        self.record = {"deaths": {}}        # the attempt record (deaths: offset (str) -> deaths while it ran alone)
        self.quarantined = {}                           # offset (str) -> why it is not run
        self.single = False                             # one item at a time, each behind the attempt record
        self.life = None                                # s its dead delivery lived, at least (0: unknown)
        self.progress_at = 0                            # the delivery (receive count) that last made progress
        self.heartbeat = None                           # its lease's Heartbeat (open_claim sets it)
        self.requests = Counter()                       # requests made for it, for its summary (Requests.tally)


class Done:
    """fn(*args), run here and now, read as a finished Future is (result, exception): where the same code takes
    the work of a thread or the caller's own. Not a Future: its lock and condition cost ~3 us, and a 1,000-item
    claim makes ~35 of these (each batch's preparation and its result lines)."""
    __slots__ = ("value", "error")

    def __init__(self, fn, *args):
        self.value = self.error = None
        try:
            self.value = fn(*args)
        except Exception as e:
            self.error = e

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self, timeout=None):
        return self.error


class ClaimReleased(Exception):
    """The drain loop gave the claim back (grace period over, or lease lost)."""


class Prepared:
    """One batch as the handler will receive it, plus the ring slot and CUDA event that back it."""
    __slots__ = ("inputs", "slot", "event")

    def __init__(self, inputs, slot=None, event=None):
        self.inputs, self.slot, self.event = inputs, slot, event


# How a claim's batches are prepared, decided once per claim by Collator.claim_kind
BY_HANDLER = "handler"      # the handler's own collate(payloads), on the pipeline thread
NUMERIC = "numeric"         # fastbatch plans each batch: dicts of arrays are gathered, any other batch passes through
AS_LIST = "list"            # no item can collate: every batch passes through as the list, on the model's thread
NOT_NUMERIC = (str, bytes, dict, type(None), complex)   # a payload value of these types never collates
JSON_SCALARS = {str, int, float, bool, type(None), dict}  # value types of JSON items that hold no array


def may_collate(item):
    """False when fastbatch would pass any batch holding this item through as a list (it is not a dict of numbers
    and arrays with at least one array or list); True when a batch of such items may collate. Type checks only:
    nothing is imported to answer, and a text item is refused at its first string value."""
    if type(item) is not dict:
        return False
    array = False
    for value in item.values():
        if isinstance(value, NOT_NUMERIC):
            return False
        array = array or isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0
    return array


class Collator:
    """What a handler's batch call receives: its own collate(payloads) when it has one; otherwise numeric
    payloads (dicts of arrays/lists) are gathered by fastbatch in one copy into a ring of reused host
    buffers (pinned with CUDA), and with CUDA copied to the GPU on a side stream, non_blocking, so the
    copy of batch k+1 overlaps the model running batch k. Anything else passes through as the list.
    fastbatch and torch (~2 s and ~150 MiB) are imported by the first claim that may collate, or at load
    when the handler brought torch in anyway: a plain-Python handler's worker never holds them."""

    def __init__(self, handler_collate):
        self.handler_collate = handler_collate
        self.ring = None
        if handler_collate is None and "torch" in sys.modules:   # cheap now: keeps the import out of a claim
            self._load()

    def _load(self):
        import fastbatch
        import torch
        self.torch, self.ring = torch, fastbatch.PinnedRing(RING_SLOTS)
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None

    def claim_kind(self, items):
        """How this claim's batches are prepared, decided once for the claim (not per batch): BY_HANDLER with a
        collate of its own; NUMERIC when some item may collate (may_collate), AS_LIST when none can. A claim that
        mixes kinds is NUMERIC, and fastbatch still plans each of its batches: a batch of dicts of arrays is
        gathered, a batch holding any other item passes through as the list, exactly as if every claim were
        planned batch by batch. What the decision saves is the planning of claims none of whose items can
        collate: a claim of JSON items without lists costs one set of its values' types (~0.1 us an item), not
        a numeric plan of every batch (two numpy conversions an item)."""
        if self.handler_collate is not None:
            return BY_HANDLER
        try:   # the common case first: no value in the claim is a list (one set of types, ~0.1 us an item)
            if set(map(type, itertools.chain.from_iterable(map(dict.values, items)))) <= JSON_SCALARS:
                return AS_LIST
        except TypeError:   # an item that is not a dict: the scan below decides
            pass
        if not any(map(may_collate, items)):
            return AS_LIST
        if self.ring is None:
            self._load()
        return NUMERIC

    def prepare(self, payloads, kind):
        """One batch of a claim of this kind; on the pipeline thread unless the kind is AS_LIST."""
        if kind == BY_HANDLER:
            return Prepared(self.handler_collate(payloads))
        collated = self.ring.collate(payloads, timeout=RING_WAIT) if kind == NUMERIC else None
        if collated is None:
            return Prepared(payloads)
        slot, batch = collated
        if not self.cuda:
            return Prepared(batch, slot)
        try:
            with self.torch.cuda.stream(self.stream):
                on_device = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}   # DMA from the pinned slot
                event = self.torch.cuda.Event()
                event.record(self.stream)
        except BaseException:
            self.ring.release(slot)
            raise
        return Prepared(on_device, slot, event)

    def inputs(self, prepared):
        """On the model's thread: make its stream wait for the copy (a GPU-side wait, not a host sync)."""
        if prepared.event is not None:
            main = self.torch.cuda.current_stream()
            main.wait_event(prepared.event)
            for tensor in prepared.inputs.values():
                tensor.record_stream(main)   # the allocator must not reuse this memory before the model is done
        return prepared.inputs

    def release(self, prepared):
        """The slot is handed out again only once the copy out of it has finished."""
        if prepared.slot is not None:
            if prepared.event is not None:
                prepared.event.synchronize()
            self.ring.release(prepared.slot)


def result_encoder():
    """value -> its strict JSON text, compact (allow_nan=False: NaN and Infinity have no JSON form; numpy and torch
    values through calque.to_jsonable), from an encoder made once: json.dumps with options makes a JSONEncoder
    (and, inside, a C encoder) per call, half of a small result's cost. Made without the circular check, which
    needs a fresh table per call: a circular result fails its item with RecursionError, as nesting too deep does."""
    make = json.encoder.c_make_encoder      # None where the C accelerator is missing (the pure-Python encoder)
    if make is None:
        return json.JSONEncoder(default=calque.to_jsonable, separators=(",", ":"), allow_nan=False,
                                check_circular=False).encode
    encode = make(None, calque.to_jsonable, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
    return lambda value: "".join(encode(value, 0))


encode_result = result_encoder()


# orjson writes dataclasses and datetimes itself; passed through to calque.to_jsonable, they are refused as json's
# encoder refuses them, so a result fails or succeeds alike whichever encoder writes it
ORJSON_AS_JSON = orjson and orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def refuse_arrays(value):
    """orjson's default= for a batch encoded whole: an array or a tensor is refused, so that the batch goes item by
    item (format_each), where a typed result is kept in binary; any other value as calque.to_jsonable has it."""
    np = sys.modules.get("numpy")
    if hasattr(value, "detach") or (np is not None and isinstance(value, np.ndarray)):
        raise TypeError("an array: typed")
    return calque.to_jsonable(value)


def encode_fast(value, default=calque.to_jsonable):
    """value's result JSON as bytes, by orjson (~6x json's encoder on the demo model's results; it writes non-ASCII
    as UTF-8, not as escapes, and floats in their shortest form: 1e-7, not 1e-07), or None where orjson's text would
    not do: a null in it (None, or a NaN or an Infinity, which orjson writes as null where json refuses them), or a
    value orjson refuses (an integer beyond 64 bits, a key that is not a string, nesting past 254 levels, a lone
    surrogate)."""
    try:
        text = orjson.dumps(value, default=default, option=ORJSON_AS_JSON)
    except orjson.JSONEncodeError:
        return None
    return None if b"null" in text else text


def load_framer(folder=None):
    """(ffi, lib) of fastbatch's compiled module, loaded from its file in fastbatch's folder (found, not imported:
    `import fastbatch` would import torch, ~2 s and ~150 MiB, into a worker whose handler may never need it).
    (None, None) where it is not built (pip install or `make setup` builds it; a worker then frames every line
    in Python, as format_each)."""
    try:
        folder = folder or importlib.util.find_spec("fastbatch").submodule_search_locations[0]
        path = os.path.join(folder, "_fastbatch_c" + sysconfig.get_config_var("EXT_SUFFIX"))
        spec = importlib.util.spec_from_file_location("fastbatch._fastbatch_c", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi, module.lib
    except (ImportError, OSError, AttributeError) as e:   # at import, before logging is set up: WARNING shows
        log.warning("warmd: fastbatch's C module is not built (%s): result lines are framed in Python, more slowly "
                    "---> HINT: install calque where gcc and the Python headers are (pip install, make setup)", e)
        return None, None


ffi, framer = load_framer()


def format_outcome(outcome, base):
    """One batch's [(ok, result or error)] as its result lines (one string, in a list), failed indices and error
    messages. A batch whose every item succeeded is encoded in one call (encode_fast's orjson) and framed in C
    (frame_lines: 3-4x format_each on the demo model's results, `make bench`); any other batch, or one that orjson
    alone cannot encode, goes through format_each, where each item fails or succeeds alone."""
    if framer is not None and all(ok for ok, _ in outcome):
        lines = frame_lines([value for _, value in outcome], base)
        if lines is not None:
            return [lines], [], {}
    return format_each(outcome, base)


def frame_lines(values, base):
    """The result lines of items base, base + 1, ... with these values, from one encoding of the list, or None
    when encode_fast does not take the list (format_each then encodes item by item, and fails those that are not
    strict JSON alone). The same text as format_each's, line for line (tests/test_fastbatch.py compares them)."""
    text = encode_fast(values, refuse_arrays)
    if text is None:
        return None
    cap = len(text) + len(values) * framer.FB_LINE_FRAME
    out = ffi.new("char[]", cap)
    written = framer.fb_frame_lines(text, len(text), base, len(values), out, cap)
    if written < 0:   # the encoder wrote what the framer cannot cut: never seen; the lines one by one are right
        log.warning("fb_frame_lines returned %d; framing this batch in Python", written)
        return None
    return ffi.unpack(out, written).decode()


def format_each(outcome, base):
    """format_outcome one item at a time: each result encoded once into the line's fixed frame (no dict and no
    encoder per line), by encode_fast, else by json's encoder (encode_result), the lines joined once. A result that
    is an array, or a dict with arrays (calque.typed_cells), has them null in its line and kept in the lines' cells,
    in binary. A result that is not strict JSON fails its item alone: NaN, Infinity, a type json cannot take,
    nesting too deep to encode (RecursionError)."""
    lines, failed, errors, cells = [], [], {}, []
    for i, (ok, value) in enumerate(outcome, base):
        if ok:
            try:
                typed = calque.typed_cells(value)
                value = value if typed is None else typed[0]
                fast = b"null" if typed and value is None else encode_fast(value)   # an array result: null
                text = encode_result(value) if fast is None else fast.decode()
                lines.append(f'{{"i":{i},"ok":true,"result":{text}}}\n')
                cells += [(i - base, *cell) for cell in typed[1]] if typed else []
                continue
            except Exception as e:
                value = f"result is not JSON-serialisable: {type(e).__name__}: {e}"
        failed.append(i)
        errors[str(i)] = value[:calque.ERROR_CHARS]
        error_line = {"i": i, "ok": False, "error": value[:calque.ERROR_CHARS], **trace_of(value)}
        lines.append(encode_result(error_line) + "\n")
    text = "".join(lines)
    if cells:
        text = calque.TypedLines(text)
        text.cells = cells
    return [text], failed, errors


class ItemError(str):
    """A failed item's message ("ValueError: ..."), carrying `trace`: the last frames where it was raised."""
    trace = ()


def item_error(error):
    """The ItemError of an exception a handler raised for one item: its message, and its last
    calque.TRACE_FRAMES traceback frames as "file:line in function: code" (the handler's own lines)."""
    message = ItemError(f"{type(error).__name__}: {error}")
    message.trace = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {f.line}"
                     for f in traceback.extract_tb(error.__traceback__)[-calque.TRACE_FRAMES:]]
    return message


def trace_of(error):
    """{"trace": frames} for a failed item's result line, {} when the error has none (a wrong result count)."""
    return {"trace": error.trace} if getattr(error, "trace", None) else {}


class Tee:
    """A sys.stdout / sys.stderr that also hands what is written to an Output."""

    def __init__(self, stream, output):
        self.stream, self.output = stream, output

    def write(self, text):
        self.output.add(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class Output:
    """What handler code prints (sys.stdout, sys.stderr; warmd's own log lines go around it) still
    reaches the worker's log, and goes to the store in chunks (calque.output_key) every OUTPUT_FLUSH
    s and before each claim's summary, where `modal run` and `submit --follow-logs` follow it
    (supervisor.WorkerOutput) from any machine. Nothing is captured until capture() (main(): the
    process's streams, not an in-process test's)."""

    def __init__(self, store, prefix, label):
        self.store, self.prefix, self.label = store, prefix, label
        self.parts, self.size, self.seq, self.kept = [], 0, 0, []
        self.lock, self.flushing = threading.Lock(), threading.Lock()

    def capture(self):
        """sys.stdout and sys.stderr through a Tee to the log; fds 1 and 2 (a subprocess's or a C
        library's output) through a pipe a thread copies to the log and here. warmd's log lines and
        a crash's traceback (faulthandler) go to the log alone."""
        log_file = open(os.dup(2), "w", buffering=1, errors="replace")
        read, write = os.pipe()
        for fd in (1, 2):
            os.dup2(write, fd)
        os.close(write)
        sys.stdout, sys.stderr = Tee(log_file, self), Tee(log_file, self)
        for handler in logging.getLogger().handlers:
            handler.setStream(log_file)
        faulthandler.enable(log_file)
        threading.Thread(target=self._copy, args=(read, log_file), daemon=True).start()
        threading.Thread(target=self._run, name="output", daemon=True).start()

    def _copy(self, read, log_file):
        for text in open(read, errors="replace", newline=""):
            log_file.write(text)
            self.add(text)

    def add(self, text):
        with self.lock:
            self.parts.append(text)
            self.size += len(text)
            if self.size > 4 * OUTPUT_CHUNK:
                dropped = self.size - 2 * OUTPUT_CHUNK
                self._keep(f"[{dropped} characters of output dropped]\n" + "".join(self.parts)[dropped:])

    def _keep(self, text):
        self.parts, self.size = [text], len(text)

    def _run(self):
        while True:
            time.sleep(OUTPUT_FLUSH)
            self.flush(final=False)

    def flush(self, final=True):
        """Write what is printed so far (but a line still being written, unless `final`)."""
        with self.flushing:
            while True:
                with self.lock:
                    text = "".join(self.parts)
                    chunk = text[:OUTPUT_CHUNK]
                    whole = final or len(chunk) == OUTPUT_CHUNK
                    end = chunk.rfind("\n") + 1 or (len(chunk) if whole else 0)
                    self._keep(text[end:])
                    if not end:
                        return
                self.seq += 1
                key = calque.output_key(self.prefix, self.seq, self.label)
                try:
                    self.store.put(key, chunk[:end].encode())
                except Exception as e:   # bookkeeping: a failed write must not stop the worker
                    log.warning("output: write failed (%s): %d characters lost", e, end)
                    return
                self.kept.append(key)
                if len(self.kept) > OUTPUT_KEPT:
                    with contextlib.suppress(Exception):
                        self.store.delete(self.kept.pop(0))


class Leases:
    """The leases of the claims this worker holds (the one draining, the one finishing, one received ahead), renewed
    by one thread: each message's visibility is extended to its timeout every third of it. One thread for the
    worker, not one a claim: starting and joining a thread cost the claim's own thread ~1 ms each on a busy
    machine (4 % of a 1,000-item claim of the demo model). Hidden cost: renewals go one after another, so one
    that hangs (a network stall, up to the client's read timeout) delays the others by as long; the two thirds of
    a timeout left after a renewal falls due cover it."""

    def __init__(self, queue):
        self.queue, self.held, self.changed = queue, set(), threading.Condition()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def add(self, lease):
        with self.changed:
            self.held.add(lease)
            self.changed.notify()

    def remove(self, lease):
        with self.changed:
            self.held.discard(lease)

    def _run(self):
        while True:
            with self.changed:
                now = time.monotonic()
                due = [lease for lease in self.held if lease.due <= now]
                if not due:
                    self.changed.wait(min((lease.due for lease in self.held), default=now + 3600.0) - now)
                    continue
            for lease in due:
                self._renew(lease)

    def _renew(self, lease):
        with lease.renewing:
            if lease.stopped:
                return
            lease.due = time.monotonic() + lease.period
            try:
                self.queue.change_visibility(lease.message, lease.timeout)
            except calque.LeaseLost as e:
                log.warning("heartbeat: lease lost (%s); this claim will not be written", e)
                lease.lost.set()
                self.remove(lease)
            except Exception as e:   # a transient network error: the next beat retries, well inside the timeout
                log.warning("heartbeat: visibility renewal failed (%s); retrying", e)


class Heartbeat:
    """One claim's lease, renewed every third of the visibility timeout by the worker's Leases thread; on a lost
    lease, sets `lost`."""

    def __init__(self, leases, message, visibility_timeout):
        self.leases, self.message, self.timeout = leases, message, visibility_timeout
        self.period = max(visibility_timeout / 3.0, 0.2)
        self.due = time.monotonic() + self.period
        self.lost, self.renewing, self.stopped = threading.Event(), threading.Lock(), False
        leases.add(self)

    def stop(self):
        """No renewal after this returns (one in progress is waited for): the ack or release may follow."""
        with self.renewing:
            self.stopped = True
        self.leases.remove(self)


class Watchdog:
    """Times the handler's calls of the claim it is armed for: a call running past `timeout` s has
    `on_overrun(offsets)` called from this thread, which does not return (the process exits: no thread can stop one
    stuck in a handler). `on_call`, when given, is called on the claim's thread as each call starts (with its
    offsets) and ends (None). One for the worker, armed per claim (a thread a claim cost its start and join)."""

    def __init__(self, timeout):
        self.timeout, self.lock = timeout, threading.Lock()
        self.on_overrun = self.on_call = None
        self.running = None                 # (offsets, time.monotonic() at its start) of the call in progress
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, on_overrun, on_call=None):
        with self.lock:
            self.on_overrun, self.on_call, self.running = on_overrun, on_call, None

    def disarm(self):
        self.arm(None)

    def watch(self, offsets):
        """A handler call on these items starts now (None: the call is over). Waits while an overrun is handled,
        so that the claim's thread writes nothing beside it."""
        if self.on_call:
            self.on_call(offsets)
        with self.lock:
            self.running = None if offsets is None else (offsets, time.monotonic())

    def _run(self):
        while True:
            time.sleep(min(WATCHDOG_TICK, self.timeout / 4))
            with self.lock:
                if self.running and self.on_overrun and time.monotonic() - self.running[1] > self.timeout:
                    self.on_overrun(self.running[0])


class Ahead:
    """The next claim, received beside the running claim's last batch on the worker's `ahead` thread: a probe of
    the queue (no wait: an empty queue costs one receive, and the worker's own poll follows), then open_claim
    (heartbeat, duplicate check, manifest). Bound: a claim not taken within AHEAD_HOLD s of its accept, or held
    when the worker is told to stop, is given back (visibility 0), so that it is not kept from an idle worker of
    the pool. Hidden cost of a give-back: its attempt record (a PUT), and its next delivery lists its parts (a
    LIST and a GET more)."""

    def __init__(self, worker):
        self.worker, self.taken, self.lock = worker, threading.Event(), threading.Lock()
        self.idle = Counter()           # an empty probe's requests: the next claim's, as the worker's idle polls
        self.future = worker.ahead_thread.submit(self._fetch)

    def _fetch(self):
        worker, counts = self.worker, Counter()
        if worker.stop_requested:
            return None
        try:
            with worker.backend.requests.tally(counts):
                message = worker.queue.receive(0)    # a probe: a claim waiting now, or none (never a wait)
        except Exception as e:   # the worker's own poll comes next, and retries with backoff
            log.warning("worker %s: receive ahead failed (%s: %s)", worker.worker_id, type(e).__name__, e)
            message = None
        if message is None:
            self.idle = counts
            return None
        claim = worker.open_claim(message, counts)
        if claim is None or self._held():
            return claim
        with self.lock:      # taken between the wait's end and here: the worker has it
            if self.taken.is_set():
                return claim
        worker.give_back(claim, "the worker stops" if worker.stop_requested else
                         f"held ahead {AHEAD_HOLD:g} s without starting")
        return None

    def _held(self):
        """Wait for the worker to take the claim: True when it did, False past AHEAD_HOLD or once it stops. The
        clock stands still while the worker retries a store write: a claim given back then would be a second
        delivery that a store outage caused, and another worker would meet the same outage."""
        deadline = time.monotonic() + AHEAD_HOLD
        while not self.taken.wait(AHEAD_TICK):
            if self.worker.retrying.is_set():
                deadline = time.monotonic() + AHEAD_HOLD
            if self.worker.stop_requested or time.monotonic() >= deadline:
                return False
        return True

    def take(self, timeout=None):
        """The claim once received and accepted (waiting for both), or None: nothing came, it was handled in
        accept (dead letter, duplicate), or given back past the hold."""
        with self.lock:
            self.taken.set()
        return self.future.result(timeout)


class Acks:
    """Acks of finished claims, sent ACK_BATCH to a request (SQS DeleteMessageBatch, one transaction locally),
    `wait` s after the first one at most. Safe: a claim's ack is queued only once its summary is written, so a
    crash that loses queued acks leaves those claims to be redelivered, and each redelivery finds its summary in
    the duplicate check and is acked without recompute. Hidden cost: a finished claim stays in flight up to
    `wait` s longer, and such a crash costs a receive, a HEAD, a GET and an ack per lost ack."""

    def __init__(self, queue, requests, wait):
        self.queue, self.requests, self.wait = queue, requests, wait
        self.lock, self.waiting, self.timer = threading.Lock(), [], None

    def add(self, message, name):
        with self.lock:
            self.waiting.append((message, name))
            if len(self.waiting) < ACK_BATCH:
                if self.timer is None:
                    self.timer = threading.Timer(self.wait, self.flush)
                    self.timer.daemon = True
                    self.timer.start()
                return
        self.flush()

    def flush(self):
        with self.lock:
            waiting, self.waiting = self.waiting, []
            if self.timer:
                self.timer.cancel()
                self.timer = None
        if not waiting:
            return
        try:
            with self.requests.tally(None):     # each summary counted its own ack
                refused = self.queue.delete_batch([m for m, _ in waiting])
        except Exception as e:
            log.warning("acks of %s not sent (%s: %s): they come back and are acked as duplicates",
                        ", ".join(name for _, name in waiting), type(e).__name__, e)
            return
        for message, name in waiting:
            if message in refused:
                log.warning("claim %s: ack refused (receipt stale); its summary stands", name)


class GpuSampler:
    """Mean GPU utilisation over a claim, sampled through NVML; unavailable without a GPU (and says so)."""

    def __init__(self, index=0):
        self.nvml, self.reason = None, "no NVML (nvidia-ml-py not installed)"
        try:
            import pynvml   # lazy: NVML only where a GPU may be
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except ImportError:
            pass
        except Exception as e:
            self.reason = f"no GPU visible to NVML ({type(e).__name__})"

    def start(self):
        self.samples, self.done = [], threading.Event()
        if self.nvml:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self):
        while not self.done.wait(GPU_SAMPLE_INTERVAL):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100.0)

    def stop(self):
        """{value, source, scope, measured} for the claim."""
        self.done.set()
        if not self.nvml or not self.samples:
            return {"value": None, "source": "nvml", "scope": "device", "measured": False,
                    "reason": self.reason if not self.nvml else "claim shorter than one sample"}
        self.thread.join()
        return {"value": round(sum(self.samples) / len(self.samples), 4), "source": "nvml", "scope": "device",
                "measured": True, "samples": len(self.samples)}


def metadata(base, *paths):
    """The bodies of EC2 instance metadata paths under `base` (IMDSv2: one token for them all); None
    for a path that 404s (no notice, no Auto Scaling group)."""
    token_req = urllib.request.Request(base.rstrip("/") + "/latest/api/token", method="PUT",
                                       headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    token = urllib.request.urlopen(token_req, timeout=2).read().decode()
    bodies = []
    for path in paths:
        req = urllib.request.Request(f"{base.rstrip('/')}/latest/meta-data/{path}",
                                     headers={"X-aws-ec2-metadata-token": token})
        try:
            bodies.append(urllib.request.urlopen(req, timeout=2).read())
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            bodies.append(None)
    return bodies


class SpotPoller:
    """Polls the EC2 metadata spot `instance-action` (IMDSv2) and calls `on_notice` once when one
    appears; with `on_terminating`, also the instance's Auto Scaling `target-lifecycle-state`, and
    calls it once when that reads Terminated (the pool's termination hook holds the instance).
    Off unless CALQUE_SPOT_POLL names the metadata address; tests point it at a loopback stub."""

    def __init__(self, base_url, interval, on_notice, on_terminating=None):
        self.base, self.interval, self.on_notice = base_url.rstrip("/"), interval, on_notice
        self.on_terminating = on_terminating
        if not self._poll():   # the first check before the worker loads anything: a notice already given stops it
            threading.Thread(target=self._run, name="spot-poller", daemon=True).start()

    def _check(self):
        lifecycle = ["autoscaling/target-lifecycle-state"] if self.on_terminating else []
        *state, notice = metadata(self.base, *lifecycle, "spot/instance-action")
        if state == [b"Terminated"]:
            log.warning("its instance is terminating: no new claims; the claim held finishes first")
            self.on_terminating()
            self.on_terminating = None
        return None if notice is None else json.loads(notice or b"{}")

    def _poll(self):
        """One check; True when it found a notice (and called on_notice)."""
        try:
            notice = self._check()
            if notice is not None:
                log.warning("spot: interruption notice %s; stopping as on SIGTERM", notice)
                self.on_notice()
                return True
        except Exception as e:
            log.warning("spot: metadata check failed (%s)", e)
        return False

    def _run(self):
        while True:
            time.sleep(self.interval)
            if self._poll():
                return


class ScaleInProtection:
    """An EC2 pool's instance (on_instance) protected from scale-in while
    its worker holds a claim and unprotected once a poll finds nothing, so a shrinking group terminates only idle
    instances: scaling in costs no redelivery. One SetInstanceProtection call per change, not per claim; a
    failed call is logged and tried again at the next poll. An instance terminating anyway (a
    replacement, a rebalance: the pool's termination hook holds it; SpotPoller sees it) is let go at
    the worker's exit, once its claim is done (CompleteLifecycleAction)."""

    def __init__(self, asg, instance_id, client, hook):
        self.asg, self.instance_id, self.client, self.hook = asg, instance_id, client, hook
        self.protected = None    # unknown: a restarted worker's instance may still be protected by the one before
        self.leaving = False

    @classmethod
    def on_instance(cls, record, conf):
        """The protection of this worker's instance when it serves an EC2 pool (None elsewhere): the
        group named after the model, the instance id from the metadata at CALQUE_SPOT_POLL."""
        if "ec2" not in record or not conf.get("CALQUE_SPOT_POLL"):
            return None
        try:
            instance_id = metadata(conf["CALQUE_SPOT_POLL"], "instance-id")[0].decode()
        except Exception as e:
            log.warning("no scale-in protection: the instance id is unreadable (%s)", e)
            return None
        import boto3   # lazy: only an EC2 pool instance needs it
        import ec2
        region = os.environ.get("AWS_REGION") or calque.DEFAULT_REGION
        client = boto3.client("autoscaling", config=calque.aws_client_config(region))
        names = ec2.resource_names(record["model"])
        return cls(names["asg"], instance_id, client, names["hook"])

    def release(self):
        """Let a terminating instance go: its worker holds no claim any more."""
        if self.leaving:
            try:
                self.client.complete_lifecycle_action(
                    LifecycleHookName=self.hook, AutoScalingGroupName=self.asg,
                    InstanceId=self.instance_id, LifecycleActionResult="CONTINUE")
            except Exception as e:
                log.warning("completing the termination hook failed (%s: %s)", type(e).__name__, e)

    def hold(self, busy):
        if busy != self.protected:
            try:
                self.client.set_instance_protection(AutoScalingGroupName=self.asg, InstanceIds=[self.instance_id],
                                                    ProtectedFromScaleIn=busy)
                self.protected = busy
            except Exception as e:
                log.warning("scale-in protection %s failed (%s: %s)", "on" if busy else "off", type(e).__name__, e)


class Worker:
    def __init__(self, backend, record, stats_key_prefix, conf, ephemeral, supervisor_pid=0,
                 ready_file="", spawned_at=None, previous_life=None, gpu_index=0):   # HANDOFF_FLAGS
        self.backend, self.record, self.conf, self.ephemeral = backend, record, conf, ephemeral
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        self.stats_prefix = stats_key_prefix
        self.stats_key = f"{stats_key_prefix}{self.worker_id}.json"
        self.grace = calque.setting_number(conf, "CALQUE_GRACE", float, 0)
        self.batch_timeout = float(record.get("batch_timeout",
                                              calque.setting_number(conf, "CALQUE_BATCH_TIMEOUT", float, 0.01)))
        self.checkpoint_seconds = calque.setting_number(conf, "CALQUE_CHECKPOINT_SECONDS", float, 0)
        self.checkpoint_batches = calque.setting_number(conf, "CALQUE_CHECKPOINT_BATCHES", int, 1)
        self._serving = threading.local()       # per thread: the heartbeat of the claim it works for
        self.watchdog = None                    # Watchdog, armed for the draining claim (start() makes it)
        self.progressed = False          # a result part or a summary written (announce)
        self.seen_life = previous_life   # s the latest death seen lived (commit_interval)
        self.seen_at = time.time()                       # when it was seen
        self.part_seconds = 0.0          # s the latest result part's PUT took (commit_interval)
        self.last_word = None            # how this process ends, when it knows: in its last stats (poison reports)
        self.poll_wait = COLD_POLL_WAIT if ephemeral else calque.setting_number(conf, "CALQUE_POLL_WAIT", float, 0)
        self.state = "starting"          # starting | polling | claim | between | stopping
        self.stop_requested = False
        self.scaling_in = False          # the stop is a scale-in (SIGUSR1): a claim already received still runs
        self.release_now = threading.Event()
        self.retrying = threading.Event()   # a store write of a claim is failing and being retried
        self.started = time.time()
        self.spawned_at = spawned_at or self.started
        self.acquisition_seconds = 0.0   # process spawn -> ready to load; charged to a cold worker's first claim
        self.entered_at = None
        self.enter_seconds = 0.0
        self.enter_count = 0
        self.stats = Counter()           # claims, warm_hits, items, items_failed
        self.busy_seconds = 0.0
        self.last_stats = 0.0            # monotonic time of the last stats write
        self.stats_behind = False        # a claim ended since then: the stats miss it
        self.supervisor, self.ready_file = supervisor_pid, ready_file   # from a pool supervisor
        self.gpu = GpuSampler(gpu_index)
        self.protection = None if ephemeral else ScaleInProtection.on_instance(record, conf)
        self.prefetcher = ThreadPoolExecutor(1, thread_name_prefix="pipeline") if PREFETCH else None
        # the pipeline thread's CPU clock: what it ran during a handler call is taken out of the model's time
        self.pipeline_clock = (time.pthread_getcpuclockid(self.prefetcher.submit(threading.get_ident).result())
                               if self.prefetcher and hasattr(time, "pthread_getcpuclockid") else None)
        # the manifest read beside the duplicate check (over a network; see self.network)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="manifest")
        # claim pipelining: the next claim's receive and accept, and the last one's writes, each on a thread
        self.ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="ahead")
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="finisher")
        # requests cross a network (S3 + SQS): overlapping them with other work pays; a local one costs less than
        # handing it to a thread (the manifest read, the receive ahead)
        self.network = backend.kind != "local"
        self.receives_ahead = self.network if AHEAD is None else AHEAD
        self.ahead = None                # Ahead: the claim being received beside the last batch
        self.call_started, self.call_seconds = 0.0, float("inf")   # the latest handler call's (unknown: none yet)
        self.finishing = None            # future of the claim the finisher writes
        self.acks = None                 # Acks, once the queue is open
        self.leases = None               # Leases: the claims' heartbeats, once the queue is open
        ready = re.search(r"worker-(\d+)\.ready$", ready_file)
        self.output = Output(backend.store, stats_key_prefix.replace("/workers/", "/output/"),
                             f"w{ready[1]}" if ready else socket.gethostname())

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self):
        """Everything before the first claim: open the queues, import the handler, and, for a pool
        worker, run @enter (so no claim waits on a load; a cold worker pays it in its first claim) unless
        a stop came first: loading a model only to exit would cost minutes of a GPU for nothing."""
        self.queue = self.backend.queues.open_queue(self.record["queue"])
        self.dlq = self.backend.queues.open_queue(self.record["dlq"])
        self.acks = Acks(self.queue, self.backend.requests, min(ACK_WAIT, self.record["visibility_timeout"] / 4))
        self.leases, self.watchdog = Leases(self.queue), Watchdog(self.batch_timeout)
        self.load_handler()
        if not self.ephemeral and not self.stop_requested:   # stopped already (SIGTERM, spot notice): no @enter
            self.enter()

    def load_handler(self):
        """Fetch the handler snapshot named by the pool record, check its digest, import it."""
        h = self.record["handler"]
        source = self.backend.store.get(h["key"])
        if hashlib.sha256(source).hexdigest() != h["sha256"]:
            raise calque.UserError(f"handler snapshot {h['key']} does not match the pool record's sha256: recreate the "
                                   "pool")
        folder = os.path.join(os.path.abspath(self.conf["CALQUE_STATE"]), "handlers", h["sha256"][:16])
        if "include" in h:   # the modules and data files it needs beside it (pool create --include, add_local_*)
            folder += "-" + h["include"]["sha256"][:16]
            calque.unpack_include(self.backend.store, h["include"], folder)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, h["file"])
        calque.write_file_atomic(path, source.decode())
        enter_workdir(self.record.get("workdir"), folder)
        self.handler, self.enter_fn, self.batch_fn, collate = calque.load_handler(
            path, h["class"], self.record.get("modal"), container=True)
        if isinstance(self.handler, calque.ModalHandler) and not self.ephemeral:
            self.handler.streams = (self.backend.store, self.record["model"])
        self.collator = Collator(collate)

    def enter(self):
        self.acquisition_seconds = max(0.0, time.time() - self.spawned_at)
        t0 = time.perf_counter()
        self.enter_fn()
        self.enter_seconds = time.perf_counter() - t0
        self.enter_count += 1
        self.entered_at = time.time()
        log.info("worker %s: @enter done in %.3fs (acquisition %.3fs)", self.worker_id, self.enter_seconds,
                 self.acquisition_seconds)

    def run_exit_hooks(self):
        """A Modal handler's @modal.exit / __exit__, once the last claim is done (within the grace period of a
        SIGTERM): a failing hook is logged, the worker still stops cleanly."""
        hooks = getattr(self.handler, "calque_exit", None) if self.entered_at is not None else None
        if hooks:
            try:
                hooks()
            except Exception as e:
                log.warning("worker %s: @modal.exit failed (%s: %s)", self.worker_id, type(e).__name__, e)

    def on_signal(self, signum, frame):
        if self.stop_requested:
            log.warning("worker %s: second %s: releasing the claim now", self.worker_id, signal.Signals(signum).name)
            self.release_now.set()
            if self.state == "claim":
                raise ReleaseNow()
            return
        self.stop_requested = True
        log.info("worker %s: %s: warm stop (no new claims; %.0fs grace for the running one)",
                 self.worker_id, signal.Signals(signum).name, self.grace)
        if self.state == "claim":
            timer = threading.Timer(self.grace, self.release_now.set)
            timer.daemon = True    # a claim that ends first must not keep the process alive for the rest of the grace
            timer.start()
        elif self.state == "polling":
            raise Interrupted()

    def on_scale_in(self, signum, frame):
        """SIGUSR1, the supervisor scaling in: no new claim; the running one finishes however long it takes (no
        grace timer), so scaling in never costs a redelivery. A SIGTERM after it is a second signal."""
        if not self.stop_requested:
            self.stop_requested = self.scaling_in = True
            log.info("worker %s: scale-in: no new claims; the running one finishes", self.worker_id)
            if self.state == "polling":
                raise Interrupted()

    def on_sibling_death(self, signum, frame):
        """SIGUSR2, the supervisor saw another worker of the pool die: this one commits under churn
        too (commit_interval), its own age taken for the life seen."""
        self.seen_life, self.seen_at = time.time() - self.started, time.time()

    def request_stop(self):
        """The spot poller's notice: the same warm stop as SIGTERM."""
        os.kill(os.getpid(), signal.SIGTERM)

    def leave(self):
        """Its instance is terminating: the scale-in stop; the hook completed at exit."""
        self.protection.leaving = True
        os.kill(os.getpid(), signal.SIGUSR1)

    def work(self):
        """The loop: claim, drain, write, ack; a logged reason for every exit."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGUSR1, self.on_scale_in)
        signal.signal(signal.SIGUSR2, self.on_sibling_death)
        signal.siginterrupt(signal.SIGUSR2, False)   # a notice: a system call it lands in goes on
        if self.conf.get("CALQUE_SPOT_POLL"):
            SpotPoller(self.conf["CALQUE_SPOT_POLL"],
                       calque.setting_number(self.conf, "CALQUE_SPOT_INTERVAL", float, 0.01),
                       self.request_stop, self.leave if self.protection else None)
        reason = "?"
        try:
            self.start()
            self.write_stats("running")
            announce(self.ready_file)
            self.backoff = 0.0
            while reason == "?":
                reason = self._loop_once() or "?"
        except Interrupted:
            reason = "stop requested"
        except SystemExit as e:          # a handler called sys.exit: the poison report of its item will say so
            reason = self.last_word = f"exit code {e.code} (sys.exit)"
            raise
        finally:
            self.state = "stopping"
            self.settle()
            if self.prefetcher:
                self.prefetcher.shutdown(wait=False, cancel_futures=True)
            for pool in (self.reader, self.ahead_thread, self.finisher):
                pool.shutdown(wait=False, cancel_futures=True)
            self.run_exit_hooks()
            self.output.flush()
            self.write_stats("stopped")
            if self.protection:
                self.protection.release()
            log.info("worker %s: exit (%s) after %d claim(s), %d warm hit(s), enter_count %d",
                     self.worker_id, reason, self.stats["claims"], self.stats["warm_hits"], self.enter_count)

    def _loop_once(self):
        """One pass: the claim received ahead, else a poll, and run the claim. Returns the reason to stop, or None
        to go on."""
        if self.stop_requested:
            return "stop requested"
        if self.supervisor and os.getppid() != self.supervisor:
            # the supervisor was killed without stopping us: nobody would stop or count this worker
            # any more (pool delete included), so leave rather than run on as an orphan
            return f"supervisor {self.supervisor} is gone"
        self.state = "between"
        ahead, idle = self.ahead, False
        claim = ahead and ahead.take()
        self.ahead = None
        if claim is None:
            counts = Counter(ahead.idle if ahead else ())
            try:
                self.state = "polling"           # a signal cuts the backoff and the poll short
                time.sleep(self.backoff)
                self.state = "between"
                with self.backend.requests.tally(counts):
                    message = self.queue.receive(0)   # a probe: a busy queue answers at once
                if message is None:     # it looks empty: the last claim's writes and the acks go out before a wait
                    self.settle()       # (one empty receive more each time the worker runs out of claims)
                    self.state = "polling"
                    wait = min(self.poll_wait, STATS_IDLE_WAIT) if self.stats_behind else self.poll_wait
                    with self.backend.requests.tally(counts):
                        message = self.queue.receive(wait, should_stop=lambda: self.stop_requested)
                self.backoff = 0.0
            except Interrupted:
                return "stop requested while polling"
            except Exception as e:   # the queue is unreachable for a while: stay warm (the model stays loaded), retry
                self.backoff = min(max(self.backoff * 2, ERROR_BACKOFF[0]), ERROR_BACKOFF[1])
                log.warning("worker %s: receive failed (%s: %s); retrying in %.0fs",
                            self.worker_id, type(e).__name__, e, self.backoff)
                return None
            self.state, idle = "between", message is None
            if self.protection:
                self.protection.hold(not idle)
            if idle:
                self.backend.requests.loose.update(counts)
            else:
                claim = self.open_claim(message, counts)
        if claim is not None:
            if self.stop_requested and not self.scaling_in:   # told to stop while it was received: it never starts
                self.give_back(claim, "the worker stops")
                return "stop requested"
            self.state = "claim"         # a signal from here on sees the claim (grace timer, release)
            reason = self.run_claim(claim, PIPELINE)
            self.state = "between"       # a second signal from here on has no claim to release
            if reason:
                return reason
            self.stats_behind = True
        elif idle and self.ephemeral and sum(self.queue.counts().values()) == 0:
            return "cold run drained"
        # Stats on a timer, not after every claim (a PUT per claim, 1 in 10 of its requests on SQS + S3), and once
        # when the worker runs out of claims, so that an idle pool's stats are whole. Hidden cost: a live pool's
        # totals lag by up to STATS_INTERVAL while it is busy; the stats written at exit carry them all.
        if (idle and self.stats_behind) or time.monotonic() - self.last_stats > STATS_INTERVAL:
            self.write_stats("running")
        return None

    # ---- one claim: accept, drain, finish --------------------------------------------------------

    def handle(self, message):
        """One claim, start to end, on this thread, with no claim ahead and its ack sent before it returns (the
        loop runs claims through open_claim and run_claim; the bench and in-process tests call this). Returns the
        reason to stop the worker, or None."""
        claim = self.open_claim(message, Counter())
        reason = self.run_claim(claim, pipelined=False) if claim is not None else None
        self.acks.flush()
        return reason

    @property
    def heartbeat(self):
        """The heartbeat of the claim this thread works for: the drain loop's, the finisher's, the ahead
        thread's. Store writes for a claim stop when its lease is lost (_put)."""
        return getattr(self._serving, "heartbeat", None)

    @contextlib.contextmanager
    def serving(self, heartbeat, requests):
        """This thread works for one claim: its writes check that claim's lease, its requests count in `requests`
        (the claim's summary's)."""
        saved, self._serving.heartbeat = self.heartbeat, heartbeat
        try:
            with self.backend.requests.tally(requests):
                yield
        finally:
            self._serving.heartbeat = saved

    def open_claim(self, message, requests):
        """Accept a received message under a new heartbeat (validate, dedupe, read the manifest, take over earlier
        deliveries' work): the Claim to run, or None when it was handled here (dead-lettered, a duplicate acked,
        let go on a fault). `requests`: those made for it so far (its receive)."""
        heartbeat = Heartbeat(self.leases, message, self.record["visibility_timeout"])
        claim = None
        with self.serving(heartbeat, requests):
            try:
                claim = self.accept(message)
            except Exception as e:
                self.end_early(message, None, e)
                return None
        if claim is None:
            heartbeat.stop()
            self.backend.requests.loose.update(requests)   # a duplicate's requests: the next summary's
            return None
        claim.heartbeat, claim.requests = heartbeat, requests
        return claim

    def run_claim(self, claim, pipelined):
        """Drain an accepted claim on this thread (its last result part too), then finish it: on the finisher
        thread when `pipelined` (the next claim is received and drains while this one's summary and ack go out;
        at most one claim finishes behind the one that drains), else here. The last part is written here, not
        on the finisher: a worker whose writes the store refuses takes no further claim while it retries them,
        so another worker of the pool takes it (a pause, not a second delivery). Returns the reason to stop the
        worker, or None."""
        on_call = (lambda offsets: self.reach_ahead(claim, offsets)) if pipelined and self.receives_ahead else None
        self.watchdog.arm(lambda offsets: self.overrun(claim, offsets), on_call)
        with self.serving(claim.heartbeat, claim.requests):
            try:
                self.drain(claim)
                if self.finishing is not None:
                    self.finishing.result()
            except (ReleaseNow, Exception) as e:
                return self.end_early(claim.message, claim, e)
            finally:
                self.watchdog.disarm()
        if not pipelined:
            return self.finish_claim(claim)
        self.finishing = self.finisher.submit(self.finish_claim, claim)
        return None

    def reach_ahead(self, claim, offsets):
        """As each handler call of a pipelined claim starts (offsets) and ends (None): the call that runs the
        claim's last item starts the receive of the next claim beside it (the contract: at most one ahead, and only
        during the last batch), unless the finisher still writes the claim before (a worker holds two claims at
        most: a store outage does not gather more), or the latest call took over half of AHEAD_HOLD (a claim
        received beside a batch that long would be given back before it starts; beside it, the requests saved are
        a small part of the claim)."""
        now = time.monotonic()
        if offsets is None:
            self.call_seconds = now - self.call_started
            return
        self.call_started = now
        if (self.ahead is None and not self.stop_requested and len(claim.items) - 1 in offsets
                and (self.finishing is None or self.finishing.done()) and self.call_seconds <= AHEAD_HOLD / 2):
            self.ahead = Ahead(self)

    def finish_claim(self, claim):
        """The claim's summary, then its ack (queued with others' in Acks). Returns the reason to stop the worker,
        or None."""
        with self.serving(claim.heartbeat, claim.requests):
            try:
                self.finish(claim)
            except (ReleaseNow, Exception) as e:
                return self.end_early(claim.message, claim, e)
        return None

    def end_early(self, message, claim, error):
        """A claim this thread cannot finish: let go at once when the worker stops (second signal, grace over),
        after a growing delay on a store or queue fault outside the handler, not written when its lease is lost.
        Returns the reason to stop the worker, or None."""
        if isinstance(error, ReleaseNow):
            self.let_go(message, claim, 0, "second signal")
            return "second signal: claim released"
        if not isinstance(error, ClaimReleased):
            self.let_go(message, claim, self.fault_delay(message), f"{type(error).__name__}: {error}")
        elif self.heartbeat.lost.is_set():
            self.heartbeat.stop()
            log.warning("worker %s: claim %s lease lost: not writing it", self.worker_id, self._name(message, claim))
        else:                           # ours to give back: visible again at once, for another worker
            self.let_go(message, claim, 0, str(error))
        return None

    def give_back(self, claim, why):
        """Let go of an accepted claim that never started: visible again at once, and this delivery is not held
        against max_deliveries (it made no attempt)."""
        claim.progress_at = claim.message.receive_count
        with self.serving(claim.heartbeat, claim.requests):
            self.let_go(claim.message, claim, 0, why)
        self.backend.requests.loose.update(claim.requests)

    def settle(self, wait=None):
        """Nothing left behind the claim that drains, before the worker idles or stops: the claim received ahead
        given back, the finisher's claim written, the queued acks sent. `wait`: at most that many seconds on each
        of the first two (the watchdog's exit must not hang on them)."""
        with contextlib.suppress(TimeoutError):
            claim = self.ahead and self.ahead.take(wait)
            if self.ahead:
                self.backend.requests.loose.update(self.ahead.idle)
            self.ahead = None
            if claim is not None:
                self.give_back(claim, "the worker stops")
        with contextlib.suppress(TimeoutError):
            if self.finishing is not None:
                self.finishing.result(wait)
        if self.acks:
            self.acks.flush()

    def accept(self, message):
        """The claim to run, or None when it was handled here: dead-lettered, or a duplicate acked."""
        received = time.time()
        try:
            msg = calque.parse_message(message.body)
        except ValueError as e:
            return self.dead_letter(message, f"malformed message: {e}", None)
        key = self.backend.store.key_for_uri(msg["manifest_uri"])
        match = calque.MANIFEST_KEY.match(key or "")
        if not match:
            return self.dead_letter(message, f"manifest_uri {msg['manifest_uri']!r} is outside this pool's store "
                                             f"{self.backend.describe()}: refused", msg)
        run_id, claim = match.groups()
        msg.update(run_id=run_id, claim=claim)    # the key is the authority, not the message's own fields
        if msg["model"] != self.record["model"]:
            return self.dead_letter(message, f"claim is for model {msg['model']!r}, "
                                             f"this pool serves {self.record['model']!r}", msg)
        if calque.run_slug(run_id) != self.record["slug"]:
            return self.dead_letter(message, f"run {run_id} is not one of this model's runs "
                                             f"({self.record['slug']}.*): refused", msg)
        # the duplicate check and the manifest read are independent: over a network issue both at once (one store
        # round trip off every claim's critical path; a duplicate wastes one read). A local read (a file, ~30 us)
        # is done here: handing it to the reader thread cost a 1,000-item claim 0.3-0.5 ms more
        if self.network:
            manifest_read = self.reader.submit(self.backend.requests.carried(self.backend.store.get), key)
        else:
            manifest_read = Done(self.backend.store.get, key)
        if self.backend.store.exists(calque.summary_key(run_id, claim)):
            manifest_read.exception()    # let it finish: nothing is left running behind the ack
            self.queue.delete(message)
            log.info("worker %s: claim %s/%s already has a summary (duplicate delivery): acked without recompute",
                     self.worker_id, run_id, claim)
            return None
        try:
            manifest = json.loads(manifest_read.result())
            items = calque.array_items(self.backend.store, manifest) if "arrays" in manifest else manifest["items"]
            first = int(manifest.get("first_index", 0))
            if not isinstance(items, list):
                raise ValueError("'items' is not a list")
        except calque.NotFound as e:
            return self.dead_letter(message, f"claim object {e} does not exist", msg)
        except (ValueError, KeyError, TypeError) as e:
            return self.dead_letter(message, f"manifest {key} is corrupt: {e}", msg)
        accepted = Claim(message, run_id, claim, items, first, received)
        if message.receive_count > 1 or msg.get("resume") is True:   # a first delivery pays no request for this
            self.take_over(accepted)
        limit = self.record["max_deliveries"]
        if message.receive_count > limit and message.receive_count - accepted.progress_at > limit:
            return self.dead_letter(message, f"delivered {message.receive_count} times, more than the pool's max "
                                             f"deliveries {limit}, with no progress (no new result part, no death "
                                             f"pinned on an item, no item quarantined) in the last {limit}", msg)
        return accepted

    def take_over(self, claim):
        """What earlier deliveries left: their result parts are kept (resumed, not recomputed; a torn one is
        redone), and their attempt record says how the last one ended (the rules: the module docstring)."""
        rc = claim.message.receive_count
        keys = self.backend.store.list(calque.results_prefix(claim.run_id, claim.claim_id))
        for start, stop, key in calque.part_chain(keys, len(claim.items)):
            try:
                lines = [json.loads(line) for line in calque.read_part(self.backend.store, key, start, stop).lines]
            except (calque.ResultsIncomplete, ValueError) as e:
                log.warning("worker %s: part %s unreadable (%s): recomputing from offset %d",
                            self.worker_id, key, e, claim.start)
                break
            for line in lines[claim.start - start:]:
                if not line["ok"]:
                    claim.failed.append(line["i"])
                    if len(claim.errors) < calque.ERRORS_KEPT:
                        claim.errors[str(line["i"])] = line["error"]
            claim.parts.append([start, stop])
            claim.start = claim.committed = stop
        claim.resumed_failed = len(claim.failed)
        record, attempt = {}, calque.attempt_key(claim.run_id, claim.claim_id)
        if attempt in keys:
            try:
                record = json.loads(self.backend.store.get(attempt))
            except ValueError as e:     # torn by hand: what it said is lost (a redelivery still runs item by item)
                log.warning("worker %s: attempt record %s unreadable (%s)", self.worker_id, attempt, e)
        state, previous = record.get("state"), record.get("receive_count", 0)
        # a record at or past this count was written under an earlier message (a redrive restarts the count)
        claim.progress_at = record.get("progress_at", 0) if previous < rc else 0
        if claim.start > record.get("covered", 0):        # a part was written after the record: progress
            claim.progress_at = max(claim.progress_at, rc - 1)
        claim.quarantined, deaths = dict(record.get("quarantined", {})), dict(record.get("deaths", {}))
        ahead = [str(k) for k in record.get("running", []) if k >= claim.start and str(k) not in claim.quarantined]
        if state == "running" and ahead and 0 < previous < rc:   # a delivery died running this item alone: progress,
            claim.progress_at = max(claim.progress_at, previous + 1)   # even if the one after it died before it saw it
        if state == "running" and previous == rc - 1 and ahead:   # the last delivery died running this item alone
            deaths[ahead[0]] = deaths.get(ahead[0], 0) + 1
            if deaths[ahead[0]] >= POISON_DEATHS:
                how, own = self.how_it_ended(record)
                if own or deaths[ahead[0]] > POISON_DEATHS or not self.churning():
                    claim.quarantined[ahead[0]] = (f"poison: the worker died running this item "
                                                   f"({deaths[ahead[0]]} deaths; {how})")
        elif state == "suspect" and len(ahead) == 1:             # the watchdog saw this item alone overrun
            claim.quarantined[ahead[0]] = (f"timed out after {record['batch_timeout']:g} s (the pool's "
                                           f"batch_timeout): the worker was restarted, the item quarantined")
        if len(claim.quarantined) > len(record.get("quarantined", {})):
            claim.progress_at = rc
        claim.record = dict(record, deaths=deaths)
        claim.single = (bool(record) or rc > 1) and not (state == "released" and previous == rc - 1)
        if claim.single:    # its last delivery died: how long it lived, at least (its last record's age)
            claim.life = record.get("alive", 0.0) if previous == rc - 1 else 0.0
            if claim.life or self.seen_life is None:   # a life known, or the first death seen
                self.seen_life = claim.life
            self.seen_at = time.time()
        log.info("worker %s: claim %s/%s delivery %d: %d items resumed from %d part(s)%s%s%s", self.worker_id,
                 claim.run_id, claim.claim_id, rc, claim.start, len(claim.parts),
                 ", one item at a time" if claim.single else "", f", deaths at offsets {deaths}" if deaths else "",
                 f", quarantined {sorted(map(int, claim.quarantined))}" if claim.quarantined else "")

    def mark_churn(self):
        """An item with a death pinned on it ran alone and returned: it did not cause that death, so this pool's
        workers die of something else. The marker (its key says when) makes churning() true for CHURN_MEMORY s.
        Best effort: a lost marker only leaves the bar where it was."""
        with contextlib.suppress(Exception):
            self.backend.store.put(f"{self.stats_prefix}churn-{time.time():012.1f}-{self.worker_id}", b"")

    def churning(self):
        """Whether an innocent death was marked in this pool (mark_churn) within CHURN_MEMORY s: then a death while
        an item ran alone may be a coincidence, and poison needs one death more. One LIST, only when an item reaches
        POISON_DEATHS."""
        marks = f"{self.stats_prefix}churn-"
        since = f"{marks}{time.time() - CHURN_MEMORY:012.1f}"
        return any(key.startswith(marks) for key in self.backend.store.list(self.stats_prefix, start_after=since))

    def how_it_ended(self, record):
        """(How the worker of an attempt record ended, whether by its own doing): its last stats
        say, when it wrote them, else the exit status its supervisor recorded (record_exit). Any
        end but SIGKILL is the process's own (a status, a segfault); a SIGKILL may be outside's."""
        stats, worker = self.backend.store, record.get("worker_id")
        with contextlib.suppress(Exception):
            last = json.loads(stats.get(f"{self.stats_prefix}{worker}.json")).get("exit")
            if last:
                return last, True
        with contextlib.suppress(Exception):
            code = int(stats.get(f"{self.stats_prefix}exit-{worker}"))
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            return how, code != -signal.SIGKILL
        return (f"exit code or signal unknown: worker {worker} left no word (kill -9, a crash, "
                f"os._exit)"), False

    def drain(self, claim):
        """Run the claim's items (paying @enter first on a cold worker); raises ClaimReleased when the claim was
        given back (grace over, lease lost)."""
        self.gpu.start()
        try:
            if self.entered_at is None:     # a cold worker pays its load inside its first claim
                self.enter()
                claim.enter_paid, claim.acquisition = self.enter_seconds, self.acquisition_seconds
            self._drain_batches(claim)
        finally:
            claim.gpu = self.gpu.stop()
        if self.heartbeat.lost.is_set():
            raise ClaimReleased("lease lost")

    def finish(self, claim):
        """The summary, then the ack (queued: Acks): a crash before the ack leaves the claim to be redelivered, and
        its redelivery finds the summary and acks without recomputing."""
        finished = time.time()
        warm_hit = self.entered_at is not None and self.entered_at <= claim.received
        notes = []
        if len(claim.errors) < len(claim.failed):
            notes.append(f"errors: only the first {len(claim.errors)} of {len(claim.failed)} messages kept")
        if not claim.gpu["measured"]:
            notes.append(f"GPU utilisation not measured: {claim.gpu['reason']}")
        if self.backend.kind == "local":
            notes.append("requests: counted on the local backend, where they cost nothing; priced as if on SQS/S3")
        summary = self._summary(claim.message, claim.run_id, claim.claim_id, claim.received, finished,
                                extra_other=1,   # + the ack below, counted as if it went alone
                                items=len(claim.items), failed=claim.failed, errors=claim.errors, warm_hit=warm_hit,
                                enter_seconds_paid=claim.enter_paid, acquisition_seconds=claim.acquisition,
                                model_seconds=claim.model_seconds, notes=notes, parts=claim.parts,
                                resumed=claim.start, collate_wait_seconds=round(claim.wait_seconds, 6),
                                prefetch=self.pipelined(claim), gpu_utilisation=claim.gpu)
        self.output.flush()              # what the claim printed lands before its summary
        self._put(calque.summary_key(claim.run_id, claim.claim_id), json.dumps(summary, indent=1))
        self.made_progress()
        self.heartbeat.stop()            # no renewal may land after the ack
        self.acks.add(claim.message, f"{claim.run_id}/{claim.claim_id}")
        ran = len(claim.items) - claim.start
        self.stats["claims"] += 1
        self.stats["warm_hits"] += warm_hit
        self.stats["items"] += ran
        self.stats["items_failed"] += len(claim.failed) - claim.resumed_failed
        self.busy_seconds += summary["claim_seconds"]
        log.info("worker %s: run %s claim %s: %d items (%d failed), warm hit %s, @enter paid %.3fs, %.3fs%s",
                 self.worker_id, claim.run_id, claim.claim_id, len(claim.items), len(claim.failed),
                 "yes" if warm_hit else "no", claim.enter_paid, summary["claim_seconds"],
                 f", {claim.start} resumed" if claim.start else "")

    def _summary(self, message, run_id, claim, started, finished, extra_other, **fields):
        """calque.claim_summary with this worker's identity and the requests counted since its last claim
        (plus the summary's own PUT and `extra_other` queue calls still to come)."""
        return calque.claim_summary(
            run_id=run_id, claim=claim, model=self.record["model"], worker_id=self.worker_id,
            mode="cold" if self.ephemeral else "pool", backend=self.backend.kind,
            receive_count=message.receive_count, enter_count=self.enter_count, started=started, finished=finished,
            requests=self.claim_requests(extra_puts=1, extra_other=extra_other), **fields)

    def _drain_batches(self, claim):
        """Items [claim.start, n) through collate + batch: batch_size at a time, or one at a time behind the
        attempt record (claim.single). How batches are prepared is decided once, for the claim (claim_kind);
        where the pipeline thread serves it (pipelined), the next batch is gathered while the model runs the
        current one (not item by item: there an item's collation must run after its attempt record, where a crash
        in it is blamed on the right item). Results are serialised on this thread, after each call: GIL-bound
        work that would only slow a model beside it. Quarantined items fail unrun. A batch that raises is
        retried one item at a time, so that only the failing items fail. Results go into a part at each
        checkpoint and at the end."""
        n, size = len(claim.items), 1 if claim.single else self.record["batch_size"]
        claim.kind = self.collator.claim_kind(claim.items)
        units = [range(a, min(a + size, n)) for a in range(claim.start, n, size)]
        runnable = ([[k for k in unit if str(k) not in claim.quarantined] for unit in units] if claim.quarantined
                    else units)   # nothing quarantined (nearly always): no str(k) per item
        pending = self._prepare(claim, runnable[0]) if units and not claim.single else None
        claim.last_commit = time.monotonic()
        try:
            for u, unit in enumerate(units):
                if self.release_now.is_set():
                    self.commit(claim)       # what is done stays done
                    raise ClaimReleased("grace period over" if self.stop_requested else "released")
                if self.heartbeat.lost.is_set():
                    raise ClaimReleased("lease lost")
                if claim.single:
                    if runnable[u]:
                        self.write_attempt(claim, "running", runnable[u])
                    current = self._prepare(claim, runnable[u])
                else:
                    current, pending = pending, (self._prepare(claim, runnable[u + 1]) if u + 1 < len(units) else None)
                outcome = self._run_unit(claim, unit, runnable[u], current)
                if claim.single:              # it ran alone and the process lived: whatever killed one, not this
                    if any([claim.record["deaths"].pop(str(k), 0) for k in runnable[u]]):
                        self.mark_churn()
                formatted = Done(format_outcome, outcome, claim.first + unit.start)   # GIL-bound: no thread
                claim.formatted.append((unit.stop, formatted))
                claim.batches += 1
                since, every = time.monotonic() - claim.last_commit, self.commit_interval(claim)
                if (since >= every if every is not None else
                        claim.batches >= self.checkpoint_batches and since >= self.checkpoint_seconds):
                    self.commit(claim)
        finally:
            if pending is not None:   # a batch gathered ahead of a loop that ended early gives its slot back
                with contextlib.suppress(Exception):
                    self.collator.release(pending.result())
        self.commit(claim)

    def commit_interval(self, claim):
        """s between two result parts under churn, or None where neither this claim's last delivery died nor this
        worker saw a death within CHURN_MEMORY s: the checkpoint rule alone, so a pool never killed pays nothing.
        Under churn, Young's interval sqrt(2 x part PUT x life), at most the checkpoint: a part's
        cost against the work a kill loses. The life: the dead delivery's (0, a part every batch,
        when unknown) or the latest this worker saw (its slot's last worker's, a claim's it took
        over, its age at a sibling's death)."""
        if claim.life is None and (self.seen_life is None or time.time() - self.seen_at > CHURN_MEMORY):
            return None
        life = claim.life or (self.seen_life or 0.0)
        return min(self.checkpoint_seconds, (2 * self.part_seconds * life) ** 0.5)

    def commit(self, claim, wait=None):
        """The batches run since the last part, written as one part (with `wait`: only those serialised within
        `wait` s each, for the watchdog, which must not hang on a pipeline thread stuck in a handler's collate)."""
        ready = []
        for stop, future in claim.formatted:
            try:
                ready.append((stop, future.result(timeout=wait)))
            except TimeoutError:
                break
        if not ready:
            return
        stop = ready[-1][0]
        suffix, data = calque.encode_part([chunk for _, (chunks, _, _) in ready for chunk in chunks])
        t0 = time.monotonic()
        self._put(calque.part_key(claim.run_id, claim.claim_id, claim.committed, stop, suffix), data)
        self.part_seconds = time.monotonic() - t0
        for _, (_, failed, errors) in ready:
            claim.failed += failed
            claim.errors.update(list(errors.items())[:calque.ERRORS_KEPT - len(claim.errors)])
        claim.parts.append([claim.committed, stop])
        claim.committed, claim.progress_at = stop, claim.message.receive_count
        self.made_progress()
        del claim.formatted[:len(ready)]
        claim.batches, claim.last_commit = 0, time.monotonic()

    def made_progress(self):
        """A result part or a summary is written: the supervisor hears of this process's first (announce)."""
        if not self.progressed:
            self.progressed = True
            announce(self.ready_file, "progress")

    def write_attempt(self, claim, state, running, retry=True, **fields):
        """The claim's attempt record: `state` running (`running` runs alone now), suspect (it overran
        batch_timeout) or released (let go alive); deaths, quarantines and progress carry over."""
        claim.record = dict(claim.record, state=state, running=list(running), worker_id=self.worker_id,
                            receive_count=claim.message.receive_count, covered=claim.committed,
                            progress_at=claim.progress_at, quarantined=claim.quarantined, at=calque.now_iso(),
                            alive=round(time.time() - claim.received, 3), **fields)
        key, body = calque.attempt_key(claim.run_id, claim.claim_id), json.dumps(claim.record)
        if retry:
            self._put(key, body)
        else:
            self.backend.store.put(key, body)

    def _put(self, key, data):
        """A store write for the running claim, retried (WRITE_RETRY) while its lease holds: a short store
        outage costs a pause, not a delivery. A stop signal ends the waits."""
        delay, retries = WRITE_RETRY
        try:
            for retry in range(retries + 1):
                if self.heartbeat.lost.is_set():
                    raise ClaimReleased("lease lost")
                try:
                    return self.backend.store.put(key, data)
                except Exception as e:
                    if retry == retries:
                        raise
                    self.retrying.set()
                    log.warning("worker %s: store write of %s failed (%s: %s); retrying in %.1fs",
                                self.worker_id, key, type(e).__name__, e, delay)
                if self.release_now.wait(delay):
                    raise ClaimReleased("grace period over while retrying a store write")
                delay *= 2
        finally:
            self.retrying.clear()

    def let_go(self, message, claim, delay, why):
        """Give a claim back alive: its attempt record says so (best effort, one try: the next delivery then
        neither counts a death nor runs item by item), then it is visible again after `delay` s."""
        if claim is not None:
            with contextlib.suppress(Exception):
                self.write_attempt(claim, "released", [], retry=False)
        self.heartbeat.stop()            # a renewal after this would hide the claim again
        try:
            self.queue.change_visibility(message, delay)
        except Exception as e:
            log.warning("worker %s: claim %s not released (%s: %s): visible again when its lease runs out",
                        self.worker_id, self._name(message, claim), type(e).__name__, e)
        log.warning("worker %s: claim %s let go (%s); visible again in %.0fs", self.worker_id,
                    self._name(message, claim), why, delay)

    def fault_delay(self, message):
        """How long a claim let go on a fault stays invisible: long enough that a store outage does not spend
        its deliveries in milliseconds, doubling per delivery, at most the visibility timeout."""
        return min(RELEASE_DELAY * 2 ** (message.receive_count - 1), self.record["visibility_timeout"])

    @staticmethod
    def _name(message, claim):
        return f"{claim.run_id}/{claim.claim_id}" if claim else f"(delivery {message.receive_count})"

    def overrun(self, claim, offsets):
        """The watchdog's call, from its thread, when a handler call on `offsets` ran past batch_timeout: commit
        what is done, mark the items suspect, release the claim at once and exit EXIT_HUNG for the supervisor
        to start a fresh worker (the stuck thread cannot be stopped)."""
        seconds = time.monotonic() - self.watchdog.running[1]
        log.error("worker %s: claim %s/%s: items %s ran %.1fs, past the batch_timeout of %gs: releasing the claim "
                  "and exiting %d", self.worker_id, claim.run_id, claim.claim_id,
                  [claim.first + k for k in offsets], seconds, self.batch_timeout, EXIT_HUNG)
        with self.serving(claim.heartbeat, claim.requests):
            try:
                self.commit(claim, wait=OVERRUN_COMMIT_WAIT)
                self.write_attempt(claim, "suspect", offsets, batch_timeout=self.batch_timeout)
            except BaseException as e:      # the exit below must happen whatever the store says
                log.warning("worker %s: before exiting: %s: %s", self.worker_id, type(e).__name__, e)
        claim.heartbeat.stop()
        with contextlib.suppress(Exception):
            self.queue.change_visibility(claim.message, 0)
        with contextlib.suppress(Exception):
            self.settle(wait=OVERRUN_COMMIT_WAIT)
        self.last_word = f"exit {EXIT_HUNG}: a handler call ran past the batch_timeout of {self.batch_timeout:g} s"
        self.write_stats("stopped")
        os._exit(EXIT_HUNG)

    def pipelined(self, claim):
        """Whether this claim's batches are prepared on the pipeline thread, while the model runs the one before:
        only where that can run beside the model (a numeric gather: a copy with the GIL released; the handler's
        own collate, often tokenizers or torch that release it too). Not for batches that pass through as lists:
        there, on two cores, it gained nothing end to end (0.95-1.02x) and its GIL-bound Python slowed the model's
        thread (model_seconds 1.44-1.52x what the model took)."""
        return self.prefetcher is not None and claim.kind != AS_LIST

    def _prepare(self, claim, offsets):
        """A future of the batch of these offsets, prepared as the claim's kind says."""
        if not offsets:
            return None
        payloads = [claim.items[k] for k in offsets]
        if self.pipelined(claim):
            return self.prefetcher.submit(self.collator.prepare, payloads, claim.kind)
        return Done(self.collator.prepare, payloads, claim.kind)

    def model_clock(self):
        """Seconds on the model's clock: wall time less the pipeline thread's CPU time. The difference of two
        readings around a handler call is the call's wall time less what the pipeline thread ran meanwhile, so a
        call slowed by waiting for the GIL that thread held is not counted as the model's. Hidden cost: a GIL-free
        copy on that thread is taken out too, so with large numeric batches and a model that releases the GIL,
        model_seconds errs low, never high. Without the pipeline thread it is the call's wall time."""
        pipeline = time.clock_gettime(self.pipeline_clock) if self.pipeline_clock is not None else 0.0
        return time.perf_counter() - pipeline

    def _run_unit(self, claim, unit, runnable, prepared):
        """[(ok, result or error)] for a unit's items: the runnable ones through the handler, the quarantined
        ones failed with the reason they were quarantined."""
        ran = {}
        if runnable:
            outcome, model, wait = self._run_batch(prepared, [claim.items[k] for k in runnable], runnable, claim.kind)
            claim.model_seconds += model
            claim.wait_seconds += wait
            if len(runnable) == len(unit):   # nothing quarantined: the outcome is the unit's, in order
                return outcome
            ran = dict(zip(runnable, outcome))
        return [ran[k] if k in ran else (False, claim.quarantined[str(k)]) for k in unit]

    def _run_batch(self, future, payloads, offsets, kind):
        """[(ok, result or error)] for one batch, its model seconds (model_clock) and the seconds spent waiting for
        collation. The watchdog times the batch call, then each single-item retry on its own."""
        self.watchdog.watch(offsets)
        try:
            return self._call_batch(future, payloads, offsets, kind)
        finally:
            self.watchdog.watch(None)

    def _call_batch(self, future, payloads, offsets, kind):
        t0 = time.perf_counter()
        try:
            prepared = future.result()
        except Exception:
            prepared = None     # collation failed: the items are tried one by one below, each failing alone
        wait = time.perf_counter() - t0
        model = 0.0
        if prepared is not None:
            t0 = self.model_clock()
            try:
                outputs = self.batch_fn(self.collator.inputs(prepared))
                model = self.model_clock() - t0
                try:
                    return [(True, o) for o in calque.batch_rows(outputs, len(payloads))], model, wait
                except ValueError as e:     # the wrong count or shape: every item fails with why, none is retried
                    return [(False, str(e))] * len(payloads), model, wait
            except Exception:
                model = self.model_clock() - t0
            finally:
                self.collator.release(prepared)
        outcome = []
        for offset, payload in zip(offsets, payloads):
            self.watchdog.watch([offset])
            t0 = self.model_clock()
            try:
                single = self.collator.prepare([payload], kind)
                try:
                    out = self.batch_fn(self.collator.inputs(single))
                finally:
                    self.collator.release(single)
                try:
                    outcome.append((True, calque.batch_rows(out, 1)[0]))
                except ValueError as e:
                    outcome.append((False, str(e)))
            except Exception as e:
                outcome.append((False, item_error(e)))
            model += self.model_clock() - t0
        return outcome, model, wait

    def dead_letter(self, message, reason, msg):
        """A claim that cannot succeed: failure summary (where the run is known), DLQ copy, then delete. The
        DLQ copy carries run_id, claim and reason, so nothing is lost when the summary cannot be written."""
        run_id, claim = (msg or {}).get("run_id"), (msg or {}).get("claim")
        known = all(isinstance(v, str) and calque.SAFE_ID.match(v) for v in (run_id, claim))
        if known:
            try:    # another model's run may be out of this worker's reach (its IAM role): the DLQ copy still goes
                self.write_failure_summary(message, run_id, claim, reason)
            except Exception as e:
                log.warning("worker %s: no failure summary for %s/%s (%s: %s)", self.worker_id, run_id, claim,
                            type(e).__name__, e)
        self.dlq.send(json.dumps({"reason": reason, "body": message.body, "receive_count": message.receive_count,
                                  "worker_id": self.worker_id, "at": calque.now_iso(),
                                  "run_id": run_id if known else None, "claim": claim if known else None}))
        self.queue.delete(message)
        log.warning("worker %s: claim to dead-letter queue %s: %s", self.worker_id, self.record["dlq"], reason)

    def write_failure_summary(self, message, run_id, claim, reason):
        """The summary of a claim that was not run, so that a waiting submitter reports it (unless one exists);
        retried like a result write for this model's runs (another model's may be out of this worker's reach)."""
        key = calque.summary_key(run_id, claim)
        if not self.backend.store.exists(key):
            now = time.time()
            summary = json.dumps(self._summary(message, run_id, claim, now, now,
                                               extra_other=2,   # + the DLQ send and the delete
                                               error=reason, notes=["dead-lettered: the claim was not run"]), indent=1)
            if calque.run_slug(run_id) == self.record["slug"]:
                self._put(key, summary)
            else:
                self.backend.store.put(key, summary)

    # ---- accounting -----------------------------------------------------------------------------

    def claim_requests(self, extra_puts, extra_other):
        """The requests this thread made for the claim (its receive, accept, parts and heartbeats drained on it)
        and the worker's loose ones since the previous summary (idle polls, stats, start-up), plus the writes about
        to happen, which this thread's tally then leaves out. Claims overlap, so a claim's own requests are
        tallied apart (calque.Requests); the worker stats hold the exact totals."""
        delta = self.backend.requests.take()
        delta["store_puts"] += extra_puts
        delta["queue_other"] += extra_other
        return {k: delta[k] for k in calque.REQUEST_KEYS}

    def write_stats(self, state):
        now = time.time()
        self.last_stats, self.stats_behind = time.monotonic(), False
        stats = {"worker_id": self.worker_id, "model": self.record["model"], "host": socket.gethostname(),
                 "pid": os.getpid(),
                 "mode": "cold" if self.ephemeral else "pool", "state": state, "backend": self.backend.kind,
                 "started_at": calque.now_iso(self.started), "updated_at": calque.now_iso(now),
                 "alive_seconds": round(now - self.started, 3), "busy_seconds": round(self.busy_seconds, 3),
                 "enter_seconds": round(self.enter_seconds, 6), "enter_count": self.enter_count,
                 "entered_at": calque.now_iso(self.entered_at) if self.entered_at else None,   # @enter's end
                 "acquisition_seconds": round(self.acquisition_seconds, 6),
                 "claims": self.stats["claims"], "warm_hits": self.stats["warm_hits"], "items": self.stats["items"],
                 "items_failed": self.stats["items_failed"], "requests": dict(self.backend.requests),
                 # "c", "reference" (the numpy fallback: a failed C build, or FASTBATCH_REFERENCE=1), or None when
                 # this handler's batches never needed fastbatch: a GPU pool on the fallback says so here
                 "fastbatch": getattr(sys.modules.get("fastbatch"), "BACKEND", None)}
        if self.last_word:
            stats["exit"] = self.last_word
        try:
            self.backend.store.put(self.stats_key, json.dumps(stats, indent=1))
        except Exception as e:   # stats are bookkeeping: a failed write must not stop the worker
            log.warning("worker %s: stats write failed (%s)", self.worker_id, e)


def enter_workdir(workdir, snapshot_folder):
    """Run the handler where its user works: the folder `pool create` (or a cold submit) ran in, when it exists on
    this machine, else (an EC2 instance) the handler's snapshot folder. It goes first on sys.path too, so that the
    handler imports its sibling modules as it would there; relative paths (open("vocab.txt")) resolve there."""
    folder = workdir if workdir and os.path.isdir(workdir) else snapshot_folder
    os.chdir(folder)
    sys.path.insert(0, folder)
    log.info("worker: working directory %s", folder)


def announce(ready_file, *words):
    """Tell this machine's supervisor how far this worker got: its ready file gets our pid once
    @enter is done (pool create waits on it), then "progress" once a result part or a summary is
    written (a death after that is not a crash loop: supervisor.restart_delay)."""
    if ready_file:
        calque.write_file_atomic(ready_file, " ".join((str(os.getpid()), *words)))


HANDOFF_FLAGS = (("--supervisor-pid", int), ("--ready-file", str), ("--spawned-at", float),
                 ("--previous-life", float), ("--gpu-index", int))   # Worker's keyword arguments


def main(argv=None):
    parser = argparse.ArgumentParser(prog="warmd.py", description="The sticky worker of a calque pool.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="serve the pool of this model")
    which.add_argument("--run", help="serve one cold run's queue, then exit (started by `calque.py submit` without "
                                     "--pool)")
    for flag, kind in HANDOFF_FLAGS:   # from supervisor.py or a cold run; not in --help
        parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if argv is None:   # a command line: run under the kit's .venv when this Python lacks its packages
        try:
            calque.kit_python(sys.argv[1:], os.path.abspath(__file__))
        except calque.UserError as e:
            print(f"warmd: error: {e}", file=sys.stderr)
            return calque.EXIT_USAGE
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s warmd %(message)s", stream=sys.stderr)
    faulthandler.enable()   # a handler that crashes the process (a segfault) leaves its traceback in the worker log
    try:
        conf = calque.settings()
        # check the store under the pool's own folder, the only one a least-privilege worker role may list
        own_folder = f"pools/{calque.slug(args.model)}/" if args.model else f"runs/{args.run}/"
        backend = calque.open_backend(conf["CALQUE_STORE"], check_prefix=own_folder)
        handoff = {key: value for key, value in vars(args).items() if key not in ("model", "run")}
        if args.model:
            record = calque.load_pool(backend, args.model)
            prefix = calque.worker_stats_prefix(args.model)
        else:
            record = calque.read_json(backend, calque.cold_record_key(args.run))
            prefix = f"runs/{args.run}/workers/"
        worker = Worker(backend, record, prefix, conf, not args.model, **handoff)
        worker.output.capture()
        worker.work()
    except calque.UserError as e:
        print(f"warmd: error: {e}", file=sys.stderr)
        return calque.EXIT_USAGE
    except calque.NotFound as e:
        print(f"warmd: error: {e} not found in the store: check CALQUE_STORE and the pool (`calque.py pool list`)",
              file=sys.stderr)
        return calque.EXIT_USAGE
    except Exception as e:
        if type(e).__module__.startswith("botocore"):   # at start-up: credentials, permissions, endpoint
            print(f"warmd: error: AWS: {calque.aws_error_line(e)}: check the instance role and region", file=sys.stderr)
            return calque.EXIT_FAILED
        raise
    return calque.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
