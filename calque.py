"""calque: warm-worker pools for batch model inference: the Python API and the CLI (and, re-exported,
the handler API). A run: stage_run writes the run record, a manifest and a queue message per claim;
warmd.py's Worker receives a claim, its ClaimRun runs its batches and writes its summary, then acks it;
wait_for_run waits on the summaries. The kit in floors, each importing only those below it
(tests/test_layout.py keeps it so; docs/contract.md: the contract; README.md: the commands):
    calque.py            the Python API (Pool, submit, Run) and the CLI (cmd_* per verb, main)
    calque_dashboard.py  the web dashboard and the run report
    calque_fleet.py      where a pool's workers run, chosen (fleet_for); cold runs, status, planner
    warmd.py             the worker (it reaches EC2 itself for its own instance's notices)
    calque_supervisor.py, calque_ec2.py   the two fleets: this machine; an EC2 Auto Scaling group
    calque_runs.py       submit and runs: stage, send, wait, cancel, redrive, report; Modal calls
    calque_sources.py, calque_cost.py     items, one Source per input kind; the cost model
    calque_core.py       the ground floor: handler API, settings, the contract, backends, records
    calque_values.py     the typed encoding of Python values (a Modal call's), below them all
"""
import sys
if __name__ == "__main__":   # `python calque.py` / `python -m calque`: a handler's or an app's `import calque`
    sys.modules["calque"] = sys.modules[__name__]   # gets this module, not a second copy
import argparse, contextlib, ctypes, functools, importlib.util, inspect, json
import math, os, re, secrets, shutil, signal, sqlite3, time, typing

import calque_supervisor

from calque_core import (BYTES, EXIT_FAILED, EXIT_OK, EXIT_USAGE, NotFound, Parser,
                         ResultsIncomplete, SCALE_IDLE_MINUTES, SEND_BATCH, SUMMARY_POLL_MAX,
                         StoreFault, UserError, VERSION_CHECK, VersionAction, WorkersFailed, batch,
                         check_slug_free, claim_items, cli_error, command, desired_count, dlq_name,
                         enter, import_modal_file, include_paths, key_values, kit_fault, kit_python,
                         latest_runs, list_runs, load_pool, new_run_id, now_iso, one_line,
                         open_backend, open_volume, orjson, parse_handler_spec, pool_key,
                         pool_name_claimed, pool_queue_name, pool_settings, pool_version,
                         queue_depth, read_run, read_summaries, read_worker_stats, recent_summaries,
                         refuse_other_version, retry_policy, serve_volumes, setting_number,
                         settings, size_text, slug, snapshot_handler, state_dir, stop_seconds,
                         summary_claims, unlink_volumes, update_run, user_code_error, version_label,
                         version_of, wait_queue_reusable, wait_seconds, web_endpoint,
                         write_file_atomic, write_json)
from calque_sources import as_items, read_items
from calque_runs import (Calls, SubmitInterrupted, as_sizes, follow_claims, follow_results,
                         result_of, with_ids,
                         cancel_run, check_deletable, claim_batch,
                         claim_ids, claim_list, claim_states,
                         delete_run, drop_pool, field_value, format_runs_list, interrupted,
                         interrupted_waiting, listed_run, live_claims, next_step, parse_age,
                         redrive, report_run, run_array, run_options, run_table,
                         run_view, runs_to_prune, send_batch, send_claims, handling, sigint_noted,
                         signals_interrupt, stage_run, typed_values, wait_for_run, with_parts)
from calque_cost import (_usd, format_cost_table, format_ladder, format_pool_cost, format_run_cost,
                         pool_cost_report, pricing, run_cost_report)
from calque_supervisor import (DEPLOY_POLL, LIVE_STATES, LOCAL_WORKERS_DEFAULT, WORKER_START_GRACE,
                               crash_looping, read_desired, read_scaling, read_state,
                               read_supervisor, scale_local, wait_warm)
from calque_fleet import (PLAN_CLAIMS_READ, _duration, add_count_flags, check_counts,
                          claim_sizing, cold_run, fleet_for, format_plan, format_pool_list,
                          format_pool_status, make_plan, mark_lost_workers, modal_options,
                          parse_duration, pick_option, plan_against_actual, pool_ceiling,
                          pool_liveness, pool_record_to_delete, pool_status, unwarmed_death,
                          volume_folders)

__all__ = [
    "enter", "batch",                                   # the handler API
    "Pool", "submit", "Run",                            # the Python API (section 10)
    "UserError", "StoreFault", "WorkersFailed", "NotFound", "ResultsIncomplete",
    "SubmitInterrupted",
]


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


def announce_run(conf, model, items, sizes, run_id):
    """Tell a self-sizing local pool the claims run `run_id` brings (sizes: a ClaimSizes or an int): it
    starts workers while they stage."""
    folder = state_dir(conf, model)
    bounds = read_scaling(folder)
    if bounds is not None:
        claims = len(as_sizes(sizes).plan(items.count)) if items.count else 1
        wake = {"at": time.time(), "claims": claims, "run": run_id}
        write_file_atomic(os.path.join(folder, "scaling.json"), json.dumps(dict(bounds, wake=wake)))


