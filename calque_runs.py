"""Runs: stage and send claims (a source cuts and stages them), wait on summaries, cancel,
redrive, report; a Modal app's calls as runs (Calls). Stands on calque_core and calque_sources;
calque.py's submit and runs verbs, `modal run`, the fleets, the worker and the dashboard call it."""
import collections, contextlib, datetime, json, math, os, re, shutil, signal, threading, time, sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from calque_core import (BYTES, CLAIM_LOOKAHEAD_MAX, CLAIM_OVERHEAD_SHARE, CLAIM_SIZE_FLOOR,
                         CLAIM_SIZE_MAX, DLQ_SCAN_WAIT, ERRORS_KEPT, WorkersFailed,
                         ERROR_GROUPS_SHOWN, EXIT_FAILED, EXIT_OK, FIRST_ITEMS_SHOWN,
                         LOCAL_SUMMARY_WAIT, LOCAL_WRITERS, LeaseLost, NUMERIC_KINDS, NotFound,
                         Part, RUN_RECHECK, RUN_RECHECK_MAX, ResultsIncomplete, SEND_BATCH,
                         STAGE_AHEAD, STAGE_BYTES, STORE_WRITERS, SUMMARY_BATCH,
                         SUMMARY_POLL_FLOOR, SUMMARY_POLL_MIN, SUMMARY_WAIT_MAX, StoreFault,
                         UserError, _parse_time, _run_defaults, bytes_text, claim_id, claim_items,
                         claim_sizes, claim_summary, claims_progress, command, dlq_name, dumps,
                         format_sizes, json_line, list_runs, list_summaries, load_modal_shim,
                         make_message, manifest_key, new_run_id, note_queue_deleted, now_iso,
                         orjson, parse_message, read_claim_parts, read_json, read_run,
                         read_summaries, read_worker_stats, result_lines, results_key,
                         results_prefix, run_key, setting_number,
                         run_queue_names, stream_prefix, SUMMARY_POLL_MAX, summary_claims,
                         summary_key, update_run, with_bytes, write_json)
import calque_values
from calque_sources import as_items, claim_field


