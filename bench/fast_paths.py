"""Each of the worker's fast paths on and off, end to end on the demo and the embedding example.

    .venv/bin/python bench/fast_paths.py         # both examples (~6 min on 2 shared cores)
    .venv/bin/python bench/fast_paths.py demo    # or one; BENCH_DEMO_ROUNDS, BENCH_EMBED_ROUNDS

One in-process warmd.Worker per example (entered once) runs one claim of the example's items per
variant and round: stage, receive, manifest, batches, result lines, part, summary, ack
(Worker.handle). A variant turns one path off by monkeypatching warmd or fastbatch here (no
setting). Rounds interleave the variants claim by claim, in a shuffled order; "all on, again" is
the A/A control, whose gain is the noise. Items/s of the median wall time and of the least CPU
time (steadier on a shared machine); gain = items/s with the path on / with it off - 1. A second
table times the paths alone (a real claim's result lines, recorded), a bound on what each can pay. The rule (issue #26): a path stays where it pays >= 5 % on either example.
"""
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import calque  # noqa: E402
import warmd   # noqa: E402
import calque_core
import calque_runs
from common import chosen  # noqa: E402

# ------------------------------------------------------------------------------------------------
ROUNDS = {"demo": int(os.environ.get("BENCH_DEMO_ROUNDS", "80")),   # claims per variant
          "embed": int(os.environ.get("BENCH_EMBED_ROUNDS", "3"))}
CLAIM = {"demo": 1000, "embed": 250}   # items a claim: calque's default; the embedding bench's
BATCH = 32                             # calque's default (CALQUE_BATCH_SIZE)
ALONE_REPEATS = 20                     # the paths alone: the least CPU time of this many
# ------------------------------------------------------------------------------------------------


def fastbatch_reference():
    """fastbatch's numpy reference for every gather, as without the C module."""
    import fastbatch
    return [(fastbatch, "BACKEND", "reference")]


# name -> () -> [(module, attribute, value while off)]; the first is everything on
VARIANTS = {
    "all on": lambda: [],
    "all on, again (A/A: the noise)": lambda: [],
    "C framing off (format_each, orjson per item)": lambda: [(warmd, "framer", None)],
    "C framing + orjson off (json per item)": lambda: [
        (warmd, "framer", None), (warmd, "encode_fast", lambda *a, **k: None)],
    "fastbatch C gather off (numpy)": fastbatch_reference,
}


@contextlib.contextmanager
def patched(patches):
    """The attributes set to the values given, restored on the way out."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    try:
        for m, a, value in patches:
            setattr(m, a, value)
        yield
    finally:
        for m, a, value in saved:
            setattr(m, a, value)


def make_pool(tmp, handler):
    """A local-backend pool of handler (batches of BATCH) in tmp; (conf, backend, record, queue)."""
    store = os.path.join(tmp, "store")
    os.environ.update(CALQUE_STORE=store, CALQUE_STATE=os.path.join(tmp, "state"))
    conf, backend = calque_core.settings(), calque_core.open_backend(store)
    args = calque.build_parser().parse_args(["pool", "create", "--model", "bench", "--handler",
                                            handler, "--batch-size", str(BATCH), "--workers", "0"])
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        calque.cmd_pool_create(conf, backend, args)
    record = calque_core.load_pool(backend, "bench")
    return conf, backend, record, backend.queues.open_queue(record["queue"])


def drain(pool, items):
    """(wall s, CPU s) to stage items as one claim and have the worker run it; all must succeed."""
    worker, backend, record, queue = pool
    t0, c0 = time.perf_counter(), time.process_time()
    run = calque_runs.stage_run(backend, record, items, len(items), queue, "pool")
    worker.handle(queue.receive(1))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    (summary,) = calque_core.read_summaries(backend, run["run_id"])
    assert summary["ok"] == len(items), summary.get("errors")
    assert not summary["prefetch"]   # text items: no claim collates, fastbatch gathers nothing
    return seconds, cpu


def example_setup(name, tmp):
    """(handler, items) of an example; the embedding example's model is built into tmp first."""
    if name == "demo":
        with open(os.path.join(ROOT, "examples", "items.jsonl")) as f:
            base = [json.loads(line) for line in f]
        return (os.path.join(ROOT, "examples", "demo_model.py:DemoModel"),
                [base[i % len(base)] for i in range(CLAIM[name])])
    folder = os.path.join(tmp, "embed-model")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_embed_model.py"), folder],
                   check=True, stdout=subprocess.DEVNULL)
    os.environ.update(EMBED_MODEL_DIR=folder, HF_HUB_OFFLINE="1")
    import make_embed_model
    return (os.path.join(ROOT, "examples", "embed_model.py:EmbedModel"),
            [{"text": t} for t in make_embed_model.texts(CLAIM[name])])