class Pool:
    """One model's pool of local workers: create, scale, status, delete."""

    def __init__(self, model, *, store=None, context=None):
        self.model = model
        self.conf, self.backend = context or _context(store)

    def create(self, handler, workers=LOCAL_WORKERS_DEFAULT, *, batch_size=None, visibility_timeout=None,
               max_deliveries=None, batch_timeout=None, gpus_per_worker=None, threads_per_worker=None, wait=True,
               progress=False, modal=None, include=(), retries=None):
        """Create the pool (one of the same version is left as it is, another refused: `pool
        deploy`), then start `workers` local workers, waited for unless wait=False. `modal`:
        modal_options' record; `include`: [local, relative path] files; `retries`: N or retry_policy's."""
        record = self.draft(batch_size, visibility_timeout, max_deliveries, batch_timeout, modal,
                            retries)
        record["workdir"] = os.getcwd()
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

    def draft(self, batch_size=None, visibility_timeout=None, max_deliveries=None,
              batch_timeout=None, modal=None, retries=None):
        """Its record before the handler snapshot: names, settings, when and where."""
        if batch_timeout is not None and not (math.isfinite(batch_timeout) and batch_timeout > 0):
            raise UserError(f"--batch-timeout {batch_timeout}: must be a number of seconds above 0")
        model = self.model
        record = {"model": model, "slug": slug(model), "queue": pool_queue_name(model),
                  "dlq": dlq_name(model), "created_at": now_iso(), "store": self.backend.describe(),
                  **pool_settings(self.conf, batch_size, visibility_timeout, max_deliveries)}
        if batch_timeout is not None:   # absent: the workers' CALQUE_BATCH_TIMEOUT applies
            record["batch_timeout"] = batch_timeout
        if modal:
            record["modal"] = modal
        if isinstance(retries, int):   # --retries N: Modal's retries=N
            retries = retry_policy(retries)
        if retries and retries["max_retries"]:   # absent: an item that raises fails at once
            record["retries"] = retries
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
        with handling(lambda signum, frame: noted.append(signum), signal.SIGINT, signal.SIGTERM):
            if here and not calque_supervisor.stop_supervisor(self.conf, self.model,
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
                calque_supervisor.start_supervisor(self.conf, self.model, read_desired(folder),
                                                     *[int(v) if v else None for v in per_worker])
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
        if not calque_supervisor.stop_supervisor(self.conf, self.model, stop_seconds(self.conf) + 15):
            raise UserError(f"pool {self.model}: its supervisor did not stop; "
                            f"see {state_dir(self.conf, self.model)}/supervisor.log, then retry")
        return drop_pool(self.backend, record, cancel=force)


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


def check_claim_size(claim_size):
    if claim_size is not None and claim_size < 1:
        raise UserError(f"--claim-size {claim_size}: must be at least 1")


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
        items = items.with_id_field(id_field)
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
    run = stage_run(backend, record, items, sizes, queue, "pool", run_id, options,
                    fleet_for(conf, backend, record).grant_read)
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
                result = result_of(line)
                if not (failed_only and result.get("ok")):
                    yield result

    def iter_batches(self, poll=SUMMARY_POLL_MAX):
        """Each claim's results as a pyarrow.RecordBatch, in item order, as each claim finishes."""
        for _, claim, parts in follow_claims(self.backend, self.record, poll):
            yield claim_batch(self.backend, self.record, claim, parts)

    def to_arrow(self):
        """Every item's result as one pyarrow.Table in item order (iter_batches, columns unified)."""
        return run_table(self.iter_batches())

    def to_numpy(self, field=None, fill=None):
        """`field` of every result (None: the result or its only array) stacked; a failed item's
        row is `fill` (default NaN for floats, else a UserError). bfloat16 comes as float32."""
        return run_array(self.record, follow_claims(self.backend, self.record), field, fill)

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


# ------------------------------------------------------------------------------------------------
# 11. the CLI: printing helpers, then one cmd_* per verb in the parser's order, build_parser, main
def emit(args, data, text, *text_args):
    """Print `data` as JSON with --json, else the lines of text(*text_args); the exit code."""
    print(json.dumps(data, indent=1) if args.json else "\n".join(text(*text_args)))
    return EXIT_OK


def _pricing(args):
    """The Pricing the cost options every cost-printing verb takes ask for."""
    return pricing(args.rates, args.instance_type, args.spot, args.savings_plan)


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
        report, _, label, _ = run_cost_report(backend, run, summaries, _pricing(args))
        for line in format_run_cost(report, label):
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


def write_binary_results(out, backend, run, claims, args):
    """The results of `claims` ((index, claim, parts)) as one Parquet table or .npy array to `out`
    (--files: a file an item); the rows written."""
    if args.files is not None:
        return write_result_files(backend, run, claims, args.files, args.field)
    if args.format == "npy":
        import numpy as np
        array = run_array(run, claims, args.field, args.fill)
        np.save(out, array, allow_pickle=False)
        return len(array)
    import pyarrow as pa
    import pyarrow.parquet as pq
    if "pandas" not in sys.modules:   # pyarrow would import it (a third of the time)
        sys.meta_path.insert(0, NoPandas)
        try:
            pa.array([None])
        finally:
            sys.meta_path.remove(NoPandas)
    table = run_table(claim_batch(backend, run, claim, parts) for _, claim, parts in claims)
    if args.failed:
        import pyarrow.compute as pc
        table = table.filter(pc.invert(table["ok"]))
    pq.write_table(table, out)
    return table.num_rows


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
        typed = typed_values(parts, field)
        held.update(dict.fromkeys(b.field for part in parts for b in part.blocks
                                  if b.dtype == BYTES and b.field not in (None, field)))
        hint = (f"--field {next(iter(held))} (its bytes)" if held else "no field of its results "
                f"holds bytes: read them with `{command()} runs results {run['run_id']}`")
        for k, line in enumerate(map(orjson.loads, (line for part in parts for line in part.lines))):
            result = line.get("result")
            value = typed.get(k, field_value(result, field))
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
    try:
        out = open(path, "wb")
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}) ---> HINT: pick a path in a folder "
                        "you can write to")
    rows = []
    with out:
        try:
            yield out, rows
        except BaseException:
            os.unlink(path)
            raise
    print(f"runs results: wrote {sum(rows):,} rows, {os.path.getsize(path):,} bytes, to {path}", file=sys.stderr)


