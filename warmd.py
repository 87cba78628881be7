"""warmd: the sticky worker. Loads its pool's model once (@enter), then claims batch after batch.

    python warmd.py --model demo    # a pool worker (what the supervisor and EC2 run)
    python warmd.py --run RUN       # a cold run's worker: @enter in its first claim, drains, exits

All it runs comes from the pool record in the store, never from a message. The rooms:
  Worker    the process: start (queues, handler, @enter), signals, the loop (_loop_once: a poll or
            the claim ahead, Ahead), stop; each delivery is a ClaimRun (open_claim, run_claim,
            finish_claim on the finisher), let go or dead-lettered where it cannot finish (ending)
  ClaimRun  one delivery, on the threads that work for it: its plan of units, batches, spool,
            parts, progress and attempt record, summary (finish), ack (Acks), or let_go
  Rules     the redelivery and poison rules: accept (dead letters, duplicates, other versions),
            take_over (what earlier deliveries left: parts, spool, deaths, poison, overruns), the
            pool's deaths as this worker knows them (the part cadence, churn marks)
  Model     the handler's batch calls under the Watchdog, collated beside the model (Collator)
  Accounts  the worker's counters and stats; a claim summary's identity and requests
The rules (checkpoints, poison, dead letters, hung batches, faults, claims ahead, signals) are
docs/contract.md's.
"""
# Threads. The main one runs the loop, the handler and the signal handlers. The others:
#   thread         does                                      touches               lock
#   heartbeat      Leases: renews each held claim's lease    Heartbeat.due, .lost  Leases.changed,
#                  every third of its visibility timeout                           lease.renewing
#   watchdog       times handler calls; on an overrun,       the claim (overrun)   Watchdog.lock
#                  commits, releases, exits EXIT_HUNG
#   pipeline       Collator.prepare of the next batch        ring slots, a stream  its future
#   collate        the handler's collate further ahead       its batch's items     its future
#                  (Model.deepen: while the model waits)
#   fetch          FetchedItems._get: a claim's objects      FetchedItems.futures  FetchedItems.lock
#                  by reference, ahead of their batch
#   manifest       the manifest read (network backends)      the store             its future
#   ahead          Ahead._fetch: probe, then open_claim      the claim it gets     Ahead.lock/taken
#   finisher       finish_claim: summary, Acks.add           stats, Acks           its future
#   ack timer      Acks.flush, `wait` s after the first ack  the queue             Acks.lock
#   grace timer    release_now, CALQUE_GRACE s after SIGTERM Worker.release_now    an Event
#   GPU sampler    NVML samples during a claim               GpuSampler.samples    joined in stop()
#   spot-poller    metadata: a spot notice -> SIGTERM,       signals to itself     none
#                  a terminating instance -> SIGUSR1
#   output         Output.flush every OUTPUT_FLUSH s         the store             Output.flushing
#   (pipe copier)  fds 1 and 2 -> the log and Output.add     Output.parts          Output.lock
# A thread working for a claim counts its requests there (Worker.ending); its writes check its lease
import argparse
import contextlib
import faulthandler
import fcntl
import functools
import glob
import hashlib
import heapq
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
import collections
from collections import Counter
from concurrent.futures import ThreadPoolExecutor


import calque_core
import calque_runs
import calque_sources
import calque_supervisor
from calque_core import orjson

# ------------------------------------------------------------------------------------------------
# defaults (the pool record and CALQUE_* settings override the per-pool ones)
STATS_INTERVAL = 30.0       # s between two worker-stats writes, busy or idle
STATS_IDLE_WAIT = 0.2       # s of the first poll after a claim; an empty one writes the stats
COLD_POLL_WAIT = 0.2        # s of one long poll of a cold run's worker, which exits once it is empty
GPU_SAMPLE_INTERVAL = 0.1   # s between two NVML utilisation samples during a claim
ERROR_BACKOFF = (1.0, 30.0) # s: first wait after a failed receive, doubling up to this cap
PREFETCH = True             # a pipeline thread gathers batch k+1 while the model runs k
COLLATE_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))   # batches a handler's collate prepares
                            # at once, at most: one more each time the model waits on it (COLLATE_WAIT_SHARE)
COLLATE_WAIT_SHARE = 0.05   # a wait on collate over this share of the batch's model time adds a thread
FETCH_THREADS = 16          # threads fetching a claim's objects by reference (each waits on one GET)
RING_SLOTS = 3              # host buffers: the batch in the model, the one being gathered, one spare
RING_WAIT = 60.0            # s the prefetch thread waits for a free ring slot before failing the batch
PIPELINE = True             # claims pipelined: the finisher writes summary and ack; AHEAD
AHEAD = None                # receive the next claim beside the last batch; None: where a request
                            # crosses a network (S3 + SQS), not on the local backend
AHEAD_HOLD = 2.0            # s a claim received ahead waits to start, at most
AHEAD_TICK = 0.05           # s between two looks, while a claim is held ahead, at whether the worker stops
PROGRESS_SECONDS = 5.0      # s between two progress records of a long claim (items done: submit's bar,
                            # runs show, the dashboard); a claim shorter than that writes none
ACK_BATCH = 10              # acks per request (SQS's DeleteMessageBatch takes at most 10)
ACK_WAIT = 1.0              # s an ack waits for others, at most (and <= visibility/4)
WRITE_RETRY = (0.5, 5)      # a failed store write of a claim: first wait (s), doubling, and retries (15.5 s in all)
RELEASE_DELAY = 5.0         # s a claim let go on a fault stays invisible, doubling per delivery
SQS_MAX_INVISIBLE = 43140.0 # s a claim may stay invisible from its receipt: SQS's 12 h, a minute kept
POISON_DEATHS = 2           # lone-run deaths that quarantine an item as poison (+1 under churn)
CHURN_MEMORY = 600.0        # s an innocent death (an item died alone, then returned) marks churn
BYTES_REPR = re.compile(r"<_io\.BytesIO object at 0x[0-9a-f]+>")   # a decoder's name for its bytes
WATCHDOG_TICK = 1.0         # s between two checks of the handler call (batch_timeout/4 if less)
OVERRUN_WAIT = 1.0          # s the watchdog waits on the claim ahead and the finisher at exit
OUTPUT_FLUSH = 1.0          # s between two chunks of what handler code prints, written to the store
OUTPUT_CHUNK = 64 << 10     # characters of a chunk at most; past 4 unwritten, the oldest go
OUTPUT_KEPT = 64            # chunks a worker keeps in the store (it deletes the older ones)
EXIT_HUNG = 3               # exit status after a handler call overran batch_timeout
SPOOL_KEPT = 86400.0        # s a spool file left by a dead worker is kept for a delivery here

log = logging.getLogger("warmd")


class Interrupted(BaseException):
    """Raised by the signal handler to break out of an idle long poll."""


class ReleaseNow(BaseException):
    """A second signal during a claim, or a first one without grace: release it now (no Exception:
    a handler cannot catch it)."""


class ClaimReleased(Exception):
    """The drain loop gave the claim back (grace period over, or lease lost)."""


class ClaimTooLong(Exception):
    """The drain loop stopped a claim near SQS's cap on its invisibility: dead-letter it (why)."""


# One batch as the handler will receive it, plus the ring slot and CUDA event that back it
Prepared = collections.namedtuple("Prepared", "inputs slot event", defaults=(None, None))


# How a claim's batches are prepared, decided once per claim by Collator.claim_kind
BY_HANDLER = "handler"      # the handler's own collate(payloads), on the pipeline thread
NUMERIC = "numeric"         # fastbatch gathers dicts of arrays; any other batch passes through
AS_LIST = "list"            # no item can collate: batches pass as lists, on the model's thread
NOT_NUMERIC = (str, bytes, dict, type(None), complex)   # payload values that never collate
JSON_SCALARS = {str, int, float, bool, type(None), dict}  # value types of JSON items with no array


def may_collate(item):
    """Whether a batch holding this item may collate (type checks only: nothing imported)."""
    if type(item) is not dict or any(isinstance(value, NOT_NUMERIC) for value in item.values()):
        return False
    return any(isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0
               for value in item.values())


class Collator:
    """What a handler's batch call receives: its own collate(payloads); else numeric payloads
    gathered by fastbatch into reused host buffers (pinned, then copied to the GPU on a side stream
    beside the model); else the list. fastbatch and torch load only for a claim that may collate."""

    def __init__(self, handler_collate):
        self.handler_collate = handler_collate
        self.ring = None
        if handler_collate is None and "torch" in sys.modules:   # cheap now, not in a claim
            self._load()

    def _load(self):
        import fastbatch
        import torch
        fastbatch.load()    # its C or numpy path, chosen now (and named in the worker's stats)
        self.torch, self.ring = torch, fastbatch.PinnedRing(RING_SLOTS)
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None

    def claim_kind(self, items):
        """How this claim's batches are prepared: BY_HANDLER with a collate of its own; NUMERIC when
        some item may collate (fastbatch still plans each batch); AS_LIST when none can."""
        if self.handler_collate is not None:
            return BY_HANDLER
        if items.fetched:   # files, {"path", "bytes"}: never scanned (each a fetch)
            return AS_LIST
        try:   # the common case first: no value in the claim is a list
            values = itertools.chain.from_iterable(map(dict.values, items))
            if set(map(type, values)) <= JSON_SCALARS:
                return AS_LIST
        except TypeError:   # an item that is not a dict: the scan below decides
            pass
        if not any(map(may_collate, items)):
            return AS_LIST
        if self.ring is None:
            self._load()
        return NUMERIC

    def prepare(self, payloads, kind):
        """One batch of a claim of this kind (on the pipeline thread where pipelined)."""
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
                on_device = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
                event = self.torch.cuda.Event()
                event.record(self.stream)
        except BaseException:
            self.ring.release(slot)
            raise
        return Prepared(on_device, slot, event)

    def inputs(self, prepared):
        """On the model's thread: its stream waits for the copy (on the GPU, not a host sync)."""
        if prepared.event is not None:
            main = self.torch.cuda.current_stream()
            main.wait_event(prepared.event)
            for tensor in prepared.inputs.values():
                tensor.record_stream(main)   # not reused before the model is done with it
        return prepared.inputs

    def release(self, prepared):
        """The slot is handed out again only once the copy out of it has finished."""
        if prepared is not None and prepared.slot is not None:
            if prepared.event is not None:
                prepared.event.synchronize()
            self.ring.release(prepared.slot)


def gather(items, offsets):
    """The payloads of `offsets` that can be had, and {offset: why} of those that cannot (objects by
    reference that changed or vanished since submit)."""
    payloads, missing = [], {}
    for k in offsets:
        item = items[k]
        if type(item) is calque_core.Unavailable:
            missing[k] = str(item)
        else:
            payloads.append(item)
    return payloads, missing


def result_encoder():
    """value -> its strict, compact JSON text, from an encoder made once (json.dumps makes one a
    call). No circular check: a circular result fails its item with RecursionError."""
    make = json.encoder.c_make_encoder      # None without the C accelerator
    if make is None:
        return json.JSONEncoder(default=calque_core.to_jsonable, separators=(",", ":"), allow_nan=False,
                                check_circular=False).encode
    encode = make(None, calque_core.to_jsonable, json.encoder.encode_basestring_ascii, None, ":", ",",
                  False, False, False)
    return lambda value: "".join(encode(value, 0))


encode_result = result_encoder()


# dataclasses and datetimes go to calque.to_jsonable, which refuses them as json does
ORJSON_AS_JSON = orjson and orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def refuse_arrays(value):
    """orjson's default= for a batch encoded whole: refuses an array or tensor (format_each keeps it
    in binary), takes any other value as calque.to_jsonable does."""
    np = sys.modules.get("numpy")
    if hasattr(value, "detach") or (np is not None and isinstance(value, np.ndarray)):
        raise TypeError("an array: typed")
    return calque_core.to_jsonable(value)


def encode_fast(value, default=calque_core.to_jsonable):
    """value's result JSON as bytes, by orjson, or None where its text would not do: a null in it (a
    NaN or Infinity, which orjson writes as null where json refuses them) or a value orjson refuses
    (an integer past 64 bits, a key not a string, deep nesting, a lone surrogate)."""
    try:
        text = orjson.dumps(value, default=default, option=ORJSON_AS_JSON)
    except orjson.JSONEncodeError:
        return None
    return None if b"null" in text else text


