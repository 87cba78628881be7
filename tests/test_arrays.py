"""Numeric inputs (.npy, ragged .npz) staged as binary and read back by the worker as views."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import calque
import calque_core
import calque_runs
import calque_sources
from conftest import HANDLERS, ROOT, cli, start_worker


def test_npy_view_is_a_view_not_a_copy():
    """npy_view maps the fetched bytes: same values as np.load, no copy, read-only; object arrays refused."""
    import io
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    buf = io.BytesIO()
    np.save(buf, a)
    data = buf.getvalue()
    view = calque_core.npy_view(data)
    assert np.array_equal(view, a) and view.dtype == a.dtype
    assert view.base is not None and not view.flags.writeable     # backed by `data`, not its own memory
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        calque_core.npy_view(buf.getvalue())


def test_stage_and_read_back_ragged_and_fixed(tmp_path):
    """A .npz with a fixed field and a ragged one round-trips per claim, item for item."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=7)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 1000, size=offsets[-1]).astype(np.int64)
    image = rng.standard_normal((7, 3, 2)).astype(np.float32)
    path = tmp_path / "in.npz"
    np.savez(path, tokens=tokens, tokens_offsets=offsets, image=image)
    items = calque_sources.read_items(str(path))
    assert items.count == 7
    backend = calque_core.LocalBackend(str(tmp_path / "store"))
    queue = backend.queues.create_queue("calque-pool-a", 30)
    run = calque_runs.stage_run(backend, {"model": "a"}, items, 3, queue, "pool")
    got = []
    for claim in run["claims"]:
        got += calque_sources.array_items(backend.store, json.loads(backend.store.get(calque_core.manifest_key(run["run_id"], claim))))
    for i, item in enumerate(got):
        assert np.array_equal(item["tokens"], tokens[offsets[i]:offsets[i + 1]])
        assert np.array_equal(item["image"], image[i])


@pytest.mark.parametrize("arrays, problem", [
    ({"tokens": np.arange(5), "tokens_offsets": np.array([0, 2, 9])}, "tokens_offsets must be"),
    ({"a": np.zeros((3, 2)), "b": np.zeros(4)}, "disagree on the item count"),
    ({"a": np.zeros((0, 2))}, "holds no items"),
    ({"s": np.array(["x", "y"])}, "only numeric arrays"),
    ({"x": np.array(5)}, "is a scalar: its first axis must index the items"),
    ({"x": np.array(5), "x_offsets": np.array([0, 1])}, "x_offsets must be .* over a 1-D x"),
])
def test_bad_array_inputs(tmp_path, arrays, problem):
    """Bad numeric inputs are refused with a message naming the field."""
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(calque.UserError, match=problem):
        calque_sources.read_items(str(path))


@pytest.mark.parametrize("spelling", ["script", "installed"])
def test_a_ragged_scalar_is_one_line(local_env, tmp_path, spelling):
    """A scalar with offsets (`x_offsets` over a 0-d `x`) is refused by submit in one line, exit 2,
    from either spelling of the command: not a traceback of len() of an unsized object."""
    np.savez(tmp_path / "bad.npz", x=np.array(5), x_offsets=np.array([0, 1]))
    command = ([sys.executable, os.path.join(ROOT, "calque.py")] if spelling == "script"
               else [os.path.join(os.path.dirname(sys.executable), "calque")])
    args = ["submit", "--model", "sum", "--handler", f"{HANDLERS}:RowSum", "bad.npz"]
    out = subprocess.run([*command, *args], env=local_env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == ["calque: error: bad.npz: x_offsets must be N+1 "
                                               "increasing ints from 0 to len(x) over a 1-D x"]


def test_numeric_run_end_to_end(local_env, tmp_path):
    """submit a .npz to a cold worker: collated, summed, every item right."""
    offsets = np.array([0, 3, 4, 8], dtype=np.int64)
    tokens = np.arange(8, dtype=np.int64)
    np.savez(tmp_path / "in.npz", tokens=tokens, tokens_offsets=offsets, x=np.ones((3, 4), dtype=np.float32))
    out = cli(local_env, "submit", "--model", "sum", "--handler", f"{HANDLERS}:RowSum", str(tmp_path / "in.npz"))
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[1]
    lines = [json.loads(l) for l in cli(local_env, "runs", "results", run_id).stdout.splitlines()]
    assert [l["result"] for l in lines] == [{"tokens": 3.0, "x": 4.0}, {"tokens": 3.0, "x": 4.0}, {"tokens": 22.0, "x": 4.0}]
    np.save(tmp_path / "rows.npy", np.arange(6, dtype=np.float64).reshape(3, 2))
    out = cli(local_env, "submit", "--model", "sum", "--handler", f"{HANDLERS}:RowSum", str(tmp_path / "rows.npy"))
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[1]
    assert [json.loads(l)["result"]["input"] for l in cli(local_env, "runs", "results", run_id).stdout.splitlines()] == [1.0, 5.0, 9.0]


def test_prefetch_gives_identical_results(local_env, tmp_path):
    """The drain loop's results are the same with and without the prefetch thread."""
    rng = np.random.default_rng(3)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 50, size=40))]).astype(np.int64)
    np.savez(tmp_path / "in.npz", tokens=rng.integers(0, 9, size=offsets[-1]), tokens_offsets=offsets,
             x=rng.standard_normal((40, 8)).astype(np.float32))
    out = cli(local_env, "pool", "create", "--model", "sum", "--handler", f"{HANDLERS}:RowSum", "--workers", "0",
              "--batch-size", "7")
    assert out.returncode == 0, out.stderr
    outputs = []
    for prefetch in (True, False):
        worker = start_worker(local_env, "--model", "sum", constants={"PREFETCH": prefetch})
        out = cli(local_env, "submit", "--pool", "sum", str(tmp_path / "in.npz"), "--wait-for-workers",
                  "--json")
        worker.send_signal(signal.SIGTERM)
        assert out.returncode == 0 and worker.wait(30) == 0, out.stderr
        run = json.loads(out.stdout)
        assert run["summaries"][0]["prefetch"] is prefetch
        outputs.append(cli(local_env, "runs", "results", run["run"]["run_id"]).stdout)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 40
