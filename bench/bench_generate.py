"""make bench, part 5: expensive items on defaults (issue 35): text generation with HF generate.

    .venv/bin/python bench/bench_generate.py            # both sections
    .venv/bin/python bench/bench_generate.py sizes      # or tail

examples/generate_model.py (a random-weight 4 x 128 GPT-2 and a BPE tokenizer trained here, built by
examples/make_generate_model.py; left padding, greedy generate of GENERATE_NEW_TOKENS tokens, batches of 32) over
PROMPTS prompts of 5-40 words, on a warm pool of 2 local workers (one torch thread each: they share the cores).
1. sizes: at each run size, side by side in one run: the limit for two workers (two plain loops in parallel, each
   on half the prompts, one torch thread each: the slower one's seconds, model loaded before the clock), calque
   on defaults (claims sized to the run and the pool, which has measured one warm-up run), and calque at each
   --claim-size of SWEEP (the best of them is what a user tuning by hand gets). A calque run is timed in-process
   from submit() to wait() (no CLI start); ratios are limit seconds / calque seconds.
2. tail: RUN_TAIL prompts on defaults, a worker killed -9 holding a claim once TAIL_AT of the items are done, on a
   pool whose visibility timeout is TAIL_VISIBILITY s: the seconds from the kill to the run's end when the claim
   waits out its timeout (its receipts file emptied before the kill: the kit before issue 35) against the
   supervisor releasing it at once.
The machine is shared and noisy: read the ratios measured side by side, not the absolutes.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from common import chosen, compile_kit  # noqa: E402
import calque_core
import calque_supervisor

# ------------------------------------------------------------------------------------------------
PROMPTS = (300, 1200, 6000)       # run sizes (the 300 and 1,200, and a longer one)
SWEEP = (10, 25, 32, 64, 100, 400, 1000)   # --claim-size values a user might pick by hand (1000: the old default)
WARM_UP = 64                      # prompts of the run that warms the pool and measures it, first
BATCH = 32                        # items per generate call (calque's default batch size), in the loops too
NEW_TOKENS = "24"                 # max_new_tokens (GENERATE_NEW_TOKENS)
RUN_TAIL = 1200                   # prompts of the tail section's runs
TAIL_AT = 0.7                     # share of its items done when a worker is killed
TAIL_VISIBILITY = 15              # s: that pool's visibility timeout (the default is 60)
SECTIONS = ("sizes", "tail")
HANDLER = os.path.join(ROOT, "examples", "generate_model.py") + ":GenerateModel"
PY = sys.executable
# one plain loop on a file of prompts: the model loaded, then the clock runs over the batches
LOOP = """
import json, sys, time, torch
sys.path.insert(0, {examples!r})
torch.set_num_threads(1)
from generate_model import GenerateModel
model = GenerateModel()
model.load()
items = [json.loads(line) for line in open(sys.argv[1])]
t0 = time.perf_counter()
out = [t for i in range(0, len(items), {batch}) for t in model.generate(items[i:i + {batch}])]
print(time.perf_counter() - t0)
""".format(examples=os.path.join(ROOT, "examples"), batch=BATCH)


def limit(tmp, prompts):
    """The two-loop limit: each half of `prompts` in its own process, one torch thread each; the slower's s."""
    halves = []
    for k, part in enumerate((prompts[:len(prompts) // 2], prompts[len(prompts) // 2:])):
        halves.append(os.path.join(tmp, f"half-{k}.jsonl"))
        with open(halves[-1], "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in part)
    procs = [subprocess.Popen([PY, "-c", LOOP, path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for path in halves]
    return max(float(p.communicate()[0]) for p in procs)


def start_pool(tmp, name, *extra):
    """A warm 2-worker pool of the handler in tmp/name (this process's settings point there)."""
    os.environ.update(CALQUE_STORE=os.path.join(tmp, name, "store"), CALQUE_STATE=os.path.join(tmp, name, "state"))
    out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), "pool", "create", "--model", "gen", "--handler",
                          HANDLER, "--workers", "2", *extra], capture_output=True, text=True, cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]


def stop_pool(tmp):
    subprocess.run([PY, os.path.join(ROOT, "calque.py"), "pool", "delete", "--model", "gen", "--yes", "--force"],
                   capture_output=True, cwd=tmp)


def timed(calque, prompts, claim_size=None):
    """(s from submit() to the run's end, its claim sizes)."""
    t0 = time.perf_counter()
    run = calque.submit(prompts, pool="gen", claim_size=claim_size)
    assert run.wait(timeout=1800)
    return time.perf_counter() - t0, calque_core.format_sizes(calque_core.claim_sizes(run.record), shown=4)


def sizes_section(tmp, prompts):
    import calque
    start_pool(tmp, "sizes")
    try:
        timed(calque, prompts[:WARM_UP])
        print(f"   {'prompts':>7} {'limit s':>8} {'defaults s':>10} {'x limit':>8} {'best s':>8} {'size':>5} "
              f"{'x best':>7}  default claims; sweep {', '.join(map(str, SWEEP))}")
        for n in PROMPTS:
            wall = limit(tmp, prompts[:n])
            auto, sizes = timed(calque, prompts[:n])
            swept = {size: timed(calque, prompts[:n], size)[0] for size in SWEEP}
            best = min(swept, key=swept.get)
            print(f"   {n:>7,} {wall:>8.2f} {auto:>10.2f} {wall / auto:>8.2f} {swept[best]:>8.2f} {best:>5} "
                  f"{swept[best] / auto:>7.2f}  {sizes}; sweep s: "
                  + " ".join(f"{swept[s]:.2f}" for s in SWEEP), flush=True)
    finally:
        stop_pool(tmp)


def tail_section(tmp, prompts):
    import calque
    start_pool(tmp, "tail", "--visibility-timeout", str(TAIL_VISIBILITY))
    state = os.path.join(os.environ["CALQUE_STATE"], "pools", "gen")
    try:
        timed(calque, prompts[:WARM_UP])
        plain, _ = timed(calque, prompts[:RUN_TAIL])
        for released in (False, True):
            run = calque.submit(prompts[:RUN_TAIL], pool="gen")
            while sum(s["items"] for s in run.summaries()) < TAIL_AT * RUN_TAIL:
                time.sleep(0.05)
            while True:   # a worker holding a claim (its receipts file names one)
                status = json.load(open(os.path.join(state, "supervisor.json")))
                held = [w for w in status["workers"] if w["pid"] and json.loads(
                    calque_supervisor.read_state(os.path.join(state, f"worker-{w['slot']}.claims"), str, "[]"))]
                if held:
                    break
                time.sleep(0.01)
            if not released:
                calque_core.write_file_atomic(os.path.join(state, f"worker-{held[0]['slot']}.claims"), "[]")
            os.kill(held[0]["pid"], signal.SIGKILL)
            killed = time.perf_counter()
            assert run.wait(timeout=600)
            redelivered = max(s["receive_count"] for s in run.summaries())
            print(f"   {RUN_TAIL:,} prompts, a worker killed -9 at {TAIL_AT:.0%}: "
                  f"{'released by the supervisor' if released else f'left to its {TAIL_VISIBILITY} s timeout'}: "
                  f"{time.perf_counter() - killed:6.2f} s from the kill to the end (delivery {redelivered}); "
                  f"the same run unkilled {plain:.2f} s", flush=True)
    finally:
        stop_pool(tmp)


def main():
    picked = chosen(SECTIONS)
    compile_kit()
    os.environ.update(GENERATE_NEW_TOKENS=NEW_TOKENS, HF_HUB_OFFLINE="1", AWS_EC2_METADATA_DISABLED="true")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GENERATE_MODEL_DIR"] = os.path.join(tmp, "generate-model")
        import make_generate_model
        make_generate_model.build(os.environ["GENERATE_MODEL_DIR"])
        prompts = [{"prompt": p} for p in make_generate_model.prompts(max(PROMPTS))]
        print(f"bench_generate: a random-weight GPT-2 (4 x 128), greedy generate of {NEW_TOKENS} tokens, batches of "
              f"{BATCH}; 2 local workers, {len(os.sched_getaffinity(0))} cores")
        if "sizes" in picked:
            print(" 1. run sizes: defaults against the two-loop limit and the best hand-picked --claim-size")
            sizes_section(tmp, prompts)
        if "tail" in picked:
            print(" 2. the tail after a worker death")
            tail_section(tmp, prompts)


if __name__ == "__main__":
    main()