def load_framer(folder=None):
    """(ffi, lib) of fastbatch's compiled module, loaded from its file (`import fastbatch` would
    import torch into a worker that may never need it); (None, None) where it is not built, and
    every line is then framed in Python (format_each)."""
    try:
        folder = folder or importlib.util.find_spec("fastbatch").submodule_search_locations[0]
        path = os.path.join(folder, "_fastbatch_c" + sysconfig.get_config_var("EXT_SUFFIX"))
        spec = importlib.util.spec_from_file_location("fastbatch._fastbatch_c", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.ffi, module.lib
    except (ImportError, OSError, AttributeError) as e:   # before logging is set up: WARNING shows
        log.warning("warmd: fastbatch's C module is not built (%s): lines framed in Python "
                    "---> HINT: build it where gcc and the Python headers are (make setup)", e)
        return None, None


ffi, framer = load_framer()


def format_outcome(outcome, base, attempts=None):
    """One batch's [(ok, result or error)] as ([result lines], failed indices, errors): encoded in
    one call and framed in C where all succeeded (frame_lines), else item by item (format_each;
    `attempts`: {index: calls} of the items retried, said in their lines)."""
    if not attempts and framer is not None and all(ok for ok, _ in outcome):
        lines = frame_lines([value for _, value in outcome], base)
        if lines is not None:
            return [lines], [], {}
    return format_each(outcome, base, attempts)


def frame_lines(values, base):
    """The result lines of items base, base + 1, ... from one encoding of the values, or None where
    encode_fast does not take them. Line for line format_each's text (tests/test_fastbatch.py)."""
    text = encode_fast(values, refuse_arrays)
    if text is None:
        return None
    cap = len(text) + len(values) * framer.FB_LINE_FRAME
    out = ffi.new("char[]", cap)
    written = framer.fb_frame_lines(text, len(text), base, len(values), out, cap)
    if written < 0:   # text the framer cannot cut (never seen): the lines one by one are right
        log.warning("fb_frame_lines returned %d; framing this batch in Python", written)
        return None
    return ffi.unpack(out, written).decode()


def format_each(outcome, base, attempts=None):
    """format_outcome one item at a time (encode_fast, else encode_result). Arrays in a result
    (calque.typed_cells) are null in its line and kept in binary in the lines' cells. A result that
    is not strict JSON fails its item alone."""
    lines, failed, errors, cells, attempts = [], [], {}, [], attempts or {}
    for i, (ok, value) in enumerate(outcome, base):
        tried = f',"attempts":{attempts[i]}' if i in attempts else ""
        if ok:
            try:
                typed = calque_core.typed_cells(value)
                value = value if typed is None else typed[0]
                fast = b"null" if typed and value is None else encode_fast(value)
                text = encode_result(value) if fast is None else fast.decode()
                lines.append(f'{{"i":{i},"ok":true,"result":{text}{tried}}}\n')
                cells += [(i - base, *cell) for cell in typed[1]] if typed else []
                continue
            except Exception as e:
                value = (f"result is not JSON-serialisable: {type(e).__name__}: {e} ---> HINT: "
                         "return JSON values (a date: .isoformat()), arrays or bytes")
        failed.append(i)
        errors[str(i)] = (getattr(value, "kept", None) or value)[:calque_core.ERROR_CHARS]
        line = {"i": i, "ok": False, "error": value[:calque_core.ERROR_CHARS]}
        if getattr(value, "trace", None):   # an ItemError's frames (none for a wrong result count)
            line["trace"] = value.trace
        if getattr(value, "raised", None):   # a `modal run` call's exception (calque.ModalHandler)
            line["raised"] = value.raised
        if tried:
            line["attempts"] = attempts[i]
        lines.append(encode_result(line) + "\n")
    text = "".join(lines)
    if cells:
        text = calque_core.TypedLines(text)
        text.cells = cells
    return [text], failed, errors


class ItemError(str):
    """A failed item's message ("ValueError: ..."), with `trace`: the frames where it was raised,
    `kept`: the message its claim's summary keeps, where one about another file is the same, and
    `raised`: a `modal run` call's exception, typed, and its app frame (ModalHandler)."""
    trace, kept, raised = (), None, None


def raised(ok, value):
    """Whether an item's outcome is its call's exception (an ItemError): what the pool's retries
    retry; not a wrong result count, a quarantined or a vanished item."""
    return not ok and isinstance(value, ItemError)


def item_error(error, payload=None):
    """The ItemError of a handler's exception for one item, with its last frames. A BytesIO's
    address in it (a decoder's name for the bytes it was given) is the file's path in the result
    line, where the item is a file {"path", "bytes"}, and "<the item's bytes>" in the summary."""
    text = f"{type(error).__name__}: {error}"
    path = payload.get("path") if isinstance(payload, dict) else None
    kept = BYTES_REPR.sub("<the item's bytes>", text)
    named = BYTES_REPR.sub(lambda _: repr(path), text) if isinstance(path, str) else kept
    message = ItemError(named)
    message.kept, message.raised = kept, getattr(error, "calque_raised", None)
    message.trace = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}: {f.line}"
                     for f in traceback.extract_tb(error.__traceback__)[-calque_core.TRACE_FRAMES:]]
    return message


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
    """What handler code prints, to the worker's log and to the store in chunks every OUTPUT_FLUSH s
    and before each summary (`modal run`, `submit --follow-logs`). Captured from capture() on."""

    def __init__(self, store, prefix, label):
        self.store, self.prefix, self.label = store, prefix, label
        self.parts, self.size, self.seq, self.kept = [], 0, 0, []
        self.lock, self.flushing = threading.Lock(), threading.Lock()

    def capture(self):
        """sys.stdout and sys.stderr through a Tee, fds 1 and 2 through a pipe copied to the log and
        here; warmd's log lines and tracebacks go to the log alone."""
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
                text = "".join(self.parts)[dropped:]
                self._keep(f"[{dropped} characters of output dropped]\n" + text)

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
                key = calque_core.output_key(self.prefix, self.seq, self.label)
                try:
                    self.store.put(key, chunk[:end].encode())
                except Exception as e:   # bookkeeping: must not stop the worker
                    log.warning("output: write failed (%s): %d characters lost", e, end)
                    return
                self.kept.append(key)
                if len(self.kept) > OUTPUT_KEPT:
                    with contextlib.suppress(Exception):
                        self.store.delete(self.kept.pop(0))


class Leases:
    """The leases of the claims this worker holds (draining, finishing, received ahead), each
    renewed every third of its timeout by one thread for all (a renewal that hangs delays the
    others: the two thirds of a timeout left cover it). A pool worker keeps their receipts in
    `receipts` (worker-<slot>.claims under a supervisor, else worker-pid<pid>.claims), locked while
    it lives: a supervisor that sees it die, or the pool's next worker to start on this machine
    (release_orphaned_claims: a systemd restart), makes them visible at once, not at their timeout."""

    def __init__(self, queue, receipts="", max_invisible=None):
        self.queue, self.held, self.changed = queue, set(), threading.Condition()
        self.max_invisible = max_invisible   # s a claim may stay invisible from its receipt (SQS)
        # kept open and rewritten in place (~5 us, a rename ~150 us: twice a claim); read once we are dead
        self.receipts = open_locked(receipts) if receipts else None
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def add(self, lease):
        with self.changed:
            self.held.add(lease)
            self._note()
            self.changed.notify()

    def remove(self, lease):
        with self.changed:
            if lease in self.held:
                self.held.discard(lease)
                self._note()

    def _note(self):
        """The receipts held, written where the supervisor reads them (under self.changed)."""
        if self.receipts is not None:   # (a write torn by our death reads as none held: the timeout's case)
            data = json.dumps([lease.message.receipt for lease in self.held]).encode()
            os.pwrite(self.receipts, data, 0)
            os.ftruncate(self.receipts, len(data))

    def _run(self):
        while True:
            with self.changed:
                now = time.monotonic()
                due = [lease for lease in self.held if lease.due <= now]
                if not due:
                    next_due = min((lease.due for lease in self.held), default=now + 3600.0)
                    self.changed.wait(next_due - now)
                    continue
            for lease in due:
                self._renew(lease)

    def _renew(self, lease):
        with lease.renewing:
            if lease.stopped:
                return
            lease.due = time.monotonic() + lease.period
            timeout = int(min(lease.timeout, lease.cap - time.monotonic()))
            if timeout < 1:     # at the cap: SQS would refuse (the drain loop stopped before it)
                return
            try:
                self.queue.change_visibility(lease.message, timeout)
            except calque_core.LeaseLost as e:
                log.warning("heartbeat: lease lost (%s); this claim will not be written", e)
                lease.lost.set()
                self.remove(lease)
            except Exception as e:   # transient: the next beat retries, well inside the timeout
                log.warning("heartbeat: visibility renewal failed (%s); retrying", e)


def open_locked(path):
    """`path`, created empty and flock-ed before it appears under its name (so that no sweep finds
    it unlocked while its worker lives); the descriptor, kept open: the lock lasts as long as we do."""
    staged = f"{path}.tmp-{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staged, path)
    return fd


def release_orphaned_claims(folder, queue):
    """The claims this pool's workers on this machine held when they died unseen by a supervisor (a
    systemd restart, a hand-started worker killed): their receipts files in `folder` that no live
    process locks, made visible now rather than at their visibility timeout, then removed. Best
    effort: a receipt acked or received again since is skipped (LeaseLost); a torn file holds none."""
    for path in glob.glob(os.path.join(glob.escape(folder), "*.claims")):
        with contextlib.suppress(OSError, ValueError):
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # its worker lives: BlockingIOError
                held = json.loads(os.read(fd, 1 << 20) or b"[]")
                if os.fstat(fd).st_ino == os.stat(path).st_ino:   # (not a new worker's file of that name)
                    os.remove(path)
                for receipt in held:
                    with contextlib.suppress(calque_core.LeaseLost):
                        queue.change_visibility(calque_core.Message(None, receipt, 0), 0)
                        log.info("worker: a claim held by a dead worker (%s) is visible again now",
                                 os.path.basename(path))
            finally:
                os.close(fd)


class Heartbeat:
    """One claim's lease, renewed by the worker's Leases thread; `lost` is set when it is lost."""

    def __init__(self, leases, message, visibility_timeout):
        self.leases, self.message, self.timeout = leases, message, visibility_timeout
        self.period = max(visibility_timeout / 3.0, 0.2)
        now = time.monotonic()
        self.due = now + self.period
        self.cap = now + (leases.max_invisible or float("inf"))   # from (about) its receipt
        self.lost, self.renewing, self.stopped = threading.Event(), threading.Lock(), False
        leases.add(self)

    def stop(self):
        """No renewal after this returns (one in progress is waited for)."""
        with self.renewing:
            self.stopped = True
        self.leases.remove(self)


class Watchdog:
    """Times the handler calls of the claim it is armed for: past `timeout` s, it calls
    `on_overrun(offsets)`, which exits. `on_call`, if given, is called on the claim's thread as each
    call starts (offsets) and ends (None)."""

    def __init__(self, timeout):
        self.timeout, self.lock = timeout, threading.Lock()
        self.on_overrun = self.on_call = None
        self.running = None                 # (offsets, time.monotonic() at its start) of the call
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, on_overrun, on_call=None):
        with self.lock:
            self.on_overrun, self.on_call, self.running = on_overrun, on_call, None

    def watch(self, offsets):
        """A handler call on these items starts (None: ends); waits while an overrun is handled."""
        if self.on_call:
            self.on_call(offsets)
        with self.lock:
            self.running = None if offsets is None else (offsets, time.monotonic())

    def _run(self):
        while True:
            time.sleep(min(WATCHDOG_TICK, self.timeout / 4))
            with self.lock:
                late = self.running and time.monotonic() - self.running[1] > self.timeout
                if late and self.on_overrun:
                    self.on_overrun(self.running[0])


