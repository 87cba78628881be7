"""make bench, part 3: runs at scale, what calque's own code costs around the model.

    .venv/bin/python bench/bench_scale.py                          # every section: 10k, 100k, 1M items, ...
    BENCH_SCALE_SIZES=10000,100000 BENCH_STREAM_ITEMS=10000000 .venv/bin/python bench/bench_scale.py
    .venv/bin/python bench/bench_scale.py latency                  # only section 4
    # sections: local stream moto latency memory prestaged (all when none is named)

1. local backend, demo model (examples/demo_model.py), 2 warm workers, batch 64, claims of 1000: for each run
   size, a real `calque.py submit --pool` process: end to end and steady-state items/s against the two-process
   model-only rate measured just before and just after that run (their mean: the shared machine's load drifts
   within minutes), time from submit start to the first claim received, the submit process's peak RSS and CPU
   (getrusage of the child), keys it listed per claim, and the workers' CPU; the summaries' model_seconds against
   the model-only time for as many items (1.00: the model's own time, more: the worker's other work or GIL waits
   counted as the model's); and the CPU an item of model-only against the workers' (the share of the workers' CPU
   that is the model's: unlike the rates, it does not move with what else the machine runs);
2. staging alone (`submit --no-wait` to a pool with no worker) of a generated stream on stdin
   (BENCH_STREAM_ITEMS, items never kept in a file): items/s and peak RSS;
3. moto_server (bench/peers/moto_counted.py, whose SQS reads the clock cheaply; that file says why): staging
   100k items as 1,000 claims of 100 (`submit --no-wait`, no worker) as shipped against one request at a time
   (the staging before it was parallel, emulated: one store writer and one message a send, so at most a PUT and
   a send in flight), on moto_server with its stock clock, with the cheap clock, and behind bench/latency_proxy.py
   adding BENCH_LATENCY_MS per request: items/s, the ratio, the submitter's requests per claim; and an
   end-to-end run with 2 workers (requests per claim, submitter and workers together: the workers' from the
   stats they write as they stop, exact, since a summary counts its ack as one request where a batch is one);
4. moto_server behind bench/latency_proxy.py adding BENCH_LATENCY_MS (15) per request, as real SQS and S3 calls
   cost in a region: BENCH_LATENCY_ITEMS (20k) items as claims of 100 through 2 workers of the Timeline handler
   (next to no model time, so that the requests show; then 50 ms a batch, a model on an accelerator, whose host
   thread waits: BENCH_LATENCY_MODEL_MS), claim pipelining off (warmd.PIPELINE = False), the finisher only
   (warmd.AHEAD = False), and as it ships on S3 + SQS, the next claim received ahead too, twice each:
   items/s, requests per claim, and the per-claim gap in the model's timeline (per worker, from the end of a
   claim's last handler call to the start of the next claim's first, timestamps taken in the handler), in ms and
   in request latencies (the median of requests through the proxy sampled every 0.25 s during that run: on 2
   shared cores moto_server's own time under load, not the 15 ms, can set it).
5. the resident memory of an idle worker whose handler is plain Python (tests/handlers.py:Empty), after a claim;
6. the largest local run size again, staged first (`submit --no-wait`) and then drained by WORKERS workers, so
   that the submitter is idle: items/s against model-only, and where a claim's time goes (model, the rest, the
   gap to the next claim), with the workers' CPU against their wall.
The machine is shared and noisy: read the ratios measured side by side, not the absolutes.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.update(AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_DEFAULT_REGION="us-east-1")
import calque  # noqa: E402
import calque_core
from bench_pool import start_moto  # noqa: E402
from latency_proxy import start_proxy  # noqa: E402
from common import chosen, warmd_command  # noqa: E402

# ------------------------------------------------------------------------------------------------
SIZES = [int(n) for n in os.environ.get("BENCH_SCALE_SIZES", "10000,100000,1000000").split(",")]   # local run sizes
STREAM_ITEMS = int(os.environ.get("BENCH_STREAM_ITEMS", "2000000"))   # items of the generated stdin stream
CLAIM = 1000                     # items per claim of the local runs
BATCH = 64                       # items per handler call
WORKERS = 2                      # warm workers (this machine has 2 cores)
MOTO_ITEMS, MOTO_CLAIM = int(os.environ.get("BENCH_MOTO_ITEMS", "100000")), 100   # moto staging: 1,000 claims
MOTO_E2E_ITEMS = int(os.environ.get("BENCH_MOTO_E2E_ITEMS", "20000"))            # moto end to end: 200 claims
MODEL_ONLY_ITEMS = int(os.environ.get("BENCH_MODEL_ONLY_ITEMS", "100000"))   # items per model-only process
LATENCY_MS = float(os.environ.get("BENCH_LATENCY_MS", "15"))                  # ms the proxy adds per request
LATENCY_ITEMS = int(os.environ.get("BENCH_LATENCY_ITEMS", "20000"))          # items per latency run (claims of 100)
LATENCY_ROUNDS = 2               # latency runs: pipelining off then on, this many times, per model time
LATENCY_MODEL_MS = [float(ms) for ms in os.environ.get("BENCH_LATENCY_MODEL_MS", "0,50").split(",")]   # per batch
LATENCY_SAMPLE = 0.25            # s between two requests that sample the request latency during a latency run
LATENCY_MODES = {"off": {"PIPELINE": False, "AHEAD": False}, "finisher": {"AHEAD": False},
                 "ahead": {"AHEAD": True}}   # warmd's module constants, set in each worker
SECTIONS = ("local", "stream", "moto", "latency", "memory", "prestaged")
TIMELINE = os.path.join(ROOT, "tests", "handlers.py") + ":Timeline"
DEMO = os.path.join(ROOT, "examples", "demo_model.py")
PLAIN = os.path.join(ROOT, "tests", "handlers.py") + ":Empty"   # a plain-Python handler: no torch, no numpy
WORDS = "batch cost heartbeat pool worker ring manifest claim tensor result drain load cold queue copy".split()
# runs calque.py's main() and, at exit, writes what the submitter's stores listed and requested to $BENCH_OUT;
# on SQS + S3 also each AWS operation it called (a boto3 before-call hook on its clients: S3 ListObjectsV2 pages,
# SQS GetQueueAttributes...), which the backends' coarse counts lump together. With $BENCH_SERIAL it stages as
# calque did before staging was parallel: one store writer, one message a send, one AWS request in flight.
SUBMITTER = """
import atexit, json, os, sys, threading
sys.path.insert(0, {root!r})
import calque
opened, operations = [], calque.Counter()
open_backend = calque.open_backend
serial = os.environ.get("BENCH_SERIAL")
in_flight = threading.Lock()

