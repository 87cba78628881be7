"""supervisor: the detached process that keeps a local pool's warmd.py workers alive here.

    python calque_supervisor.py --model demo     # what `pool create` / `pool scale` start, detached

One per pool and machine (a lock in its state folder). Every SUPERVISOR_TICK s it reads the count
wanted (LocalScaler), restarts the dead with backoff, leases GPUs, and writes supervisor.json, which
calque reads (section 6). LocalFleet is the Fleet (calque_fleet.fleet_for) of a pool's workers here.
"""
import contextlib, fcntl, functools, glob, json, math, os, re, shutil, signal, socket, sqlite3
import subprocess, sys, threading, time

import calque_core
from calque_core import (DEFAULTS, NotFound, StoreFault, UserError, WorkersFailed,
                         check_slug_free, command, desired_count, load_pool, measured_seconds,
                         now_iso, open_backend, pool_bounds, queue_depth, read_json,
                         read_worker_stats, recent_summaries, setting_number, slug, state_dir,
                         stop_seconds, summary_claims, unlink_volumes, version_label, version_of,
                         worker_stats_prefix, write_file_atomic)
from calque_runs import drop_pool

# ------------------------------------------------------------------------------------------------
# a pool supervisor's state here, as calque reads it
SUPERVISOR_TICK = 0.2                   # s between two looks of the supervisor (and of a follower)
SCALE_INTERVAL = 0.5                    # s between two looks at a self-sizing pool's queue
COLD_EXIT_WAIT = 5.0                    # s a cold run's drained worker has to exit before SIGTERM
STOPPED_SHOWN = 5                       # stopped workers `pool status` lists (the rest: --json)
LOCAL_WORKERS_DEFAULT = 1               # local workers `pool create` starts without --workers
WARM_WAIT = 1800.0                      # s `pool create` waits for its workers' @enter
DEPLOY_POLL = 2.0                       # s between two looks of `pool deploy` at its runs in flight
WORKER_START_GRACE = 2.0                # s submit looks again for a worker that started this instant
                                        # (`warmd --model M &` then submit: its first stats take ~0.2 s)
LIVE_STATES = ("starting", "running")   # a worker's stats state while it is alive: @enter, then claims
WORKER_LOST_AFTER = 120.0               # s of silence that makes a live worker elsewhere lost
                                        # (4 of warmd's stats intervals; it writes after claims too)


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
        # a zombie still answers kill(0); /proc tells (and a process reaped since has no entry)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError:   # PermissionError: another user's process, alive
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
# the supervisor process
RESTART_BACKOFF = (1.0, 30.0)   # s: first restart delay after a death without progress, doubling
RESTART_RESET_AFTER = 60.0      # s: a worker that lived this long made progress, whatever it did
SCALE_MEASURE_EVERY = 10.0      # s between two reads of a sized pool's recent seconds per claim
SCALE_WAKE_HOLD = 30.0          # s at most a submit's announced claims count while it stages
SUPERVISOR_START_WAIT = 10.0    # s `pool create` / `pool scale` wait for a new supervisor's status
EXIT_LOG_TAIL = 16384           # bytes of a dead worker's log searched for why it died
OUTPUT_LAG = 5000               # ms of output chunks a follower lists again (clocks differ)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")


class WorkerOutput:
    """What handler code prints in a pool's workers, on any machine (warmd's Output writes it to
    the store in chunks), on our stderr as it lands, each line prefixed with the pool's label and
    the worker's. A thread follows the output/ folders until stop(), which prints what is left."""

    def __init__(self, backend, labels):
        self.backend, self.labels, self.seen = backend, {}, set()
        self.since = int(time.time() * 1000)
        for model, label in labels.items():
            self.add(model, label)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="worker-output", daemon=True)
        self.thread.start()

    def add(self, model, label):
        self.labels[f"pools/{slug(model)}/output/"] = [label, self.since]

    def _run(self):
        while not self.stopped.wait(SUPERVISOR_TICK):
            with contextlib.suppress(Exception):   # a store hiccup: the next look finds them
                self._poll()

    def _poll(self):
        for prefix, cursor in list(self.labels.items()):
            for key in self.backend.store.list(prefix, f"{prefix}{cursor[1] - OUTPUT_LAG:013d}"):
                ms, worker = key[len(prefix):].split(".", 1)
                if key in self.seen or int(ms[:13]) < self.since:
                    continue
                self.seen.add(key)
                cursor[1] = max(cursor[1], int(ms[:13]))
                with contextlib.suppress(NotFound):
                    text = self.backend.store.get(key).decode(errors="replace")
                    for line in text.rstrip("\n").split("\n"):
                        shown = line.rsplit("\r", 1)[-1]   # a progress bar: its last state
                        print(f"[{cursor[0]} {worker}] {shown}", file=sys.stderr, flush=True)

    def stop(self):
        self.stopped.set()
        self.thread.join()
        with contextlib.suppress(Exception):
            self._poll()