class Ahead:
    """The next claim, received beside the running claim's last batch on the `ahead` thread: a probe
    of the queue (no wait), then open_claim. A claim not taken within AHEAD_HOLD s of its accept, or
    held when the worker stops, is given back (visibility 0): it is not kept from an idle worker."""

    def __init__(self, worker):
        self.worker, self.taken, self.lock = worker, threading.Event(), threading.Lock()
        self.idle = Counter()           # an empty probe's requests: counted as idle polls
        self.future = worker.ahead_thread.submit(self._fetch)

    def _fetch(self):
        worker, counts = self.worker, Counter()
        if worker.stop_requested:
            return None
        try:
            with worker.backend.requests.tally(counts):
                message = worker.queue.receive(0)    # a probe, never a wait
        except Exception as e:   # the worker's own poll comes next, and retries with backoff
            log.warning("worker %s: receive ahead failed (%s: %s)", worker.worker_id,
                        type(e).__name__, e)
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
        """Wait for the worker to take the claim: True when it did, False past AHEAD_HOLD or once it
        stops. The clock stands still while the worker retries a store write (another worker would
        meet the same outage)."""
        deadline = time.monotonic() + AHEAD_HOLD
        while not self.taken.wait(AHEAD_TICK):
            if self.worker.retrying.is_set():
                deadline = time.monotonic() + AHEAD_HOLD
            if self.worker.stop_requested or time.monotonic() >= deadline:
                return False
        return True

    def take(self, timeout=None):
        """The claim once received and accepted, or None (nothing came, handled, given back)."""
        with self.lock:
            self.taken.set()
        return self.future.result(timeout)


class Acks:
    """Acks of finished claims, ACK_BATCH a request, `wait` s after the first at most. Safe: queued
    once its summary is written, a lost ack's claim comes back and is acked as a duplicate."""

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
            log.warning("acks of %s not sent (%s: %s): they come back as duplicates",
                        ", ".join(name for _, name in waiting), type(e).__name__, e)
            return
        for message, name in waiting:
            if message in refused:
                log.warning("claim %s: ack refused (receipt stale); its summary stands", name)


class GpuSampler:
    """Mean GPU utilisation over a claim, sampled through NVML; without a GPU, it says why not."""

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
        return {"value": round(sum(self.samples) / len(self.samples), 4), "source": "nvml",
                "scope": "device", "measured": True, "samples": len(self.samples)}


class Spool:
    """A claim's progress on this machine's disk (one write a batch, no request): its first item,
    then each batch's result lines (where they hold arrays, how far it got). A delivery here after
    a kill -9 resumes after the last whole line and knows where the dead one was (contract.md)."""

    def __init__(self, folder, claim):
        self.prefix = os.path.join(folder, f"{claim.run_id}.{claim.claim_id}.")
        self.path, self.fd, self.lines = f"{self.prefix}{os.getpid()}", None, True

    def add(self, start, stop, chunks):
        """Items [start, stop) (run indices) are done: their result lines, else how far."""
        self.lines = self.lines and not any(getattr(chunk, "cells", None) for chunk in chunks)
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.write(self.fd, b'{"from":%d}\n' % start)
            os.write(self.fd, "".join(chunks).encode() if self.lines else b'{"reach":%d}\n' % stop)
        except OSError as e:   # a full or read-only disk: the claim goes on, its parts still count
            log.warning("spool %s: %s: no spool for the rest of this claim", self.path, e)
            self.add = lambda start, stop, chunks: None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def left(self, index):
        """What dead deliveries spooled here: (text, failed, errors) of the longest whole run of
        result lines for items index, index + 1, ..., and {writer pid: the item it got to} for each
        file covering index (its writer died in the batch from there, or gathering the next). Their
        files are removed."""
        best, reached = [], {}
        for path in glob.glob(glob.escape(self.prefix) + "*"):
            with contextlib.suppress(OSError), open(path, "rb") as f:
                start = end = None
                lines, whole = [], True   # result lines for index on; False after a "reach"
                for data in f.read().split(b"\n")[:-1]:   # after the last "\n": "" or a torn line
                    try:
                        text = data.decode()
                        line = json.loads(text)
                        key = "from" if start is None else "reach" if "reach" in line else "i"
                        at = int(line[key])
                    except (ValueError, KeyError, TypeError, AttributeError):   # not ours: stop
                        break
                    if start is None:
                        start = end = at
                    elif "reach" in line and at > end:
                        end, whole = at, False
                    elif "reach" not in line and whole and at == end:
                        if at >= index:
                            lines.append((line, text + "\n"))
                        end += 1
                    else:
                        break
                if start is not None and start <= index <= end:
                    reached[path[len(self.prefix):]] = end
                    best = max(best, lines, key=len)
            with contextlib.suppress(OSError):
                os.remove(path)
        failed = [line["i"] for line, _ in best if not line["ok"]]
        errors = {str(line["i"]): line["error"] for line, _ in best if not line["ok"]}
        return "".join(text for _, text in best), failed, errors, reached

    @staticmethod
    def sweep(folder):
        """Remove the files of claims no delivery came back for within SPOOL_KEPT."""
        for path in glob.glob(os.path.join(glob.escape(folder), "*")):
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(path) > SPOOL_KEPT:
                    os.remove(path)


