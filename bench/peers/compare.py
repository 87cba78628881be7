"""make bench-peers: calque against Celery 5.x on the same moto_server, side by side in one run.

    make bench-peers                                            # 100,000 items as 1,000 claims / tasks of 100
    BENCH_PEER_ITEMS=20000 PEERS_PY=.venv-peers/bin/python .venv/bin/python bench/peers/compare.py
    BENCH_PEER_DELAY_MS=15 make bench-peers                     # both behind bench/latency_proxy.py, 15 ms a request

One moto_server (bench/peers/moto_counted.py: it counts every request it serves, by operation) holds both runs:
1. calque: a demo pool of 2 warm workers (bench/bench_scale.py's end_to_end), then `calque.py submit --pool` of
   the items file in claims of 100, a child process timed whole (wall and CPU, interpreter start included);
2. Celery: 2 workers (bench/peers/celery_peer.py workers, `--pool solo` each, the demo model loaded before they
   say ready), then its client (celery_peer.py client: send a task per 100 items, join the results), a child
   process timed whole the same way, run by PEERS_PY (the .venv-peers interpreter).
Each prints items/s (items over the submitting process's wall), requests per claim or task (everything the
server served while the submitter or client ran: workers' polls included), and the submitter's or client's CPU
against its workers'. Then the ratio calque / Celery, for each of BENCH_PEER_ROUNDS pairs (2; the order swapped
in each). With BENCH_PEER_DELAY_MS, both talk to the server through
bench/latency_proxy.py (`--upstream URL --delay-ms N --port P`), which must exist.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.update(AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_DEFAULT_REGION="us-east-1")
import bench_scale  # noqa: E402

# ------------------------------------------------------------------------------------------------
ITEMS = int(os.environ.get("BENCH_PEER_ITEMS", "100000"))         # items of each run
CLAIM = 100                                                        # items per claim (calque) and per task (Celery)
PEERS_PY = os.environ.get("PEERS_PY", os.path.join(ROOT, ".venv-peers", "bin", "python"))   # Celery's interpreter
DELAY_MS = int(os.environ.get("BENCH_PEER_DELAY_MS", "0"))       # ms the latency proxy adds a request (0: none)
ROUNDS = int(os.environ.get("BENCH_PEER_ROUNDS", "2"))           # calque-Celery pairs, the order swapped each round
START_WAIT = 30                                                    # s a server may take to accept connections


def serve(args):
    """Start a server process on a free port; (process, its URL) once it accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*args, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_WAIT
    while True:
        try:
            urllib.request.urlopen(url + "/_bench/counts", timeout=1).close()   # moto_counted's; a proxy passes it on
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"compare: {args[1]} did not start")
            time.sleep(0.1)


def counter(url):
    """A function that reads the counting server's {operation: requests}."""
    return lambda: json.load(urllib.request.urlopen(url + "/_bench/counts", timeout=10))


def timed(args, env):
    """Run args as a child: (wall s, CPU s, stdout), measured by wait4 as bench/bench_scale.py measures submit."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        if os.waitstatus_to_exitcode(status):
            sys.exit(f"compare: {args[1]} failed: {err.read().decode()[-2000:]}")
        return wall, usage.ru_utime + usage.ru_stime, out.read().decode()


def celery_run(endpoint, path, counts, queue):
    """The Celery side: 2 warm workers, then the timed client; its figures as end_to_end's are. A queue of its own
    each run: a stopped worker's long poll lives on in moto_server for up to 20 s, and a task sent to its queue
    then goes to that dead poll and stays invisible for the visibility timeout (60 s): a Celery run right after
    another took 65-71 s instead of 11-18 before each had its own queue."""
    peer, env = os.path.join(HERE, "celery_peer.py"), dict(os.environ, PEER_QUEUE=queue)
    workers = subprocess.Popen([PEERS_PY, peer, "workers", "--endpoint", endpoint, "--workers",
                                str(bench_scale.WORKERS)], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(workers.stdout.readline())["pids"]
        cpu0, served = bench_scale.process_cpu(pids), counts()
        wall, cpu, stdout = timed([PEERS_PY, peer, "client", "--endpoint", endpoint, "--items", path, "--task-size",
                                   str(CLAIM)], env)
        workers_cpu = bench_scale.process_cpu(pids) - cpu0
        served = {op: n - served.get(op, 0) for op, n in counts().items() if n > served.get(op, 0)}
    finally:
        workers.stdin.close()
        workers.wait()
    done = json.loads(stdout)
    assert done["items"] == ITEMS and not done["failed"], done
    return {"items": ITEMS, "claims": done["tasks"], "wall": wall, "items_per_s": ITEMS / wall,
            "submitter_cpu": cpu, "workers_cpu": workers_cpu, "server": served}


def line(name, run, unit, client):
    """One system's figures: items/s, requests a claim or task (by operation), its client's CPU."""
    per, total = run["claims"], sum(run["server"].values())
    return (f"   {name:<7} {run['items_per_s']:8,.0f} items/s ({run['wall']:.1f} s)  {total / per:5.2f} requests a "
            f"{unit} ({bench_scale.per_claim(run['server'], per)})  {client} CPU {run['submitter_cpu']:.1f} s = "
            f"{run['submitter_cpu'] / max(run['workers_cpu'], 1e-9):.0%} of its workers' {run['workers_cpu']:.1f} s")


def main():
    tmp = tempfile.mkdtemp(prefix="calque-bench-peers-")
    os.environ["DEMO_CACHE"] = os.path.join(tmp, "demo-weights")
    path = bench_scale.write_items(os.path.join(tmp, f"items-{ITEMS}.jsonl"), ITEMS)
    moto, moto_url = serve([sys.executable, os.path.join(HERE, "moto_counted.py")])
    servers, endpoint = [moto], moto_url
    try:
        if DELAY_MS:
            proxy, endpoint = serve([sys.executable, os.path.join(ROOT, "bench", "latency_proxy.py"), "--upstream",
                                     moto_url, "--delay-ms", str(DELAY_MS)])
            servers.append(proxy)
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        import boto3
        for bucket in ("bench", "peers"):
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        counts = counter(moto_url)
        print(f"calque bench, peers  ({os.cpu_count()} cores); demo model, {ITEMS:,} items of ~100 B as "
              f"{-(-ITEMS // CLAIM):,} claims / tasks of {CLAIM}, {bench_scale.WORKERS} workers each, one "
              f"moto_server{f' behind a {DELAY_MS} ms latency proxy' if DELAY_MS else ''}")
        for round_ in range(ROUNDS):   # calque first, then Celery first: a neighbour's load falls on both alike
            env = dict(os.environ, CALQUE_STORE=f"s3://bench/peers{round_}",
                       CALQUE_STATE=os.path.join(tmp, f"calque-state-{round_}"))
            os.makedirs(env["CALQUE_STATE"])
            runs = {}
            for name in (("calque", "Celery") if round_ % 2 == 0 else ("Celery", "calque")):
                if name == "calque":
                    runs[name] = bench_scale.end_to_end(env, path, CLAIM, counts)
                    print(line("calque", runs[name], "claim", "submitter"), flush=True)
                else:
                    runs[name] = celery_run(endpoint, path, counts, f"calque-peer-{round_}")
                    print(line("Celery", runs[name], "task", "client"), flush=True)
            ratio = runs["calque"]["items_per_s"] / runs["Celery"]["items_per_s"]
            print(f"   round {round_ + 1}: calque / Celery {ratio:.2f}x items/s", flush=True)
    finally:
        for server in reversed(servers):
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