def alone(pool, items):
    """{variant: CPU us an item of the paths alone}: one claim's result lines (format_outcome over
    its batches' outcomes, recorded from a real claim)."""
    outcomes, real_format = [], warmd.format_outcome

    def record_format(outcome, base):
        outcomes.append((outcome, base))
        return real_format(outcome, base)
    with patched([(warmd, "format_outcome", record_format)]):
        drain(pool, items)
    cost = {}
    for variant, patches in VARIANTS.items():
        with patched(patches()):
            best = float("inf")
            for _ in range(ALONE_REPEATS):
                c0 = time.process_time()
                for outcome, base in outcomes:
                    warmd.format_outcome(outcome, base)
                best = min(best, time.process_time() - c0)
        cost[variant] = 1e6 * best / len(items)
    return cost


def measure(name):
    """{variant: (items/s of the median wall time, of the least CPU time, us an item alone)}."""
    tmp = tempfile.mkdtemp(prefix=f"calque-fast-{name}-")
    handler, items = example_setup(name, tmp)
    conf, backend, record, queue = make_pool(tmp, handler)
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix("bench"), conf, False)
    worker.start()
    pool = worker, backend, record, queue
    drain(pool, items)   # warm-up: first batches, imports, caches
    isolated = alone(pool, items)
    times = {v: [] for v in VARIANTS}
    for r in range(ROUNDS[name]):
        order = list(VARIANTS.items())
        random.Random(r).shuffle(order)   # no variant always runs after the same one
        for variant, patches in order:
            with patched(patches()):
                times[variant].append(drain(pool, items))
    return {v: (len(items) / statistics.median(wall for wall, _ in t),
                len(items) / min(cpu for _, cpu in t), isolated[v]) for v, t in times.items()}


def main():
    names = chosen(list(ROUNDS))
    results = {name: measure(name) for name in names}
    print("\nend to end, items/s: "
          + ", ".join(f"{ROUNDS[n]} {n} claims of {CLAIM[n]}" for n in names)
          + f" a variant, interleaved, batches of {BATCH}; median wall / least CPU;"
          " gain = on / off - 1")
    print(f"{'path turned off':46s}"
          + "".join(f" {n + ' wall':>11s} {n + ' cpu':>10s} {'gain':>13s}" for n in names))
    for variant in VARIANTS:
        row = f"{variant:46s}"
        for n in names:
            (wall, cpu, _), (on_wall, on_cpu, _) = results[n][variant], results[n]["all on"]
            row += (f" {wall:11.1f} {cpu:10.1f}"
                    f" {100 * (on_wall / wall - 1):+6.1f}/{100 * (on_cpu / cpu - 1):+5.1f}%")
        print(row)
    print("\nthe paths alone: CPU us an item of a claim's result lines; bound = "
          "what turning the path off adds, over the claim's least CPU us an item, all on")
    print(f"{'path turned off':46s}"
          + "".join(f" {n + ' us/item':>14s} {'bound':>8s}" for n in names))
    for variant in VARIANTS:
        row = f"{variant:46s}"
        for n in names:
            us, on_us = results[n][variant][2], results[n]["all on"][2]
            bound = 100 * (us - on_us) * results[n]["all on"][1] / 1e6
            row += f" {us:14.2f} {bound:+7.1f}%"
        print(row)


if __name__ == "__main__":
    main()