class Worker:
    """The process: its start, signals, loop and stop (the module's map says what each room does)"""

    def __init__(self, backend, record, stats_key_prefix, conf, ephemeral, supervisor_pid=0,
                 ready_file="", spawned_at=None, previous_life=None, gpu_index=0):   # HANDOFF_FLAGS
        self.backend, self.record, self.conf, self.ephemeral = backend, record, conf, ephemeral
        self.version_checked = time.monotonic()
        self.spool_folder = None if ephemeral else os.path.join(
            calque_core.state_dir(conf, record["model"]), "spool")
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        self.grace = calque_core.setting_number(conf, "CALQUE_GRACE", float, 0)
        default_timeout = calque_core.setting_number(conf, "CALQUE_BATCH_TIMEOUT", float, 0.01)
        self.batch_timeout = float(record.get("batch_timeout", default_timeout))
        self.progressed = False          # a result part or a summary written (announce)
        self.poll_wait = (COLD_POLL_WAIT if ephemeral
                          else calque_core.setting_number(conf, "CALQUE_POLL_WAIT", float, 0))
        self.state = "starting"          # starting | backoff | polling | claim | between | stopping
        self.stop_requested = self.scaling_in = False   # scale-in (SIGUSR1): a received claim runs
        self.release_now = threading.Event()
        self.retrying = threading.Event()   # a store write of a claim is failing and being retried
        self.supervisor, self.ready_file = supervisor_pid, ready_file   # from a pool supervisor
        self.accounts = Accounts(self, f"{stats_key_prefix}{self.worker_id}.json", spawned_at,
                                 GpuSampler(gpu_index))
        self.protection = None        # an EC2 pool instance's scale-in protection
        if not ephemeral and "ec2" in record and conf.get("CALQUE_SPOT_POLL"):
            import calque_ec2   # its own instance's metadata and group: no fleet verb
            self.protection = calque_ec2.ScaleInProtection.on_instance(record, conf)
        self.fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="fetch")   # calque_sources.FetchedItems
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="manifest")
        self.ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="ahead")
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="finisher")
        self.rules = Rules(self, stats_key_prefix, previous_life)
        # over a network, requests beside other work pay; a local one costs less than a thread
        self.receives_ahead = backend.kind != "local" if AHEAD is None else AHEAD
        self.ahead = None                # Ahead: the claim being received beside the last batch
        self.call_started, self.call_seconds = 0.0, float("inf")   # the latest handler call's
        self.finishing = None            # future of the claim the finisher writes
        self.acks = self.leases = None   # Acks, and Leases (the claims' heartbeats), once started
        self.model = None                # the handler's, once started
        self.calls = None                # WorkerCalls, for a Modal app's handler
        ready = re.search(r"worker-(\d+)\.ready$", ready_file)
        self.output = Output(backend.store, stats_key_prefix.replace("/workers/", "/output/"),
                             f"w{ready[1]}" if ready else socket.gethostname())

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self):
        """Before the first claim: the queues, the handler, and a pool worker's @enter (unless
        a stop came first: no claim waits on a load)."""
        self.queue = self.backend.queues.open_queue(self.record["queue"])
        dlq = self.backend.queues.open_queue(self.record["dlq"])
        self.acks = Acks(self.queue, self.backend.requests, min(ACK_WAIT, self.record["visibility_timeout"] / 4))
        receipts = ""
        if self.spool_folder:   # a pool worker
            os.makedirs(self.spool_folder, exist_ok=True)
            Spool.sweep(self.spool_folder)
            folder = os.path.dirname(self.spool_folder)
            receipts = (os.path.splitext(self.ready_file)[0] if self.ready_file
                        else os.path.join(folder, f"worker-pid{os.getpid()}")) + ".claims"
            release_orphaned_claims(folder, self.queue)
        cap = SQS_MAX_INVISIBLE if self.backend.kind == "aws" else None
        self.leases, self.watchdog = Leases(self.queue, receipts, cap), Watchdog(self.batch_timeout)
        self.rules.queue, self.rules.dlq = self.queue, dlq
        self.note_own_kills()
        self.load_handler()
        if not self.ephemeral and not self.stop_requested:
            self.accounts.enter(self.enter_fn)

    def start_counted(self):
        """start(), its stats saying "starting" every STATS_INTERVAL meanwhile, so a submit on any
        machine counts this worker while @enter runs (minutes for an LLM), and why it died if it does."""
        done = threading.Event()

        def beat():
            while not done.wait(STATS_INTERVAL):
                self.accounts.write("starting")
        self.accounts.write("starting")
        beat = threading.Thread(target=beat, daemon=True)
        beat.start()
        try:
            self.start()
        except Exception as e:
            self.accounts.last_word = self.accounts.last_word or f"{type(e).__name__}: {e}"
            raise
        finally:
            done.set()
            beat.join()

    def note_own_kills(self):
        """Make handler code that sends SIGKILL to this process (os.kill, os.killpg,
        signal.raise_signal) write the worker's last word first: its parent cannot tell such a
        death from a kill -9 from outside, and the poison rule needs to (docs/contract.md)."""
        def noted(name, send, hits_us):
            @functools.wraps(send)
            def sending(*args):
                if hits_us(*args):
                    self.accounts.last_word = f"killed itself with SIGKILL ({name} in handler code)"
                    self.accounts.write("stopping")
                return send(*args)
            return sending
        me, group = os.getpid(), os.getpgrp()
        os.kill = noted("os.kill", os.kill,
                        lambda pid, sig: sig == signal.SIGKILL and pid in (me, 0, -group))
        os.killpg = noted("os.killpg", os.killpg,
                          lambda pgid, sig: sig == signal.SIGKILL and pgid in (0, group))
        signal.raise_signal = noted("signal.raise_signal", signal.raise_signal,
                                    lambda sig: sig == signal.SIGKILL)

    def load_handler(self):
        """Fetch the handler snapshot named by the pool record, check its digest, import it."""
        h = self.record["handler"]
        source = self.backend.store.get(h["key"])
        if hashlib.sha256(source).hexdigest() != h["sha256"]:
            raise calque_core.UserError(f"handler snapshot {h['key']} does not match the pool record's "
                                   "sha256: recreate the pool")
        state = os.path.abspath(self.conf["CALQUE_STATE"])
        folder = os.path.join(state, "handlers", h["sha256"][:16])
        if "include" in h:   # the files it needs beside it (pool create --include, add_local_*)
            folder += "-" + h["include"]["sha256"][:16]
            calque_core.unpack_include(self.backend.store, h["include"], folder)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, h["file"])
        calque_core.write_file_atomic(path, source.decode())
        # run it where its user works (the folder `pool create` ran in, where it exists here, else
        # the snapshot's), first on sys.path, so its sibling modules and paths resolve
        workdir = self.record.get("workdir")
        folder = workdir if workdir and os.path.isdir(workdir) else folder
        os.chdir(folder)
        sys.path.insert(0, folder)
        log.info("worker: working directory %s", folder)
        if "modal" in self.record:   # its volumes in place before its app is imported, as Modal's
            calque_core.serve_volumes(self.conf, self.backend.store,
                                      self.record["modal"]["volumes"])
        streams = None if self.ephemeral else (self.backend.store, self.record["model"])
        self.handler, self.enter_fn, batch_fn, collate = calque_core.load_handler(
            path, h["class"], self.record.get("modal"), container=True, streams=streams)
        if "modal" in self.record:   # a Modal app's handler: its calls to the app's others
            self.calls = calque_core.load_modal_shim().runner = WorkerCalls(self, self.handler)
        self.model = Model(self.worker_id, batch_fn, collate, self.watchdog)
        log.info("worker %s: pool %s, version %s", self.worker_id, self.record["model"],
                 calque_core.version_label(self.record))

    def run_exit_hooks(self):
        """A Modal handler's @modal.exit / __exit__ at the end; a failing one is logged."""
        hooks = self.accounts.entered_at is not None and getattr(self.handler, "calque_exit", None)
        if hooks:
            try:
                hooks()
            except Exception as e:
                log.warning("worker %s: @modal.exit failed (%s: %s)", self.worker_id,
                            type(e).__name__, e)

    def on_signal(self, signum, frame):
        if self.stop_requested:
            log.warning("worker %s: second %s: releasing the claim now", self.worker_id,
                        signal.Signals(signum).name)
            self.release_now.set()
            if self.state == "claim":
                raise ReleaseNow()
            if self.state in ("backoff", "polling"):
                raise Interrupted()
            return
        self.stop_requested = True
        log.info("worker %s: %s: warm stop (no new claims; %.0fs grace for the running one)",
                 self.worker_id, signal.Signals(signum).name, self.grace)
        if self.state == "claim" and not self.grace:   # no grace (a stopped modal run's pool): now
            self.release_now.set()
            raise ReleaseNow()
        if self.state == "claim":
            timer = threading.Timer(self.grace, self.release_now.set)
            timer.daemon = True    # a claim that ends first does not wait for the grace
            timer.start()
        elif self.state == "backoff":
            raise Interrupted()
        elif self.state == "polling":   # not cut short: see _loop_once
            log.info("worker %s: stopping as this poll returns (within %.0fs; a second signal stops now)",
                     self.worker_id, self.poll_wait)

    def on_scale_in(self, signum, frame):
        """SIGUSR1, the supervisor scaling in: no new claim; the running one finishes however long
        it takes, so scaling in costs no redelivery. A SIGTERM after it is a second signal."""
        if not self.stop_requested:
            self.stop_requested = self.scaling_in = True
            log.info("worker %s: scale-in: no new claims; the running one finishes", self.worker_id)
            if self.state == "backoff":
                raise Interrupted()

    def on_sibling_death(self, signum, frame):
        """SIGUSR2, another worker of the pool died: commit under churn too, at this one's age."""
        self.rules.seen_death(time.time() - self.accounts.started)

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
            import calque_ec2   # lazy: an instance's metadata, read only where it is
            calque_ec2.SpotPoller(self.conf["CALQUE_SPOT_POLL"],
                       calque_core.setting_number(self.conf, "CALQUE_SPOT_INTERVAL", float, 0.01),
                       functools.partial(os.kill, os.getpid(), signal.SIGTERM),   # a warm stop
                       self.leave if self.protection else None)
        reason = "?"
        try:
            self.start_counted()
            self.accounts.write("running")
            announce(self.ready_file)
            self.backoff = 0.0
            while reason == "?":
                reason = self._loop_once() or "?"
        except Interrupted:
            reason = "stop requested"
        except SystemExit as e:          # a handler called sys.exit: its poison report says so
            reason = self.accounts.last_word = f"exit code {e.code} (sys.exit)"
            raise
        finally:
            self.state = "stopping"
            self.settle()
            model = (self.model.prefetcher, self.model.decoders) if self.model else ()
            for pool in (self.reader, self.ahead_thread, self.finisher, self.fetchers, *model):
                if pool:
                    pool.shutdown(wait=False, cancel_futures=True)
            self.run_exit_hooks()
            self.output.flush()
            self.accounts.write("stopped")
            if self.protection:
                self.protection.release()
            log.info("worker %s: exit (%s) after %d claim(s), %d warm hit(s), enter_count %d",
                     self.worker_id, reason, self.accounts.stats["claims"],
                     self.accounts.stats["warm_hits"], self.accounts.enter_count)

    def _loop_once(self):
        """One pass: the claim ahead, else a poll, then run it. The reason to stop, or None."""
        if self.rules.replaced_by:
            return (f"the pool runs version {self.rules.replaced_by} now (pool deploy): "
                    "restarting on it")
        if self.stop_requested:
            return "stop requested"
        if self.supervisor and os.getppid() != self.supervisor:
            # our supervisor died without stopping us: leave, not run on as an orphan none counts
            return f"supervisor {self.supervisor} is gone"
        self.state = "between"
        ahead, idle = self.ahead, False
        claim = ahead and ahead.take()
        self.ahead = None
        if claim is None:
            counts = Counter(ahead.idle if ahead else ())
            try:
                self.state = "backoff"           # a signal cuts it short
                time.sleep(self.backoff)
                self.state = "between"
                with self.backend.requests.tally(counts):
                    message = self.queue.receive(0)   # a probe: a busy queue answers at once
                if message is None and not self.stop_requested:   # empty: writes and acks go out first
                    self.settle()
                    # a first signal lets this poll end, not cut it short: SQS still sends a claim to an
                    # abandoned poll, out of sight for its visibility timeout (should_stop ends a local one)
                    self.state = "polling"
                    wait = self.poll_wait
                    if self.accounts.stats_behind:
                        wait = min(wait, STATS_IDLE_WAIT)
                    with self.backend.requests.tally(counts):
                        message = self.queue.receive(wait, should_stop=lambda: self.stop_requested)
                self.backoff = 0.0
            except Interrupted:
                return "stop requested while polling"
            except Exception as e:   # the queue unreachable a while: stay warm, retry
                if self.ephemeral and calque_core._aws_error_code(e) in calque_core.SQS_NOT_FOUND:
                    return "cold run drained"   # its submit deleted the queue: every summary is in
                self.backoff = min(max(self.backoff * 2, ERROR_BACKOFF[0]), ERROR_BACKOFF[1])
                log.warning("worker %s: receive failed (%s: %s); retrying in %.0fs",
                            self.worker_id, type(e).__name__, e, self.backoff)
                return None
            self.state, idle = "between", message is None
            if self.protection:
                self.protection.hold(not idle)
            if idle:
                self.backend.requests.loose.update(counts)
                since = time.monotonic() - self.version_checked
                if since > calque_core.VERSION_CHECK and not self.ephemeral:
                    self.version_checked = time.monotonic()
                    self.rules.replaced_by = self.rules.pool_version_now()
            else:
                claim = self.open_claim(message, counts)
        if claim is not None:
            if self.stop_requested and not self.scaling_in:   # told to stop meanwhile: never starts
                self.give_back(claim, "the worker stops")
                return "stop requested"
            self.state = "claim"         # a signal from here on sees the claim
            reason = self.run_claim(claim, PIPELINE)
            self.state = "between"       # a second signal from here on has no claim to release
            if reason:
                return reason
            self.accounts.stats_behind = True
        elif idle and self.ephemeral and self.run_drained():
            return "cold run drained"
        # stats on a timer, not a PUT a claim, and once when the worker runs out of claims
        stale = time.monotonic() - self.accounts.last_stats > STATS_INTERVAL
        if (idle and self.accounts.stats_behind) or stale:
            self.accounts.write("running")
        return None

    def run_drained(self):
        """A cold run's queue is empty, or gone: its submit deletes it once every summary is in."""
        try:
            return sum(self.queue.counts().values()) == 0
        except Exception as e:
            if calque_core._aws_error_code(e) not in calque_core.SQS_NOT_FOUND:
                raise
            return True

    # ---- one claim: open, run, finish; its end ---------------------------------------------------

    def handle(self, message):
        """One claim on this thread, acked before it returns (the bench, in-process tests)."""
        claim = self.open_claim(message, Counter())
        reason = self.run_claim(claim, pipelined=False) if claim is not None else None
        self.acks.flush()
        return reason

    def open_claim(self, message, requests):
        """A received message, accepted under a new heartbeat: the ClaimRun to run, or None where
        it was handled here (dead-lettered, a duplicate acked, let go). `requests`: made for it."""
        claim = ClaimRun(self, message, requests)
        with self.ending(claim):
            claim.accepted = self.rules.accept(claim)
            if self.calls and claim.run_id and claim.message.receive_count > 1:
                self.calls.cancel_earlier(claim)
        if claim.ended:
            return None
        if not claim.accepted:
            claim.heartbeat.stop()
            self.backend.requests.loose.update(requests)   # counted in the next summary
            return None
        return claim

    def run_claim(self, claim, pipelined):
        """Drain an accepted claim here (its last part too: a worker whose writes fail takes no
        further claim), then finish it: on the finisher thread when `pipelined`, at most one behind
        the claim that drains, else here. Returns the reason to stop the worker, or None."""
        ahead = pipelined and self.receives_ahead
        on_call = functools.partial(self.reach_ahead, claim) if ahead else None
        self.watchdog.arm(lambda offsets: self.overrun(claim, offsets), on_call)
        if self.calls:
            self.calls.start(claim)
        with self.ending(claim):
            try:
                claim.run()
                if self.calls:   # what it spawned ends before its summary
                    self.calls.settle()
                if self.finishing is not None:
                    self.finishing.result()
            finally:
                self.watchdog.arm(None)
        if claim.ended:
            if self.calls:
                self.calls.cancel(claim.stop_reason or "it was let go")
            return claim.stop_reason
        if not pipelined:
            return self.finish_claim(claim)
        self.finishing = self.finisher.submit(self.finish_claim, claim)
        return None

    def reach_ahead(self, claim, offsets):
        """As each handler call of a pipelined claim starts (offsets) and ends (None): the call that
        runs the last item starts receiving the next claim (Ahead), unless the finisher still writes
        the claim before (two claims held at most) or the latest call took over AHEAD_HOLD/2."""
        now = time.monotonic()
        if offsets is None:
            self.call_seconds = now - self.call_started
            return
        self.call_started = now
        finisher_free = self.finishing is None or self.finishing.done()
        if (self.ahead is None and not self.stop_requested and len(claim.items) - 1 in offsets
                and finisher_free and self.call_seconds <= AHEAD_HOLD / 2):
            self.ahead = Ahead(self)

    def finish_claim(self, claim):
        """The claim's summary, then its ack (Acks). Returns the reason to stop, or None."""
        with self.ending(claim):
            claim.finish()
        return claim.stop_reason

    @contextlib.contextmanager
    def ending(self, claim):
        """This thread works for `claim` (its requests count there). One it cannot finish is let go
        at once when the worker stops, after a growing delay on a store or queue fault, not written
        when its lease is lost; claim.ended is then set, and claim.stop_reason where the worker
        stops."""
        with self.backend.requests.tally(claim.requests):
            try:
                yield
            except ReleaseNow:
                why = "second signal" if self.grace else "signal, no grace"
                claim.let_go(0, why)
                claim.stop_reason = f"{why}: claim released"
            except ClaimTooLong as e:
                claim.heartbeat.stop()
                named = {"run_id": claim.run_id, "claim": claim.claim_id}
                self.rules.dead_letter(claim, str(e), named, f"stopped near SQS's 12 h cap, "
                                        f"{claim.committed} item(s) done and kept")
            except ClaimReleased as e:
                if not claim.heartbeat.lost.is_set():   # ours to give back: visible again at once
                    claim.let_go(0, str(e))
                else:
                    claim.heartbeat.stop()
                    log.warning("worker %s: claim %s lease lost: not writing it", self.worker_id,
                                claim)
            except Exception as e:   # a fault: a delay doubling a delivery (not spent by an outage)
                delay = RELEASE_DELAY * 2 ** (claim.message.receive_count - 1)
                delay = min(delay, self.record["visibility_timeout"])
                claim.let_go(delay, f"{type(e).__name__}: {e}")
            else:
                return
            claim.ended = True

    def give_back(self, claim, why):
        """Let go of a claim that never started: at once, not held against max_deliveries."""
        claim.progress_at = claim.message.receive_count
        with self.backend.requests.tally(claim.requests):
            claim.let_go(0, why)
        self.backend.requests.loose.update(claim.requests)

    def settle(self, wait=None):
        """Nothing left behind, before the worker idles or stops: the claim ahead given back, the
        finisher's written, the acks sent. `wait`: at most that many s on each of the first two."""
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

    def made_progress(self):
        """A part or a summary is written: the supervisor hears of the first (announce)."""
        if not self.progressed:
            self.progressed = True
            announce(self.ready_file, "progress")

    def overrun(self, claim, offsets):
        """The watchdog's call when a handler call on `offsets` ran past batch_timeout: commit what
        is done, mark the items suspect, release the claim, exit EXIT_HUNG (nothing can stop it)."""
        seconds = time.monotonic() - self.watchdog.running[1]
        log.error("worker %s: claim %s: items %s ran %.1fs, past the batch_timeout of %gs: "
                  "releasing the claim and exiting %d", self.worker_id, claim,
                  [claim.first + k for k in offsets], seconds, self.batch_timeout, EXIT_HUNG)
        with self.backend.requests.tally(claim.requests):
            try:
                claim.commit()
                claim.write_attempt("suspect", offsets, batch_timeout=self.batch_timeout)
            except BaseException as e:      # the exit below must happen whatever the store says
                log.warning("worker %s: before exiting: %s: %s", self.worker_id,
                            type(e).__name__, e)
        claim.heartbeat.stop()
        with contextlib.suppress(Exception):
            self.queue.change_visibility(claim.message, 0)
        with contextlib.suppress(Exception):
            self.settle(wait=OVERRUN_WAIT)
        self.accounts.last_word = (f"exit {EXIT_HUNG}: a handler call ran past the batch_timeout "
                                   f"of {self.batch_timeout:g} s")
        self.accounts.write("stopped")
        os._exit(EXIT_HUNG)