def plan_run(conf, backend, model, items, claim_size, price):
    """make_plan of `items` on the pool; with no measured claim, one sample claim runs first."""
    record = load_pool(backend, model)
    check_claim_size(claim_size)
    sizes = claim_sizing(conf, backend, record, claim_size)
    counted = items.counted()
    if counted is None:
        raise UserError(f"{items.where}: a plan counts the items first, and files are listed as they are "
                        f"staged ---> HINT: submit without --plan, --deadline or --budget")
    summaries = recent_summaries(backend, model, PLAN_CLAIMS_READ)
    if not summaries:
        first = counted.head(sizes.fixed or sizes.hi)
        run = submit(first, model, claim_size=first.count, context=(conf, backend))   # or refused
        print(f"plan: pool {model} has no measured claim yet: ran one sample claim of "
              f"{first.count} item(s) first (run {run.run_id}) to measure it", file=sys.stderr)
        if not run.wait():
            raise UserError(f"plan: the sample claim (run {run.run_id}) did not finish within "
                            f"CALQUE_TIMEOUT ---> HINT: {command()} runs show {run.run_id}")
        summaries = recent_summaries(backend, model, PLAN_CLAIMS_READ)
        sizes = claim_sizing(conf, backend, record, claim_size)   # measured now
    return make_plan(backend, conf, record, counted.count, sizes, price, summaries)


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


def apply_count(fleet, record, plan, verb):
    """Give the run its planned count (its options' `plan`) once its claims are queued (the
    fleet's boost)."""
    noun, count = plan["noun"], plan["count"]
    fleet.boost(record, count)
    print(f"{verb}: running at {count} {noun if count != 1 else noun[:-1]} (predicted "
          f"{_duration(plan['seconds'])}, {_usd(plan['cost_usd'])} on-demand)", file=sys.stderr)


def cmd_pool_create(conf, backend, args):
    check_counts(args, "create")
    fleet = fleet_for(conf, backend, args=args)
    batch_size = pool_settings(conf, args.batch_size)["batch_size"]
    modal, suggested, notes = modal_options(args.handler, args.param, args.secret, args.volume, args.gpus_per_worker,
                                            batch_size, workers_here=fleet.here,
                                            store=backend.store)
    for note in notes:
        print(f"pool {args.model}: {note}")
    if modal:
        modal["calls"] = pool_calls(backend, args.model, args.handler, args.call)
    elif args.call:
        raise UserError(f"--call applies to a Modal app handler; {args.handler} imports no modal")
    for key in ("retries", "max_deliveries", "batch_timeout"):   # the app's retries=, timeout=;
        if getattr(args, key) is None:                           # if not given
            setattr(args, key, suggested.get(key))
    fleet.create(Pool(args.model, context=(conf, backend)), modal=modal, suggested=suggested,
                 include=include_paths(args.include, args.handler))
    return EXIT_OK


def pool_calls(backend, model, handler, given):
    """A Modal app pool's `calls` (printed): for each other target of its app, the pool --call
    TARGET=POOL names, else an existing one serving that target of the same file."""
    path, name = parse_handler_spec(handler)
    shim, module = import_modal_file(path)
    targets = app_targets(shim, module)[1]
    full = {t.partition(".")[0] if len(targets[t].methods()) == 1 else t: t
            for t in targets if "." in t}   # a one-method class's pool names the class alone
    calls, own = {}, full.get(name, name)
    for pool in sorted(calque_supervisor.list_pools(backend)):
        h = load_pool(backend, pool)["handler"]
        target = full.get(h["class"], h["class"])
        if h.get("source_path") == os.path.abspath(path) and target in targets and target != own:
            calls.setdefault(target, pool)
    for target, pool in key_values(given, "--call").items():
        if target not in targets or target == own:
            raise UserError(f"--call {target}={pool}: {path} has no other function or Cls.method "
                            f"{target} (it has: {', '.join(t for t in targets if t != own)})")
        h = load_pool(backend, pool)["handler"]
        if full.get(h["class"], h["class"]) != target:   # its items would reach another method
            raise UserError(f"--call {target}={pool}: pool {pool} serves {h['file']}:{h['class']}, "
                            f"not {target} ---> HINT: pool create --handler {path}:{target} first")
        calls[target] = pool
    missing = [t for t in targets if t not in calls and t != own]
    print(f"pool {model}: its calls go to: "
          f"{', '.join(f'{t} -> {p}' for t, p in calls.items()) or 'none'}"
          + (f"; no pool for {', '.join(missing)} (--call TARGET=POOL)" if missing else ""))
    return calls


def cmd_pool_scale(conf, backend, args):
    record = load_pool(backend, args.model)
    check_counts(args, "scale")
    fleet_for(conf, backend, record, args).scale(Pool(args.model, context=(conf, backend)), record)
    return EXIT_OK


def cmd_pool_deploy(conf, backend, args):
    if modal_options(args.handler)[0]:
        raise UserError(f"pool deploy takes a calque handler; {args.handler} is a Modal app "
                        f"---> HINT: pool delete --model {args.model}, then pool create it with "
                        "its --param options")
    old, new = Pool(args.model, context=(conf, backend)).deploy(
        args.handler, batch_size=args.batch_size, include=include_paths(args.include, args.handler),
        wait=not args.no_wait, progress=sys.stderr.isatty())
    pool, here = f"pool {args.model}", fleet_for(conf, backend, new).here
    if old is new:
        idle = here and not read_supervisor(conf, args.model)
        print(f"{pool}: already runs version {version_label(old)}: nothing changed" + (
            f"; no local worker runs it here ---> HINT: {command()} pool scale --model "
            f"{args.model} --workers N" if idle else ""))
        return EXIT_OK
    print(f"{pool}: version {version_label(new)} replaces {version_label(old)}; runs submitted "
          "from now on run on it")
    if not here:
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
    pools = fleet_for(conf, backend, {"model": None}).pools()   # on S3 EC2's: groups by tag too
    local_workers = {p["model"]: (read_supervisor(conf, p["model"]) or {}).get("desired", 0)
                     for p in pools} if not args.json else {}
    return emit(args, pools, format_pool_list, pools, local_workers, backend.describe())