# ------------------------------------------------------------------------------------------------
# 5. submit and runs: read items, stage and send claims, wait on summaries, cancel, redrive, report
class SubmitInterrupted(BaseException):
    """SIGINT or SIGTERM while submit or runs resume stages or sends claims; a BaseException."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def handling(handler, *signums):
    """Inside the block `handler` takes the signals given; the handlers before are back after it."""
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, was in previous.items():
            signal.signal(s, was)


def signals_interrupt():
    """Inside the block SIGINT and SIGTERM raise SubmitInterrupted once; a second one is ignored, so
    that recording what was sent is not cut short."""
    fired = []

    def on_signal(signum, frame):
        if not fired:
            fired.append(signum)
            raise SubmitInterrupted(signum)

    return handling(on_signal, signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block is done (blocked for this thread meanwhile)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
        fresh = ClaimSizes(self.fixed, self.workers, self.lo, self.hi, self.unit)
        sizes, left = [], total
        while left > 0:
            sizes.append(min(fresh.next(left), left))
            left -= sizes[-1]
        return sizes

    def ahead(self):
        """Items a stream is read ahead of its claims, so that `left` is known where it matters."""
        return 0 if self.fixed else min(CLAIM_LOOKAHEAD_MAX, 2 * self.workers * self.hi)


def sized_claims(conf, backend, record, claim_size, workers):
    """The ClaimSizes of a run on the pool `record` (None: unmeasured): --claim-size, else a set
    CALQUE_CLAIM_SIZE, else factoring over `workers` (calque_fleet.claim_sizing: the pool's
    ceiling), its claims at most CALQUE_CLAIM_SECONDS long and CLAIM_SIZE_MAX items, at least
    CLAIM_OVERHEAD_SHARE of overhead: both from the pool's claims so far (claim_costs), once it
    has some. Here, below the fleets, so that a worker's calls are sized as submit's runs."""
    if claim_size:
        return ClaimSizes(fixed=claim_size, why="--claim-size")
    if conf["CALQUE_CLAIM_SIZE"].strip():
        return ClaimSizes(fixed=setting_number(conf, "CALQUE_CLAIM_SIZE", int, 1), why="CALQUE_CLAIM_SIZE")
    target = setting_number(conf, "CALQUE_CLAIM_SECONDS", float, 0.001)
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


def as_sizes(size):
    """A ClaimSizes from an int (a fixed size) or a ClaimSizes."""
    return size if hasattr(size, "plan") else ClaimSizes(fixed=size)


def stage_claim(backend, run, items, claim, start, stop, chunk):
    """Write one claim's manifest, as the source stages it (JSON items inside, numeric items
    beside it as .npy, bytes values beside it in one object; by reference, what the worker
    fetches)."""
    manifest = {"run_id": run["run_id"], "claim": claim, "model": run["model"], "first_index": start,
                "count": stop - start}
    backend.store.put(manifest_key(run["run_id"], claim), items.stage(backend, manifest, chunk))


def stage_run(backend, record, items, claim_size, queue, mode, run_id=None, options=None,
              grant=None):
    """Stage the items as a stream, sending each claim once its manifest has landed; returns the
    run, its claims sized by `claim_size` (an int, or a ClaimSizes). The run record comes first
    (`staged: false`, with the submit `options` it keeps: run_options); claims are cut as items
    are read, manifests PUT on STORE_WRITERS threads (LOCAL_WRITERS locally) and sent in order,
    SEND_BATCH a request, with at most STAGE_AHEAD manifests a writer unsent (bounded memory).
    SIGINT or SIGTERM stops the sending, not the staging (`runs resume` sends the rest), then
    raises SubmitInterrupted. Another error before a claim was sent deletes what was staged;
    after, the run keeps the claims sent. `grant`: the fleet's grant_read, for an s3:// prefix the
    pool's workers may not read yet (an EC2 pool's role)."""
    run_id, items = run_id or new_run_id(record["model"]), as_items(items)
    items.place(backend, record)
    if items.reads and grant:
        grant(record, items.reads)
    known = items.count
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
                for index, (start, stop, chunk, media) in enumerate(items.claims(sizes)):
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

    def claims(self, retry=True):
        try:
            self.queue = self.queue or self.backend.queues.open_queue(self.name)
            counts = self.queue.counts()
            if counts["visible"] + counts["in_flight"] != self.depth or counts["in_flight"]:
                self.depth = counts["visible"] + counts["in_flight"]
                messages = receive_all(self.queue, counts["visible"])
                release(self.queue, messages)
                letters = [dead_letter_of(m) for m in messages]
                self.found = {c: why for rid, c, why in filter(None, letters) if rid == self.run_id}
        except NotFound:   # deleted (an ended cold run's, a deleted pool's): it holds nothing
            return {}
        except StoreFault:
            if self.backend.kind != "local" or not retry:
                raise
            return self.claims(retry=False)   # the local queue file was replaced: reopened now
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
                run.update(_run_defaults(read_json(backend, run_key(run["run_id"]))))
                states = claim_states(backend, run, list(done.values()), dead).values()
                if all(state != "queued or running" for state, _ in states):   # none will run
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

    with handling(on_sigint, signal.SIGINT):
        yield noted


def run_recheck(progressed, now):
    """When wait_for_run next looks at the run record: RUN_RECHECK s after the last new summary,
    then at gaps doubling with the time stalled, up to RUN_RECHECK_MAX."""
    return max(progressed + RUN_RECHECK, now + min(max(now - progressed, RUN_RECHECK), RUN_RECHECK_MAX))


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
    runs = [r for r in list_runs(backend, model) if r["model"] == model and r["mode"] == "pool"]
    marked = {run["run_id"]: cancel_run(backend, run, "pool deleted") for run in runs}
    return {run_id: claims for run_id, claims in marked.items() if claims}


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


def drop_pool(backend, record, cancel=False):
    """Delete a pool's queues and store folder (its runs are kept); `cancel`: its unfinished runs
    first. Its workers are stopped already. Returns the cancelled runs, as cancel_pool_runs."""
    cancelled = cancel_pool_runs(backend, record["model"]) if cancel else {}
    for role in ("queue", "dlq"):
        backend.queues.delete_queue(record[role])
        if backend.kind == "aws":    # a create within the minute waits (SQS still deletes)
            note_queue_deleted(backend.store, record[role])
    backend.store.delete_prefix(f"pools/{record['slug']}/")
    return cancelled


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
                    send_batch(backend, run, queue, [claim], resume=True)
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


def claim_ids(backend, run, claim, field):
    """The `field` of each of the claim's items, read from its manifest (by reference: a file's
    path, a Parquet column's values; a bytes value reads as null)."""
    manifest = json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
    return claim_field(backend.store, manifest, field)