class ClaimRun:
    """One delivery from its receipt to its end (offsets: positions in the claim). Its writes stop
    once its lease is lost. It reads the worker's settings and calls on its rooms."""
    progress_failed = False   # a progress write failed in this process (logged once)

    def __init__(self, worker, message, requests):
        self.worker, self.message = worker, message
        self.requests = requests                  # requests made for it (Requests.tally)
        self.heartbeat = Heartbeat(worker.leases, message, worker.record["visibility_timeout"])
        self.received = time.time()               # when it arrived
        self.accepted = self.ended = False        # by the Rules; given up (Worker.ending)
        self.stop_reason = None                   # why the worker stops, where its end says so
        self.run_id = self.claim_id = self.items = self.spool = None   # set by Rules.accept
        self.first = 0                            # the run index of offset 0
        self.enter_paid = self.acquisition = 0.0  # what a cold worker paid inside it
        self.gpu = None                           # GpuSampler.stop()'s reading
        self.start = self.committed = 0   # [0, start): earlier deliveries' parts; then this one's
        self.parts, self.failed, self.errors = [], [], {}   # [start, stop]s; run indices; messages
        self.resumed_failed = 0                   # of `failed`, those from earlier parts
        self.formatted = []                       # (stop, format_outcome's) not yet in a part
        self.held = []                            # units whose items wait a retry (hold), in order
        self.retries = []                         # heap: (due, offset, its unit's hold, payload)
        self.retried = Counter()                  # items retried, their attempts in all
        self.kind = None                          # Collator.claim_kind, once, as its drain starts
        self.batches, self.last_commit = 0, 0.0   # batches since the last part, and when it went
        self.reported_at = 0.0                    # monotonic s of its last progress record
        self.model_seconds = self.wait_seconds = 0.0
        self.record = {"deaths": {}}              # the attempt record
        self.quarantined = {}                     # offset (str) -> why it is not run
        self.single = False                       # one item at a time, behind the attempt record
        self.alone = range(0)                     # ... only these offsets, then batches (a spool)
        self.life = None                          # s its dead delivery lived, at least (0: unknown)
        self.progress_at = 0                      # the delivery that last made progress

    def __str__(self):
        if self.accepted:
            return f"{self.run_id}/{self.claim_id}"
        return f"(delivery {self.message.receive_count})"

    def run(self):
        """Items [start, n) (@enter first on a cold worker) unit by unit (plan), each collated
        ahead where pipelined (collated), called (run_unit), its lines kept (keep); parts at
        checkpoints, and the end. Quarantined items fail unrun; a batch that raises is retried item
        by item. Results are serialised here (GIL-bound work would slow a model beside it).
        ClaimReleased where it is given back."""
        model, accounts = self.worker.model, self.worker.accounts
        ahead, batching = {}, False   # unit -> its batch's future, collated beside the model
        accounts.gpu.start()
        try:
            if accounts.entered_at is None:     # a cold worker pays its load in its first claim
                accounts.enter(self.worker.enter_fn)
                self.enter_paid = accounts.enter_seconds
                self.acquisition = accounts.acquisition_seconds
            self.kind = model.collator.claim_kind(self.items)
            units, lone = self.plan()
            runnable = units   # nothing quarantined (nearly always): no str(k) per item
            if self.quarantined:
                runnable = [[k for k in unit if str(k) not in self.quarantined] for unit in units]
            self.last_commit = self.reported_at = time.monotonic()
            self.commit()   # the spool's lines (take_over), if any: a part before anything else
            for u, unit in enumerate(units):
                self.check()
                single = unit.start in lone
                if single:
                    batching = False
                    if runnable[u]:
                        self.write_attempt("running", runnable[u])
                    current = model.prepare(self.items, runnable[u], self.kind)
                else:
                    first, batching = not batching, True
                    if first and self.single:   # the first batch after items alone: say so
                        self.write_attempt("batches", [])
                    current = self.collated(ahead, units, runnable, u, lone)
                waited, busy = self.wait_seconds, self.model_seconds
                outcome = self.run_unit(unit, runnable[u], current)
                self.hold(unit, outcome)
                self.items.drop(unit)
                if single:                    # it ran alone and the process lived: not a killer
                    if any([self.record["deaths"].pop(str(k), 0) for k in runnable[u]]):
                        self.worker.rules.mark_churn()
                elif self.kind == BY_HANDLER and not first:
                    model.deepen(self.wait_seconds - waited, self.model_seconds - busy)
                self.retry(wait=False)
            self.retry(wait=True)
            self.commit()
        finally:
            for future in ahead.values():   # gathered ahead of a loop that ended early: slots back
                if future is not None:
                    with contextlib.suppress(Exception):
                        model.collator.release(future.result())
            self.gpu = accounts.gpu.stop()
            if self.spool:
                self.spool.close()
            self.items.close()
        if self.heartbeat.lost.is_set():
            raise ClaimReleased("lease lost")

    def plan(self):
        """(units, the offsets that run alone): items [start, n) batch_size at a time (all at once
        for a whole_claim handler), or one at a time behind the attempt record (single: all of
        them, or those of `alone`)."""
        n, size = len(self.items), self.worker.record["batch_size"]
        if self.worker.model.whole_claim:   # @calque.batch(whole_claim=True)
            size = max(1, n - self.start)
        lone = range(self.start, n) if self.single else range(0)
        if self.single and self.alone:
            lone = range(min(max(self.alone.start, self.start), n), min(self.alone.stop, n))
        lo, hi = lone.start, max(lone.stop, self.start)   # batches, [lo, hi) alone, batches
        return ([range(k, min(k + size, lo)) for k in range(self.start, lo, size)]
                + [range(k, k + 1) for k in lone]
                + [range(k, min(k + size, n)) for k in range(hi, n, size)]), lone

    def check(self):
        """Before each unit: the claim given back (ClaimReleased: a stop's grace is over, its lease
        lost), or stopped where one batch more could pass SQS's cap (ClaimTooLong); what is done
        is committed first."""
        worker, lease = self.worker, self.heartbeat
        if worker.release_now.is_set():
            self.commit()       # what is done stays done
            raise ClaimReleased("grace period over" if worker.stop_requested else "released")
        if lease.lost.is_set():
            raise ClaimReleased("lease lost")
        if time.monotonic() > lease.cap - lease.timeout - worker.batch_timeout:
            self.commit()
            hours = (time.monotonic() - lease.cap + SQS_MAX_INVISIBLE) / 3600
            raise ClaimTooLong(
                f"claim ran {hours:.1f} h: SQS keeps a claim invisible 12 h at most, and one batch "
                f"more (batch_timeout {worker.batch_timeout:g} s) could pass that; "
                f"{self.committed} of {len(self.items)} items done and kept (`runs redrive "
                f"{self.run_id}` resumes after them) ---> HINT: split such claims: submit "
                "--claim-size N (docs/limits.md)")

    def collated(self, ahead, units, runnable, u, lone):
        """Unit u's batch, the `depth` after it collated beside it, unless alone (depth: 1, or the
        Model's collate_depth for a handler's own collate)."""
        model = self.worker.model
        depth = model.collate_depth if self.kind == BY_HANDLER else 1
        for v in range(u, min(u + 1 + depth, len(units))):
            if units[v].start in lone:
                break
            if v not in ahead:
                ahead[v] = model.prepare(self.items, runnable[v], self.kind, beside=v > u + 1)
        return ahead.pop(u)

    def run_unit(self, unit, runnable, prepared):
        """[(ok, result or error)] for a unit's items: the quarantined ones fail with the reason."""
        ran, t0 = {}, time.perf_counter()
        payloads, missing = gather(self.items, runnable)
        if prepared is None and self.items.fetched:   # the model waited: a fetch
            self.wait_seconds += time.perf_counter() - t0
        if missing:
            runnable = [k for k in runnable if k not in missing]
        if runnable:
            outcome, model, wait = self.worker.model.run(prepared, payloads, runnable, self.kind)
            self.model_seconds += model
            self.wait_seconds += wait
            if len(runnable) == len(unit):   # nothing quarantined: the unit's outcome, in order
                return outcome
            ran = dict(zip(runnable, outcome))
        return [ran[k] if k in ran else (False, missing.get(k) or self.quarantined[str(k)])
                for k in unit]

    def hold(self, unit, outcome):
        """A unit's outcome, held until its items that raised are retried (the pool's retries, as
        Modal's: max_retries, each after its backoff) while later units run; kept in order."""
        policy = self.worker.record.get("retries")
        held = {"unit": unit, "outcome": list(outcome), "attempts": {}, "pending": 0}
        for k, (ok, value) in zip(unit, outcome):
            if policy and raised(ok, value):
                held["attempts"][self.first + k] = 1
                held["pending"] += 1
                due = time.monotonic() + policy["initial_delay"]
                heapq.heappush(self.retries, (due, k, held, self.items[k]))
        self.held.append(held)

    def retry(self, wait):
        """The held items' retries now due (with `wait`: all, each at its time; the heartbeat keeps
        the lease meanwhile), then the held units now settled kept, in order."""
        policy = self.worker.record.get("retries")
        while self.retries and (wait or self.retries[0][0] <= time.monotonic()):
            due, k, held, payload = heapq.heappop(self.retries)
            self.worker.release_now.wait(max(0.0, due - time.monotonic()))
            self.check()   # given back (a stop, the lease lost): what is kept stays done
            outcome, model, waited = self.worker.model.run(None, [payload], [k], self.kind)
            self.model_seconds += model
            self.wait_seconds += waited
            held["outcome"][k - held["unit"].start] = outcome[0]
            held["attempts"][self.first + k] += 1
            retries = held["attempts"][self.first + k] - 1   # done so far
            if raised(*outcome[0]) and retries < policy["max_retries"]:
                delay = policy["initial_delay"] * policy["backoff_coefficient"] ** retries
                due = time.monotonic() + min(delay, policy["max_delay"])
                heapq.heappush(self.retries, (due, k, held, payload))
            else:
                held["pending"] -= 1
        while self.held and not self.held[0]["pending"]:
            held = self.held.pop(0)
            attempts = {i: n for i, n in held["attempts"].items() if n > 1}
            self.retried.update(items=len(attempts), attempts=sum(attempts.values()))
            unit = held["unit"]
            self.keep(unit, format_outcome(held["outcome"], self.first + unit.start, attempts))

    def keep(self, unit, lines):
        """A unit's result lines: spooled, held for the next part, progress said every
        PROGRESS_SECONDS, a part written when the Rules say one is due."""
        if self.spool:
            self.spool.add(self.first + unit.start, self.first + unit.stop, lines[0])
        self.formatted.append((unit.stop, lines))
        self.batches += 1
        if time.monotonic() - self.reported_at >= PROGRESS_SECONDS:
            self.report_progress(unit.stop)
        if self.worker.rules.part_due(self):
            self.commit()

    def commit(self):
        """The batches run since the last part, written as one part."""
        ready = list(self.formatted)
        if not ready:
            return
        stop = ready[-1][0]
        suffix, data = calque_core.encode_part([c for _, (chunks, _, _) in ready for c in chunks])
        t0 = time.monotonic()
        self.put(calque_core.part_key(self.run_id, self.claim_id, self.committed, stop, suffix),
                 data)
        self.worker.rules.part_seconds = time.monotonic() - t0
        for _, (_, failed, errors) in ready:
            self.failed += failed
            self.errors.update(list(errors.items())[:calque_core.ERRORS_KEPT - len(self.errors)])
        self.parts.append([self.committed, stop])
        self.committed, self.progress_at = stop, self.message.receive_count
        self.worker.made_progress()
        del self.formatted[:len(ready)]
        self.batches, self.last_commit = 0, time.monotonic()

    def report_progress(self, done):
        """A long claim's items done so far, where submit, runs show and the dashboard read them
        (best effort, not retried: the next one or the summary says it; a failure logged once)."""
        self.reported_at, worker = time.monotonic(), self.worker
        try:
            progress = {"done": done, "worker_id": worker.worker_id, "at": calque_core.now_iso()}
            worker.backend.store.put(calque_core.progress_key(self.run_id, self.claim_id),
                                     json.dumps(progress))
        except Exception as e:
            if not ClaimRun.progress_failed:
                log.warning("worker %s: progress of claim %s/%s not written (%s); submit shows it "
                            "when the claim ends (logged once)", worker.worker_id, self.run_id,
                            self.claim_id, calque_core.aws_error_line(e))
            ClaimRun.progress_failed = True

    def write_attempt(self, state, running, retry=True, **fields):
        """The claim's attempt record: `state` running (`running` runs alone now), suspect (they
        overran) or released (let go alive); deaths, quarantines and progress carry over."""
        self.record = dict(self.record, state=state, running=list(running),
                           worker_id=self.worker.worker_id,
                           receive_count=self.message.receive_count,
                           covered=self.committed, progress_at=self.progress_at,
                           quarantined=self.quarantined, at=calque_core.now_iso(),
                           alive=round(time.time() - self.received, 3), **fields)
        put = self.put if retry else self.worker.backend.store.put
        put(calque_core.attempt_key(self.run_id, self.claim_id), json.dumps(self.record))

    def put(self, key, data):
        """A store write for this claim, retried (WRITE_RETRY) while its lease holds."""
        worker, (delay, retries) = self.worker, WRITE_RETRY
        try:
            for retry in range(retries + 1):
                if self.heartbeat.lost.is_set():
                    raise ClaimReleased("lease lost")
                try:
                    return worker.backend.store.put(key, data)
                except Exception as e:
                    if retry == retries:
                        raise
                    worker.retrying.set()
                    log.warning("worker %s: store write of %s failed (%s: %s); retrying in %.1fs",
                                worker.worker_id, key, type(e).__name__, e, delay)
                if worker.release_now.wait(delay):
                    raise ClaimReleased("grace period over while retrying a store write")
                delay *= 2
        finally:
            worker.retrying.clear()

    def finish(self):
        """The summary, then the ack (queued: Acks)."""
        worker, accounts = self.worker, self.worker.accounts
        finished = time.time()
        warm_hit = accounts.entered_at is not None and accounts.entered_at <= self.received
        notes = []
        if len(self.errors) < len(self.failed):
            notes.append(f"errors: only the first {len(self.errors)} of {len(self.failed)} "
                         "messages kept")
        if not self.gpu["measured"]:
            notes.append(f"GPU utilisation not measured: {self.gpu['reason']}")
        if worker.backend.kind == "local":
            notes.append("requests: counted on the local backend, where they cost nothing; "
                         "priced as if on SQS/S3")
        summary = accounts.summary(
            self.message, self.run_id, self.claim_id, self.received, finished,
            extra_other=1,   # + the ack below, counted as if it went alone
            items=len(self.items), failed=self.failed, errors=self.errors, warm_hit=warm_hit,
            enter_seconds_paid=self.enter_paid, acquisition_seconds=self.acquisition,
            model_seconds=self.model_seconds, notes=notes, parts=self.parts,
            resumed=self.start, collate_wait_seconds=round(self.wait_seconds, 6),
            prefetch=worker.model.pipelined(self.kind), gpu_utilisation=self.gpu,
            **({"retried": dict(self.retried)} if self.retried["items"] else {}))
        worker.output.flush()              # what the claim printed lands before its summary
        self.put(calque_core.summary_key(self.run_id, self.claim_id), json.dumps(summary, indent=1))
        worker.made_progress()
        self.heartbeat.stop()            # no renewal may land after the ack
        worker.acks.add(self.message, f"{self.run_id}/{self.claim_id}")
        accounts.count(self, summary["claim_seconds"], warm_hit, finished)
        log.info("worker %s: run %s claim %s: %d items (%d failed), warm hit %s, @enter paid "
                 "%.3fs, %.3fs%s",
                 worker.worker_id, self.run_id, self.claim_id, len(self.items), len(self.failed),
                 "yes" if warm_hit else "no", self.enter_paid, summary["claim_seconds"],
                 f", {self.start} resumed" if self.start else "")

    def let_go(self, delay, why):
        """Give the claim back alive (its attempt record says so): visible again after `delay` s."""
        worker = self.worker
        if self.accepted:
            with contextlib.suppress(Exception):
                self.write_attempt("released", [], retry=False)
        self.heartbeat.stop()            # a renewal after this would hide the claim again
        try:
            worker.queue.change_visibility(self.message, delay)
        except Exception as e:
            log.warning("worker %s: claim %s not released (%s: %s): visible when its lease ends",
                        worker.worker_id, self, type(e).__name__, e)
        log.warning("worker %s: claim %s let go (%s); visible again in %.0fs", worker.worker_id,
                    self, why, delay)