def cmd_pool_delete(conf, backend, args):
    record = pool_record_to_delete(backend, args.model, args.force)
    pool = Pool(args.model, context=(conf, backend))
    cancelled = fleet_for(conf, backend, record, args).delete(pool, record)
    if cancelled is False:
        return EXIT_FAILED
    for run_id, marked in cancelled.items():
        print(f"pool {args.model}: run {run_id} cancelled: {len(marked)} claim(s) without a "
              "summary will not run")
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
    if other:   # their claims would be dead-lettered again (pool_of_run)
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
    record = load_pool(backend, args.model)
    fleet_for(conf, backend, record, args).logs(record)
    return EXIT_OK


def cmd_submit(conf, backend, args):
    """A pool run (--pool M) or a cold run (--model M): their flags' clashes refused here, first."""
    wait_seconds(conf, args.timeout)   # checked before anything is read (the run keeps a given one)
    planned = args.plan or args.deadline is not None or args.budget is not None
    if args.pool and args.shards > 1:
        raise UserError("--pool with --shards > 1: a pool submission is claims against an "
                        "already-running pool; scale the pool instead (pool scale), or drop "
                        "--pool for a cold run")
    if not args.pool and not args.model:
        raise UserError("submit needs --pool M (a warm pool) or --model M (a cold run)")
    if not args.pool and planned:
        raise UserError("--plan, --deadline and --budget plan a pool run ---> HINT: "
                        "submit --pool M")
    if not args.pool and args.no_wait:
        raise UserError("--no-wait applies to --pool runs; a cold run's workers live only while "
                        "submit waits")
    items = read_items(args.items, args.columns and [c.strip() for c in args.columns.split(",") if c.strip()])
    if items.large:
        few_malloc_arenas()
    run = (submit_pool_run(conf, backend, args, items, planned) if args.pool
           else submit_cold_run(conf, backend, args, items))
    return run if isinstance(run, int) else report_submitted(backend, *run, args)


def submit_pool_run(conf, backend, args, items, planned):
    """submit --pool: (run, summaries, timed_out), or an exit status (not run, --no-wait)."""
    kept = None   # a planned run's plan: the count picked, its predicted time and cost
    record = load_pool(backend, args.pool)
    fleet = fleet_for(conf, backend, record, args)
    if planned:
        items = items.counted() or items   # read in once, then planned and staged
        plan = plan_run(conf, backend, args.pool, items, args.claim_size, _pricing(args))
        print("\n".join(format_plan(plan)), file=sys.stderr)
        option = planned_count(conf, backend, record, plan, args)
        kept = dict(count=option[fleet.unit], noun=fleet.unit, seconds=option["seconds"],
                    cost_usd=option["cost_usd"])
        if args.plan and not confirm(f"run {plan['items']:,} items at {option[plan['noun']]} {plan['noun']}, "
                                     f"{_usd(option['cost_usd'])} predicted?", args.yes):
            print("submit: not run", file=sys.stderr)
            return EXIT_FAILED
        fleet.boost(record, kept["count"], check=True)   # before anything is queued
    run_id = new_run_id(args.pool)
    follow = args.follow_logs and not args.no_wait
    output = calque_supervisor.WorkerOutput(backend, {args.pool: args.pool}) if follow else None
    try:
        with signals_interrupt():
            run = submit(items, args.pool, claim_size=args.claim_size, id_field=args.id_field,
                         wait_for_workers=args.wait_for_workers or args.no_wait,
                         timeout=args.timeout, context=(conf, backend), run_id=run_id,
                         plan=kept)
    except SubmitInterrupted as e:
        return interrupted(backend, run_id, e.signum)
    if kept:   # once its claims are queued: the fleet holds the planned count while they wait
        apply_count(fleet, record, kept, "submit")
    else:   # (an EC2 group's backlog steps follow the claims it ran)
        fleet.boost(record, None)
    if args.no_wait:
        print(run.run_id)
        return EXIT_OK

    def say_sent():
        depth = backend.queues.open_queue(run.record["queue"]).counts()
        print(f"run {run.run_id}: {len(run.record['claims'])} claim(s) of {run.record['items']} "
              f"items sent to {run.record['queue']} ({depth['visible']} visible, "
              f"{depth['in_flight']} in flight)", file=sys.stderr, flush=True)
    return wait_submitted(run, args, say_sent, output)


def wait_submitted(run, args, say_sent, output=None):
    """The end of submit --pool and runs resume, all claims queued: say_sent(), the wait (an
    interrupt leaves the run going on; `output`, worker logs followed, stops), the report."""
    try:
        with sigint_noted() as noted:
            say_sent()
            if args.no_wait:
                return EXIT_OK
            progress = not args.json and sys.stderr.isatty()
            timed_out = not run.wait(args.timeout, progress, interrupted=noted)
    except KeyboardInterrupt:
        return interrupted_waiting(run.run_id)
    finally:
        if output:
            output.stop()
    return report_submitted(run.backend, run.record, run.waited, timed_out, args)