def claim_column(parts, field):
    """(offsets, values) of the items whose result holds `field` (None: the result itself): typed
    arrays stacked (bfloat16 as float32), else as numpy.array makes them; ValueError on shapes."""
    import numpy as np
    blocks = field_blocks(parts, field)
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
    for k, line in enumerate(map(orjson.loads, (line for part in parts for line in part.lines))):
        value = field_value(line.get("result"), field)
        if line["ok"] and value is not None:
            rows.append(k)
            values.append(value)
    values = np.array(values)
    if values.dtype.kind not in NUMERIC_KINDS:
        raise ValueError(f"its values are not numbers: numpy makes {values.dtype} of them")
    return np.array(rows, dtype=np.int64), values


def field_value(result, field):
    """`field` of a result (None: the result itself); None where the result is no dict."""
    return result if field is None else result.get(field) if isinstance(result, dict) else None


def field_blocks(parts, field):
    """The parts' typed blocks of `field`, their rows as offsets in the whole claim."""
    blocks, at = [], 0
    for part in parts:
        blocks += [b._replace(rows=b.rows + at) for b in part.blocks if b.field == field]
        at += len(part.lines)
    return blocks


def typed_values(parts, field):
    """{row: array} of the claim's typed values of `field` (bytes for a bytes block)."""
    return {row: array for block in field_blocks(parts, field)
            for row, array in zip(block.rows.tolist(), block.arrays())}


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


def follow_results(backend, run, poll=SUMMARY_POLL_MAX, stop_if=None):
    """Each claim's result lines (with the run's id_field), in claim order, as each finishes."""
    for _, claim, parts in follow_claims(backend, run, poll, stop_if):
        yield with_ids(backend, run, claim, parts)


def follow_claims(backend, run, poll=SUMMARY_POLL_MAX, stop_if=None):
    """(index, claim, parts) as each claim is summarised, in order; one that will not run raises.
    stop_if() may raise, looked at with the run record (RUN_RECHECK s)."""
    recheck = 0.0
    for index, claim in enumerate(run["claims"]):
        delay = SUMMARY_POLL_MIN   # quick at first (a short claim's round trip), growing to `poll`
        while True:
            if claim in summary_claims(backend, run["run_id"]):
                s = read_json(backend, summary_key(run["run_id"], claim))
                state, detail = claim_states(backend, run, [s], dead_letters=False)[claim]
                break
            if time.monotonic() >= recheck:   # claim_states may scan the DLQ: not every poll
                recheck = time.monotonic() + RUN_RECHECK
                run.update(read_run(backend, run["run_id"]))
                state, detail = claim_states(backend, run, [])[claim]
                if state != "queued or running":
                    break
                if stop_if:
                    stop_if()
            time.sleep(delay)
            delay = min(delay * 1.5, poll)
        if state not in ("done", "failed"):
            raise ResultsIncomplete(f"run {run['run_id']}: no results for claim {claim} ({state}"
                                    f"{': ' + detail if detail else ''}) ---> HINT: {next_step(run, state)}")
        yield from with_parts(backend, run, [(index, claim)])


