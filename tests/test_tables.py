"""Parquet and Arrow input: one item a row, numeric columns as numpy views, the rest as JSON; nulls carried."""
import json
from decimal import Decimal

import numpy as np
import pytest

import calque
import calque_core
import calque_runs
import calque_sources
from conftest import HANDLERS, cli

pa = pytest.importorskip("pyarrow", reason="pyarrow is in requirements.txt: make setup installs it")
pq = pytest.importorskip("pyarrow.parquet")


def table():
    return pa.table({
        "text": ["a b", None, "c", "d e f"],
        "n": pa.array([1, None, 3, 4], pa.int64()),
        "ok": [True, False, None, True],
        "v": pa.array([[1.5, 2.0], None, [], [3.0]], pa.list_(pa.float32())),
        "xy": pa.array([[1, 2], [3, 4], [5, 6], [7, 8]], pa.list_(pa.int16(), 2)),
        "meta": [{"a": 1, "tags": ["x"]}, None, {"a": None, "tags": []}, {"a": 4, "tags": None}],
        "day": pa.array([0, 1, None, 3], pa.date32()),
    })


def staged(items, claim_size=3):
    """Stage `items` on a fresh local backend and read every claim back as the worker does."""
    backend = calque_core.LocalBackend(_tmp())
    queue = backend.queues.create_queue("calque-pool-t", 30)
    run = calque_runs.stage_run(backend, {"model": "t"}, items, claim_size, queue, "pool")
    got = []
    for claim in run["claims"]:
        manifest = json.loads(backend.store.get(calque_core.manifest_key(run["run_id"], claim)))
        got += calque_sources.array_items(backend.store, manifest) if "arrays" in manifest else manifest["items"]
    return run, got


def _tmp():
    import tempfile
    return tempfile.mkdtemp(prefix="calque-tables-")


def test_rows_nulls_and_nested_columns_are_carried(tmp_path):
    """Every row is an item; numeric columns arrive as numpy (views), null as None; structs, lists of text and dates
    as JSON values; claims cut across row groups."""
    pq.write_table(table(), tmp_path / "t.parquet", row_group_size=3)
    items = calque_sources.read_items(str(tmp_path / "t.parquet"))
    assert items.count == 4 and sorted(items.numeric) == ["n", "ok", "v", "xy"]
    run, got = staged(items, claim_size=3)
    assert run["items"] == 4 and len(run["claims"]) == 2
    assert [g["text"] for g in got] == ["a b", None, "c", "d e f"]
    assert [g["n"] for g in got] == [1, None, 3, 4] and isinstance(got[0]["n"], np.int64)
    assert [g["ok"] for g in got] == [True, False, None, True]
    assert got[1]["v"] is None and got[2]["v"].tolist() == [] and got[0]["v"].dtype == np.float32
    assert got[0]["v"].tolist() == [1.5, 2.0] and got[3]["v"].tolist() == [3.0]
    assert [g["xy"].tolist() for g in got] == [[1, 2], [3, 4], [5, 6], [7, 8]] and got[0]["xy"].dtype == np.int16
    assert [g["meta"] for g in got] == [{"a": 1, "tags": ["x"]}, None, {"a": None, "tags": []},
                                        {"a": 4, "tags": None}]
    assert [g["day"] for g in got] == ["1970-01-01", "1970-01-02", None, "1970-01-04"]


def test_folder_glob_columns_and_arrow_files(tmp_path):
    """A folder or a glob of Parquet files is read in name order; --columns reads only those; .arrow/.feather
    files (Arrow IPC) are read the same way."""
    import pyarrow.feather as feather
    (tmp_path / "parts").mkdir()
    for k in range(3):
        pq.write_table(pa.table({"i": [2 * k, 2 * k + 1], "s": ["x", "y"]}), tmp_path / "parts" / f"{k}.parquet")
    for source in (str(tmp_path / "parts"), str(tmp_path / "parts" / "*.parquet")):
        _, got = staged(calque_sources.read_items(source, ["i"]))
        assert [g for g in got] == [{"i": i} for i in range(6)]
    feather.write_feather(pa.table({"s": ["p", "q"]}), str(tmp_path / "t.feather"))
    assert staged(calque_sources.read_items(str(tmp_path / "t.feather")))[1] == [{"s": "p"}, {"s": "q"}]