def start_supervisor(conf, model, workers, gpus_per_worker=None, threads_per_worker=None):
    """Ask this machine's supervisor of the pool for `workers` workers, starting one when there is
    none; its pid. `gpus_per_worker` (None: 1 where devices exist) and `threads_per_worker` (None:
    thread_env's share) apply to the workers it starts next."""
    if gpus_per_worker is not None and gpus_per_worker < 0:
        raise UserError(f"--gpus-per-worker {gpus_per_worker}: must be 0 (no GPU) or more")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise UserError(f"--threads-per-worker {threads_per_worker}: must be 1 or more")
    folder = state_dir(conf, model)
    os.makedirs(folder, exist_ok=True)
    for name, value in (("gpus-per-worker", gpus_per_worker),
                        ("threads-per-worker", threads_per_worker), ("desired", workers)):
        write_file_atomic(os.path.join(folder, name), "" if value is None else str(value))
    status = read_supervisor(conf, model)
    if status:
        with contextlib.suppress(ProcessLookupError):   # gone since the read: a new one starts
            os.kill(status["pid"], signal.SIGHUP)   # it re-reads `desired`
            return status["pid"]
    with open(os.path.join(folder, "supervisor.log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--model", model],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=child_env(conf), start_new_session=True, cwd=calque_core.HERE)
    deadline = time.monotonic() + SUPERVISOR_START_WAIT
    while time.monotonic() < deadline:
        status, exited = read_supervisor(conf, model), proc.poll()   # 0: ours found the lock held
        # ours, or the one holding the lock; never a dead one's status file, which outlives it
        if status and (status["pid"] == proc.pid or exited == 0):
            return status["pid"]
        if exited not in (None, 0):
            raise UserError(f"the pool supervisor exited at once: see {folder}/supervisor.log")
        time.sleep(0.02)
    raise UserError(f"the pool supervisor did not report within {SUPERVISOR_START_WAIT:g} s: "
                    f"see {folder}/supervisor.log, then retry")


