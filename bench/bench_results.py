"""make bench, part 4: typed results. The same 50,000 embeddings of 256 float32 stored by calque as binary (a
handler returning the batch's [B, 256] array) and as JSON lists (the same values returned as lists, what calque
stored before typed results): bytes stored per item against the raw 1,024, and the time to read them back,
side by side, per format. First, what a worker spends writing one claim's part either way (in process).

    .venv/bin/python bench/bench_results.py            # BENCH_RESULT_ITEMS=50000 by default
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import compile_kit  # noqa: E402
import calque  # noqa: E402
import calque_core

ITEMS = int(os.environ.get("BENCH_RESULT_ITEMS", "50000"))   # embeddings per run
TRIALS = int(os.environ.get("BENCH_RESULT_TRIALS", "3"))     # times each is measured (the median is printed)
HANDLER = os.path.join(ROOT, "tests", "handlers.py") + ":Embeddings"
RAW = 256 * 4                                                # bytes of one float32 embedding


def hide_pandas(tmp, env):
    """env with pandas unimportable, as in a runtime install (requirements.txt has no pandas): pyarrow imports pandas
    where it is installed, at its first conversion, which a command then pays."""
    os.makedirs(os.path.join(tmp, "nopandas", "pandas"), exist_ok=True)
    with open(os.path.join(tmp, "nopandas", "pandas", "__init__.py"), "w") as f:
        f.write('raise ImportError("hidden by bench_results.py")\n')
    return dict(env, PYTHONPATH=os.path.join(tmp, "nopandas") + os.pathsep + env["PYTHONPATH"])


def cli(env, *args, out=subprocess.DEVNULL):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=ROOT, stdout=out,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"calque {' '.join(args)}: {done.stderr}")


def timed(fn):
    """Median wall seconds of TRIALS calls of fn."""
    times = []
    for _ in range(TRIALS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stored_bytes(store, run_id):
    folder = os.path.join(store, "runs", run_id, "results")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def one_run(tmp, kind):
    """(env, run id) of ITEMS embeddings run by a one-worker pool returning them as `kind` (binary or json)."""
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, "store"), CALQUE_STATE=os.path.join(tmp, "state"),
               CALQUE_ENV=os.path.join(tmp, "none.env"), PYTHONPATH=ROOT,
               EMBED_AS="json" if kind == "json" else "array")
    items = os.path.join(tmp, "items.jsonl")
    if not os.path.exists(items):
        with open(items, "w") as f:
            f.writelines(f'{{"x": {k}}}\n' for k in range(ITEMS))
    cli(env, "pool", "create", "--model", kind, "--handler", HANDLER, "--workers", "1")
    cli(env, "submit", "--pool", kind, items, "--no-wait", out=open(os.path.join(tmp, kind), "w"))
    run_id = open(os.path.join(tmp, kind)).read().strip()
    run = calque.Run(run_id, store=env["CALQUE_STORE"])
    run.wait(timeout=3600)
    cli(env, "pool", "delete", "--model", kind, "--yes")
    return env, run


def write_cost(claim=1000, batch=32):
    """Median ms a worker spends turning one claim's handler returns into its part's bytes (warmd.format_outcome
    per batch, calque.encode_part at the commit): the batch's [B, 256] array, against the same rows as lists."""
    import numpy as np
    import warmd
    rows = np.random.default_rng(0).standard_normal((claim, 256), np.float32)
    ways = {"binary (.npz)": [rows[b:b + batch] for b in range(0, claim, batch)],    # what the handlers return
            "json (.jsonl)": [rows[b:b + batch].tolist() for b in range(0, claim, batch)]}
    for name, returns in ways.items():
        def one_claim():
            chunks = []
            for k, returned in enumerate(returns):
                outcome = [(True, r) for r in calque_core.batch_rows(returned, len(returned))]
                chunks += warmd.format_outcome(outcome, k * batch)[0]
            return calque_core.encode_part(chunks)
        print(f"  write one claim of {claim} x 256 float32, {name}: {timed(one_claim) * 1000:.1f} ms "
              f"({len(one_claim()[1]) / claim:,.0f} bytes an item)")


def main():
    compile_kit()
    write_cost()
    with tempfile.TemporaryDirectory() as tmp:
        binary_env, binary = one_run(tmp, "binary")
        json_env, as_json = one_run(tmp, "json")
        store = binary_env["CALQUE_STORE"]
        out = os.path.join(tmp, "out")
        rows = []
        for name, env, run in (("binary", binary_env, binary), ("json", json_env, as_json)):
            size = stored_bytes(store, run.run_id) / ITEMS
            import numpy as np
            assert run.to_numpy().shape == (ITEMS, 256)
            rows.append((name, size, {
                "Run.to_numpy()": timed(run.to_numpy),
                "Run.results() -> numpy": timed(lambda: np.array([r["result"] for r in run.results()], np.float32)),
                "runs results --format parquet": timed(lambda: cli(hide_pandas(tmp, env), "runs", "results",
                                                                   run.run_id, "--format", "parquet", "--output",
                                                                   out + ".parquet")),
                "the same, pandas installed": timed(lambda: cli(env, "runs", "results", run.run_id, "--format",
                                                                "parquet", "--output", out + ".parquet")),
                "runs results --format npy": timed(lambda: cli(env, "runs", "results", run.run_id, "--format", "npy",
                                                               "--output", out + ".npy")),
                "runs results (JSONL)": timed(lambda: cli(env, "runs", "results", run.run_id)),
            }))
        assert (binary.to_numpy() == as_json.to_numpy()).all(), "the two runs' embeddings differ"
        print(f"typed results: {ITEMS:,} embeddings of 256 float32, one local worker, claims of "
              f"{binary.record['claim_size']}; median of {TRIALS} reads (a command: its process start included)")
        print(f"  {'stored as':<10} {'bytes/item':>10} {'x raw':>6}   " + "  ".join(f"{k:>29}" for k in rows[0][2]))
        for name, size, reads in rows:
            print(f"  {name:<10} {size:>10,.0f} {size / RAW:>6.2f}   " +
                  "  ".join(f"{seconds:>28.2f}s" for seconds in reads.values()))
        print("  binary against json: " + ", ".join(f"{k} {rows[1][2][k] / v:.1f}x faster"
                                                   for k, v in rows[0][2].items()))


if __name__ == "__main__":
    main()
