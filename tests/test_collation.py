"""How a worker prepares its batches, decided once per claim, in real warmd.py processes on the embedded backend: a
plain-Python handler's worker never imports torch, and a claim that mixes numeric and text items gets each batch
prepared as its own items allow."""
import json

import calque
import calque_core
from conftest import backend_for, cli, start_worker, wait_for, write_items

KINDS = '''
import sys

import calque


class Kinds:
    """Says, for each item, what its batch call received (a collated dict of tensors, or the list of payloads) and
    whether torch was imported in this worker by then."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, batch):
        torch = "torch" in sys.modules
        if isinstance(batch, dict):
            return [{"got": "tensors", "torch": torch}] * len(batch["x"])
        return [{"got": "list", "torch": torch}] * len(batch)
'''


def kinds_pool(env, tmp_path):
    """A pool of the Kinds handler (batches of 4) and one worker; its backend and the worker."""
    handler = tmp_path / "kinds.py"
    handler.write_text(KINDS)
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{handler}:Kinds", "--batch-size", "4",
              "--workers", "0")
    assert out.returncode == 0, out.stderr
    return backend_for(env), start_worker(env, "--model", "m")


def run_claim(env, backend, tmp_path, items, pipelined):
    """Submit one claim of these items and wait for it; its result lines. Its summary says whether its batches were
    prepared on the pipeline thread (only in a claim that may collate)."""
    out = cli(env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", items), "--no-wait")
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    wait_for(lambda: backend.store.exists(calque_core.summary_key(run_id, "c00000")), 60, "the claim's summary")
    assert calque_core.read_json(backend, calque_core.summary_key(run_id, "c00000"))["prefetch"] is pipelined
    return [json.loads(line) for line in calque_core.read_claim_results(backend.store, run_id, "c00000", len(items))]


def test_a_plain_python_worker_never_imports_torch(local_env, tmp_path):
    """A worker whose claims are text items runs them, goes idle, and has still not imported torch or fastbatch."""
    backend, worker = kinds_pool(local_env, tmp_path)
    text = [{"x": f"word {i}"} for i in range(6)]
    assert [r["result"]["got"] for r in run_claim(local_env, backend, tmp_path, text, False)] == ["list"] * 6
    idle = wait_for(lambda: [w for w in calque_core.read_worker_stats(backend, "m") if w["claims"] == 1], 30,
                    "the worker's stats once it is idle")
    assert idle[0]["fastbatch"] is None
    assert [r["result"] for r in run_claim(local_env, backend, tmp_path, text, False)] == \
        [{"got": "list", "torch": False}] * 6
    worker.terminate()
    assert worker.wait(30) == 0


def test_a_claim_mixing_kinds_collates_batch_by_batch(local_env, tmp_path):
    """In one claim, a batch of numeric items is collated and a batch holding any text item passes through as the
    list, whichever kind comes first; a later text claim finds torch imported by the numeric one."""
    backend, worker = kinds_pool(local_env, tmp_path)
    numeric, text = {"x": [1.0, 2.0]}, {"x": "a"}
    items = [text] * 4 + [numeric] * 4 + [numeric, text, numeric, numeric] + [numeric] * 4 + [text] * 2
    got = [r["result"]["got"] for r in run_claim(local_env, backend, tmp_path, items, True)]
    assert got == ["list"] * 4 + ["tensors"] * 4 + ["list"] * 4 + ["tensors"] * 4 + ["list"] * 2
    assert [r["result"] for r in run_claim(local_env, backend, tmp_path, [text], False)] == \
        [{"got": "list", "torch": True}]
    worker.terminate()
    assert worker.wait(30) == 0
