"""make bench, part 4: pools that size themselves, and the planner against what a run does.

    .venv/bin/python bench/bench_autoscale.py            # BENCH_AUTOSCALE_PAIRS (2) pairs of each
1. a burst of 40 claims (tests/handlers.py:Matmul, 100 rows of 1024 a claim, 40 products of 1024 x 1024 a
   batch: about a second a claim here) on a fixed 2-worker pool against a pool of
   --min-workers 0 --max-workers 2: seconds from `pool create` to the run's last summary, start-up and @enter
   included in both, in alternating pairs; the ratio fixed / sized (>= 0.95 is the goal), and the seconds from
   the last summary until the sized pool's supervisor scales to 0 and until its last worker has exited,
   against its idle window (--scale-to-zero-after 0.25: 15 s);
2. the planner: a pool that has run the job before, once at 1 worker and once at 2 (on shared cores
   a claim's time depends on how many workers run beside it), each once its workers were warm; then
   `submit --plan --yes` of it at 2 workers, at 1, and from 0 on the pool turned into --min-workers 0
   --max-workers 2 (`pool scale`) once it idled to 0: predicted wall time against the run's actual
   (created_at to the last summary), with how far the run's own seconds an item moved from the measured
   one and the prediction at that speed (the planner's model alone). The demo model: BENCH_PLAN_ITEMS
   (240,000) items of 300 words in claims of 500 (11-34 s a run here); examples/embed_model.py: a
   hundredth of them, in claims of 50.
The machine is shared and noisy: read the ratios measured side by side, not the absolutes.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import calque
import calque_core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PAIRS = int(os.environ.get("BENCH_AUTOSCALE_PAIRS", "2"))
PLAN_ITEMS = int(os.environ.get("BENCH_PLAN_ITEMS", "240000"))
IDLE_MINUTES = 0.25
WORDS = " ".join(f"word{i}" for i in range(300))
# (name, handler, item maker, items divisor, claim size): the embedding model is ~40x the demo's per item
MODELS = [("demo", "examples/demo_model.py:DemoModel", lambda i: {"text": f"{i} {WORDS}"}, 1, 500)]
if os.path.exists(os.path.join(ROOT, "examples", "embed_model.py")):
    MODELS.append(("embed", "examples/embed_model.py:EmbedModel", lambda i: {"text": f"{i} {WORDS[:400]}"}, 100, 50))


def cli(env, *args, check=True):
    out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    if check and out.returncode != 0:
        raise SystemExit(f"calque {' '.join(args)} failed: {out.stderr[-2000:]}")
    return out


def fresh_env(folder):
    return dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"), CALQUE_STATE=os.path.join(folder, "state"),
                CALQUE_ENV=os.path.join(folder, "none.env"), CALQUE_POLL_WAIT="1", DEMO_THREADS="1",
                DEMO_CACHE=os.path.join(tempfile.gettempdir(), "calque-bench-demo-weights"))


def items_file(folder, count, make):
    path = os.path.join(folder, f"items-{count}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(make(i)) + "\n" for i in range(count))
    return path


def finished(env, run_id):
    """(s from the run's created_at to its last summary, the summaries)."""
    show = json.loads(cli(env, "runs", "show", run_id, "--json").stdout)
    ended = max(calque_core._parse_time(s["finished_at"], "f") for s in show["summaries"])
    return (ended - calque_core._parse_time(show["run"]["created_at"], "c")).total_seconds(), show["summaries"]


def scale_to(env, name, workers):
    """`pool scale` to a fixed count, then wait until that many workers are warm: claims measured beside
    a worker still starting (its imports take a core) would time the start-up, not the pool."""
    cli(env, "pool", "scale", "--model", name, "--workers", str(workers))
    status = os.path.join(env["CALQUE_STATE"], "pools", name, "supervisor.json")
    while sum(bool(w["pid"] and w["warm"]) for w in json.load(open(status))["workers"]) != workers:
        time.sleep(0.2)


def burst(sized):
    """Seconds from pool create to the last summary of 40 claims; for the sized pool also the seconds from then
    until it scales to 0 and until its last worker is gone."""
    import numpy
    with tempfile.TemporaryDirectory() as folder:
        env = dict(fresh_env(folder), MATMUL_REPEATS="40")
        items = os.path.join(folder, "rows.npy")
        numpy.save(items, numpy.random.default_rng(0).random((4000, 1024), dtype=numpy.float32))
        flags = ["--min-workers", "0", "--max-workers", "2", "--scale-to-zero-after", str(IDLE_MINUTES)] if sized \
            else ["--workers", "2"]
        started = time.time()
        cli(env, "pool", "create", "--model", "m", "--handler", "tests/handlers.py:Matmul", *flags)
        run = json.loads(cli(env, "submit", "--pool", "m", items, "--claim-size", "100", "--json").stdout)
        import calque
        last = max(calque_core._parse_time(s["finished_at"], "f") for s in run["summaries"]).timestamp()
        first = min(calque_core._parse_time(s["started_at"], "s") for s in run["summaries"]).timestamp()
        assert all(s["receive_count"] == 1 for s in run["summaries"]) and len(run["summaries"]) == 40
        with open(os.path.join(env["CALQUE_STATE"], "pools", "m", "supervisor.json")) as f:
            spawned = [(w["started_at"] - started, w["threads"]) for w in json.load(f)["workers"]]
        back = None
        if sized:   # the supervisor's status file: its count, and the workers still alive
            decided = None
            while True:
                with open(os.path.join(env["CALQUE_STATE"], "pools", "m", "supervisor.json")) as f:
                    status = json.load(f)
                if status["desired"] == 0 and decided is None:
                    decided = time.time() - last
                if decided is not None and not any(w["pid"] for w in status["workers"]):
                    back = (decided, time.time() - last)
                    break
                time.sleep(0.05)
        cli(env, "pool", "delete", "--model", "m", "--yes")
        return last - started, back, first - started, spawned


def planner(name, handler, make, divisor, claim_size):
    """Predicted against actual wall time of `submit --plan --yes` at 2 workers, then 1, after a run
    of the same items at each count; then on a pool of --min-workers 0 --max-workers 2 at 0 workers
    (the prediction includes its workers' start-up and @enter)."""
    with tempfile.TemporaryDirectory() as folder:
        env = fresh_env(folder)
        if name == "embed":   # its random-weight model, built here as its README says
            env.update(EMBED_MODEL_DIR=os.path.join(folder, "embed-model"), HF_HUB_OFFLINE="1")
            subprocess.run([PY, os.path.join(ROOT, "examples", "make_embed_model.py"), env["EMBED_MODEL_DIR"]],
                           check=True, capture_output=True)
        size, items = str(claim_size), items_file(folder, PLAN_ITEMS // divisor, make)
        cli(env, "pool", "create", "--model", name, "--handler", handler, "--workers", "2")
        for workers in (1, 2):
            scale_to(env, name, workers)
            cli(env, "submit", "--pool", name, items, "--claim-size", size)
        rows = []
        for workers in (2, 1, 0):
            if workers:
                scale_to(env, name, workers)
            else:   # the same pool sizing itself, at 0 when the run comes (its workers' stats kept)
                cli(env, "pool", "scale", "--model", name, "--min-workers", "0", "--max-workers",
                    "2", "--scale-to-zero-after", str(IDLE_MINUTES))
                status = os.path.join(env["CALQUE_STATE"], "pools", name, "supervisor.json")
                while any(w["pid"] for w in json.load(open(status))["workers"]):
                    time.sleep(0.2)
            plan = json.loads(cli(env, "plan", "--pool", name, items, "--claim-size", size, "--json").stdout)
            out = cli(env, "submit", "--pool", name, items, "--claim-size", size, "--plan", "--yes",
                      "--json")
            run = json.loads(out.stdout)["run"]
            actual, summaries = finished(env, run["run_id"])
            predicted, count = run["plan"]["seconds"], run["plan"]["count"]
            # a miss split in two: how far the run's own seconds an item moved from the measured one, and
            # the prediction scaled by that move (the planner's model given the run's own speed)
            drift = calque_core.measured_seconds(summaries)[1] / plan["options"][count - 1]["seconds_per_item"] - 1
            rows.append((workers, predicted, actual))
            print(f"  {name:<6} {count} worker(s){' from 0' if not workers else ''}: predicted "
                  f"{predicted:6.2f} s, actual {actual:6.2f} s ({(predicted - actual) / actual:+.1%}); the run's "
                  f"s an item {drift:+.1%} from the measured, the prediction at it "
                  f"{predicted * (1 + drift) / actual - 1:+.1%}; load {os.getloadavg()[0]:.1f}", flush=True)
        cli(env, "pool", "delete", "--model", name, "--yes")
        return rows


def main():
    print(f"1. a burst of 40 claims: fixed 2 workers against --min-workers 0 --max-workers 2 ({PAIRS} pairs)")
    for pair in range(PAIRS):
        order = (False, True) if pair % 2 == 0 else (True, False)
        result = {sized: burst(sized) for sized in order}
        fixed, _, fixed_first, _ = result[False]
        sized, back, sized_first, spawned = result[True]
        print(f"  pair {pair + 1} ({'fixed' if pair % 2 == 0 else 'sized'} first): fixed {fixed:6.2f} s (first claim "
              f"at {fixed_first:.1f} s), sized {sized:6.2f} s (at {sized_first:.1f} s): {fixed / sized:.2f}x; after "
              f"the last claim: scaled to 0 at {back[0]:.1f} s, every worker gone at {back[1]:.1f} s (idle window "
              f"{IDLE_MINUTES * 60:.0f} s); sized workers started at "
              f"{', '.join(f'{at:.1f} s ({threads} threads)' for at, threads in spawned)}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"2. the planner: predicted against actual wall time, {PLAN_ITEMS:,} items in claims of 500 (the "
          f"embedding model: a hundredth of them, in claims of 50)")
    for model in MODELS:
        planner(*model)
    if len(MODELS) == 1:
        print("  (examples/embed_model.py is not in this tree: not measured)")


if __name__ == "__main__":
    main()
