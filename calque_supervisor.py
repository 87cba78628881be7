"""supervisor: the detached process that keeps a local pool's warmd.py workers alive here.

    python calque_supervisor.py --model demo     # what `pool create` / `pool scale` start, detached

One per pool and machine (a lock in its state folder). Every SUPERVISOR_TICK s it reads the count
wanted (LocalScaler), restarts the dead with backoff, leases GPUs, and writes supervisor.json, which
calque reads (section 6). calque imports it only in the verbs that start or stop workers.
"""
import contextlib
import fcntl
import functools
import json
import math
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import calque_core
from calque_core import (DEFAULTS, NotFound, StoreFault, UserError, desired_count, load_pool,
                         measured_seconds, now_iso, open_backend, recent_summaries, slug, state_dir,
                         stop_seconds, worker_stats_prefix, write_file_atomic)
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
    write_file_atomic(os.path.join(folder, "gpus-per-worker"),
                      "" if gpus_per_worker is None else str(gpus_per_worker))
    write_file_atomic(os.path.join(folder, "threads-per-worker"), str(threads_per_worker or ""))
    write_file_atomic(os.path.join(folder, "desired"), str(workers))
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
    devices, per_worker = gpu_plan(conf, folder)
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


def gpu_plan(conf, folder):
    """(devices, GPUs per worker): the count `pool create` wrote, else 1 where devices exist."""
    devices = gpu_devices(conf)
    asked = read_state(os.path.join(folder, "gpus-per-worker"), str.strip, "")
    return devices, int(asked) if asked else min(1, len(devices))


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
