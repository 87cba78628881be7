"""A Modal call's values on their way, side by side in one run: plain JSON items as they travelled
before the typed encoding (calque_values) and through it, its check of plain JSON
(calque_values.plain) by calque_plain's C walk where it was built and by the Python walk (as where
it was not), and typed items (a dataclass and a date) for scale.

    .venv/bin/python bench/bench_values.py     # ~20 s; BENCH_VALUES_ITEMS, BENCH_VALUES_ROUNDS

The values alone: one item's round trip in this process, the parts that differ by the encoding:
the call item made and written as the manifest's JSON, read by the worker and unpacked
(ModalHandler._args), the handler's result (the item back, as an echo handler returns it) encoded
as its result line (ModalHandler._out, warmd's encoder) and read back by `modal run`
(ModalRun._decoded): the most the encoding can cost. End to end: claims of call items staged and
run by an in-process warmd.Worker of an echo app's pool (as bench/fast_paths.py's: manifest,
batches, result part, summary, ack), the encoding on or off (ModalRun._typed not called,
ModalHandler._out patched to give the result as it is). Rounds interleave the paths in a shuffled
order; the least CPU time of the rounds (and the median wall time end to end).
"""
import dataclasses
import datetime
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import calque  # noqa: E402
import calque_core  # noqa: E402
import calque_values  # noqa: E402
import warmd  # noqa: E402
import calque_runs  # noqa: E402
from fast_paths import make_pool  # noqa: E402

ITEMS = int(os.environ.get("BENCH_VALUES_ITEMS", "10000"))   # items a round
ROUNDS = int(os.environ.get("BENCH_VALUES_ROUNDS", "7"))      # rounds a path
CLAIMS = int(os.environ.get("BENCH_VALUES_CLAIMS", "20"))     # end to end: 1000-item claims a path
APP = "import modal\napp = modal.App()\n@app.function()\ndef echo(x):\n    return x\n"


@dataclasses.dataclass
class Job:
    prompt: str
    day: datetime.date


def plain_item(k):
    """A prompt job as a plain JSON dict: what most batch calls carry."""
    return {"id": k, "prompt": f"Summarise document {k} in one line.", "max_tokens": 64,
            "temperature": 0.2, "tags": ["news", "en"], "meta": {"source": "crawl", "rank": k % 7}}


def python_walk():
    """calque_values.plain as where calque_plain was not built: the Python walk (a second copy of
    calque_values, loaded with calque_plain hidden)."""
    spec = importlib.util.spec_from_file_location("calque_values_python", calque_values.__file__)
    module, built = importlib.util.module_from_spec(spec), sys.modules.get("calque_plain")
    sys.modules["calque_plain"] = None   # its import raises ImportError
    spec.loader.exec_module(module)
    sys.modules.pop("calque_plain")
    sys.modules.update({"calque_plain": built} if built else {})
    return module.plain


WALKS = {"": calque_values.plain, ", Python walk": python_walk()}   # the kit's; the fallback


def round_trip(items, handler, runner, encoding):
    """Each item's call and result; `encoding`: through ModalRun._typed, ModalHandler._args and
    _out and ModalRun._decoded, else as before them (the call's lists as they are)."""
    lines = []
    for item in items:
        call = {calque_core.MODAL_CALL_KEY: [[item], {}]}
        call = json.loads(json.dumps(runner._typed(call) if encoding else call))
        args, kwargs = handler._args(call)[:2]   # before: the same, less one check
        result = handler.fn(*args, **kwargs)
        result = handler._out(call, result) if encoding else result
        lines.append(warmd.encode_result({"ok": True, "result": result}))
    results = (json.loads(line) for line in lines)
    return list(runner._decoded(results) if encoding else results)