def opening(*args, **kwargs):
    backend = open_backend(*args, **kwargs)
    for client in (getattr(backend.store, "s3", None), getattr(backend.queues, "sqs", None)):
        if client is not None:
            client.meta.events.register("before-call", lambda model, **_: operations.update([model.name]))
            if serial:   # (a before-call hook that returns a value would stand for the call's answer: None)
                client.meta.events.register("before-call", lambda **_: None if in_flight.acquire() else None)
                client.meta.events.register("after-call", lambda **_: in_flight.release())
                client.meta.events.register("after-call-error", lambda **_: in_flight.release())
    opened.append(backend)
    return backend

calque.open_backend = opening
if serial:
    calque.STORE_WRITERS = calque.SEND_BATCH = 1
atexit.register(lambda: json.dump({{"keys_listed": sum(b.store.keys_listed for b in opened),
    "requests": sum((b.requests for b in opened), calque.Counter()), "operations": operations}},
    open(os.environ["BENCH_OUT"], "w")))
sys.argv = ["calque.py"] + sys.argv[1:]
sys.exit(calque.main())
""".format(root=ROOT)


def item(i):
    """A JSON item of ~100 bytes, deterministic."""
    return {"id": i, "text": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(8 + i % 5))}


def write_items(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(item(i)) + "\n")
    return path


def model_only_rate(path):
    """(items/s, CPU s an item) of WORKERS processes each running DemoModel.predict over MODEL_ONLY_ITEMS parsed
    items, side by side."""
    code = ("import json, sys, time; sys.path.insert(0, {root!r}); sys.path.insert(0, {ex!r}); "
            "from demo_model import DemoModel; m = DemoModel(); m.load(); "
            "items = [json.loads(l) for l in open(sys.argv[1])][:{n}]; "
            "t, c = time.perf_counter(), time.process_time(); "
            "[m.predict(items[i:i + {b}]) for i in range(0, len(items), {b})]; "
            "print(time.perf_counter() - t, time.process_time() - c)"
            ).format(root=ROOT, ex=os.path.dirname(DEMO), n=MODEL_ONLY_ITEMS, b=BATCH)
    procs = [subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True, env=os.environ)
             for _ in range(WORKERS)]
    seconds, cpu = zip(*[map(float, p.communicate()[0].split()) for p in procs])
    return WORKERS * MODEL_ONLY_ITEMS / max(seconds), sum(cpu) / (WORKERS * MODEL_ONLY_ITEMS)


def run_submitter(args, env, stdin=None):
    """Run calque.py with args as a child; returns (wall s, stdout, peak RSS MiB, CPU s, its store counts, start)."""
    out = os.path.join(env["CALQUE_STATE"], "submitter.json")
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        t0, started = time.perf_counter(), time.time()
        proc = subprocess.Popen([sys.executable, "-c", SUBMITTER, *args], env=dict(env, BENCH_OUT=out), cwd=ROOT,
                                stdin=stdin or subprocess.DEVNULL, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)   # not proc.wait(): its rusage is what is measured
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0), stderr.seek(0)
        assert proc.returncode == 0, stderr.read().decode()[-2000:]
        text = stdout.read().decode()
    with open(out) as f:
        counts = json.load(f)
    return wall, text, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, counts, started


def cli(env, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def process_cpu(pids):
    """CPU seconds (user + system) of these live processes, from /proc."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def pool(env, workers, handler=f"{DEMO}:DemoModel"):
    """A demo pool (or one of `handler`) with `workers` warm local workers; their pids."""
    cli(env, "pool", "create", "--model", "demo", "--handler", handler, "--workers", str(workers),
        "--batch-size", str(BATCH))
    backend = calque_core.open_backend(env["CALQUE_STORE"])
    deadline = time.monotonic() + 120
    while len(calque_core.read_worker_stats(backend, "demo")) < workers:
        assert time.monotonic() < deadline, "workers did not get warm"
        time.sleep(0.1)
    return backend, [w["pid"] for w in calque_core.read_worker_stats(backend, "demo")]