def submit_cold_run(conf, backend, args, items):
    """submit --model: fresh workers here, or with --ami / --yes-spend-money / --dry-run on an
    s3:// store EC2 instances (fleet_for); (run, summaries, timed_out), or an exit status."""
    check_claim_size(args.claim_size)
    if args.id_field:
        items = items.with_id_field(args.id_field)
    try:
        with signals_interrupt():   # a SIGTERM too ends its workers and deletes its queues
            run = cold_run(conf, backend, items, model=args.model, handler=args.handler,
                           shards=args.shards, batch_size=args.batch_size,
                           claim_size=args.claim_size, timeout=wait_seconds(conf, args.timeout),
                           fleet=fleet_for(conf, backend, args=args),
                           progress=not args.json and sys.stderr.isatty(),
                           options=run_options(args.id_field, args.timeout))
    except SubmitInterrupted as e:
        print("calque: interrupted: the cold run is cancelled (its workers and queues are "
              "gone) ---> HINT: submit again", file=sys.stderr)
        return 128 + e.signum
    return EXIT_OK if run[0] is None else run   # None: a dry run printed its calls, staged nothing


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
    if not args.json and (versus := plan_against_actual(run, summaries)):
        print(versus)
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
        states = claim_states(backend, run, read_summaries(backend, args.run))
        code, not_run = EXIT_OK, {}

        def finished():   # (index, claim, parts) of the claims that ran; one lost is said, skipped
            nonlocal code
            for index, claim in enumerate(run["claims"]):
                state = states[claim][0]
                if state not in ("done", "failed"):
                    not_run.setdefault(state, []).append(claim)
                    continue
                try:
                    yield from with_parts(backend, run, [(index, claim)])
                except ResultsIncomplete as e:
                    print(f"calque: error: {e} ---> HINT: the store lost these results: submit "
                          "the claim's items again", file=sys.stderr)
                    code = EXIT_FAILED
        if binary:
            rows.append(write_binary_results(out, backend, run, finished(), args))
        else:
            for _, claim, parts in finished():
                rows.append(write_results(out, with_ids(backend, run, claim, parts), args.failed))
    for state, claims in not_run.items():
        print(f"calque: error: run {args.run}: no results for {len(claims)} claim(s) {state} "
              f"({claim_list(claims)}) ---> HINT: {next_step(run, state)}", file=sys.stderr)
    return EXIT_FAILED if not_run else code


def cmd_runs_resume(conf, backend, args):
    """Send the claims an interrupted submit did not, and again those in no queue, then wait, as its
    submit would have (its options: --timeout and --wait-for-workers unless given here)."""
    wait_seconds(conf, args.timeout)   # a bad CALQUE_TIMEOUT is said before anything is read
    run = read_run(backend, args.run)
    record = pool_of_run(backend, run, "runs resume")
    if not run["staged"]:   # submit killed while staging: past `sent`, manifests may be missing
        raise UserError(f"run {args.run} was stopped while staging: {run['sent']} claim(s) were "
                        f"queued, the rest may have no manifest ---> HINT: runs cancel {args.run}, "
                        f"then submit the items from {sum(claim_items(run, k) for k in range(run['sent']))} on again")
    try:
        queue = backend.queues.open_queue(record["queue"])
    except NotFound:
        raise UserError(f"run {args.run}: pool {run['model']}'s queue is gone ---> HINT: pool create --model "
                        f"{run['model']} ... again (it is idempotent), then runs resume {args.run}") from None
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

    def say_sent():
        again = f"; {len(lost)} claim(s) in no queue sent again ({claim_list(lost)})"
        print(f"run {args.run}: {len(unsent)} claim(s) not sent before now sent to {queue.name}"
              f"{again if lost else ''}", file=sys.stderr, flush=True)
        if run["options"].get("plan") and (unsent or lost):   # its submit's boost ended with them
            fleet = fleet_for(conf, backend, record)
            apply_count(fleet, record, run["options"]["plan"], "runs resume")
    return wait_submitted(Run(args.run, context=(conf, backend)), args, say_sent)


def pool_of_run(backend, run, verb):
    """The pool record of a run `verb` (runs resume, runs redrive) sends claims of: a cold run, a
    cancelled one, or one of a version its pool no longer runs (a run keeps its version) refused."""
    if run["mode"] != "pool":
        raise UserError(f"run {run['run_id']} is a cold run: its workers and queues lived only "
                        "while its submit waited ---> HINT: submit its items again")
    if run.get("cancelled"):
        raise UserError(f"run {run['run_id']} was cancelled ({run['cancelled']['reason']}): "
                        f"nothing to {verb.split()[1]} ---> HINT: submit its items again")
    record = load_pool(backend, run["model"])
    if run.get("version", version_of(record)) != version_of(record):
        raise UserError(f"run {run['run_id']} was submitted to version {run['version']}; pool "
                        f"{run['model']} runs {version_label(record)} now (pool deploy): {verb} "
                        "would run none of its claims ---> HINT: submit its items again")
    return record


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
    record = pool_of_run(backend, run, "runs redrive")
    sent = redrive(backend, record, {args.run: run})
    print_redriven(record, sent)
    if not sent:
        print(f"run {args.run}: no dead-lettered claim: nothing to redrive")
    return EXIT_OK


def cmd_runs_report(conf, backend, args):
    import calque_dashboard   # (the web page's code loads for `dashboard` and `runs report` alone)
    run_id = read_run(backend, args.run)["run_id"]
    view = calque_dashboard.write_report(conf, backend, run_id, args.html, _pricing(args))
    print(f"run {args.run}: report written to {args.html} ({view['items']['ok']} items ok, "
          f"{view['items']['failed']} failed, {view['items']['pending']} pending)")
    return EXIT_OK


def cmd_dashboard(conf, backend, args):
    import calque_dashboard
    calque_dashboard.serve(conf, backend, args.host, args.port, args.token, _pricing(args))
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
        if versus := plan_against_actual(run, summaries):
            noun = run["options"]["plan"]["noun"][:-1]
            print(f"  {versus}; its claims cost {_usd(report['total_usd'])} "
                  f"(the plan prices every {noun} for the whole wall time)")
        return EXIT_OK
    labels = list(dict.fromkeys(label for _, _, _, label, _ in reports))   # one per run kind
    print("\n".join(format_cost_table([(run, report) for run, report, *_ in reports], "; ".join(labels))))
    return EXIT_OK


class ModalEntrypointFailed(Exception):
    """A remote call of `calque modal run`'s entrypoint failed: one line, exit 1."""