def with_ids(backend, run, claim, parts):
    """The claim's result lines (of its parts) with each item's --id-field (if the run has one)
    copied in from the claim's manifest."""
    lines = [line for part in parts for line in result_lines(part)]
    field = run["options"].get("id_field")
    if not field:
        return lines
    ids = claim_ids(backend, run, claim, field)
    return [dumps(dict(json.loads(line), **{field: ids[k]})) + "\n" for k, line in enumerate(lines)]


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
        values = [field_value(line.get("result"), field) for line in lines]
        if field in typed:
            try:
                rows, stacked = claim_column(parts, field)
            except ValueError:      # shapes that differ: one list a row, below
                rows = None
            if rows is not None and (len(rows) == count or not any(
                    values[k] is not None for k in set(range(count)) - set(rows.tolist()))):
                columns[name] = _arrow_column(pa, stacked)
                if len(rows) < count:   # the items without it (failed) are nulls
                    where = np.full(count, -1)
                    where[rows] = np.arange(len(rows))
                    columns[name] = columns[name].take(pa.array(where, mask=where < 0))
                continue
        for row, array in typed_values(parts, field).items():
            values[row] = array if isinstance(array, bytes) else array.tolist()
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            columns[name] = pa.array([None if v is None else bytes_text(v) if isinstance(v, bytes) else dumps(v)
                                      for v in values], pa.string())
    return pa.record_batch(columns)


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
    detail the dead-letter or cancel reason. Without dead_letters: no DLQ scan, no queue look;
    a DeadLetters: its scan (a waiter's, rescanned only when the DLQ changed)."""
    by_claim = {s["claim"]: s for s in summaries}
    cancelled = run.get("cancelled")
    pending = not cancelled and any(claim not in by_claim for claim in run["claims"])
    dead = DeadLetters(backend, run) if dead_letters is True else dead_letters
    letters = dead.claims() if pending and dead else {}
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
    retried, attempts = (sum(s.get("retried", {}).get(k, 0) for s in summaries)
                         for k in ("items", "attempts"))
    if retried:   # a pool's retries (docs/modal.md): their attempts, the first included
        lines.append(f"  {retried} item{'s' * (retried > 1)} retried ({attempts} attempts)")
    lines += format_item_errors(run, summaries, names)
    lines.append(f"  results: {results_uri}  ({command()} runs results {run['run_id']})")
    cancelled = sorted({v["detail"] for v in view["claims"].values() if v["state"] == "cancelled"})
    why = f" ({'; '.join(cancelled)})"
    return lines + [f"  not finished: {counts[state]} claim(s) {what.format(why=why)} ---> HINT: "
                    f"{next_step(run, state)}" for state, what in NOT_RUN.items() if counts[state]]


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
    field, names = run["options"].get("id_field"), dict(zip(indices, indices))
    for claim in dict.fromkeys(claim_of[i] for i in indices):
        with contextlib.suppress(NotFound):   # a manifest deleted: its items keep their indices
            manifest = json.loads(backend.store.get(manifest_key(run["run_id"], claim)))
            ids = (claim_field(backend.store, manifest, field or "path")   # else: a file's path
                   if field or {"refs", "bytes"} & set(manifest) else [])
            for i in (i for i in indices if claim_of[i] == claim):
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
# a Modal app's calls, from `modal run`'s entrypoint (calque.ModalRun) or a worker (WorkerCalls)
def result_of(line):
    """A result line as the item's result dict (its bytes values as bytes)."""
    return json_line(line) if '"$bytes"' not in line else with_bytes(json_line(line))


class Calls:
    """Where a Modal app's .remote / .map / .spawn ... go (modal_shim's `runner`): a call's items,
    typed where JSON cannot say them, as one run on the pool that serves its target (pool_for,
    send: the caller's), its results decoded as each claim ends; a worker's stop_if (ended) may
    end the wait, and so does the called pool's every worker dying before it is warm (crashing:
    the death line of a pool of this machine, as submit's wait)."""
    ended = crashing = None

    def __init__(self, backend, folder):
        self.backend, self.allowed = backend, calque_values.app_modules(folder)
        self.runs, self.lock = [], threading.Lock()

    @staticmethod
    def key(target, params):
        return target, json.dumps({k: str(v) for k, v in params.items()}, sort_keys=True)

    def __call__(self, target, params, items):
        with self.lock:   # .aio calls come from threads: one pool per target, one submit at a time
            pool = self.pool_for(target, params)
            try:
                items = [self._typed(item) for item in items]
                run = self.send(pool, items)
            except (TypeError, RecursionError) as e:   # calque_values.Refused, an array's tolist()
                if isinstance(e, RecursionError):        # of objects; or a value nested too deep
                    e = f"nested deeper than Python's recursion limit ({sys.getrecursionlimit()}): " \
                        "flatten them"
                raise load_modal_shim().app_error(TypeError(f"{target}'s arguments: {e}")) from None
            self.runs.append(run)
        return self._decoded(self._results(run))

    def _results(self, run):
        """The run's results as its claims end; once read whole it is done: not waited for, nor
        cancelled (a worker's claim may have made thousands)."""
        for lines in follow_results(self.backend, run, stop_if=lambda: self.check(run)):
            yield from map(result_of, lines)
        with self.lock, contextlib.suppress(ValueError):   # (a claim before's, in a worker)
            self.runs.remove(run)

    def check(self, run):
        """Raise where waiting for `run` is moot: ended(), or no worker of its pool will come
        (WorkersFailed; the run cancelled, so nothing waits on it)."""
        if self.ended:
            self.ended()
        died = self.crashing and self.crashing(run["model"])
        if died:
            why = f"pool {run['model']}: every local worker dies before it is warm: {died}"
            cancel_run(self.backend, run, why)
            raise WorkersFailed(why if "---> HINT" in why else f"{why} ---> HINT: fix the app")

    def _typed(self, item):
        """A call item with its arguments in the typed encoding where JSON cannot say them (the
        worker's ModalHandler decodes them); a plain call as it is, walked once."""
        if calque_values.plain(item):   # {"__modal_call__": [args, kwargs(, stream)]}
            return item
        (key, call), = item.items()
        encoder = calque_values.Encoder(self.allowed, tag_bytes=False)   # bytes: the bytes form
        call = [encoder.encode(call[0]), encoder.encode(call[1]), *call[2:]]
        return {key: {calque_values.TAG: ["typed", call]}} if encoder.tagged else item

    def _decoded(self, results):
        """Each result as the call returned it; a failed one's exception rebuilt (`exception`)
        where its class is the app's or the standard library's, else left to its message."""
        for result in results:
            if result["ok"]:
                try:
                    result["result"] = calque_values.decode_result(result["result"], self.allowed)
                except calque_values.Refused as e:
                    raise load_modal_shim().app_error(e) from None
            elif "exception" in result.get("raised", {}):
                raised = result["raised"]["exception"]
                with contextlib.suppress(Exception):   # a class not found here: RemoteError
                    result["exception"] = calque_values.decode(raised, self.allowed)
            yield result

    def streamed(self, target, params, stream, after=None, done=False):
        """The chunks a .remote_gen worker wrote after key `after`: [(key, chunk)]; `done`
        deletes them."""
        store = self.backend.store
        prefix = stream_prefix(self.pool_for(target, params), stream)
        if done:
            return store.delete_prefix(prefix)
        chunks = [(key, json.loads(store.get(key))) for key in store.list(prefix, after)]
        for _, chunk in chunks:   # its values in the typed encoding (calque.Streamed)
            chunk["values"] = calque_values.decode_result(chunk["values"], self.allowed)
        return chunks
