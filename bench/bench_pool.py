"""make bench, part 1: what a claim costs the pool machinery, and what warm workers buy.

    .venv/bin/python bench/bench_pool.py            # all of it, local backend and moto_server side by side
    BENCH_CLAIMS=20 DEMO_MODEL_MB=256 .venv/bin/python bench/bench_pool.py

1. dispatch overhead per claim (receive -> manifest -> results + summary -> ack) with an empty handler,
   measured inside one worker object so that nothing else is in the number;
2. the idle round trip: submit -> summary with an idle warm worker (a real warmd.py process);
3. warm pool against a cold fresh-process-per-claim baseline over the same claims of the demo model with a
   made-expensive @enter, with the ideal ratio (enter + batch) / batch beside the measured one;
4. the drain loop's occupancy (model busy / claim wall) with and without the collation prefetch thread.
Medians of many trials; the machine is shared and noisy, so read ratios, not absolutes.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.update(AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_DEFAULT_REGION="us-east-1")
import calque  # noqa: E402
import warmd   # noqa: E402
import calque_core
import calque_runs
import calque_sources
import calque_supervisor
import calque_fleet

# ------------------------------------------------------------------------------------------------
DISPATCH_CLAIMS = int(os.environ.get("BENCH_DISPATCH", "200"))   # claims timed for dispatch overhead
ROUND_TRIPS = int(os.environ.get("BENCH_ROUND_TRIPS", "30"))     # idle round trips timed
CLAIMS = int(os.environ.get("BENCH_CLAIMS", "20"))               # claims in the warm-vs-cold comparison
ITEMS_PER_CLAIM = int(os.environ.get("BENCH_ITEMS", "1024"))     # demo items per claim (a batch of real size)
EXPENSIVE_ENTER = {"DEMO_MODEL_MB": os.environ.get("DEMO_MODEL_MB", "256"),      # checkpoint loaded by @enter
                   "DEMO_WARMUP_BATCHES": os.environ.get("DEMO_WARMUP_BATCHES", "100")}
OVERLAP_ITEMS = int(os.environ.get("BENCH_OVERLAP_ITEMS", "2048"))   # numeric items in the occupancy claim
OVERLAP_BATCH = 64                                                  # items per batch there (1 MiB of float32)
HANDLERS = os.path.join(ROOT, "tests", "handlers.py")


def start_moto(stock_clock=False):
    """moto_server on a free loopback port (bench/peers/moto_counted.py: its SQS reads the clock cheaply, unless
    stock_clock; that file says why), with a bucket "bench"; AWS_ENDPOINT_URL points at it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = os.path.join(ROOT, "bench", "peers", "moto_counted.py")
    proc = subprocess.Popen([sys.executable, server, "--port", str(port), *(["--stock-clock"] if stock_clock else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import boto3
    boto3.client("s3").create_bucket(Bucket="bench")
    return proc


def make_pool(store, state, handler, model="bench", batch_size=64):
    os.environ.update(CALQUE_STORE=store, CALQUE_STATE=state)
    conf = calque_core.settings()
    backend = calque_core.open_backend(store)
    args = calque.build_parser().parse_args(["pool", "create", "--model", model, "--handler", handler,
                                            "--batch-size", str(batch_size), "--visibility-timeout", "60",
                                            "--workers", "0"])   # the bench's own in-process worker serves it alone
    with open(os.devnull, "w") as quiet:
        saved, sys.stdout = sys.stdout, quiet
        try:
            calque.cmd_pool_create(conf, backend, args)
        finally:
            sys.stdout = saved
    return conf, backend, calque_core.load_pool(backend, model)


def dispatch_overhead(store, state):
    """Median seconds per claim through one in-process worker with an empty handler."""
    conf, backend, record = make_pool(store, state, f"{HANDLERS}:Empty")
    queue = backend.queues.open_queue(record["queue"])
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix("bench"), conf, False)
    worker.start()
    for _ in range(DISPATCH_CLAIMS):
        calque_runs.stage_run(backend, record, [{"x": 1}], 1, queue, "pool")
    times = []
    for _ in range(DISPATCH_CLAIMS):
        t0 = time.perf_counter()
        worker.handle(queue.receive(1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.quantiles(times, n=20)[18]


def idle_round_trip(store, state):
    """Median seconds from submit to summary, with an idle warm warmd.py waiting on the queue."""
    conf, backend, record = make_pool(store, state, f"{HANDLERS}:Empty", model="idle")
    queue = backend.queues.open_queue(record["queue"])
    env = calque_supervisor.child_env(conf)
    worker = subprocess.Popen([sys.executable, calque_core.WARMD, "--model", "idle"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not calque_core.read_worker_stats(backend, "idle"):
            time.sleep(0.05)
        times = []
        for _ in range(ROUND_TRIPS):
            time.sleep(0.05)   # let the worker go back to its long poll: this measures an idle worker
            t0 = time.perf_counter()
            run = calque_runs.stage_run(backend, record, [{"x": 1}], 1, queue, "pool")
            summaries, timed_out = calque_runs.wait_for_run(backend, run, 30, progress=False)
            times.append(time.perf_counter() - t0)
            assert summaries and not timed_out
        return statistics.median(times), statistics.quantiles(times, n=20)[18]
    finally:
        worker.terminate()
        worker.wait()


def warm_vs_cold(store, state):
    """Wall seconds for CLAIMS demo claims: one warm worker (already entered) against one fresh process per claim."""
    os.environ.update(EXPENSIVE_ENTER)
    conf, backend, record = make_pool(store, state, os.path.join(ROOT, "examples", "demo_model.py:DemoModel"),
                                      model="demo", batch_size=ITEMS_PER_CLAIM)
    with open(os.path.join(ROOT, "examples", "items.jsonl")) as f:
        base = [json.loads(line) for line in f]
    items = [base[i % len(base)] for i in range(CLAIMS * ITEMS_PER_CLAIM)]
    env = calque_supervisor.child_env(conf)
    worker = subprocess.Popen([sys.executable, calque_core.WARMD, "--model", "demo"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not calque_core.read_worker_stats(backend, "demo"):   # written once @enter is done
            time.sleep(0.05)
        queue = backend.queues.open_queue(record["queue"])
        t0 = time.perf_counter()
        run = calque_runs.stage_run(backend, record, items, ITEMS_PER_CLAIM, queue, "pool")
        warm_summaries, _ = calque_runs.wait_for_run(backend, run, 3600, progress=False)
        warm_wall = time.perf_counter() - t0
    finally:
        worker.terminate()
        worker.wait()
    cold_summaries = []
    t0 = time.perf_counter()
    for k in range(CLAIMS):   # the baseline: a fresh process (imports + @enter) for every claim
        chunk = items[k * ITEMS_PER_CLAIM:(k + 1) * ITEMS_PER_CLAIM]
        saved, sys.stderr = sys.stderr, open(os.devnull, "w")
        try:
            run, summaries, _ = calque_fleet.cold_run(conf, backend, calque.as_items(chunk), model="demo", batch_size=ITEMS_PER_CLAIM,
                                                claim_size=ITEMS_PER_CLAIM, timeout=3600, progress=False)
        finally:
            sys.stderr = saved
        cold_summaries += summaries
    cold_wall = time.perf_counter() - t0
    batch = statistics.mean(s["claim_seconds"] for s in warm_summaries)
    enter = statistics.mean(s["enter_seconds_paid"] + s["acquisition_seconds"] for s in cold_summaries)
    return warm_wall, cold_wall, batch, enter, warm_summaries, cold_summaries


def occupancy(store, state, prefetch):
    """One claim of numeric items through the Matmul handler in one in-process worker; its summary."""
    import numpy as np
    conf, backend, record = make_pool(store, state, f"{HANDLERS}:Matmul", model="overlap", batch_size=OVERLAP_BATCH)
    path = os.path.join(state, "x.npy")
    os.makedirs(state, exist_ok=True)
    np.save(path, np.random.default_rng(0).standard_normal((OVERLAP_ITEMS, 1024)).astype(np.float32))
    queue = backend.queues.open_queue(record["queue"])
    warmd.PREFETCH = prefetch
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix("overlap"), conf, False)
    worker.start()
    run = calque_runs.stage_run(backend, record, calque_sources.read_items(path), OVERLAP_ITEMS, queue, "pool")
    worker.handle(queue.receive(1))
    summary = calque_core.read_summaries(backend, run["run_id"])[0]
    assert summary["status"] == "ok", summary["errors"]
    return summary


def main():
    moto = start_moto()
    tmp = tempfile.mkdtemp(prefix="calque-bench-")
    backends = {"local": lambda name: (os.path.join(tmp, name, "store"), os.path.join(tmp, name, "state")),
                "moto_server": lambda name: (f"s3://bench/{name}", os.path.join(tmp, name, "state"))}
    try:
        print(f"calque bench  ({os.cpu_count()} cores, python {sys.version.split()[0]})")
        print(f"\n1. dispatch overhead per claim, empty handler, {DISPATCH_CLAIMS} claims "
              "(receive -> manifest -> results + summary -> ack)")
        for name, paths in backends.items():
            median, p95 = dispatch_overhead(*paths(f"dispatch-{name}"))
            print(f"   {name:<12} median {median * 1e3:7.2f} ms   p95 {p95 * 1e3:7.2f} ms")
        print(f"\n2. idle round trip, submit -> summary with an idle warm worker, {ROUND_TRIPS} trips")
        for name, paths in backends.items():
            median, p95 = idle_round_trip(*paths(f"idle-{name}"))
            print(f"   {name:<12} median {median * 1e3:7.2f} ms   p95 {p95 * 1e3:7.2f} ms")
        print(f"\n3. warm pool vs fresh process per claim: {CLAIMS} claims x {ITEMS_PER_CLAIM} demo items, "
              f"DEMO_MODEL_MB={EXPENSIVE_ENTER['DEMO_MODEL_MB']} DEMO_WARMUP_BATCHES={EXPENSIVE_ENTER['DEMO_WARMUP_BATCHES']}, local backend")
        warm, cold, batch, enter, _, _ = warm_vs_cold(*backends["local"]("demo"))
        ideal = (enter + batch) / batch
        measured = cold / warm
        print(f"   warm pool   {warm:8.2f} s  ({CLAIMS * ITEMS_PER_CLAIM / warm:8.1f} items/s), batch {batch * 1e3:.1f} ms/claim")
        print(f"   cold        {cold:8.2f} s  ({CLAIMS * ITEMS_PER_CLAIM / cold:8.1f} items/s), start + @enter {enter:.2f} s/claim")
        print(f"   speed-up {measured:.1f}x  vs ideal (enter + batch) / batch = {ideal:.1f}x  -> {measured / ideal:.2f} of ideal")
        print(f"\n4. drain-loop occupancy (model busy / claim wall): {OVERLAP_ITEMS} x 1024 float32 items from .npy, "
              f"batches of {OVERLAP_BATCH}, Matmul handler, local backend")
        for prefetch in (False, True):
            s = occupancy(*backends["local"](f"overlap-{prefetch}"), prefetch)
            print(f"   prefetch {'on ' if prefetch else 'off'}  occupancy {s['occupancy']['value']:.1%}  "
                  f"(model {s['model_seconds']:.3f} s, waiting on collation {s['collate_wait_seconds']:.3f} s, "
                  f"claim {s['claim_seconds']:.3f} s)")
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