def alone(folder, path, runner):
    """{path: least CPU s of a round} of the values alone."""
    handler = calque_core.load_handler(path, "echo")[0]
    handler.enter()
    plain = [plain_item(k) for k in range(ITEMS)]
    typed = [Job(f"document {k}", datetime.date(2024, 1, 1 + k % 28)) for k in range(ITEMS)]
    paths = {"plain JSON, before the encoding": (plain, False, ""),
             "plain JSON, before, again (A/A: the noise)": (plain, False, ""),
             **{f"plain JSON, through it{w}": (plain, True, w) for w in WALKS},
             "a dataclass with a date, through it": (typed, True, "")}
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(ROUNDS):
        for name in random.sample(list(paths), len(paths)):
            items, encoding, calque_values.plain = *paths[name][:2], WALKS[paths[name][2]]
            start = time.process_time()
            round_trip(items, handler, runner, encoding)
            best[name] = min(best[name], time.process_time() - start)
    calque_values.plain = WALKS[""]
    return best


def drain(pool, items):
    """One claim of the items staged and run by the worker; all must succeed."""
    worker, backend, record, queue = pool
    run = calque_runs.stage_run(backend, record, items, len(items), queue, "pool")
    worker.handle(queue.receive(1))
    (summary,) = calque_core.read_summaries(backend, run["run_id"])
    assert summary["ok"] == len(items), summary.get("errors")


def end_to_end(folder, path, runner):
    """{path: (median wall s, least CPU s) of a claim of 1000 plain call items}."""
    conf, backend, record, queue = make_pool(folder, f"{path}:echo")
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix("bench"), conf, False)
    worker.start()
    pool = worker, backend, record, queue
    calls = [{calque_core.MODAL_CALL_KEY: [[plain_item(k)], {}]} for k in range(1000)]
    out = worker.handler._out
    before = (lambda: calls, lambda item, value: value, "")
    paths = {"plain JSON, before the encoding": before,
             "plain JSON, before, again (A/A: the noise)": before,
             **{f"plain JSON, through it{w}": (lambda: [runner._typed(c) for c in calls], out, w)
                for w in WALKS}}
    drain(pool, calls)   # warm-up
    times = {name: [] for name in paths}
    for _ in range(CLAIMS):
        for name in random.sample(list(paths), len(paths)):
            items, worker.handler._out, walk = paths[name]
            calque_values.plain = WALKS[walk]
            start, cpu = time.perf_counter(), time.process_time()
            drain(pool, items())
            times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    calque_values.plain = WALKS[""]
    return {name: (statistics.median(w for w, _ in t), min(c for _, c in t))
            for name, t in times.items()}


def main():
    folder = tempfile.mkdtemp(prefix="bench-values-")
    path = os.path.join(folder, "app.py")
    with open(path, "w") as f:
        f.write(APP)
    runner = calque.ModalRun.__new__(calque.ModalRun)   # its encoding only: no store, no pool
    runner.allowed = calque_values.app_modules(folder)
    sys.modules[Job.__module__].__file__ = path   # Job stands for a class of the app's own
    best = alone(folder, path, runner)
    base = best["plain JSON, before the encoding"]
    walk = "C" if WALKS[""].__module__ == "calque_plain" else "Python (calque_plain not built)"
    print(f"A Modal call's values alone, {ITEMS} items a round, least CPU time of {ROUNDS} rounds; "
          f"the kit's walk: {walk}")
    print(f"{'path':<44} {'us/item':>8} {'vs before':>10}")
    for name, seconds in best.items():
        print(f"{name:<44} {seconds / ITEMS * 1e6:>8.2f} {seconds / base:>9.2f}x")
    ends = end_to_end(folder, path, runner)
    wall, cpu = ends["plain JSON, before the encoding"]
    print(f"\nEnd to end, {CLAIMS} claims of 1000 plain call items a path, in-process worker")
    print(f"{'path':<44} {'items/s wall':>12} {'items/s cpu':>12} {'CPU vs before':>14}")
    for name, (w, c) in ends.items():
        print(f"{name:<44} {1000 / w:>12.0f} {1000 / c:>12.0f} {c / cpu:>13.2f}x")


if __name__ == "__main__":
    main()