def stop_supervisor(conf, model, timeout):
    """SIGTERM the supervisor (it stops its workers gracefully) and wait; True when it is gone."""
    status = read_supervisor(conf, model)
    if not status:
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(status["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(status["pid"]):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------------------------------------
# the local fleet: this machine's workers of a pool, and what waits on them
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
        return start_supervisor(conf, model, workers, gpus_per_worker, threads_per_worker)
    if os.path.isdir(folder):
        write_file_atomic(os.path.join(folder, "desired"), "0")
    stop_supervisor(conf, model, stop_seconds(conf) + 10)
    return None


def list_pools(backend):
    """The models of the pools whose records are in the store."""
    models = []
    for folder in backend.store.list("pools/"):
        with contextlib.suppress(NotFound):
            models.append(read_json(backend, folder + "/pool.json")["model"])
    return models

class LocalFleet:
    """A pool's warmd.py workers on this machine, under its supervisor: the Fleet that
    calque_fleet.fleet_for documents, counted in workers."""
    unit, dry_run = "workers", False
    here = True   # its workers run this Python as this user: a Modal image's packages checked here

    def __init__(self, conf, backend, args=None):
        self.conf, self.backend, self.args = conf, backend, args
        if getattr(args, "dry_run", False):   # not a verb run for real that was asked to change nothing
            raise UserError("--dry-run prints an EC2 pool's AWS calls; this one's workers run on this "
                            "machine: nothing was done ---> HINT: drop --dry-run")

    def create(self, pool, modal=None, include=(), suggested=None):
        args, model = self.args, pool.model
        if args.read:
            raise UserError("--read grants an EC2 pool's instance role (--instances); local workers "
                            "read what you can")
        count = args.count
        if count is None and args.hi is None:
            count = LOCAL_WORKERS_DEFAULT if args.lo is None else args.lo
        lo, hi, idle = pool_bounds(count, args.lo, args.hi, args.scale_to_zero_after, "workers")
        existed = check_slug_free(self.backend, model)   # None: new (a failed create leaves none)
        record = pool.create(args.handler, 0, batch_size=args.batch_size,
                             visibility_timeout=args.visibility_timeout,
                             max_deliveries=args.max_deliveries, batch_timeout=args.batch_timeout,
                             modal=modal, include=include, retries=args.retries)
        counted = idle is not None or any(n is not None for n in (args.count, args.lo, args.hi))
        if existed and version_of(existed):   # the same version: pool.create refuses another
            here = read_supervisor(self.conf, model)   # none: workers start as at a first create
            kept = here and not counted and (
                f"; its {here['desired']} local worker(s) here are left as they are ---> HINT: "
                f"{command()} pool scale --model {model} --workers N changes the count")
            print(f"pool {model}: exists, version {version_label(record)}: nothing changed{kept or ''}")
            if here and not counted:
                return
        else:
            print(f"pool {model}: queue {record['queue']}, dead-letter {record['dlq']}, version "
                  f"{version_label(record)}, visibility {record['visibility_timeout']}s, max "
                  f"deliveries {record['max_deliveries']}; workers run in {record['workdir']}")
        if not counted:
            print(f"pool {model}: --workers not given: starting {lo} local worker (--workers 0 for none)")
        if idle is not None:
            pid = self.start(pool, lo, (lo, hi, idle), not existed)
            print(f"pool {model}: sizes itself between {lo} and {hi} local worker(s) on its "
                  f"backlog (drain target {self.conf['CALQUE_TARGET_DRAIN']} s; idle {idle / 60:g} "
                  f"min -> {lo}), supervisor pid {pid}; logs: {command()} pool logs --model {model}")
        elif lo:
            pid = self.start(pool, lo, new=not existed)
            print(f"pool {model}: {lo} local worker(s) {'started' if args.no_wait else 'warm'} under "
                  f"supervisor pid {pid}; logs: {command()} pool logs --model {model} "
                  f"({state_dir(self.conf, model)})")

    def start(self, pool, workers, bounds=None, new=False):
        """Set the workers here (pool.scale), waiting until warm unless --no-wait. A `new` pool whose
        workers cannot start, or all die before warm, is deleted again: a failed create leaves no
        pool (the worker logs its error names stay)."""
        args = self.args
        try:
            return pool.scale(workers, gpus_per_worker=args.gpus_per_worker, wait=not args.no_wait,
                              threads_per_worker=args.threads_per_worker, bounds=bounds,
                              progress=sys.stderr.isatty(),
                              then=f"{command()} pool create again" if new else None)
        except (UserError, WorkersFailed):
            if new and read_supervisor(self.conf, pool.model) is None:   # none left loading
                with contextlib.suppress(Exception):   # the error being raised is the one to report
                    pool.delete(force=True)
            raise
        except KeyboardInterrupt:   # Ctrl-C while waiting for warm: the pool and its workers go on
            print(f"calque: interrupted while waiting: pool {pool.model}: its workers go on loading "
                  f"---> HINT: {command()} pool status --model {pool.model}", file=sys.stderr)
            raise SystemExit(128 + signal.SIGINT)

    def scale(self, pool, record):
        args, model = self.args, pool.model
        if args.lo is not None or args.hi is not None:  # one keeps the other
            had = read_scaling(state_dir(self.conf, model)) or {}
            lo = had.get("lo", 0) if args.lo is None else args.lo
            hi = had.get("hi") if args.hi is None else args.hi
            minutes = args.scale_to_zero_after or (had.get("idle_window", 0) / 60 or None)
            lo, hi, idle = pool_bounds(None, lo, hi, minutes, "workers")
            pid = self.start(pool, lo, (lo, hi, idle) if idle else None)
            print(f"pool {model}: sizes itself between {lo} and {hi} local worker(s)"
                  f"{f' (idle {idle / 60:g} min -> {lo})' if idle else ''}, supervisor pid {pid}")
        elif args.count == 0:
            scale_local(self.conf, model, 0)
            print(f"pool {model}: scaled to 0 local workers")
        else:
            pid = self.start(pool, args.count)
            print(f"pool {model}: {args.count} local worker(s) "
                  f"{'starting' if args.no_wait else 'warm'} (supervisor pid {pid})")

    def bounds(self, record):
        folder = state_dir(self.conf, record["model"])
        bounds = read_scaling(folder) or {"lo": max(1, read_desired(folder)), "hi": read_desired(folder)}
        return bounds["lo"], max(1, bounds["hi"])

    def boost(self, record, count, check=False):
        """A pool that sizes itself keeps at least `count` workers while its backlog lasts."""
        folder = state_dir(self.conf, record["model"])
        bounds = read_scaling(folder)
        if bounds and count and not check:
            write_file_atomic(os.path.join(folder, "scaling.json"),
                              json.dumps(dict(bounds, boost=count)))

    def waking(self, record):
        model = record["model"]
        if read_supervisor(self.conf, model) and read_scaling(state_dir(self.conf, model)):
            return "starting", f"pool {model} sizes itself: its supervisor starts workers for the run"
        return None

    def status(self, record):
        return {"queue": queue_depth(self.backend, record["queue"]), "ec2": None,
                "dlq": queue_depth(self.backend, record["dlq"]),
                "workers": read_worker_stats(self.backend, record["model"])}

    def lines(self, status):
        return []

    def logs(self, record):
        """The worker logs here, each under a '==> path <==' header (--follow: until Ctrl-C)."""
        args, model = self.args, record["model"]
        folder = state_dir(self.conf, model)
        name = "worker-*.log" if args.worker is None else f"worker-{args.worker}.log"
        paths = sorted(glob.glob(os.path.join(folder, name)), key=lambda p: int(re.findall(r"\d+", p)[-1]))
        if not paths:
            raise UserError(f"pool {model}: no {name} in {folder}: no local worker ran here"
                            + (" in that slot" if args.worker is not None else "")
                            + f" ---> HINT: {command()} pool scale --model {model} --workers 1")
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

    def delete(self, pool, record):
        args, model = self.args, pool.model
        if not args.yes:
            if not sys.stdin.isatty():
                raise UserError(f"pool delete {model}: refusing without --yes (no terminal to ask)")
            answer = input(f"delete pool {model}: stop its local workers, "
                           f"delete {record['queue']} and {record['dlq']}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("not deleted")
                return False
        cancelled = pool.delete(args.force)
        print(f"pool {model}: local workers stopped")
        for role in ("queue", "dlq"):
            print(f"pool {model}: deleted queue {record[role]}")
        print(f"pool {model}: deleted its record, handler snapshot and worker stats; its runs remain "
              f"in the store ---> HINT: {command()} runs prune --model {model} --older-than 0s (or "
              f"runs delete RUN) deletes them")
        return cancelled

    def pools(self):
        return [{"model": model, "record": True, "asg": None} for model in list_pools(self.backend)]

    @contextlib.contextmanager
    def cold_workers(self, cold, run, shards, timeout):
        """`shards` fresh warmd.py processes on the run's queue; yields what raises WorkersFailed
        once every one exited with claims left (a handler that failed to load: none runs them)."""
        run_id, procs = run["run_id"], []
        folder = os.path.join(os.path.abspath(self.conf["CALQUE_STATE"]), "runs", run_id)
        os.makedirs(folder, exist_ok=True)

        def exited():
            if any(proc.poll() is None for proc in procs):
                return
            if len(summary_claims(self.backend, run_id)) < len(run["claims"]):   # listed after the exits
                with open(os.path.join(folder, "worker-0.log"), errors="replace") as f:
                    last = ([line.strip() for line in f if line.strip()] or ["its log is empty"])[-1]
                raise WorkersFailed(f"run {run_id}: every cold worker exited with claims left: {last} "
                                    f"---> HINT: see {folder}")
        try:
            for shard in range(shards):
                with open(os.path.join(folder, f"worker-{shard}.log"), "ab") as log:
                    argv = [sys.executable, calque_core.WARMD, "--run", run_id, "--spawned-at", repr(time.time())]
                    procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                  env=child_env(self.conf), cwd=calque_core.HERE))
            print(f"run {run_id}: cold, {len(run['claims'])} claim(s) of {run['items']} items, "
                  f"{shards} fresh worker(s); logs in {folder}", file=sys.stderr)
            yield exited
        finally:   # a drained worker exits within a poll; one still running gets SIGTERM, releasing its claim
            for proc in procs:
                try:
                    proc.wait(COLD_EXIT_WAIT)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait()

    def start_seconds(self, enter, acquisition):
        return enter + acquisition + SCALE_INTERVAL

    def grant_read(self, record, uri):
        pass   # local workers read what the user who started them can


def supervise(conf, model):
    """The supervisor's loop: keep the wanted warmd.py processes, restart the dead with backoff. It
    holds the pool's supervisor.lock for its whole life; a second supervisor exits at once."""
    folder = state_dir(conf, model)
    os.makedirs(folder, exist_ok=True)
    lock = try_lock(os.path.join(folder, "supervisor.lock"))   # held until this function returns
    if lock is None:
        print(f"supervisor {os.getpid()}: pool {model} already has a supervisor on this machine: "
              f"exit", flush=True)
        return
    stop_wait = stop_seconds(conf)
    slots = {}            # slot -> {"proc", "started", "restarts", "not_before", "log", ...}
    restarts, stopping = 0, []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    signal.signal(signal.SIGHUP, lambda *_: None)   # `pool scale` sends it; each tick re-reads
    want, scaler = read_desired(folder), LocalScaler(conf, model, folder)
    died = functools.partial(record_exit, conf, model, [])   # [] gets the backend at the first death
    owner = read_state(os.path.join(folder, "owner"), int)   # the `modal run` of an ephemeral pool
    print(f"supervisor {os.getpid()}: pool {model}: keeping {want} worker(s)", flush=True)
    try:
        while not stopping:
            if owner and not pid_alive(owner):   # killed (kill -9): it cannot delete its pool
                print(f"supervisor: pool {model} belongs to modal run pid {owner}, which is gone: "
                      "stopping its workers and deleting it", flush=True)
                break
            now = time.time()
            want = scaler.want(want, now)
            restarts += _reap(slots, want, now, died)
            _spawn(conf, model, folder, slots, want, now)
            workers = [{"slot": s, "pid": v["proc"].pid if v["proc"] else None,
                        "started_at": v["started"], "restarts": v["restarts"], "log": v["log"],
                        "warm": bool(_readiness(v)), "gpus": v["gpus"], "threads": v.get("threads"),
                        "last_exit": v["last_exit"]} for s, v in sorted(slots.items())]
            write_file_atomic(os.path.join(folder, "supervisor.json"), json.dumps(
                {"pid": os.getpid(), "model": model, "desired": want, "restarts": restarts,
                 "workers": workers, "updated_at": now_iso()}))
            time.sleep(SUPERVISOR_TICK)
    finally:
        _stop_workers([v["proc"] for v in slots.values() if v["proc"] is not None], stop_wait)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, "supervisor.json"))
        print("supervisor: exit", flush=True)
    if owner and not stopping and not pid_alive(owner):
        with contextlib.suppress(NotFound, UserError):   # deleted already (modal run's last act)
            backend = open_backend(conf["CALQUE_STORE"])
            drop_pool(backend, load_pool(backend, model), cancel=True)
        unlink_volumes(read_state(os.path.join(folder, "links.json"), json.loads, {}))
        shutil.rmtree(folder, ignore_errors=True)   # as modal run does: its pool's logs were shown as they ran


