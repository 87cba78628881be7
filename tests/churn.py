"""Churn: a kill -9 of a random worker of a 3-worker local pool every few seconds while runs drain, and what it
cost: time to done, item computations repeated, items lost, wrong or failed (a good item quarantined).
tests/test_chaos.py runs a short one; bench/bench_churn.py (`make bench`) the full one."""
import contextlib
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import calque  # noqa: E402
import calque_core
import calque_runs

HANDLER = os.path.join(ROOT, "tests", "handlers.py") + ":Faulty"
MODEL = "churn"


def cli(env, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def workers(env):
    """The live worker pids in the supervisor's status file."""
    try:
        with open(os.path.join(env["CALQUE_STATE"], "pools", MODEL, "supervisor.json")) as f:
            return [w["pid"] for w in json.load(f)["workers"] if w["pid"]]
    except (OSError, ValueError):
        return []


def churn(folder, runs, kill_every, seed, sizes=(7, 333), claims=(5, 50), spin=40000, timeout=600.0, poison=()):
    """Stage `runs` runs (sizes and claim sizes drawn from the ranges) on a fresh 3-worker pool, kill -9 a random
    worker every uniform(*kill_every) s (None: never) until every claim has a summary; the figures. `poison`: kinds
    of Faulty's "die" (exit, kill, segv) given to as many items of the first run, in distinct claims (its claim
    size is cut to make enough), which must fail as poison; poison_deliveries: the delivery that quarantined each."""
    rng = random.Random(seed)
    calls = os.path.join(folder, "calls")
    env = dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"), CALQUE_STATE=os.path.join(folder, "state"),
               CALQUE_POLL_WAIT="1", CALQUE_GRACE="5", CALQUE_ENV=os.path.join(folder, "none.env"), CALLS_FILE=calls)
    cli(env, "pool", "create", "--model", MODEL, "--handler", HANDLER, "--workers", "3", "--batch-size", "4",
        "--visibility-timeout", "2")
    backend = calque_core.open_backend(env["CALQUE_STORE"])
    record, queue = calque_core.load_pool(backend, MODEL), backend.queues.open_queue(calque_core.pool_queue_name(MODEL))
    t0, staged, x, bad, kinds = time.monotonic(), {}, 0, {}, {}
    for r in range(runs):
        n, size = rng.randint(*sizes), rng.randint(*claims)
        if r == 0 and poison:   # one poison item a claim: each is counted in its own claim's deliveries
            n = max(n, len(poison))
            size = min(size, n // len(poison))
        items = [{"x": x + i, "spin": spin} for i in range(n)]
        places = [c * size + rng.randrange(min(size, n - c * size))
                  for c in rng.sample(range(-(-n // size)), len(poison))] if r == 0 else ()
        for i, kind in zip(places, poison):
            items[i]["die"], bad[x + i], kinds[x + i] = kind, None, kind
        run = calque_runs.stage_run(backend, record, items, size, queue, "pool")
        staged[run["run_id"]] = (x, n, len(run["claims"]), size)
        x += n
    stop, kills = threading.Event(), []

    def killer():
        while kill_every and not stop.wait(rng.uniform(*kill_every)):
            pids = workers(env)
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills.append(time.monotonic())

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    done = {}
    try:
        while time.monotonic() - t0 < timeout and len(done) < len(staged):
            for run_id, (_, _, n_claims, _) in staged.items():
                if run_id not in done and len(calque_core.list_summaries(backend, run_id)) == n_claims:
                    done[run_id] = time.monotonic() - t0
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
    seconds = time.monotonic() - t0
    ok = wrong = failed = lost = 0
    errors, logs = [], ""
    for name in glob.glob(os.path.join(env["CALQUE_STATE"], "pools", MODEL, "worker-*.log")):
        with open(name) as f:
            logs += f.read()
    at = {}   # (run, claim, offset) -> the delivery that quarantined it (warmd's take-over log line)
    for run_id, claim, rc, offsets in re.findall(r"claim (\S+)/(c\d+) delivery (\d+): .*quarantined \[([\d, ]+)\]",
                                                 logs):
        for k in offsets.split(", "):
            at[run_id, claim, int(k)] = min(int(rc), at.get((run_id, claim, int(k)), int(rc)))
    for run_id, (first, n, _, size) in staged.items():
        got = {}
        if run_id in done:
            for s in calque_core.read_summaries(backend, run_id):
                for line in calque_core.read_claim_results(backend.store, run_id, s["claim"], s["items"]):
                    line = json.loads(line)
                    got[line["i"]] = line
        for i in range(n):
            line = got.get(i)
            if line is None:
                lost += 1
            elif first + i in bad:      # a poison item: the delivery of its claim that quarantined it
                poisoned = line.get("error", "").startswith("poison:")
                bad[first + i] = at.get((run_id, calque_core.claim_id(i // size), i % size)) if poisoned else "not"
            elif not line["ok"]:
                failed += 1
                errors.append(line["error"])
            elif line["result"] == {"y": 2 * (first + i)}:
                ok += 1
            else:
                wrong += 1
    with open(calls) as f:
        computations = sum(1 for _ in f)
    dead = backend.queues.open_queue(calque_core.dlq_name(MODEL)).counts()["visible"]
    # deaths pinned on a good item that then ran and returned (warmd's churn markers): the false quarantines' odds
    innocent = sum("/churn-" in key for key in backend.store.list(calque_core.worker_stats_prefix(MODEL)))
    with open(os.path.join(env["CALQUE_STATE"], "pools", MODEL, "supervisor.log")) as f:
        restarts = Counter(re.findall(r"exited with -?\d+ \(([a-z ]+);", f.read()))
    cli(env, "pool", "delete", "--model", MODEL, "--yes", "--force")
    items = sum(n for _, n, _, _ in staged.values()) - len(bad)
    return {"runs": runs, "runs_done": len(done), "items": items, "ok": ok, "wrong": wrong, "failed": failed,
            "lost": lost, "dead_letters": dead, "kills": len(kills), "restarts": dict(restarts), "innocent": innocent,
            "seconds": round(seconds, 2),
            "computations": computations, "repeated": round((computations - items - len(bad)) / items, 4),
            "poison_deliveries": dict(sorted((kinds[i], bad[i]) for i in bad)),
            "errors": errors[:5]}
