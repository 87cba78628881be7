"""make bench, part 4: goodput under churn. 8 runs of 7-333 items in claims of 5-50 on a 3-worker local pool, with no
kill, then with a kill -9 of a random worker every 1.5-3.5 s (moderate) and every 0.5-1.5 s (harsh), and harsh again
with three poison items in the first run (an os._exit, a kill -9 of itself, a segfault); the same runs each time.

    .venv/bin/python bench/bench_churn.py          # BENCH_CHURN_SEED=7 for other runs

Prints per rate: time to done, goodput (items done a second, and against no kill), repeated item computations
(share of the items), kills, false quarantines (good items failed), spared (deaths pinned on a good item that then
ran and returned: the chances a false quarantine had), lost or wrong items, dead letters, and
the delivery of its claim that quarantined each poison item. Then what the churn cadence costs a claim: the same
claims through in-process workers: one that has seen no death (a pool never killed), the same with the churn cadence
and the spool cut out (the checkpoint rule alone), and one committing a part after every batch. The machine is shared: read
ratios, not absolutes."""
import os
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import churn  # noqa: E402
from bench_pool import HANDLERS, calque, make_pool, warmd  # noqa: E402
import calque_core
import calque_runs

SEED = int(os.environ.get("BENCH_CHURN_SEED", "1"))
RATES = (("no kill", None, ()), ("moderate", (1.5, 3.5), ()), ("harsh", (0.5, 1.5), ()),
         ("harsh+poison", (0.5, 1.5), ("exit", "kill", "libc-kill", "segv")))   # a poison item of each kind in run 1
SPIN = int(os.environ.get("BENCH_CHURN_SPIN", "40000"))   # sha256 rounds an item (Faulty): ~30 ms quiet
CADENCE_CLAIMS = 50         # claims of 64 items (~3 ms each) in batches of 4 through each of the three workers


def main():
    print(f"churn: 8 runs of 7-333 items, claims of 5-50, batches of 4, 3 workers, seed {SEED}")
    print(f"{'rate':<12} {'done':>5} {'s':>7} {'items/s':>8} {'goodput':>8} {'repeated':>9} {'kills':>6} "
          f"{'false q.':>8} {'spared':>6} {'lost':>5} {'wrong':>6} {'DLQ':>4}  poison quarantined at delivery")
    base = None
    for name, every, poison in RATES:
        with tempfile.TemporaryDirectory() as folder:
            got = churn.churn(folder, 8, every, SEED, spin=SPIN, poison=poison)
        rate = got["ok"] / got["seconds"]
        base = base or rate
        print(f"{name:<12} {got['runs_done']:>3}/8 {got['seconds']:>7.1f} {rate:>8.1f} {rate / base:>8.2f} "
              f"{got['repeated']:>9.1%} {got['kills']:>6} {got['failed']:>8} {got['innocent']:>6} {got['lost']:>5} "
              f"{got['wrong']:>6} {got['dead_letters']:>4}  {got['poison_deliveries'] or '-'}", flush=True)
        if got["errors"]:
            print(f"           good items failed: {got['errors']}")
    cadence()


def cadence():
    """Median seconds and mean store PUTs per claim: a worker that saw no death, the same with the churn cadence and
    the spool cut out (the checkpoint rule alone, as before them), and one committing after every batch (churn at
    its harshest)."""
    with tempfile.TemporaryDirectory() as folder:
        conf, backend, record = make_pool(os.path.join(folder, "store"), os.path.join(folder, "state"),
                                          f"{HANDLERS}:Faulty", batch_size=4)
        queue = backend.queues.open_queue(record["queue"])
        workers = {name: warmd.Worker(backend, record, calque_core.worker_stats_prefix("bench"), conf, False)
                   for name in ("never killed", "checkpoint rule alone", "a part every batch")}
        workers["checkpoint rule alone"].rules.interval = lambda claim: None
        workers["checkpoint rule alone"].spool_folder = None
        workers["a part every batch"].rules.interval = lambda claim: 0.0
        times, puts = {name: [] for name in workers}, {name: [] for name in workers}
        for worker in workers.values():
            worker.start()
        for k in range(CADENCE_CLAIMS):
            names = list(workers)
            for name in names[k % 3:] + names[:k % 3]:   # a claim each, one after the other, first in turn
                worker = workers[name]
                run = calque_runs.stage_run(backend, record, [{"x": i, "spin": 2000} for i in range(64)], 64, queue,
                                       "pool")
                t0 = time.perf_counter()
                worker.handle(queue.receive(1))
                times[name].append(time.perf_counter() - t0)
                summary = calque_core.read_json(backend, calque_core.summary_key(run["run_id"], "c00000"))
                puts[name].append(summary["requests"]["store_puts"])
    base = statistics.median(times["checkpoint rule alone"])
    for name in workers:
        print(f"{name:<22} {statistics.median(times[name]) * 1e3:7.1f} ms a claim of 64 items "
              f"({statistics.median(times[name]) / base:.3f}x), {statistics.mean(puts[name]):5.2f} PUTs")
    spool_cost()


def spool_cost():
    """What the spool alone costs a claim of 16 batches of 4 result lines: its file made, written, removed."""
    claim = types.SimpleNamespace(run_id="r-bench", claim_id="c00000")
    lines = ["".join(f'{{"i":{i},"ok":true,"result":{{"y":{2 * i}}}}}\n' for i in range(4))]
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        for _ in range(1000):
            spool = warmd.Spool(folder, claim)
            for k in range(0, 64, 4):
                spool.add(k, k + 4, lines)
            spool.close()
    print(f"the spool alone: {(time.perf_counter() - t0) * 1e3 / 1000:.3f} ms a claim of 16 batches")


if __name__ == "__main__":
    main()