def worker_requests(backend, model):
    """{worker id: its request counts} from the pool's worker stats."""
    return {s["worker_id"]: Counter(s["requests"]) for s in calque_core.read_worker_stats(backend, model)}


def requests_until_stopped(env, backend, model, before):
    """The requests the pool's workers made since `before` (worker_requests), read from the stats each writes as it
    stops (pool scale --workers 0): exact, where summaries count each ack as one request. A few idle polls (one
    per worker per CALQUE_POLL_WAIT) are in it."""
    cli(env, "pool", "scale", "--model", model, "--workers", "0")
    total = Counter()
    for worker, counts in worker_requests(backend, model).items():
        total.update(counts)
        total.subtract(before.get(worker, Counter()))
    return sum(total.values())


def at(iso):
    return calque_core._parse_time(iso, "time").timestamp()


def steady_rate(summaries):
    """Items/s between the 10th and the 90th percentile of claim finish times (start-up and tail left out)."""
    ends = sorted((at(s["finished_at"]), s["items"]) for s in summaries)
    lo, hi = len(ends) // 10, len(ends) * 9 // 10
    if hi - lo < 2:
        return None
    return sum(n for _, n in ends[lo + 1:hi + 1]) / (ends[hi][0] - ends[lo][0])


def local_run(tmp, path, n, model_path):
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, f"local-{n}", "store"),
               CALQUE_STATE=os.path.join(tmp, f"local-{n}", "state"), CALQUE_POLL_WAIT="1")
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    backend, pids = pool(env, WORKERS)
    try:
        before, model_cpu = model_only_rate(model_path)
        cpu0 = process_cpu(pids)
        wall, stdout, rss, cpu, counts, t0 = run_submitter(
            ["submit", "--pool", "demo", path, "--claim-size", str(CLAIM), "--json"], env)
        workers_cpu = process_cpu(pids) - cpu0
        after, model_cpu_after = model_only_rate(model_path)
        model_rate = (before + after) / 2
        report = json.loads(stdout)
        summaries, claims = report["summaries"], len(report["run"]["claims"])
        first = min(at(s["started_at"]) for s in summaries) - t0
        steady = steady_rate(summaries)
        model_seconds = sum(s["model_seconds"] for s in summaries) / (WORKERS * n / model_rate)
        print(f"   {n:>9,} items  {claims:>6} claims  model-only {before:,.0f} / {after:,.0f} items/s  "
              f"end to end {n / wall:9,.0f} items/s ({n / wall / model_rate:4.2f}x model-only)  "
              f"steady {'-' if steady is None else f'{steady:9,.0f}'} items/s "
              f"({'-' if steady is None else f'{steady / model_rate:4.2f}x'})  first claim {first:5.2f} s  "
              f"submit RSS {rss:6.0f} MiB  CPU {cpu:6.2f} s ({cpu / max(workers_cpu, 1e-9):.0%} of workers' "
              f"{workers_cpu:.1f} s)  keys listed/claim {counts['keys_listed'] / claims:4.2f}  "
              f"model_seconds {model_seconds:4.2f}x model-only's  CPU an item: model-only "
              f"{(model_cpu + model_cpu_after) * 5e5:.1f} us, workers {workers_cpu / n * 1e6:.1f} us "
              f"({(model_cpu + model_cpu_after) / 2 / (workers_cpu / n):.2f}x)")
    finally:
        cli(env, "pool", "delete", "--model", "demo", "--yes")