def try_lock(path):
    """`path` open and flock'ed (held while it stays open; the kernel drops it however we die), or
    None when another process holds it."""
    lock = open(path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


class LocalScaler:
    """The count a pool wants: what `pool create` / `pool scale` wrote, or, for a pool that sizes
    itself (scaling.json), desired_count every SCALE_INTERVAL s on the queue's depth, the seconds
    per claim of recent summaries, and a submit's announced claims until it has queued them all.
    Each change is logged with its inputs."""

    def __init__(self, conf, model, folder):
        self.conf, self.model, self.folder = conf, model, folder
        self.backend = self.queue = self.spc = self.since = self.error = self.woken = None
        self.checked = self.measured = -math.inf

    def want(self, current, now):
        bounds = read_scaling(self.folder)
        if bounds is None:
            self.since = None
            return read_desired(self.folder)
        if now - self.checked < SCALE_INTERVAL:
            return current
        self.checked = now
        try:
            if self.backend is None:
                self.backend = open_backend(self.conf["CALQUE_STORE"])
                record = load_pool(self.backend, self.model)
                self.queue = self.backend.queues.open_queue(record["queue"])
            depth = self.queue.counts()
            wake = bounds.get("wake")   # a submit staging a run: its claims count until all are queued
            if wake and wake["at"] != self.woken and now - wake["at"] < SCALE_WAKE_HOLD:
                if run_staged(self.backend, wake.get("run")):
                    self.woken = wake["at"]   # that announcement is spent: the queue's count takes over
                else:
                    depth = dict(depth, visible=max(depth["visible"], wake["claims"] - depth["in_flight"]))
            # unmeasured, each look while claims wait: a plan's sample claim counts at once
            if now - self.measured > SCALE_MEASURE_EVERY or self.spc is None and depth["visible"]:
                summaries = recent_summaries(self.backend, self.model)
                self.spc, self.measured = measured_seconds(summaries)[0], now
        except (NotFound, StoreFault, UserError, OSError, sqlite3.Error) as e:
            if str(e) != self.error:     # once per distinct error
                print(f"supervisor: scale: cannot read the queue ({e}); keeping {current} "
                      f"worker(s)", flush=True)
            self.backend, self.error = None, str(e)
            return current
        self.error = None
        backlog = depth["visible"] + depth["in_flight"]
        if bounds.get("boost") and not backlog:   # a planned run's count holds while claims wait
            write_file_atomic(os.path.join(self.folder, "scaling.json"),
                              json.dumps(dict(bounds, boost=0)))
        lo = min(bounds["hi"], max(bounds["lo"], bounds.get("boost", 0) if backlog else 0))
        scale = desired_count(depth["visible"], depth["in_flight"], current, self.spc,
                              bounds["target_drain"], lo, bounds["hi"], bounds["idle_window"],
                              self.since, now)
        self.since = scale.surplus_since
        if scale.desired != current:
            print(f"supervisor: {scale.line()}", flush=True)
        return scale.desired


def run_staged(backend, run_id):
    """Whether submit has queued every claim of run `run_id` (False while its record is not written)."""
    try:
        return calque_core.read_json(backend, calque_core.run_key(run_id)).get("staged", True)
    except NotFound:
        return False


def _readiness(slot):
    """What the slot's current process wrote in its ready file: [] (nothing yet), ["warm"] once
    @enter is done, ["warm", "progress"] once it committed a result part or finished a claim."""
    if slot["proc"] is None:
        return []
    words = read_state(slot["ready"], str.split, [])
    return ["warm", *words[1:]] if words[:1] == [str(slot["proc"].pid)] else []


def restart_delay(warm, progress, lived, failures, code):
    """(s before a dead worker's slot starts again, the kind of death). Warm with progress (a part,
    a finished claim, or RESTART_RESET_AFTER s of life): killed, not a crash loop, so at once. Else
    a SIGKILL (from outside) waits RESTART_BACKOFF[0] s, and an exit of its own, the `failures`-th
    in a row, RESTART_BACKOFF[0] s doubling up to RESTART_BACKOFF[1]. One that left for the
    pool's new version (EXIT_REPLACED) starts again at once on it."""
    if code == calque_core.EXIT_REPLACED:
        return 0.0, "replaced by the pool's new version"
    if warm and (progress or lived > RESTART_RESET_AFTER):
        return 0.0, "died after progress"
    kind = "died without progress" if warm else "died before warm"
    if code == -signal.SIGKILL:
        return RESTART_BACKOFF[0], kind
    return min(RESTART_BACKOFF[0] * 2 ** (failures - 1), RESTART_BACKOFF[1]), kind


def exit_reason(log_path, returncode):
    """Why a worker died, in one line: the last exception or `warmd: error:` line of its log, else
    its exit status (the signal's name when one killed it)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - EXIT_LOG_TAIL))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        tail = []
    said = re.compile(r"^(warmd: error: .*|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*)$")
    for line in reversed(tail):
        if said.match(line.strip()):
            return line.strip()[:calque_core.ERROR_CHARS]
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode} (no error line in its log)"


def _reap(slots, want, now, died):
    """Notice exited workers and keep why each died (last_exit). A wanted slot restarts after its
    backoff; a slot above `want` gets SIGUSR1 once (it finishes its claim: scaling in costs no
    redelivery) and goes when its process has. A death goes to `died(pid, status)` and a SIGUSR2 to
    each warm sibling. Returns the restarts counted."""
    restarts = 0
    for s, slot in list(slots.items()):
        proc = slot["proc"]
        if proc is not None and proc.poll() is not None:
            said = _readiness(slot)
            progress = "progress" in said
            replaced = proc.returncode == calque_core.EXIT_REPLACED
            slot["failures"] = 0 if progress or replaced else slot.get("failures", 0) + 1
            lived = now - slot["started"]
            code = proc.returncode
            delay, kind = restart_delay(bool(said), progress, lived, slot["failures"], code)
            slot["last_exit"] = {"pid": proc.pid, "code": code, "at": now, "warm": bool(said),
                                 "progress": progress, "lived": round(lived, 3), "kind": kind,
                                 "restart_delay": delay, "reason": exit_reason(slot["log"], code)}
            slot["proc"] = None
            for lease in slot.pop("leases", ()):   # its GPUs are free for any pool here
                lease.close()
            print(f"supervisor: worker slot {s} (pid {proc.pid}) exited with {code} "
                  f"({kind}; restart {f'in {delay:g} s' if delay else 'at once'})", flush=True)
            if code and not replaced:   # a death: siblings commit more (warmd.on_sibling_death)
                died(proc.pid, code, os.path.splitext(slot["ready"])[0] + ".claims")
                for other in slots.values():
                    if other["proc"] and other["proc"].poll() is None and _readiness(other):
                        other["proc"].send_signal(signal.SIGUSR2)
            if s < want:
                slot["restarts"] += 1
                restarts += 1
                slot["not_before"] = now + delay
        if s >= want:
            if slot["proc"] is None:
                del slots[s]
            elif not slot.get("stopping"):
                slot["stopping"] = True
                slot["proc"].send_signal(signal.SIGUSR1)   # scale-in: finish the claim, then exit
    return restarts


def record_exit(conf, model, backend, pid, code, receipts):
    """A dead worker's exit status, where the poison rule reads it (warmd: how_it_ended), then the
    claims it held (`receipts`, its Leases file) visible again at once, not at their visibility
    timeout: the run's tail after a death. `backend` holds the pool's once opened. Best effort:
    unrecorded, it counts as an outside kill; unreleased, its claims wait out their timeout."""
    with contextlib.suppress(Exception):
        if not backend:
            backend.append(open_backend(conf["CALQUE_STORE"]))
        key = f"{worker_stats_prefix(model)}exit-{socket.gethostname()}-{pid}"
        backend[0].store.put(key, str(code).encode())
    held = read_state(receipts, json.loads, [])
    with contextlib.suppress(FileNotFoundError):
        os.remove(receipts)
    with contextlib.suppress(Exception):
        queue = backend[0].queues.open_queue(load_pool(backend[0], model)["queue"]) if held else None
        for receipt in held:
            with contextlib.suppress(calque_core.LeaseLost):   # acked or taken since: nothing to release
                queue.change_visibility(calque_core.Message(None, receipt, 0), 0)
                print(f"supervisor: worker {pid} died holding a claim: visible again now", flush=True)


def _spawn(conf, model, folder, slots, want, now):
    """Start a warmd.py in each wanted slot that has none and whose backoff is over, on its GPUs."""
    devices = gpu_devices(conf)   # GPUs per worker: the count `pool create` wrote, else 1 where any
    asked = read_state(os.path.join(folder, "gpus-per-worker"), str.strip, "")
    per_worker = int(asked) if asked else min(1, len(devices))
    bounds = read_scaling(folder)
    for s in range(want):
        base = os.path.join(folder, f"worker-{s}")
        slot = slots.setdefault(s, {"proc": None, "started": 0.0, "restarts": 0, "not_before": 0,
                                    "last_exit": None, "log": f"{base}.log",
                                    "ready": f"{base}.ready"})
        if slot["proc"] is None and now >= slot["not_before"]:
            slot["gpus"], slot["leases"] = lease_gpus(conf, devices, per_worker, s, bool(bounds))
            if slot["gpus"] is None:    # every device is another worker's: the slot waits for one
                slot["gpus"] = []
                continue
            env = child_env(conf)
            if slot["gpus"]:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(slot["gpus"])
            sharing = max(want, bounds["hi"]) if bounds else want
            env.update(thread_env(folder, sharing, slot["gpus"], env))
            slot["threads"] = env.get("OMP_NUM_THREADS")
            with open(slot["log"], "ab") as log:
                argv = [sys.executable, calque_core.WARMD, "--model", model, *worker_flags(slot, now)]
                slot["proc"] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=log, env=env, cwd=calque_core.HERE)
            slot["started"] = now
            print(f"supervisor: started worker slot {s} as pid {slot['proc'].pid}", flush=True)


def worker_flags(slot, now):
    """warmd's hand-off flags: our pid (it stops if we die), its ready file, when it was spawned,
    the device NVML samples (NVML ignores CUDA_VISIBLE_DEVICES), and after a death how long the last
    worker lived (the shorter, the more often the new one commits)."""
    flags = ["--supervisor-pid", str(os.getpid()), "--ready-file", slot["ready"],
             "--spawned-at", repr(now)]
    if slot["gpus"]:
        flags += ["--gpu-index", slot["gpus"][0]]
    if slot["last_exit"] and slot["last_exit"]["code"]:
        flags += ["--previous-life", str(slot["last_exit"]["lived"])]
    return flags


def thread_env(folder, want, gpus, env):
    """A new worker's THREAD_VARS (what torch, MKL, OpenBLAS and rayon size their thread pools by):
    all `--threads-per-worker N` when given; else a CPU worker's share of the cores (cores / `want`,
    at least 1) in each the user left unset; a GPU worker keeps its libraries' defaults."""
    asked = read_state(os.path.join(folder, "threads-per-worker"), str.strip, "")
    if asked:
        return dict.fromkeys(THREAD_VARS, asked)
    if gpus:
        return {}
    share = str(max(1, len(os.sched_getaffinity(0)) // max(1, want)))
    return {var: env.get(var) or share for var in THREAD_VARS}


def worker_gpus(devices, per_worker, slot):
    """Worker `slot`'s devices, round-robin: the `per_worker` after slot s-1's, wrapping."""
    if not devices or not per_worker:
        return []
    return [devices[(slot * per_worker + j) % len(devices)] for j in range(per_worker)]


def lease_gpus(conf, devices, per_worker, slot, sizing):
    """(devices, leases) for worker `slot`: its worker_gpus, each leased where free (a lock in
    CALQUE_STATE/gpus/, held while the worker lives). A fixed pool shares a device another holds; a
    pool that sizes itself takes free devices only, its own first, else (None, []): the slot waits,
    so a machine's GPUs go to the pools that have work."""
    wanted = worker_gpus(devices, per_worker, slot)
    if not wanted:
        return [], []
    folder = os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "gpus")
    os.makedirs(folder, exist_ok=True)
    got, leases = [], []
    for device in wanted + [d for d in devices if d not in wanted] if sizing else wanted:
        if len(got) == per_worker:
            break
        lease = try_lock(os.path.join(folder, f"{device}.lock"))
        if lease:
            leases.append(lease)
        if lease or not sizing:
            got.append(device)
    if len(got) < per_worker:
        for lease in leases:
            lease.close()
        return None, []
    return got, leases


def _stop_workers(live, stop_wait):
    """SIGTERM every worker, wait `stop_wait` (stop_seconds) + 5 s, then SIGKILL the ones still there."""
    print(f"supervisor: stopping {len(live)} worker(s)", flush=True)
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + stop_wait + 5
    for proc in live:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"supervisor: worker pid {proc.pid} ignored SIGTERM for {stop_wait + 5:.0f}s; "
                  f"killing it", flush=True)
            proc.kill()


def main(argv=None):
    parser = calque_core.Parser(prog="calque_supervisor.py", description="Keeps local pool workers.")
    parser.add_argument("--model", required=True, help="the pool's model name")
    try:
        args = parser.parse_args(argv)
        supervise(calque_core.settings(), args.model)
    except UserError as e:
        print(f"supervisor: error: {e}", file=sys.stderr)
        return calque_core.EXIT_USAGE
    return calque_core.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
