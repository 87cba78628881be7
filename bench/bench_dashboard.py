"""The dashboard on a big run (make bench): a 10,000-claim run of 8 workers in a fresh local store, its summaries
made by calque.claim_summary as a worker writes them, then served by a real `calque dashboard` process: the
run page's first load (every summary read), a refresh with nothing new, one after 100 new summaries, and the
bytes of the page, its live part and its API answer. In process: the store reads each refresh makes."""
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import calque  # noqa: E402
import calque_dashboard as dashboard  # noqa: E402
import calque_core
import calque_cost

CLAIMS, WORKERS, ITEMS, CLAIM_SECONDS = 10_000, 8, 10, 0.5


def synth_run(backend, claims, model="bench", items=ITEMS):
    """A pool run's record of `claims` claims of `items` items, all sent, none finished."""
    run_id = calque_core.new_run_id(model)
    run = {"run_id": run_id, "model": model, "mode": "pool", "items": claims * items,
           "claims": [calque_core.claim_id(i) for i in range(claims)], "claim_size": items,
           "queue": calque_core.pool_queue_name(model), "backend": backend.kind, "store": backend.describe(),
           "created_at": calque_core.now_iso(), "sent": claims, "staged": True}
    calque_core.write_json(backend, calque_core.run_key(run_id), run)
    return run


def finish_claims(backend, run, start, stop, workers=WORKERS, t0=None):
    """Write the summaries of claims start..stop-1: claim i on worker i % workers, back to back, every 50th with
    a failed item."""
    t0 = time.time() - CLAIM_SECONDS * len(run["claims"]) / workers if t0 is None else t0
    for i in range(start, stop):
        begin = t0 + (i // workers) * CLAIM_SECONDS
        failed = [i * ITEMS] if i % 50 == 0 else []
        summary = calque_core.claim_summary(
            run_id=run["run_id"], claim=calque_core.claim_id(i), model=run["model"], worker_id=f"bench-{i % workers}",
            mode="pool", backend=backend.kind, receive_count=1, enter_count=1, started=begin,
            finished=begin + CLAIM_SECONDS * 0.98, requests={"queue_receives": 1, "store_gets": 1, "store_puts": 2},
            items=ITEMS, failed=failed, errors={str(f): f"ValueError: item {f}: bad input" for f in failed},
            warm_hit=True, model_seconds=CLAIM_SECONDS * 0.9)
        calque_core.write_json(backend, calque_core.summary_key(run["run_id"], summary["claim"]), summary)


def fetch(url):
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as answer:
        body = answer.read()
    return time.perf_counter() - t, len(body)


def main():
    folder = tempfile.mkdtemp(prefix="calque-bench-dashboard-")
    env = dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"), CALQUE_STATE=os.path.join(folder, "state"),
               CALQUE_ENV=os.path.join(folder, "none.env"))
    backend = calque_core.open_backend(env["CALQUE_STORE"])
    run = synth_run(backend, CLAIMS)
    finish_claims(backend, run, 0, CLAIMS - 100)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "calque.py"), "dashboard", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        base = proc.stdout.readline().split()[3].rstrip("/")
        page = f"{base}/runs/{run['run_id']}"
        first = fetch(page)
        again = fetch(page)
        live = fetch(page + "?part=main")
        finish_claims(backend, run, CLAIMS - 100, CLAIMS)
        new = fetch(page + "?part=main")
        api = fetch(f"{base}/api/runs/{run['run_id']}")
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"dashboard, a run of {CLAIMS:,} claims on {WORKERS} workers (local store), run page over HTTP:")
    print(f"  first load (reads {CLAIMS - 100:,} summaries)  {first[0]:.3f} s  {first[1] / 1024:.0f} KiB")
    print(f"  reload, nothing new                  {again[0]:.3f} s  ({first[0] / again[0]:.0f}x faster)")
    print(f"  live part, nothing new               {live[0]:.3f} s  {live[1] / 1024:.0f} KiB")
    print(f"  live part after 100 new summaries    {new[0]:.3f} s")
    print(f"  /api/runs/RUN                        {api[0]:.3f} s  {api[1] / 1024:.0f} KiB")

    board = dashboard.Dashboard({"CALQUE_STATE": env["CALQUE_STATE"]}, backend, calque_cost.pricing())
    small, t0, reads = synth_run(backend, 1000, model="reads"), time.time() - 100, {}
    for label, start, stop in (("first, 500 of 1,000 done", 0, 500), ("100 new", 500, 600), ("nothing new", 600, 600),
                               ("400 new, complete", 600, 1000), ("complete", 1000, 1000)):
        finish_claims(backend, small, start, stop, t0=t0)
        before = dict(backend.requests)
        board.run_view(small["run_id"])
        reads[label] = {k: backend.requests[k] - before.get(k, 0) for k in ("store_gets", "store_lists")}
    print("store reads of one refresh of a 1,000-claim run:")
    for label, n in reads.items():
        print(f"  {label:<26} {n['store_gets']:>4} gets, {n['store_lists']} lists")

if __name__ == "__main__":
    main()