def staging_stream(tmp, n):
    """submit --no-wait of a generated stdin stream to a pool with no worker: items/s and peak RSS."""
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, "stream", "store"),
               CALQUE_STATE=os.path.join(tmp, "stream", "state"))
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    cli(env, "pool", "create", "--model", "demo", "--handler", f"{DEMO}:DemoModel", "--workers", "0")
    gen = subprocess.Popen([sys.executable, "-c", "import json, sys; sys.path.insert(0, {!r}); "
                            "from bench_scale import item; w = sys.stdout.write; "
                            "[w(json.dumps(item(i)) + '\\n') for i in range({})]".format(os.path.dirname(__file__), n)],
                           stdout=subprocess.PIPE)
    wall, _, rss, cpu, counts, _ = run_submitter(["submit", "--pool", "demo", "-", "--claim-size", str(CLAIM),
                                                  "--no-wait"], env, stdin=gen.stdout)
    gen.wait()
    print(f"   {n:>9,} items from a generated stdin stream: staged and queued at {n / wall:9,.0f} items/s, "
          f"submit peak RSS {rss:6.0f} MiB, CPU {cpu:.1f} s")


def staging(tmp, path, name, endpoint, serial):
    """`submit --no-wait` of the items at `path` in claims of MOTO_CLAIM to a fresh pool (its own queue) with no
    worker, through `endpoint`, one request at a time if `serial`: (items/s, the submitter's requests a claim, its
    CPU s)."""
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, CALQUE_STORE=f"s3://bench/{name}",
               CALQUE_STATE=os.path.join(tmp, name, "state"), **({"BENCH_SERIAL": "1"} if serial else {}))
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    cli(env, "pool", "create", "--model", name, "--handler", f"{DEMO}:DemoModel", "--workers", "0")
    try:
        wall, _, _, cpu, counts, _ = run_submitter(["submit", "--pool", name, path, "--claim-size", str(MOTO_CLAIM),
                                                    "--no-wait"], env)
    finally:
        cli(env, "pool", "delete", "--model", name, "--yes", "--force")
    return MOTO_ITEMS / wall, sum(counts["requests"].values()) / -(-MOTO_ITEMS // MOTO_CLAIM), cpu


def staging_runs(tmp, path):
    """Staging one request at a time against as shipped, side by side, on each server: moto_server with its stock
    clock, with the cheap one, and the cheap one behind the latency proxy."""
    servers = (("stock clock", True, 0), ("cheap clock", False, 0),
               (f"cheap clock + {LATENCY_MS:g} ms a request", False, LATENCY_MS))
    for i, (label, stock_clock, latency) in enumerate(servers):
        moto = start_moto(stock_clock)
        endpoint, stop = start_proxy(os.environ["AWS_ENDPOINT_URL"], latency) if latency else \
            (os.environ["AWS_ENDPOINT_URL"], lambda: None)
        try:
            serial, _, _ = staging(tmp, path, f"stage{i}-serial", endpoint, serial=True)
            shipped, per_claim, cpu = staging(tmp, path, f"stage{i}-shipped", endpoint, serial=False)
        finally:
            stop()
            moto.terminate()
            moto.wait()
        print(f"   staging {MOTO_ITEMS:,} items, {label + ':':<30} one request at a time {serial:8,.0f} items/s, "
              f"as shipped {shipped:8,.0f} ({shipped / serial:4.1f}x; {per_claim:.2f} requests/claim, submitter CPU "
              f"{cpu:.1f} s)")


def moto_runs(tmp, path_stage, path_e2e):
    staging_runs(tmp, path_stage)
    moto = start_moto()
    try:
        env = dict(os.environ, CALQUE_STORE="s3://bench/scale", CALQUE_STATE=os.path.join(tmp, "moto", "state"))
        os.makedirs(env["CALQUE_STATE"], exist_ok=True)
        e2e = end_to_end(env, path_e2e, MOTO_CLAIM)
        print(f"   end to end {MOTO_E2E_ITEMS:,} items as {e2e['claims']} claims, {WORKERS} workers: "
              f"{e2e['items_per_s']:7,.0f} items/s, {e2e['requests_per_claim']:.2f} requests/claim (workers "
              f"{e2e['worker_requests_per_claim']:.2f} incl. idle polls, submitter "
              f"{e2e['submitter_requests_per_claim']:.2f}: {per_claim(e2e['submitter_operations'], e2e['claims'])}), "
              f"keys listed/claim {e2e['keys_listed_per_claim']:.2f}, submitter CPU {e2e['submitter_cpu']:.1f} s = "
              f"{e2e['submitter_cpu'] / max(e2e['workers_cpu'], 1e-9):.0%} of the workers' {e2e['workers_cpu']:.1f} s")
    finally:
        moto.terminate()
        moto.wait()


def idle_rss(tmp):
    """Resident MiB of a warm worker with a plain-Python handler, idle after one claim of JSON items."""
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, "idle", "store"),
               CALQUE_STATE=os.path.join(tmp, "idle", "state"), CALQUE_POLL_WAIT="1")
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    backend, (pid,) = pool(env, 1, PLAIN)
    try:
        run_submitter(["submit", "--pool", "demo", write_items(os.path.join(tmp, "idle", "items.jsonl"), 1000)], env)
        deadline = time.monotonic() + 60
        while calque_core.read_worker_stats(backend, "demo")[0]["claims"] < 1:   # its stats are written once it is idle
            assert time.monotonic() < deadline, "the worker's stats did not show the claim"
            time.sleep(0.1)
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        print(f"   idle worker, plain-Python handler (tests/handlers.py:Empty), after a claim: {rss:.0f} MiB resident")
    finally:
        cli(env, "pool", "delete", "--model", "demo", "--yes")