@pytest.mark.parametrize("make, problem", [
    (lambda p: pq.write_table(pa.table({"d": pa.array([Decimal("1.5")])}), p / "t.parquet"),
     r"column 'd' is decimal128\(2, 1\), which has no JSON"),
    (lambda p: pq.write_table(pa.table({"v": pa.array([[1.0, None]], pa.list_(pa.float64()))}), p / "t.parquet"),
     "row 0, column 'v': a null inside a list of numbers"),
    (lambda p: (p / "t.parquet").write_bytes(b"not parquet at all"), "not a Parquet file"),
])
def test_bad_tables_refused_in_one_line(tmp_path, make, problem):
    make(tmp_path)
    with pytest.raises(calque.UserError, match=problem):
        staged(calque_sources.read_items(str(tmp_path / "t.parquet")))


def test_user_mistakes(local_env, tmp_path):
    """An unknown column, files of two schemas, --columns on JSONL, an empty glob: one line, exit 2."""
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [1]}), tmp_path / "b.parquet")
    (tmp_path / "x.jsonl").write_text('{"x": 1}\n')
    for args, said in [((str(tmp_path / "a.parquet"), "--columns", "txt"), "no column 'txt' (did you mean text?) ---> HINT: its columns: text"),
                       ((str(tmp_path / "*.parquet"),), "b.parquet: its columns differ from"),
                       ((str(tmp_path / "x.jsonl"), "--columns", "x"), "--columns applies to Parquet"),
                       ((str(tmp_path / "none" / "*.parquet"),), "no .parquet file there")]:
        out = cli(local_env, "submit", "--model", "t", "--handler", f"{HANDLERS}:Types", *args)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_parquet_end_to_end(local_env, tmp_path):
    """submit data.parquet --columns to a real worker: each row's fields arrive as the handler reads them."""
    pq.write_table(table(), tmp_path / "t.parquet")
    out = cli(local_env, "submit", "--model", "t", "--handler", f"{HANDLERS}:Types", str(tmp_path / "t.parquet"),
              "--columns", "text,n,v", "--claim-size", "3", "--id-field", "n")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in cli(local_env, "runs", "results", out.stdout.split()[1]).stdout.splitlines()]
    assert [line["result"]["text"] for line in lines] == [["str", "a b"], ["NoneType", None], ["str", "c"],
                                                           ["str", "d e f"]]
    assert [line["result"]["v"] for line in lines] == [["ndarray", [1.5, 2.0]], ["NoneType", None],
                                                        ["ndarray", []], ["ndarray", [3.0]]]
    assert [line["n"] for line in lines] == [1, None, 3, 4]


def test_api_takes_tables_dataframes_and_datasets():
    """submit()'s input: a pyarrow.Table, a pandas DataFrame, a Hugging Face datasets.Dataset, with columns=."""
    want = [{"text": "a", "n": 1}, {"text": "b", "n": 2}]
    t = pa.table({"text": ["a", "b"], "n": [1, 2], "skip": [0.5, 0.25]})
    assert staged(calque.as_items(t, ["text", "n"]))[1] == want
    pd = pytest.importorskip("pandas", reason="pandas (requirements-dev.txt) is not installed")
    assert staged(calque.as_items(pd.DataFrame({"text": ["a", "b"], "n": [1, 2]})))[1] == want
    datasets = pytest.importorskip("datasets", reason="datasets (requirements-dev.txt) is not installed")
    assert staged(calque.as_items(datasets.Dataset.from_dict({"text": ["a", "b"], "n": [1, 2]})))[1] == want
