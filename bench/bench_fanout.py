"""Calls fanned out from a worker against the same calls from the entrypoint, side by side in one
`calque modal run` on the embedded backend: an app's function (on its own pool) maps N calls onto a
class's pool, and the entrypoint maps the same N calls onto the same pool, warm, rounds
interleaved; the ratio of their rates (goal: >= 0.9x).

    .venv/bin/python bench/bench_fanout.py   # ~15 s; BENCH_FANOUT_CALLS, _ROUNDS, _WORKERS

Each path is timed where it makes the call: the entrypoint around its .map, the worker's function
around its own (not counting the .remote that carries it there). A call is a cheap method (a sum),
so the figures are the calls' overhead: staging, claims, the worker's loop, results back.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from common import compile_kit  # noqa: E402

CALLS = int(os.environ.get("BENCH_FANOUT_CALLS", "1000"))    # calls a path a round
ROUNDS = int(os.environ.get("BENCH_FANOUT_ROUNDS", "15"))     # rounds, each path once a round
WORKERS = int(os.environ.get("BENCH_FANOUT_WORKERS", "2"))   # the class pool's workers (--workers)
APP = '''
import json
import time
import modal

app = modal.App("fanout-bench")


@app.cls()
class Model:
    @modal.method()
    def score(self, x):
        return x * 2 + 1


@app.function()
def fan(n):
    """The worker's path: n calls mapped from here; seconds they took, and their sum (checked)."""
    start = time.perf_counter()
    total = sum(Model().score.map(range(n)))
    return [time.perf_counter() - start, total]


@app.local_entrypoint()
def main(calls: int = 1000, rounds: int = 3):
    list(Model().score.map(range(8)))   # both pools warm before anything is timed
    fan.remote(8)
    out = {"entrypoint": [], "worker": []}
    for _ in range(rounds):
        start = time.perf_counter()
        total = sum(Model().score.map(range(calls)))
        out["entrypoint"].append([time.perf_counter() - start, total])
        out["worker"].append(fan.remote(calls))
    print(json.dumps(out))
'''


def main():
    compile_kit()
    folder = tempfile.mkdtemp(prefix="bench-fanout-")
    with open(os.path.join(folder, "app.py"), "w") as f:
        f.write(APP)
    env = dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"),
               CALQUE_STATE=os.path.join(folder, "state"),
               CALQUE_ENV=os.path.join(folder, "none.env"))
    argv = [sys.executable, os.path.join(ROOT, "calque.py"), "modal", "run", "app.py", "--calls",
            str(CALLS), "--rounds", str(ROUNDS), "--workers", str(WORKERS)]
    out = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"bench_fanout: modal run failed:\n{out.stderr}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = sum(x * 2 + 1 for x in range(CALLS))
    assert all(total == want for path in got.values() for _, total in path), got
    print(f"{CALLS} calls mapped onto one pool of {WORKERS} local workers, {ROUNDS} rounds "
          "interleaved (median)")
    print(f"{'from':<12} {'seconds':>8} {'calls/s':>9}")
    median = {path: statistics.median(s for s, _ in runs) for path, runs in got.items()}
    for path, seconds in median.items():
        print(f"{path:<12} {seconds:>8.3f} {CALLS / seconds:>9.0f}")
    ratio = median["entrypoint"] / median["worker"]
    print(f"worker / entrypoint rate: {ratio:.2f}x (goal >= 0.9x)")


if __name__ == "__main__":
    main()