def end_to_end(env, path, claim, server_counts=lambda: {}):
    """`submit --pool` of the items at `path` in claims of `claim` to a fresh demo pool of WORKERS warm workers on
    env's store, deleted after: {items, claims, wall, items_per_s, requests a claim (all, workers', submitter's),
    the submitter's AWS operations, keys listed a claim, submitter and workers CPU s, and `server`: what
    server_counts() ({operation: requests}, a counting server's) grew by while submit ran}."""
    backend, pids = pool(env, WORKERS)
    try:
        cpu0, served, before = process_cpu(pids), server_counts(), worker_requests(backend, "demo")
        wall, stdout, _, cpu, counts, _ = run_submitter(["submit", "--pool", "demo", path, "--claim-size", str(claim),
                                                         "--json"], env)
        workers_cpu = process_cpu(pids) - cpu0
        served = {op: n - served.get(op, 0) for op, n in server_counts().items() if n > served.get(op, 0)}
        worker_req = requests_until_stopped(env, backend, "demo", before)
    finally:
        cli(env, "pool", "delete", "--model", "demo", "--yes", "--force")
    report = json.loads(stdout)
    claims = len(report["summaries"])
    sub_req = sum(counts["requests"].values())
    return {"items": report["run"]["items"], "claims": claims, "wall": wall,
            "items_per_s": report["run"]["items"] / wall, "requests_per_claim": (worker_req + sub_req) / claims,
            "worker_requests_per_claim": worker_req / claims, "submitter_requests_per_claim": sub_req / claims,
            "submitter_operations": counts.get("operations", {}),
            "keys_listed_per_claim": counts["keys_listed"] / claims, "submitter_cpu": cpu, "workers_cpu": workers_cpu,
            "server": served}