class ModalRun(Calls):
    """Where `calque modal run` sends calls: each target's items go to its pool (--pool M, or an
    ephemeral one made at the first call, deleted by close()). At the first, the pools of the
    app's other `targets` (those without a required modal.parameter) are named and made too,
    sizing themselves from zero: each pool's record names them all (modal `calls`), so a worker's
    calls reach them (warmd.WorkerCalls)."""

    def __init__(self, context, path, pool, workers, volumes=(), secrets=(), targets=(),
                 module=None):
        super().__init__(context[1], os.path.dirname(os.path.abspath(path)))
        self.module = module   # the app file as the entrypoint imported it: not imported again
        self.context, self.path, self.workers, self.volumes, self.secrets = context, path, workers, volumes, secrets
        self.pools, self.created, self.targets, self.calls = {}, [], targets, {}
        self.unmade = {}   # {target: why its pool could not be made}: what a call to it fails with
        self.links = {}   # {mount: (its volume's folder, a folder was there)}: its pools' links
        self.crashing = functools.partial(crash_looping, context[0])
        record = load_pool(context[1], pool) if pool else None
        if record:
            params = record.get("modal", {}).get("params", {})
            self.pools[self.key(record["handler"]["class"], params)] = pool
        labels = {pool: record["handler"]["class"]} if record else {}
        self.output = calque_supervisor.WorkerOutput(context[1], labels)

    def pool_for(self, target, params):
        key = self.key(target, params)
        if key not in self.pools:
            self.pools[key] = self._ephemeral(target, params)
        return self.pools[key]

    def send(self, pool, items):
        """A self-sizing pool made here may have no worker yet: its queue wakes it."""
        run = submit(items, pool=pool, context=self.context, wait_for_workers=pool in self.created)
        return run.record

    def _ephemeral(self, target, params):
        """The pool of the first call to (target, params). The very first names the pools of all
        `targets` (one token a run) and makes the others', sizing themselves from zero."""
        if not self.calls:
            token, given = secrets.token_hex(3), {key[0]: pool for key, pool in self.pools.items()}
            self.calls = {t: given.get(t) or self._name(t, token) for t in self.targets}
            for other, model in list(self.calls.items()):
                if (other != target or params) and other not in given:   # not --pool's
                    try:
                        self._make(other, {}, model, 0)
                    except UserError as e:   # (an image's package missing): said, not fatal
                        del self.calls[other]   # here; a call to it says so
                        self.unmade[other] = str(e)
                        print(f"calque: {other}: no pool for its callers: {e}", file=sys.stderr)
        model = None if params else self.calls.get(target)
        if model in self.created:   # made from zero: the entrypoint's call wakes it
            return model
        model = model or self._name(target, secrets.token_hex(3))
        return self._make(target, params, model, self.workers)

    def _name(self, target, token):
        return f"modal-{os.path.basename(self.path)[:-3]}-{target.replace('.', '-')}-{token}"

    def _make(self, target, params, model, workers):
        spec = f"{self.path}:{target}"
        batch_size = pool_settings(self.context[0])["batch_size"]
        modal, suggested, notes = modal_options(spec, [f"{k}={v}" for k, v in params.items()], self.secrets,
                                                self.volumes, batch_size=batch_size,
                                                store=self.context[1].store, module=self.module)
        links = {mount: (open_volume(self.context[0], self.context[1].store, volume["name"],
                                     volume.get("folder")).folder, os.path.isdir(mount))
                 for mount, volume in modal["volumes"].items() if not os.path.islink(mount)}
        self.links.update(links)
        modal["calls"] = {t: pool for t, pool in self.calls.items() if t != target}
        modal["unmade"] = self.unmade
        size = (f"{workers} local worker(s)" if workers else
                f"0 to {self.workers} local worker(s), on its calls")
        print(f"calque: ephemeral pool {model} for {target}: {size}", file=sys.stderr)
        for note in notes:
            print(f"calque: {target}: {note}", file=sys.stderr)
        self.created.append(model)
        folder = state_dir(self.context[0], model)   # `owner`: its supervisor deletes the pool
        os.makedirs(folder, exist_ok=True)            # once this process is gone (kill -9)
        write_file_atomic(os.path.join(folder, "owner"), str(os.getpid()))
        write_file_atomic(os.path.join(folder, "links.json"), json.dumps(links))   # and these
        self.output.add(model, target)
        conf = dict(self.context[0], CALQUE_GRACE="0")   # a signal: let go a call nobody awaits
        pool = Pool(model, context=(conf, self.context[1]))
        pool.create(spec, 0, modal=modal, max_deliveries=suggested.get("max_deliveries"),
                    batch_timeout=suggested.get("batch_timeout"), retries=suggested.get("retries"))
        if workers:   # a worker that dies unwarmed: the fix is the app's, then this command again
            pool.scale(workers, then=f"{command()} modal run {self.path} again")
        else:
            pool.scale(0, bounds=(0, self.workers, 60.0 * SCALE_IDLE_MINUTES), wait=False)
        return model

    def close(self, wait):
        """Delete the ephemeral pools; with `wait`, once every call made is done (a .spawn nobody
        waited for still runs rather than being lost)."""
        try:
            if wait:
                for run in self.runs:
                    Run(run["run_id"], context=self.context).wait()
        finally:   # a second SIGTERM or Ctrl-C waits for the pools' deletion
            with handling(signal.SIG_IGN, signal.SIGTERM, signal.SIGINT):
                self.output.stop()
                for model in self.created:   # UserError: no record: its making failed, saying why
                    with contextlib.suppress(NotFound, UserError):
                        Pool(model, context=self.context).delete(force=True)
                        if wait:   # its logs were shown as they ran; a failed run's error line names them
                            shutil.rmtree(state_dir(self.context[0], model), ignore_errors=True)
                unlink_volumes(self.links)


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
            raise UserError(f"entrypoint {fn.__name__}: parameter {name} is a "
                            f"{getattr(kind, '__name__', kind)}: Modal's CLI "
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
    serve_volumes(conf, backend.store, folders=key_values(args.volume, "--volume"))
    shim, module = import_modal_file(path)
    volume_folders(modal_apps(shim, module), args.volume)
    fn, name = modal_run_target(shim, module, path, name)
    kwargs = vars(entrypoint_parser(fn, f"{command()} modal run {args.app}").parse_args(args.args))
    targets = [t for t, f in app_targets(shim, module)[1].items()   # a worker may call them
               if inspect.Parameter.empty not in getattr(f, "parameters", dict)().values()]
    shim.runner = runner = ModalRun((conf, backend), path, args.pool, args.workers, args.volume,
                                    args.secret, targets, module)
    done = False
    with handling(lambda signum, frame: sys.exit(128 + signum), signal.SIGTERM):
        try:
            out = fn(**kwargs)
            if inspect.iscoroutine(out):
                import asyncio
                asyncio.run(out)
            done = True
        except shim.RemoteError as e:
            where = f" (at {e.where})" if getattr(e, "where", None) else ""
            hint = "" if "--->" in str(e) else (" ---> HINT: map(..., return_exceptions=True) "
                                               "to go on past failed items")
            raise ModalEntrypointFailed(f"entrypoint {name}: an item failed: {type(e).__name__}: "
                                        f"{one_line(e)}{where}{hint}")
        except (UserError, StoreFault, WorkersFailed, ResultsIncomplete):
            raise
        except Exception as e:   # the entrypoint's own code failed: where, in one line
            if kit_fault(e, path):
                raise
            raise ModalEntrypointFailed(f"entrypoint {name} failed: {user_code_error(path, e)}")
        finally:
            shim.runner = None
            runner.close(wait=done)
    return EXIT_OK


def modal_apps(shim, module):
    """The modal.App objects a Modal app module made."""
    return [v for v in vars(module).values() if isinstance(v, shim.App)]


def app_targets(shim, module):
    """({name: local entrypoint}, {target: its Function or Cls}, {name: web decorator}) of a Modal
    app module: the functions and Cls.methods a call can go to, and its web endpoints (not called)."""
    entrypoints, functions, webs = {}, {}, {}
    for app in modal_apps(shim, module):
        entrypoints.update(app.entrypoints)
        for key, f in app.registered_functions.items():
            web = getattr(f.raw_f, "_modal_role", {}).get("web")
            (webs if web else functions)[key] = web or f
        for key, cls in app.registered_classes.items():
            functions.update({f"{key}.{m}": cls for m in cls.methods()})
    return entrypoints, functions, webs


def modal_run_target(shim, module, path, name):
    """(callable, name) `modal run app.py[::name]` runs: a local entrypoint, else (as Modal's CLI)
    a function or Cls.method called once with its parameters as options."""
    entrypoints, functions, webs = app_targets(shim, module)
    if not name:
        found = entrypoints or functions or webs   # web endpoints only: the first is refused below
        if len(found) != 1 and found is not webs:
            raise UserError(f"{path} has {len(entrypoints)} local entrypoints and {len(functions)} functions "
                            f"({', '.join(found) or 'none'}) ---> HINT: name one: modal run {path}::NAME")
        name = next(iter(found))
    if name in entrypoints:
        return entrypoints[name], name
    if name in webs:
        raise web_endpoint(path, name, webs[name])
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


def build_parser():
    shared = {   # options several verbs take alike
        "--model": dict(required=True, help="the pool's model name"),
        "--json": dict(action="store_true", help="print JSON instead of text"),
        "run": dict(help="the run id (see `runs list`; `latest`: the newest)"),
        "--timeout": dict(type=float,
                          help="seconds to wait for the summaries (default CALQUE_TIMEOUT)"),
        "--key-name": dict(help="EC2 key pair for SSH (none by default)"),
        "--yes-spend-money": dict(action="store_true", help="allow starting paid EC2 instances"),
        "--dry-run": dict(action="store_true", help="EC2: print the AWS calls; change nothing"),
        "--batch-size": dict(type=int, help="items per handler.batch() call (default "
                                            "CALQUE_BATCH_SIZE; pool deploy: the pool's)"),
        "--include": dict(action="append", metavar="PATH", help="a file or folder the handler "
                          "needs beside it, snapshotted with it (modules, data)"),
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
        required=True)   # no dest: argparse names the verbs from their parsers where one is missing
    p = verb(pool, "create", cmd_pool_create, help="create a pool: queue + dead-letter queue, pool "
             "record, handler snapshot, local workers")
    p.add_argument("--model", required=True, help="the model name: the pool's identity")
    p.add_argument("--handler", required=True,
                   help="path/to/handler.py:ClassName (snapshotted into the store)")
    add_count_flags(p, (f"its workers: local warmd.py processes, waited for until warm "
                        f"(default {LOCAL_WORKERS_DEFAULT}), or with --instances an EC2 Auto "
                        "Scaling group's",
                        "floor of a pool that sizes itself on its backlog (default: N; 0 with a "
                        "ceiling alone or --scale-to-zero-after)", "its ceiling"))
    p.add_argument("--scale-to-zero-after", type=float, metavar="MINUTES",
                   help="idle window (fractions allowed) before the pool shrinks to its floor "
                        f"(0 unless given); default {SCALE_IDLE_MINUTES:g} with a floor below "
                        "the ceiling")
    local_options(p)
    add(p, "--batch-size", "--include")
    p.add_argument("--visibility-timeout", type=int,
                   help="seconds a claim stays invisible; the heartbeat renews it")
    p.add_argument("--max-deliveries", type=int,
                   help="deliveries before a claim goes to the dead-letter queue")
    p.add_argument("--retries", type=int, metavar="N",
                   help="retries of an item whose call raised, after 1 s, doubling (Modal's "
                        "retries=N; a Modal app's own retries= unless given)")
    p.add_argument("--batch-timeout", type=float, metavar="SECONDS",
                   help="seconds one handler.batch() call may run before the worker gives up on it "
                        "(default: the workers' CALQUE_BATCH_TIMEOUT)")
    modal_flags = p.add_argument_group("a Modal app handler (docs/modal.md)")
    modal_flags.add_argument("--param", action="append", metavar="KEY=VALUE",
                             help="a modal.parameter() of the class")
    modal_flags.add_argument("--secret", action="append", metavar="NAME=FILE",
                             help="the KEY=value file modal.Secret.from_name(NAME) reads")
    modal_flags.add_argument("--volume", action="append", metavar="NAME=PATH",
                             help="a local folder for modal.Volume.from_name(NAME), instead of "
                                  "the store's prefix volumes/NAME/ (docs/modal.md#volumes)")
    modal_flags.add_argument("--call", action="append", metavar="TARGET=POOL",
                             help="the pool its workers' calls to TARGET (Cls.method or function) "
                                  "go to (default: one of the same app file serving it)")
    ec2 = p.add_argument_group("EC2 cohort (s3:// store; --instances N and --min-/--max-instances)")
    ec2.add_argument("--instance-type",
                     help="EC2 instance type, e.g. g5.xlarge (required with --instances)")
    ec2.add_argument("--ami", help="AMI id (default: the current deep-learning GPU AMI, from its "
                                   "public SSM parameter)")
    switch(ec2, "--spot", "spot capacity: cheaper, may be interrupted at 2 minutes' notice")
    ec2.add_argument("--read", action="append", metavar="S3_PREFIX",
                     help="an s3:// prefix its runs read by reference: its instance role may read it (a run "
                          "naming another grants it then); repeat for several")
    ec2.add_argument("--subnet", help="subnet id(s), comma-separated (default: the default VPC's)")
    add(ec2, "--key-name", "--yes-spend-money", "--dry-run")
    p = verb(pool, "deploy", cmd_pool_deploy, "--model",
             help="change a live pool's handler: waits for the runs in flight, then replaces its "
                  "workers")
    p.add_argument("--handler", required=True, help="path/to/handler.py:ClassName, the new version")
    add(p, "--batch-size", "--include")
    switch(p, "--no-wait", "return once the workers start, not when warm")
    p = verb(pool, "scale", cmd_pool_scale, "--model",
             help="set the number of local workers, or of EC2 instances")
    add_count_flags(p, ("its workers here, or its EC2 group's instances", "its new floor (the "
                        "ceiling kept)", "its new ceiling (the floor kept)"))
    p.add_argument("--scale-to-zero-after", type=float, metavar="MINUTES",
                   help="local: its new idle window")
    local_options(p)
    add(p, "--yes-spend-money", "--dry-run")
    verb(pool, "status", cmd_pool_status, "--model", "--json",
         help="queue depths, live workers, per-worker claims, warm hits, enter_count")
    verb(pool, "list", cmd_pool_list, "--json", help="the pools in this store")
    p = verb(pool, "delete", cmd_pool_delete, "--model",
             help="stop local workers, delete the queues and the pool record")
    switch(p, "--yes", "do not ask for confirmation")
    switch(p, "--force", "delete even with claims still queued or in flight (they are lost)")
    add(p, "--dry-run")
    p = verb(pool, "cost", cmd_pool_cost, "--model", "--json", cost=True,
             help="what the pool paid, idle included, against cold starts")
    p.add_argument("--since", metavar="T",
                   help="only from this ISO-8601 time on (e.g. 2026-11-29T10:00:00Z)")
    verb(pool, "redrive", cmd_pool_redrive, "--model",
         help="send the dead-lettered claims of every run of the pool back to its queue")
    p = verb(pool, "logs", cmd_pool_logs, "--model",
             help="the pool's worker logs on this machine (EC2: where they are)")
    switch(p, "--follow", "keep printing what the workers write (Ctrl-C stops)")
    p.add_argument("--worker", type=int, metavar="W", help="only worker slot W")

    p = verb(verbs, "submit", cmd_submit, "--timeout", "--json", cost=True,
             help="run items: against a warm pool (--pool) or as a cold fresh acquisition "
                  "(--model)")
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
    add(cold_ec2, "--key-name", "--yes-spend-money", "--dry-run")

    p = verb(verbs, "plan", cmd_plan, "--json", cost=True,
             help="a pool run's wall time and cost for 1..B workers, before it starts")
    p.add_argument("items", help="the JSONL (or .npy/.npz) file submit would take")
    p.add_argument("--pool", metavar="M", required=True, help="the pool of model M")
    p.add_argument("--claim-size", type=int, help="items per claim (default CALQUE_CLAIM_SIZE)")

    runs = verbs.add_parser("runs", help="read runs (list, show, results, report); resume, cancel, "
                            "redrive, delete, prune them")
    runs = runs.add_subparsers(required=True)
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
    p = verb(runs, "resume", cmd_runs_resume, "run", "--timeout", "--json", cost=True,
             help="send the claims an interrupted submit did not, and those in no queue, then wait")
    switch(p, "--no-wait", "return once the claims are sent")
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

    p = verb(verbs, "cost", cmd_cost, "--json", cost=True,
             help="a run's cost, its cold counterfactual and the crossover ladder")
    p.add_argument("run", nargs="+", help="one run for the details, several for a comparison table "
                                          "(`latest`: the newest)")
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
    except BrokenPipeError:
        # the reader went away (`runs results RUN | head`): stop quietly; stdout to /dev/null, so
        # that the interpreter's flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except sqlite3.Error as e:   # the embedded queue: its file unwritable, full or damaged, or a user stopped
        hint = ("a process using it is stopped (Ctrl-Z, SIGSTOP): resume or end it"
                if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_PROTOCOL
                else "check that the folder is writable and has free space")
        print(f"calque: error: the local queue in {conf['CALQUE_STORE']} failed ({e}) ---> HINT: {hint}, then retry",
              file=sys.stderr)
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
        return cli_error(e, "calque", "check credentials, permissions (docs/aws.md) and region",
                         StoreFault, WorkersFailed, ModalEntrypointFailed, ResultsIncomplete)


if __name__ == "__main__":
    sys.exit(main())
