"""Typed results: arrays and tensors a handler returns (one an item, batch-shaped, dicts of them) are stored in
binary and read back bit-exact as JSONL, Parquet, .npy, numpy, Arrow and pandas; on both backends, with real
warmd.py processes, a kill -9 mid-claim included. The part format's round trip, in process."""
import io
import json
import os
import signal
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import calque
import calque_core
import calque_runs
from conftest import HANDLERS, PY, ROOT, backend_for, cli, start_worker, wait_for
from handlers import FakeCuda


def rows(xs):
    """What Typed returns for these x: x + [0, 1, 2, 3] / 8, float32."""
    return np.array(xs, np.float32)[:, None] + np.arange(4, dtype=np.float32) / 8


def bits(xs):
    """The 16-bit patterns Typed returns for these x (NaNs and infinities among them), as int64."""
    return np.array([[x * 7919 % 65536 - 32768, -1 - x] for x in xs], np.int64)


def items(shape, xs, **marks):
    """Typed's items of this shape; marks: {field: [x, ...]} set that field on those items."""
    return [{"x": x, "shape": shape, **{k: True for k, chosen in marks.items() if x in chosen}} for x in xs]


class Store(dict):
    def get(self, key):
        return self[key]


def test_parts_round_trip_every_dtype_bit_exact_and_json_parts_stay_text():
    """encode_part then read_part: float16, bfloat16 (NaN payloads too), float32 NaN bits, int64 extremes, bool,
    uint8, 0-d values, ragged shapes, each with the item's JSON fields beside; chunks with no array give the
    .jsonl text they always were."""
    f32 = np.array([1.5, np.nan, -np.inf], np.float32)
    f32.view(np.uint32)[1] = 0x7FC0_1234                                   # a NaN with a payload
    bf16 = torch.tensor([0x7FC1, -32768, 0x3F80, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    cells = [(0, None, *calque_core.host_array(f32)), (1, "e", *calque_core.host_array(bf16)),
             (1, "n", *calque_core.host_array(np.array(2 ** 63 - 1))), (2, "e", *calque_core.host_array(bf16[:2])),
             (3, None, *calque_core.host_array(np.array([True, False]))), (4, None, *calque_core.host_array(np.arange(3.0))),
             (5, None, *calque_core.host_array(np.float16([[1, 2], [3, 4]])))]
    results = ["null", '{"e":null,"n":null}', '{"e":null,"x":"ride"}', "null", "null", "null"]
    text = calque_core.TypedLines("".join(f'{{"i":{i},"ok":true,"result":{r}}}\n' for i, r in enumerate(results)))
    text.cells = cells
    plain = '{"i":6,"ok":false,"error":"x"}\n'
    assert calque_core.encode_part([plain]) == (".jsonl", plain)
    suffix, data = calque_core.encode_part([text, plain])
    assert suffix == ".npz"
    part = calque_core.read_part(Store({"k.npz": data}), "k.npz", 0, 7)
    assert len(part.lines) == 7 and part.lines[6] == plain
    got = {}
    for block in part.blocks:
        for row, array in zip(block.rows.tolist(), block.arrays()):
            got.setdefault(row, []).append((block.field, block.dtype, array))
    assert got[0][0][2].view(np.uint32).tolist() == f32.view(np.uint32).tolist()
    top = (got[1][0][2].view(np.uint32) >> 16).astype(np.uint16)           # float32's top half: the bfloat16 bits
    assert got[1][0][1] == "bfloat16" and top.tolist() == bf16.view(torch.int16).numpy().view(np.uint16).tolist()
    assert got[1][1][1:] == ("int64", 2 ** 63 - 1) and got[2][0][2].shape == (2,)
    assert got[3][0][2].tolist() == [True, False] and got[5][0][2].tolist() == [[1, 2], [3, 4]]
    line = json.loads(calque_core.result_lines(part)[1])                       # bfloat16 as the float32 it widens to,
    widened = (np.array([0x8000, 0x3F80, 1], np.uint32) << 16).view(np.float32)   # in float32's shortest text
    assert line["result"]["n"] == 2 ** 63 - 1 and line["result"]["e"][0] is None
    assert np.array(line["result"]["e"][1:], np.float32).tobytes() == widened.tobytes()
    assert json.loads(calque_core.result_lines(part)[0])["result"] == [1.5, None, None]   # strict JSON: NaN, inf null
    assert json.loads(calque_core.result_lines(part)[2])["result"] == {"e": [None, -0.0], "x": "ride"}
    # a second delivery's part that overlaps the first one's is read from the offset the first one reached
    trimmed = part.since(2)
    assert len(trimmed.lines) == 5 and json.loads(trimmed.lines[0])["i"] == 2
    kept = {(b.field, b.dtype): (b.rows.tolist(), [a.tolist() for a in b.arrays()]) for b in trimmed.blocks}
    assert kept[("e", "bfloat16")][0] == [0] and len(kept[("e", "bfloat16")][1][0]) == 2     # ragged: row 2's two
    assert kept[(None, "float64")] == ([2], [[0.0, 1.0, 2.0]]) and kept[("n", "int64")] == ([], [])
    with pytest.raises(calque.ResultsIncomplete, match="is unreadable"):
        calque_core.read_part(Store({"k.npz": data[:-40]}), "k.npz", 0, 7)


def test_batch_shaped_returns_split_per_item_and_wrong_lengths_name_both():
    """An array, a tensor on a device (moved with one .cpu() call), a dict of them and lists: one row an item; a
    first dimension or list of the wrong length, or a value no batch can split, is refused naming both lengths."""
    calls = []

    class Device(FakeCuda):
        def cpu(self):
            calls.append(1)
            return self.tensor
    split = calque_core.batch_rows({"e": Device(torch.ones(3, 2)), "label": np.arange(3), "name": ["a", "b", "c"]}, 3)
    assert calls == [1] and [calque_core.host_array(r["e"])[0].tolist() for r in split] == [[1.0, 1.0]] * 3
    assert [int(r["label"]) for r in split] == [0, 1, 2] and split[2]["name"] == "c"
    with pytest.raises(TypeError, match="Tensor.cpu"):
        Device(torch.ones(1)).numpy()
    for outputs, message in [(np.zeros((31, 4)), "handler returned 31 rows for a batch of 32 items"),
                             ({"e": np.zeros((32, 4)), "l": [1]}, "handler returned 1 rows for 'l' for a batch of 32"),
                             ([1, 2], "handler returned 2 results for a batch of 32 items"),
                             (np.float32(3), "handler returned float32 for a batch of 32 items")]:
        with pytest.raises(ValueError, match=message):
            calque_core.batch_rows(outputs, 32)


def test_a_json_only_worker_imports_neither_numpy_nor_pyarrow():
    """warmd's encoding of JSON results needs neither; typed results need numpy, never pyarrow."""
    code = ("import sys, warmd, calque_core\n"
            "lines = warmd.format_outcome([(True, {'y': 1})], 0)[0]\n"
            "assert calque_core.encode_part(lines)[0] == '.jsonl'\n"
            "print('numpy' in sys.modules, 'pyarrow' in sys.modules)\n"
            "import numpy\n"
            "assert calque_core.encode_part(warmd.format_outcome([(True, numpy.ones(2))], 0)[0])[0] == '.npz'\n"
            "print('pyarrow' in sys.modules)\n")
    out = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False", "False"], out.stderr


def run_of(env, backend, batch, claim_size=8):
    conf = dict(calque_core.settings(), **{k: v for k, v in env.items() if k in calque_core.DEFAULTS})
    return calque.submit(batch, pool="m", claim_size=claim_size, wait_for_workers=True, context=(conf, backend))


def test_typed_results_read_back_exactly_in_every_format(any_env, tmp_path, monkeypatch, capsys):
    """One warm worker, batch size 4. Batch-shaped arrays, a torch tensor on a fake CUDA device (.cpu() once a
    batch), dicts of arrays with a failing item (the rest of its batch stays ok), a wrong-length return,
    bfloat16/float16/int64 one array an item: JSONL, Parquet, .npy, to_numpy, to_arrow, to_pandas and the per-claim
    batches agree, bit-exact; the CLI's refusals are one line each."""
    env = dict(any_env, CPU_CALLS=str(tmp_path / "cpu"))
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Typed", "--batch-size", "4",
              "--workers", "0")
    assert out.returncode == 0, out.stderr
    backend = backend_for(env)
    worker = start_worker(env, "--model", "m")
    floats = run_of(env, backend, items("batch", range(8)) + items("cuda", range(8, 16)))
    mixed = run_of(env, backend, items("dict", range(8), fail=[2]) + items("short", range(8, 12)))
    typed = {s: run_of(env, backend, items(s, range(9))) for s in ("bf16", "f16", "i64")}
    for run in (floats, mixed, *typed.values()):
        assert run.wait(timeout=60)
    assert open(env["CPU_CALLS"]).read() == "cpu\n" * 2          # the fake device's two batches, once each

    assert floats.to_numpy().tobytes() == rows(range(16)).tobytes()
    bf16, f16 = typed["bf16"].to_numpy(), typed["f16"].to_numpy()
    top = (bf16.view(np.uint32) >> 16).astype(np.int64)    # widened to float32: the bfloat16 bits on top, 0 below
    assert bf16.dtype == np.float32 and top.tolist() == (bits(range(9)) % 65536).tolist()
    assert not (bf16.view(np.uint32) & 0xFFFF).any()
    assert f16.dtype == np.float16 and f16.view(np.int16).tolist() == bits(range(9)).astype(np.int16).tolist()
    assert typed["i64"].to_numpy().tolist() == (bits(range(9)) * 2 ** 40).tolist()

    embedding = mixed.to_numpy("embedding")
    assert embedding.shape == (12, 4) and np.isnan(embedding[[2, *range(8, 12)]]).all()
    assert embedding[[0, 1, *range(3, 8)]].tobytes() == rows([0, 1, *range(3, 8)]).tobytes()
    with pytest.raises(calque.UserError, match="5 items have no label .* int64 has no NaN"):
        mixed.to_numpy("label")
    assert mixed.to_numpy("label", fill=-1).tolist() == [0, 3, -1, 9, 12, 15, 18, 21, -1, -1, -1, -1]
    with pytest.raises(calque.UserError, match=r"several arrays \(embedding, label\)"):
        mixed.to_numpy()

    lines = [json.loads(line) for line in cli(env, "runs", "results", mixed.run_id).stdout.splitlines()]
    assert lines[0] == {"i": 0, "ok": True, "result": {"embedding": [0.0, 0.125, 0.25, 0.375], "label": 0,
                                                       "name": "n0"}}
    assert lines[2]["ok"] is False and "asked to fail" in lines[2]["error"] and lines[3]["result"]["label"] == 9
    assert {line["error"] for line in lines[8:]} == {"handler returned 3 rows for a batch of 4 items"}
    summaries = {s["claim"]: s for s in mixed.summaries()}
    assert (summaries["c00000"]["status"], summaries["c00000"]["failed"]) == ("partial", [2])
    assert (summaries["c00001"]["status"], summaries["c00001"]["ok"]) == ("failed", 0)

    table = mixed.to_arrow()
    assert table.column_names == ["i", "ok", "error", "embedding", "label", "name"]
    assert str(table.schema.field("embedding").type) == "fixed_size_list<item: float>[4]"
    assert table["i"].to_pylist() == list(range(12)) and table["label"].to_pylist()[:3] == [0, 3, None]
    assert table["embedding"][1].as_py() == [1.0, 1.125, 1.25, 1.375] and table["name"][8].as_py() is None
    assert [b.num_rows for b in mixed.iter_batches()] == [8, 4]
    frame = mixed.to_pandas()
    assert frame.shape == (12, 6) and list(frame["embedding"][7]) == [7.0, 7.125, 7.25, 7.375]

    path = tmp_path / "mixed.parquet"
    # the command, then what it imported: pyarrow is told pandas is absent (its first conversion would import it,
    # a third of the command's time), and its to_pandas() still works after
    code = ("import runpy, sys\n"
            f"sys.argv = ['calque.py', 'runs', 'results', {mixed.run_id!r}, '--format', 'parquet', '--output', "
            f"{str(path)!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code\n"
            "import pyarrow.parquet as pq\n"
            "print('pandas' in sys.modules, pq.read_table(sys.argv[-1]).to_pandas().shape)\n")
    out = subprocess.run([PY, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout == "False (12, 6)\n" and pq.read_table(path).equals(table), out.stderr
    npy = subprocess.run([PY, os.path.join(ROOT, "calque.py"), "runs", "results", typed["f16"].run_id, "--format",
                          "npy"], env=env, capture_output=True, timeout=60)
    assert npy.returncode == 0 and np.load(io.BytesIO(npy.stdout)).tobytes() == f16.tobytes()
    for var in ("CALQUE_STORE", "CALQUE_ENV"):                # the refusals, in process: the same main()
        monkeypatch.setenv(var, env[var])
    capsys.readouterr()                       # submit's notices above (a worker still starting) are not the refusals
    for args, said in [(("--format", "npy", "--field", "label", "--output", str(path)), "---> HINT: pass fill="),
                       (("--format", "npy", "--follow"), "--follow prints JSONL"),
                       (("--field", "label"), "--field and --fill choose the array of --format npy"),
                       (("--format", "parquet", "--output", str(tmp_path / "no" / "x")), "cannot write")]:
        assert calque.main(["runs", "results", mixed.run_id, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (args, err)
    assert not os.path.exists(path)                         # refused after it was opened: removed
    assert calque.main(["runs", "results", mixed.run_id, "--format", "parquet", "--failed", "--output", str(path)]) == 0
    assert pq.read_table(path)["i"].to_pylist() == [2, 8, 9, 10, 11]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0


def test_kill_9_mid_claim_with_binary_parts_loses_and_repeats_nothing(any_env, tmp_path):
    """A worker killed while it holds batch [4, 6) of a claim checkpointed each batch: the next worker resumes
    after the .npz parts written (never computing those items again) and every item reads back once, exactly."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(any_env, GATE_DIR=str(gate), CALQUE_CHECKPOINT_SECONDS="0", CALQUE_CHECKPOINT_BATCHES="1")
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Typed", "--batch-size", "2",
              "--visibility-timeout", "2", "--workers", "0")
    assert out.returncode == 0, out.stderr
    backend = backend_for(env)
    a = start_worker(env, "--model", "m")
    run = run_of(env, backend, items("batch", range(8), hold=[4]), claim_size=8)
    wait_for(lambda: os.listdir(gate), 60, "the worker to hold batch [4, 6)")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    (gate / "open").touch()
    b = start_worker(env, "--model", "m")
    assert run.wait(timeout=60)
    s = run.summaries()[0]
    assert s["status"] == "ok" and s["receive_count"] == 2 and s["resumed"] == 4
    assert s["parts"][:2] == [[0, 2], [2, 4]] and s["parts"][-1][1] == 8
    keys = backend.store.list(calque_core.results_prefix(run.run_id, "c00000"))
    assert all(key.endswith(".npz") for key in keys if calque_core.PART_NAME.match(key.rsplit("/", 1)[1]))
    assert run.to_numpy().tobytes() == rows(range(8)).tobytes()
    assert [line["i"] for line in run.results()] == list(range(8))
    b.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0


def test_to_numpy_takes_its_field_from_the_first_claim_with_arrays():
    """A run whose first claim failed whole (no arrays in it): its rows are NaN, the next claim's arrays say what
    the result is; several arrays and no field named is a UserError naming them."""
    run = {"run_id": "m.r", "claim_size": 2, "items": 4}
    failed = calque_core.Part(['{"i":0,"ok":false,"error":"x"}\n', '{"i":1,"ok":false,"error":"x"}\n'], [])
    lines = ['{"i":2,"ok":true,"result":{"e":null,"n":null}}\n', '{"i":3,"ok":true,"result":{"e":null,"n":null}}\n']
    e = calque_core.Block("e", "float32", np.arange(2), np.ones((2, 3), np.float32))
    n = calque_core.Block("n", "int64", np.arange(2), np.arange(2))
    typed = calque_core.Part(lines, [e])
    out = calque_runs.run_array(run, [(0, "c00000", [failed]), (1, "c00001", [typed])])
    assert out.dtype == np.float32 and np.isnan(out[:2]).all() and (out[2:] == 1).all()
    with pytest.raises(calque.UserError, match=r"several arrays \(e, n\)"):
        calque_runs.run_array(run, [(0, "c00000", [failed]), (1, "c00001", [typed._replace(blocks=[e, n])])])
