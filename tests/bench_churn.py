"""make bench, part 4: goodput under churn. 8 runs of 7-333 items in claims of 5-50 (three of them poison: an
os._exit, a kill -9 of itself, a segfault) on a 3-worker local pool, with no kill, then with a kill -9 of a random
worker every 1.5-3.5 s (moderate) and every 0.5-1.5 s (harsh); the same runs each time (one seed).

    .venv/bin/python tests/bench_churn.py          # BENCH_CHURN_SEED=7 for other runs

Prints per rate: time to done, goodput (items done a second, and against no kill), repeated item computations
(share of the items), kills, false quarantines (good items failed), lost or wrong items, dead letters, and how many
deliveries each poison item's claim took to quarantine it. The machine is shared: read ratios, not absolutes."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import churn  # noqa: E402

SEED = int(os.environ.get("BENCH_CHURN_SEED", "1"))
RATES = (("no kill", None), ("moderate", (1.5, 3.5)), ("harsh", (0.5, 1.5)))
POISON = ("exit", "kill", "segv")


def main():
    print(f"churn: 8 runs of 7-333 items, claims of 5-50, 3 workers, seed {SEED}, poison items {', '.join(POISON)}")
    print(f"{'rate':<10} {'done':>5} {'s':>7} {'items/s':>8} {'goodput':>8} {'repeated':>9} {'kills':>6} "
          f"{'false q.':>8} {'lost':>5} {'wrong':>6} {'DLQ':>4}  poison quarantined at delivery")
    base = None
    for name, every in RATES:
        with tempfile.TemporaryDirectory() as folder:
            got = churn.churn(folder, 8, every, SEED, poison=POISON)
        rate = got["ok"] / got["seconds"]
        base = base or rate
        print(f"{name:<10} {got['runs_done']:>3}/8 {got['seconds']:>7.1f} {rate:>8.1f} {rate / base:>8.2f} "
              f"{got['repeated']:>9.1%} {got['kills']:>6} {got['failed']:>8} {got['lost']:>5} {got['wrong']:>6} "
              f"{got['dead_letters']:>4}  {got['poison_deliveries']}", flush=True)
        if got["errors"]:
            print(f"           good items failed: {got['errors']}")


if __name__ == "__main__":
    main()