class WorkerCalls(calque_runs.Calls):
    """A Modal app's calls from this worker (one of its functions calling another): each to the
    pool its record's modal `calls` names; refused in one line where none does, or where the target
    is this pool's or one up the chain of calls waiting on this claim (the run record's `chain`):
    a call that could wait on itself. They are the running claim's: followed while it holds its
    lease, its run is not cancelled and the worker keeps it, else cancelled; waited for before its
    summary, so none outlives it."""

    def __init__(self, worker, handler):
        super().__init__(worker.backend, handler.folder)
        self.worker, self.records, self.queues = worker, {}, {}   # of the pools it calls
        self.target = handler.target.__name__ + (f".{handler.method}" if handler.method else "")
        self.claim = self.chain = None
        self.crashing = functools.partial(calque_supervisor.crash_looping, worker.conf)

    def start(self, claim):
        self.claim, self.chain, self.runs = claim, None, []

    def cancel_earlier(self, claim):
        """A claim delivered again, run or dead-lettered: cancel what its earlier deliveries called
        and left running (their worker killed -9), found by their runs' `caller`."""
        for pool in set(self.worker.record["modal"].get("calls", {}).values()):
            for run in calque_core.list_runs(self.backend, pool):
                if run["options"].get("caller") == self.caller(claim):
                    calque_runs.cancel_run(self.backend, run, "the calling claim "
                                           f"{claim.run_id}/{claim.claim_id} was delivered again")

    @staticmethod
    def caller(claim):
        return claim and {"run": claim.run_id, "claim": claim.claim_id}

    def pool_for(self, target, params):
        shim, claim = calque_core.load_modal_shim(), self.claim
        pool = self.worker.record.get("modal", {}).get("calls", {}).get(target)
        if self.chain is None and pool:   # the targets waiting on this claim, itself last
            run = claim and calque_core.read_json(self.backend, calque_core.run_key(claim.run_id))
            self.chain = (run["options"].get("chain", []) if run else []) + [self.target]
        if target == self.target or target in (self.chain or ()):
            why = ("its own pool, whose workers could all be waiting" if target == self.target else
                   f"which waits on this call ({' -> '.join(self.chain)} -> {target})")
            raise shim.Unsupported(
                f"{self.target} calls {target}, {why}: it could wait on itself ---> HINT: call "
                f"the code as a plain function, or call {target} from the local entrypoint")
        unmade = self.worker.record.get("modal", {}).get("unmade", {}).get(target)
        if pool is None and unmade:   # under modal run
            raise shim.Unsupported(f"{self.target} calls {target}, whose pool could not be made: {unmade}")
        if pool is None:
            raise shim.Unsupported(
                f"{self.target} calls {target}: no pool serves it for pool "
                f"{self.worker.record['model']} ---> HINT: pool create --call {target}=POOL, "
                "or calque modal run the app (docs/modal.md)")
        if pool not in self.records:
            self.records[pool] = calque_core.load_pool(self.backend, pool)
        served = self.records[pool].get("modal", {}).get("params", {})
        if self.key(target, params) != self.key(target, served):
            raise shim.Unsupported(f"{self.target} calls {target} with parameters {params}: its "
                                   f"pool {pool} serves {served} ---> HINT: pool create --call "
                                   f"{target}=POOL naming a pool made with --param")
        return pool

    def send(self, pool, items):
        """A run of the call's items (made after the claim ended, it is cancelled once followed).
        One item (.remote, .spawn) is one claim: sized without reading the pool's stats."""
        record, conf, sizes = self.records[pool], self.worker.conf, calque_runs.as_sizes(1)
        if len(items) > 1:
            workers = (record["ec2"]["instances"] if "ec2" in record else   # its ceiling, as submit's
                       calque_supervisor.LocalFleet(conf, self.backend).bounds(record)[1])
            sizes = calque_runs.sized_claims(conf, self.backend, record, None, workers)
        if pool not in self.queues:
            self.queues[pool] = self.backend.queues.open_queue(record["queue"])
        options = {"chain": self.chain, "caller": self.caller(self.claim)}
        return calque_runs.stage_run(self.backend, record, items, sizes, self.queues[pool], "pool",
                                     options=options)

    def ended(self):
        """Raise, the calls cancelled, once the claim cannot use their results: ReleaseNow where
        the worker lets it go (it is given back whole, not failed by the item that waited)."""
        claim = self.claim
        why = claim and ("its lease was lost" if claim.heartbeat.lost.is_set() else
                         "the worker let it go" if self.worker.release_now.is_set() else
                         "its run was cancelled" if self.backend.store.exists(
                             calque_core.summary_key(claim.run_id, claim.claim_id)) else None)
        if why:
            self.cancel(why)
            if self.worker.release_now.is_set():
                raise ReleaseNow()
            raise calque_core.ResultsIncomplete(f"calls of claim {claim} cancelled: {why}")

    def cancel(self, why):
        for run in list(self.runs):   # (a spawned call's thread may drop one meanwhile)
            calque_runs.cancel_run(self.backend, run,
                                   f"the calling claim {self.claim} ended: {why}")

    def settle(self):
        """Wait for the calls the claim did not read whole; cancelled with its run, they are
        done (the claim's items are)."""
        with contextlib.suppress(calque_core.ResultsIncomplete):
            for run in list(self.runs):
                with contextlib.suppress(calque_core.WorkersFailed):   # that run cancelled
                    calque_runs.wait_for_run(self.backend, run, math.inf, False,
                                             stop_if=functools.partial(self.check, run))