def per_claim(operations, claims):
    """'PutObject 1.00, GetObject 1.00, ...' : each operation's calls a claim, the most frequent first."""
    return ", ".join(f"{name} {n / claims:.2f}" for name, n in sorted(operations.items(), key=lambda kv: -kv[1]))


def claim_gaps(timeline):
    """Per worker, the seconds from the end of a claim's last handler call to the start of the next claim's first,
    from the Timeline handler's lines ("pid start end first-id count"; claims of MOTO_CLAIM items)."""
    calls = {}
    with open(timeline) as f:
        for line in f:
            pid, start, end, first, _ = line.split()
            calls.setdefault(pid, []).append((float(start), float(end), int(first) // MOTO_CLAIM))
    gaps = []
    for seq in calls.values():
        seq.sort()
        gaps += [b[0] - a[1] for a, b in zip(seq, seq[1:]) if b[2] != a[2]]
    return gaps


def request_latency(url, until=None):
    """Median seconds of one S3 request (a one-key LIST) through the proxy: what one request latency is here. With
    `until` (an Event), one request every LATENCY_SAMPLE s until it is set (the latency under the run's load),
    else 20 back to back."""
    import boto3
    s3 = boto3.client("s3", endpoint_url=url)
    times = []
    while len(times) < 20 if until is None else not until.wait(LATENCY_SAMPLE):
        t0 = time.perf_counter()
        s3.list_objects_v2(Bucket="bench", MaxKeys=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def latency_run(tmp, path, url, mode, model_ms, n):
    """One run of LATENCY_ITEMS Timeline items through 2 fresh workers behind the proxy, pipelining as `mode` of
    LATENCY_MODES says: (items/s, requests per claim, the per-claim gaps in the model's timeline, the median request
    latency during the run)."""
    name = f"latency-{model_ms:g}-{n}-{mode}"
    env = dict(os.environ, AWS_ENDPOINT_URL=url, CALQUE_STORE=f"s3://bench/{name}", TIMELINE_MODEL_MS=str(model_ms),
               CALQUE_STATE=os.path.join(tmp, name, "state"), CALQUE_POLL_WAIT="1",
               TIMELINE_FILE=os.path.join(tmp, name, "timeline"))
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    cli(env, "pool", "create", "--model", "timeline", "--handler", TIMELINE, "--workers", "0",
        "--batch-size", str(BATCH))
    backend = calque_core.open_backend(env["CALQUE_STORE"])
    command = warmd_command("--model", "timeline", constants=LATENCY_MODES[mode])
    workers = [subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(WORKERS)]
    try:
        while len(calque_core.read_worker_stats(backend, "timeline")) < WORKERS:   # each writes them once warm
            time.sleep(0.1)
        before, done = worker_requests(backend, "timeline"), threading.Event()
        with ThreadPoolExecutor(1) as sampler:
            latency = sampler.submit(request_latency, url, done)
            wall, stdout, _, _, counts, _ = run_submitter(["submit", "--pool", "timeline", path, "--claim-size",
                                                           str(MOTO_CLAIM), "--json"], env)
            done.set()
        claims = len(json.loads(stdout)["summaries"])
        stop_workers(workers)   # each writes its stats as it stops
        requests = requests_until_stopped(env, backend, "timeline", before) + sum(counts["requests"].values())
        return LATENCY_ITEMS / wall, requests / claims, claim_gaps(env["TIMELINE_FILE"]), latency.result()
    finally:
        stop_workers(workers)
        cli(env, "pool", "delete", "--model", "timeline", "--yes", "--force")


def stop_workers(workers):
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
            worker.wait()


def latency_runs(tmp, path):
    moto = start_moto()
    url, stop = start_proxy(os.environ["AWS_ENDPOINT_URL"], LATENCY_MS)
    try:
        print(f"   one request through the proxy, idle: {request_latency(url) * 1e3:.1f} ms median "
              f"(+{LATENCY_MS:g} ms injected)")
        for model_ms, n in ((ms, n) for ms in LATENCY_MODEL_MS for n in range(LATENCY_ROUNDS)):
            for mode in LATENCY_MODES:
                rate, per_claim, gaps, latency = latency_run(tmp, path, url, mode, model_ms, n)
                gap, p90 = statistics.median(gaps), statistics.quantiles(gaps, n=10)[8]
                print(f"   model {model_ms:g} ms/batch, pipelining {mode:<8}  "
                      f"{rate:7,.0f} items/s  "
                      f"{per_claim:5.2f} requests/claim  gap between claims: median {gap * 1e3:6.1f} ms "
                      f"(p90 {p90 * 1e3:6.1f}, {len(gaps)} gaps) = {gap / latency:4.2f} request latencies of "
                      f"{latency * 1e3:.1f} ms (the median during the run)")
    finally:
        stop()
        moto.terminate()
        moto.wait()


def prestaged_run(tmp, path, n, model_path):
    """The largest local run again with the submitter out of the way: staged (`submit --no-wait`) to a pool of no
    worker, then `pool scale --workers WORKERS`, timed to the last summary. Per claim, from the summaries: its time,
    the model's, the rest inside the claim, and the gap to the worker's next claim; and the workers' CPU against
    their wall since warm (near 1: the time around the model is their CPU, not waiting)."""
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, "prestaged", "store"),
               CALQUE_STATE=os.path.join(tmp, "prestaged", "state"), CALQUE_POLL_WAIT="1")
    os.makedirs(env["CALQUE_STATE"], exist_ok=True)
    backend, _ = pool(env, 0)
    try:
        before, _ = model_only_rate(model_path)
        run_submitter(["submit", "--pool", "demo", path, "--claim-size", str(CLAIM), "--no-wait"], env)
        (run_id,) = os.listdir(os.path.join(env["CALQUE_STORE"], "runs"))
        t0 = time.monotonic()
        cli(env, "pool", "scale", "--model", "demo", "--workers", str(WORKERS))
        while len(calque_core.read_worker_stats(backend, "demo")) < WORKERS:   # each writes its stats once warm
            time.sleep(0.05)
        pids = [w["pid"] for w in calque_core.read_worker_stats(backend, "demo")]
        cpu0, warm = process_cpu(pids), time.monotonic()
        while len(calque_core.list_summaries(backend, run_id)) < -(-n // CLAIM):   # names only: reading every
            time.sleep(0.1)                             # summary each poll took ~1/4 of a core from the workers
        wall, workers_cpu, busy = time.monotonic() - t0, process_cpu(pids) - cpu0, time.monotonic() - warm
        after, _ = model_only_rate(model_path)
        summaries = calque_core.read_summaries(backend, run_id)
    finally:
        cli(env, "pool", "delete", "--model", "demo", "--yes", "--force")
    model_rate = (before + after) / 2
    claims = {}
    for s in summaries:
        claims.setdefault(s["worker_id"], []).append((at(s["started_at"]), at(s["finished_at"])))
    gaps = [b[0] - a[1] for seq in claims.values() for a, b in zip(sorted(seq), sorted(seq)[1:])]
    claim_ms = statistics.mean(s["claim_seconds"] for s in summaries) * 1e3
    model_ms = statistics.mean(s["model_seconds"] for s in summaries) * 1e3
    print(f"   {n:>11,} items pre-staged, then {WORKERS} workers: {n / wall:9,.0f} items/s from `pool scale` "
          f"({n / wall / model_rate:.2f}x model-only {model_rate:,.0f}), steady {steady_rate(summaries):9,.0f} "
          f"({steady_rate(summaries) / model_rate:.2f}x); a claim {claim_ms:.1f} ms: model {model_ms:.1f}, the rest "
          f"{claim_ms - model_ms:.1f}, then {statistics.median(gaps) * 1e3:.1f} ms to the next; workers' CPU "
          f"{workers_cpu:.1f} s in {busy:.1f} s of wall since warm ({workers_cpu / busy / WORKERS:.2f} of each core)")


def main():
    sections = chosen(SECTIONS)
    tmp = tempfile.mkdtemp(prefix="calque-bench-scale-")
    os.environ["DEMO_CACHE"] = os.path.join(tmp, "demo-weights")
    print(f"calque bench, scale  ({os.cpu_count()} cores, python {sys.version.split()[0]}); demo model, batch {BATCH}, "
          f"{WORKERS} workers")
    paths = {}
    if "local" in sections:
        paths = {n: write_items(os.path.join(tmp, f"items-{n}.jsonl"), n)
                 for n in sorted(set(SIZES + [MODEL_ONLY_ITEMS]))}
        print(f"\n1. local backend, claims of {CLAIM}; model-only: {WORKERS} processes, predict alone, before / after")
        for n in SIZES:
            local_run(tmp, paths[n], n, paths[MODEL_ONLY_ITEMS])
    if "stream" in sections:
        print("\n2. staging alone, local backend, claims of 1000, no worker")
        staging_stream(tmp, STREAM_ITEMS)
    for n in (MOTO_ITEMS, MOTO_E2E_ITEMS, LATENCY_ITEMS):
        paths[n] = paths.get(n) or write_items(os.path.join(tmp, f"items-{n}.jsonl"), n)
    if "moto" in sections:
        print(f"\n3. moto_server, claims of {MOTO_CLAIM}")
        moto_runs(tmp, paths[MOTO_ITEMS], paths[MOTO_E2E_ITEMS])
    if "latency" in sections:
        print(f"\n4. moto_server behind a proxy adding {LATENCY_MS:g} ms per request: {LATENCY_ITEMS:,} items as "
              f"claims of {MOTO_CLAIM}, {WORKERS} workers of the Timeline handler, batch {BATCH}")
        latency_runs(tmp, paths[LATENCY_ITEMS])
    if "memory" in sections:
        print("\n5. memory")
        idle_rss(tmp)
    if "prestaged" in sections:
        print("\n6. local backend, the largest run size staged first, so that the submitter is idle while workers run")
        paths = {n: paths.get(n) or write_items(os.path.join(tmp, f"items-{n}.jsonl"), n)
                 for n in {max(SIZES), MODEL_ONLY_ITEMS}}
        prestaged_run(tmp, paths[max(SIZES)], max(SIZES), paths[MODEL_ONLY_ITEMS])


if __name__ == "__main__":
    main()