class Rules:
    """The redelivery and poison rules (docs/contract.md): whether a delivery runs (accept), what
    earlier deliveries left it (take_over), and the pool's deaths as this worker knows them: the
    latest one's life sets the part cadence (part_due); innocent deaths marked in the store make
    poison take one death more (churning)."""

    def __init__(self, worker, stats_prefix, previous_life):
        self.worker_id, self.backend, self.record = worker.worker_id, worker.backend, worker.record
        self.accounts, self.stats_prefix = worker.accounts, stats_prefix
        self.ephemeral, self.spool_folder = worker.ephemeral, worker.spool_folder
        self.fetchers, self.reader = worker.fetchers, worker.reader
        self.queue = self.dlq = None     # once the worker starts
        self.network = self.backend.kind != "local"
        self.version = calque_core.version_of(self.record)   # the only version whose claims it runs
        self.replaced_by = None          # the pool's version, once it is not ours (pool deploy)
        number, conf = calque_core.setting_number, worker.conf
        self.checkpoint_seconds = number(conf, "CALQUE_CHECKPOINT_SECONDS", float, 0)
        self.checkpoint_batches = number(conf, "CALQUE_CHECKPOINT_BATCHES", int, 1)
        self.seen_life, self.seen_at = previous_life, time.time()   # the latest death: life, when
        self.part_seconds = 0.0          # s the latest result part's PUT took (interval)

    def accept(self, claim):
        """True where the claim is to run; None where it was handled here (dead-lettered, a
        duplicate acked, given back)."""
        message = claim.message
        try:
            msg = calque_core.parse_message(message.body)
        except ValueError as e:
            return self.dead_letter(claim, f"malformed message: {e}", None)
        key = self.backend.store.key_for_uri(msg["manifest_uri"])
        match = calque_core.MANIFEST_KEY.match(key or "")
        if not match:
            return self.dead_letter(claim, f"manifest_uri {msg['manifest_uri']!r} is outside "
                                           f"this pool's store {self.backend.describe()}: "
                                           "refused", msg)
        run_id, claim_id = match.groups()
        msg.update(run_id=run_id, claim=claim_id)    # the key is the authority, not the message
        if msg["model"] != self.record["model"]:
            return self.dead_letter(claim, f"claim is for model {msg['model']!r}, "
                                           f"this pool serves {self.record['model']!r}", msg)
        if calque_core.run_slug(run_id) != self.record["slug"]:
            return self.dead_letter(claim, f"run {run_id} is not one of this model's runs "
                                           f"({self.record['slug']}.*): refused", msg)
        claim.run_id, claim.claim_id = run_id, claim_id   # ours: from here, whatever becomes of it
        if msg.get("version", self.version) != self.version and not self.adopted(run_id):
            return self.other_version(claim, msg)
        # over a network, the manifest is read beside the duplicate check; a local one after it
        get = self.backend.store.get
        manifest_read = self.network and self.reader.submit(self.backend.requests.carried(get), key)
        if self.backend.store.exists(calque_core.summary_key(run_id, claim_id)):
            if manifest_read:
                manifest_read.exception()    # let it finish: nothing is left running behind the ack
            self.queue.delete(message)
            log.info("worker %s: claim %s/%s already has a summary (duplicate delivery): acked "
                     "without recompute", self.worker_id, run_id, claim_id)
            return None
        try:
            manifest = json.loads(manifest_read.result() if manifest_read else get(key))
            items = calque_sources.read_claim(self.backend, manifest, self.fetchers)
            first = int(manifest.get("first_index", 0))
        except calque_core.NotFound as e:
            return self.dead_letter(claim, f"claim object {e} does not exist", msg)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return self.dead_letter(claim, f"manifest {key} is corrupt: {e}", msg)
        claim.items, claim.first = items, first
        if self.spool_folder:
            claim.spool = Spool(self.spool_folder, claim)
        limit, rc = self.record["max_deliveries"], message.receive_count
        spent = f"delivered {rc} times, more than the pool's max deliveries {limit}"
        if rc > 1 or msg.get("resume") is True:   # not on a first delivery
            try:
                self.take_over(claim)
            except Exception as e:   # a refusal (AccessDenied) or a fault: this delivery is spent
                if rc <= limit:
                    raise            # let go, to come back after a delay (Worker.ending)
                return self.dead_letter(claim, f"{spent}, and what earlier deliveries left cannot "
                                               f"be read: {calque_core.aws_error_line(e)}", msg)
        if rc > limit and rc - claim.progress_at > limit:
            return self.dead_letter(claim, f"{spent}, with no progress (no new result part, no "
                                           f"death pinned on an item, no item quarantined) in "
                                           f"the last {limit}", msg)
        return True

    def pool_version_now(self):
        """The pool record's version when it is no longer ours (pool deploy), else None."""
        try:
            now = calque_core.version_of(calque_core.load_pool(self.backend, self.record["model"]))
        except (calque_core.UserError, calque_core.NotFound, calque_core.StoreFault) as e:
            log.warning("worker %s: pool record unreadable (%s): version not checked",
                        self.worker_id, e)
            return None
        return now if now != self.version else None

    def adopted(self, run_id):
        """Whether the run record names our version where its claim does not: pool deploy moved a
        run none of whose claims had started to the new version (calque.runs_to_adopt)."""
        with contextlib.suppress(calque_core.NotFound, calque_core.StoreFault, ValueError):
            run = calque_core.read_json(self.backend, calque_core.run_key(run_id))
            return run.get("version") == self.version
        return False

    def other_version(self, claim, msg):
        """A claim of another version never runs here. The pool's version now (pool deploy): this
        worker is the stale one: the claim goes back at once and the worker leaves, to restart on
        it (EXIT_REPLACED). A version the pool no longer runs: failure summary and dead letter."""
        now = self.replaced_by = None if self.ephemeral else self.pool_version_now()
        if now == msg["version"]:
            claim.let_go(0, f"claim of version {now}, this worker runs {self.version}")
            return None
        return self.dead_letter(claim, f"claim of version {msg['version']}; the pool runs "
                                       f"version {now or self.version} (pool deploy): not run, "
                                       "a run keeps its version ---> HINT: submit its items "
                                       "again to run them on the pool's version", msg)

    def take_over(self, claim):
        """What earlier deliveries left: their result parts (a torn one is redone), and their
        attempt record: how the last one ended (the rules: docs/contract.md)."""
        rc, store = claim.message.receive_count, self.backend.store
        keys = store.list(calque_core.results_prefix(claim.run_id, claim.claim_id))
        for start, stop, key in calque_core.part_chain(keys, len(claim.items)):
            try:
                part = calque_core.read_part(store, key, start, stop)
                lines = [json.loads(line) for line in part.lines]
            except (calque_core.ResultsIncomplete, ValueError) as e:
                log.warning("worker %s: part %s unreadable (%s): recomputing from offset %d",
                            self.worker_id, key, e, claim.start)
                break
            for line in lines[claim.start - start:]:
                if not line["ok"]:
                    claim.failed.append(line["i"])
                    if len(claim.errors) < calque_core.ERRORS_KEPT:
                        claim.errors[str(line["i"])] = line["error"]
            claim.parts.append([start, stop])
            claim.start = claim.committed = stop
        spooled, failed, errors, reached = (claim.spool.left(claim.first + claim.start)
                                            if claim.spool else ("", [], {}, {}))
        if spooled:   # what a delivery killed here made after its last part: committed first
            stop = claim.start + spooled.count("\n")
            claim.formatted.append((stop, ([spooled], failed, errors)))
            claim.start = stop
        claim.resumed_failed = len(claim.failed) + len(failed)
        record, attempt = {}, calque_core.attempt_key(claim.run_id, claim.claim_id)
        if attempt in keys:
            try:
                record = json.loads(store.get(attempt))
            except ValueError as e:     # torn by hand: what it said is lost
                log.warning("worker %s: attempt record %s unreadable (%s)", self.worker_id,
                            attempt, e)
        state, previous = record.get("state"), record.get("receive_count", 0)
        # a record at or past this count is an earlier message's (a redrive restarts the count)
        claim.progress_at = record.get("progress_at", 0) if previous < rc else 0
        if claim.start > record.get("covered", 0):        # a part written after the record
            claim.progress_at = max(claim.progress_at, rc - 1)
        claim.quarantined = dict(record.get("quarantined", {}))
        deaths = dict(record.get("deaths", {}))
        ahead = [str(k) for k in record.get("running", [])
                 if k >= claim.start and str(k) not in claim.quarantined]
        if state == "running" and ahead and 0 < previous < rc:   # a death pinned: progress
            claim.progress_at = max(claim.progress_at, previous + 1)
        if state == "running" and previous == rc - 1 and ahead:   # the last one died on it alone
            deaths[ahead[0]] = deaths.get(ahead[0], 0) + 1
            if deaths[ahead[0]] >= POISON_DEATHS:
                how, own = self.how_it_ended(record)
                if own or deaths[ahead[0]] > POISON_DEATHS or not self.churning():
                    claim.quarantined[ahead[0]] = (f"poison: the worker died running this item "
                                                   f"({deaths[ahead[0]]} deaths; {how})")
        elif state == "suspect" and len(ahead) == 1:             # it overran alone
            claim.quarantined[ahead[0]] = (f"timed out after {record['batch_timeout']:g} s (the "
                                           f"pool's batch_timeout): the worker was restarted, the "
                                           f"item quarantined")
        if len(claim.quarantined) > len(record.get("quarantined", {})):
            claim.progress_at = rc
        claim.record = dict(record, deaths=deaths)
        claim.single = (bool(record) or rc > 1) and not (state == "released" and previous == rc - 1)
        writer = None   # the pid of the last delivery, where it ran batches and died here
        if state is None and rc == 2 and len(reached) == 1:
            writer = next(iter(reached))
        elif state == "batches" and previous == rc - 1:
            host, _, pid = record["worker_id"].rpartition("-")
            writer = pid if host == socket.gethostname() else None
        if claim.single and writer in reached:   # the batch it ran and the one it gathered, alone
            reach = reached[writer] - claim.first
            claim.alone = range(reach, reach + 2 * self.record["batch_size"])
        if claim.single:    # its last delivery died: how long it lived, at least
            claim.life = record.get("alive", 0.0) if previous == rc - 1 else 0.0
            self.seen_death(claim.life)
        log.info("worker %s: claim %s/%s delivery %d: %d items resumed from %d part(s)%s%s%s%s",
                 self.worker_id, claim.run_id, claim.claim_id, rc, claim.start, len(claim.parts),
                 f" and this machine's spool ({spooled.count(chr(10))})" if spooled else "",
                 "" if not claim.single else ", one item at a time" if not claim.alone else
                 f", offsets {claim.alone.start}-{claim.alone.stop - 1} one at a time, the rest in "
                 f"batches",
                 f", deaths at offsets {deaths}" if deaths else "",
                 f", quarantined {sorted(map(int, claim.quarantined))}" if claim.quarantined
                 else "")

    def seen_death(self, life):
        """A death seen now, of a process that lived `life` s at least (0: unknown, then kept only
        where no death was seen before)."""
        if life or self.seen_life is None:
            self.seen_life = life
        self.seen_at = time.time()

    def part_due(self, claim):
        """Whether the batches the claim ran since its last part make a part now: the checkpoint
        rule (CALQUE_CHECKPOINT_BATCHES and _SECONDS); under churn (this claim's last delivery
        died, or this worker saw a death lately) Young's interval, sqrt(2 x part PUT x life), at
        most the checkpoint (life: the dead delivery's, else the latest seen)."""
        since = time.monotonic() - claim.last_commit
        seen = self.seen_life is not None and time.time() - self.seen_at <= CHURN_MEMORY
        if claim.life is None and not seen:
            return claim.batches >= self.checkpoint_batches and since >= self.checkpoint_seconds
        life = claim.life or (self.seen_life or 0.0)
        return since >= min(self.checkpoint_seconds, (2 * self.part_seconds * life) ** 0.5)

    def mark_churn(self):
        """An item with a death pinned on it ran alone and returned: mark the pool as churning."""
        with contextlib.suppress(Exception):
            key = f"{self.stats_prefix}churn-{time.time():012.1f}-{self.worker_id}"
            self.backend.store.put(key, b"")

    def churning(self):
        """Whether an innocent death was marked in this pool within CHURN_MEMORY s: then poison
        needs one death more. One LIST, only when an item reaches POISON_DEATHS."""
        marks = f"{self.stats_prefix}churn-"
        since = f"{marks}{time.time() - CHURN_MEMORY:012.1f}"
        keys = self.backend.store.list(self.stats_prefix, start_after=since)
        return any(key.startswith(marks) for key in keys)

    def how_it_ended(self, record):
        """(How an attempt record's worker ended, whether by its own doing): from its last stats,
        else the exit status its supervisor recorded. Any end but SIGKILL is its own."""
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

    def dead_letter(self, claim, reason, msg, note="the claim was not run"):
        """A claim that cannot succeed: failure summary (if the run is known), DLQ copy, delete."""
        message = claim.message
        run_id, claim_id = (msg or {}).get("run_id"), (msg or {}).get("claim")
        known = all(isinstance(v, str) and calque_core.SAFE_ID.match(v) for v in (run_id, claim_id))
        try:    # a summary for a waiting submitter (another model's run may be out of reach: IAM)
            key = calque_core.summary_key(run_id, claim_id)
            if known and not self.backend.store.exists(key):
                now = time.time()
                summary = self.accounts.summary(message, run_id, claim_id, now, now,
                                                extra_other=2,   # + the DLQ send and the delete
                                                error=reason, notes=[f"dead-lettered: {note}"])
                own = calque_core.run_slug(run_id) == self.record["slug"]   # else no retries
                (claim.put if own else self.backend.store.put)(key, json.dumps(summary, indent=1))
        except Exception as e:
            log.warning("worker %s: no failure summary for %s/%s (%s: %s)", self.worker_id,
                        run_id, claim_id, type(e).__name__, e)
        self.dlq.send(json.dumps({"reason": reason, "body": message.body,
                                  "receive_count": message.receive_count,
                                  "worker_id": self.worker_id, "at": calque_core.now_iso(),
                                  "run_id": run_id if known else None,
                                  "claim": claim_id if known else None}))
        self.queue.delete(message)
        log.warning("worker %s: claim to dead-letter queue %s: %s", self.worker_id,
                    self.record["dlq"], reason)


class Model:
    """The handler's batch calls, timed by the watchdog; their inputs collated (Collator) on the
    pipeline thread beside the model where that can release the GIL, further ahead on the collate
    threads while the model waits on a handler's own collate (deepen)."""

    def __init__(self, worker_id, batch_fn, collate, watchdog):
        self.worker_id, self.batch_fn, self.watchdog = worker_id, batch_fn, watchdog
        self.collator = Collator(collate)
        self.whole_claim = getattr(batch_fn, "_calque_whole_claim", False)
        self.prefetcher = ThreadPoolExecutor(1, thread_name_prefix="pipeline") if PREFETCH else None
        # the pipeline thread's CPU clock, taken out of the model's time (model_clock)
        self.pipeline_clock = None
        if self.prefetcher and hasattr(time, "pthread_getcpuclockid"):
            thread = self.prefetcher.submit(threading.get_ident).result()
            self.pipeline_clock = time.pthread_getcpuclockid(thread)
        self.collate_depth = 1           # batches collated ahead of the model (a handler's collate)
        self.decoders = None             # the threads past the pipeline's, once the depth grows

    def pipelined(self, kind):
        """Whether the pipeline thread prepares a claim's batches beside the model: where that can
        release the GIL (a numeric gather, the handler's collate), not for lists."""
        return self.prefetcher is not None and kind != AS_LIST

    def prepare(self, items, offsets, kind, beside=False):
        """The pipeline thread's future of these offsets' batch (a decoder thread's `beside` it,
        further ahead); None unless pipelined. Items by reference are awaited on that thread."""
        if not offsets or not self.pipelined(kind):
            return None
        pool = self.decoders if beside else self.prefetcher
        return pool.submit(self._collate, items, offsets, kind)

    def _collate(self, items, offsets, kind):
        payloads = gather(items, offsets)[0]
        return self.collator.prepare(payloads, kind) if payloads else None

    def deepen(self, wait, model):
        """One more batch collated ahead (on one more thread, up to COLLATE_THREADS) when the model
        waited on the handler's collate over COLLATE_WAIT_SHARE of its batch time: the threads that
        pay, as many as keep the model fed (a decoder that releases the GIL, as PIL's does)."""
        if wait > COLLATE_WAIT_SHARE * model and self.collate_depth < COLLATE_THREADS:
            self.collate_depth += 1
            if self.decoders is None:
                self.decoders = ThreadPoolExecutor(COLLATE_THREADS - 1, thread_name_prefix="collate")
            log.info("worker %s: the model waited %.3fs on collate beside a %.3fs batch: collating %d "
                     "batches ahead", self.worker_id, wait, model, self.collate_depth)

    def model_clock(self):
        """Wall time less the pipeline thread's CPU time, so a wait for its GIL is not model time."""
        pipeline = 0.0 if self.pipeline_clock is None else time.clock_gettime(self.pipeline_clock)
        return time.perf_counter() - pipeline

    def run(self, future, payloads, offsets, kind):
        """([(ok, result or error)], model s, collate wait s) for one batch, under the watchdog."""
        self.watchdog.watch(offsets)
        try:
            t0 = time.perf_counter()
            try:   # a failed collation: the items are tried one by one below, each failing alone
                prepared = future.result() if future else self.collator.prepare(payloads, kind)
            except Exception:
                prepared = None
            wait = time.perf_counter() - t0 if future else 0.0
            model = 0.0
            if prepared is not None:
                t0 = self.model_clock()
                try:
                    outputs = self.batch_fn(self.collator.inputs(prepared))
                    model = self.model_clock() - t0
                    try:
                        rows = calque_core.batch_rows(outputs, len(payloads))
                        return [(True, o) for o in rows], model, wait
                    except ValueError as e:     # the wrong count or shape: all fail, none retried
                        return [(False, str(e))] * len(payloads), model, wait
                except Exception as e:
                    model = self.model_clock() - t0
                    if len(payloads) == 1:   # one item (alone, a retry): its error, not a 2nd call
                        return [(False, item_error(e, payloads[0]))], model, wait
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
                        outcome.append((True, calque_core.batch_rows(out, 1)[0]))
                    except ValueError as e:
                        outcome.append((False, str(e)))
                except Exception as e:
                    outcome.append((False, item_error(e, payload)))
                model += self.model_clock() - t0
            return outcome, model, wait
        finally:
            self.watchdog.watch(None)


class Accounts:
    """The worker's counters (claims, items, busy time, @enter, the sums a claim's cost is fitted
    from), its stats (submit, pool status and the supervisor read them), a claim's summary."""

    def __init__(self, worker, stats_key, spawned_at, gpu):
        self.worker_id, self.backend, self.conf = worker.worker_id, worker.backend, worker.conf
        self.model, self.ephemeral = worker.record["model"], worker.ephemeral
        self.version = calque_core.version_of(worker.record)
        self.stats_key, self.gpu = stats_key, gpu    # gpu: the GpuSampler of the claims
        self.started = time.time()
        self.spawned_at = spawned_at or self.started
        self.acquisition_seconds = 0.0   # process spawn -> ready to load; charged to a cold worker's first claim
        self.entered_at, self.enter_seconds, self.enter_count = None, 0.0, 0   # @enter's
        self.stats = Counter()           # claims, warm_hits, items, items_failed
        self.busy_seconds = 0.0
        # sums over its claims that submit fits a claim's cost from (calque.claim_costs): claims, items,
        # seconds, items^2, items x seconds; then the gaps between two claims (count, seconds)
        self.claim_fit, self.claim_gaps, self.finished_at = [0, 0, 0.0, 0, 0.0], [0, 0.0], None
        self.last_stats = 0.0            # monotonic time of the last stats write
        self.stats_behind = False        # a claim ended since then: the stats miss it
        self.last_word = None            # how this process ends, when it knows (its last stats)

    def enter(self, enter_fn):
        """The handler's @enter, timed."""
        self.acquisition_seconds = max(0.0, time.time() - self.spawned_at)
        t0 = time.perf_counter()
        enter_fn()
        self.enter_seconds = time.perf_counter() - t0
        self.enter_count += 1
        self.entered_at = time.time()
        log.info("worker %s: @enter done in %.3fs (acquisition %.3fs)", self.worker_id,
                 self.enter_seconds, self.acquisition_seconds)

    def count(self, claim, seconds, warm_hit, finished):
        """A claim finished in `seconds` (its summary's claim_seconds)."""
        ran = len(claim.items) - claim.start
        self.stats.update(claims=1, warm_hits=int(warm_hit), items=ran,
                          items_failed=len(claim.failed) - claim.resumed_failed)
        self.busy_seconds += seconds
        seconds -= claim.enter_paid
        for k, value in enumerate((1, ran, seconds, ran * ran, ran * seconds)):
            self.claim_fit[k] += value
        gap = claim.received - (self.finished_at or -math.inf)   # idle past PLAN_GAP_MAX: not a gap
        if gap <= calque_core.PLAN_GAP_MAX:
            self.claim_gaps[0] += 1
            self.claim_gaps[1] += max(0.0, gap)   # received ahead: no gap
        self.finished_at = finished

    def summary(self, message, run_id, claim, started, finished, extra_other, **fields):
        """calque.claim_summary with this worker's identity and this thread's requests for the
        claim, the loose ones, and the writes to come (a PUT, `extra_other` queue requests)."""
        delta = self.backend.requests.take()
        delta["store_puts"] += 1
        delta["queue_other"] += extra_other
        return calque_core.claim_summary(
            run_id=run_id, claim=claim, model=self.model, worker_id=self.worker_id,
            mode="cold" if self.ephemeral else "pool", backend=self.backend.kind,
            receive_count=message.receive_count, enter_count=self.enter_count, started=started,
            finished=finished, instance_type=self.conf.get("CALQUE_INSTANCE_TYPE") or None,
            requests={k: delta[k] for k in calque_core.REQUEST_KEYS}, **fields)

    def write(self, state):
        """The worker's stats, where submit, pool status and the supervisor read them."""
        now = time.time()
        self.last_stats, self.stats_behind = time.monotonic(), False
        stats = {"worker_id": self.worker_id, "model": self.model, "host": socket.gethostname(),
                 "pid": os.getpid(), "mode": "cold" if self.ephemeral else "pool", "state": state,
                 "backend": self.backend.kind, "started_at": calque_core.now_iso(self.started),
                 "updated_at": calque_core.now_iso(now), "alive_seconds": round(now - self.started, 3),
                 "busy_seconds": round(self.busy_seconds, 3),
                 "enter_seconds": round(self.enter_seconds, 6), "enter_count": self.enter_count,
                 "entered_at": calque_core.now_iso(self.entered_at) if self.entered_at else None,
                 "acquisition_seconds": round(self.acquisition_seconds, 6),
                 **{k: self.stats[k] for k in ("claims", "warm_hits", "items", "items_failed")},
                 "claim_fit": self.claim_fit, "claim_gaps": self.claim_gaps,
                 "requests": dict(self.backend.requests),
                 # "c", "reference" (the numpy fallback) or None (no batch needed fastbatch)
                 "fastbatch": getattr(sys.modules.get("fastbatch"), "BACKEND", None),
                 "no_gpu": None if self.gpu.nvml else self.gpu.reason,   # why NVML saw none
                 "instance_type": self.conf.get("CALQUE_INSTANCE_TYPE") or None,
                 "version": self.version}
        if self.last_word:
            stats["exit"] = self.last_word
        try:
            self.backend.store.put(self.stats_key, json.dumps(stats, indent=1))
        except Exception as e:   # bookkeeping: must not stop the worker
            log.warning("worker %s: stats write failed (%s)", self.worker_id, e)


def announce(ready_file, *words):
    """Tell this machine's supervisor how far this worker got: its ready file gets our pid once
    @enter is done (pool create waits on it), then "progress" once a result part or a summary is
    written (a death after that is not a crash loop: supervisor.restart_delay)."""
    if ready_file:
        calque_core.write_file_atomic(ready_file, " ".join((str(os.getpid()), *words)))


HANDOFF_FLAGS = (("--supervisor-pid", int), ("--ready-file", str), ("--spawned-at", float),
                 ("--previous-life", float), ("--gpu-index", int))   # Worker's keyword arguments


def main(argv=None):
    parser = calque_core.Parser(prog="warmd" if calque_core.command() == "calque" else "python warmd.py",
                           description="The sticky worker of a calque pool.")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="serve the pool of this model")
    which.add_argument("--run", help="serve one cold run's queue, then exit (started by `calque.py submit` without "
                                     "--pool)")
    for flag, kind in HANDOFF_FLAGS:   # from calque_supervisor.py or a cold run; not in --help
        parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    try:
        if argv is None:   # a command line: in the kit's .venv when this Python lacks its packages
            calque_core.kit_python(sys.argv[1:], os.path.abspath(__file__))
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s warmd %(message)s",
                            stream=sys.stderr)
        faulthandler.enable()   # a handler that segfaults: its traceback in the worker log
        conf = calque_core.settings()
        # check the store under the pool's own folder, the only one a least-privilege worker role may list
        own_folder = f"pools/{calque_core.slug(args.model)}/" if args.model else f"runs/{args.run}/"
        backend = calque_core.open_backend(conf["CALQUE_STORE"], check_prefix=own_folder)
        handoff = {key: value for key, value in vars(args).items() if key not in ("model", "run")}
        if args.model:
            record = calque_core.load_pool(backend, args.model)
            prefix = calque_core.worker_stats_prefix(args.model)
        else:
            record = calque_core.read_json(backend, calque_core.cold_record_key(args.run))
            prefix = f"runs/{args.run}/workers/"
        worker = Worker(backend, record, prefix, conf, not args.model, **handoff)
        worker.output.capture()
        worker.work()
        if worker.rules.replaced_by:
            return calque_core.EXIT_REPLACED
    except calque_core.NotFound as e:
        print(f"warmd: error: {e} not found in the store: check CALQUE_STORE and the pool (`{calque_core.command()} pool list`)",
              file=sys.stderr)
        return calque_core.EXIT_USAGE
    except Exception as e:   # AWS at start-up: credentials, permissions, endpoint
        return calque_core.cli_error(e, "warmd", "check the instance role and region")
    return calque_core.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
