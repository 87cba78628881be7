"""The source contract (docs/contract.md, "Sources"): every input kind, behind the one interface,
counts or streams its items, cuts them into claims, stages each claim (by copy or by reference),
and reads each back as a worker (read_claim) and the results (claim_field) do. The same checks
run on every kind; a kind added is one more row in KINDS."""
import ast
import glob
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import HANDLERS, PY, ROOT, backend_for
import calque_core
import calque_runs
import calque_sources

N = 7
SPELLINGS = {"script": [PY, os.path.join(ROOT, "calque.py")],
             "installed": [os.path.join(os.path.dirname(PY), "calque")]}
ROWS = [{"id": f"k{i}", "x": i} for i in range(N)]
MEDIA = [dict(row, img=bytes([i]) * (i + 1)) for i, row in enumerate(ROWS)]
FILES = [{"path": f"d/{i:02d}.bin", "bytes": bytes([65 + i]) * (i + 1)} for i in range(N)]


def jsonl(tmp):
    path = tmp / "items.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return calque_sources.read_items(str(path))


def npz(tmp):
    ragged = [list(range(i % 3)) for i in range(N)]
    np.savez(tmp / "items.npz", x=np.arange(N), v=np.array(sum(ragged, []), np.int64),
             v_offsets=np.cumsum([0] + [len(r) for r in ragged]))
    return calque_sources.read_items(str(tmp / "items.npz"))


def parquet(rows, tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp / "items.parquet", row_group_size=3)
    return calque_sources.read_items(str(tmp / "items.parquet"))


def folder(tmp):
    for f in FILES:
        os.makedirs(tmp / "in" / os.path.dirname(f["path"]), exist_ok=True)
        (tmp / "in" / f["path"]).write_bytes(f["bytes"])
    (tmp / "in" / ".hidden").write_bytes(b"skipped")
    return calque_sources.read_items(str(tmp / "in"))


def table(rows):
    import pyarrow as pa
    return calque_sources.as_items(pa.Table.from_pylist(rows))


# name: (the source, made fresh; its count (None: a stream); the items read back; an id field)
KINDS = {
    "jsonl": (jsonl, None, ROWS, "id"),
    "list": (lambda tmp: calque_sources.as_items(list(ROWS)), N, ROWS, "id"),
    "iterable": (lambda tmp: calque_sources.as_items(iter(ROWS)), None, ROWS, "id"),
    "python bytes": (lambda tmp: calque_sources.as_items(list(MEDIA)), N, MEDIA, "id"),
    "npy": (lambda tmp: calque_sources.as_items(np.arange(N)), N, [{"input": i} for i in range(N)],
            "input"),
    "npz ragged": (npz, N, [{"x": i, "v": list(range(i % 3))} for i in range(N)], "x"),
    "arrow table": (lambda tmp: table(ROWS), N, ROWS, "id"),
    "arrow media copied": (lambda tmp: table(MEDIA), N, MEDIA, "id"),
    "parquet": (lambda tmp: parquet(ROWS, tmp), N, ROWS, "id"),
    "parquet media by reference": (lambda tmp: parquet(MEDIA, tmp), N, MEDIA, "id"),
    "pandas": (lambda tmp: calque_sources.as_items(__import__("pandas").DataFrame(ROWS)), N, ROWS,
               "x"),
    "hf dataset": (lambda tmp: calque_sources.as_items(__import__("datasets").Dataset.from_list(ROWS)),
                   N, ROWS, "id"),
    "folder by reference": (folder, None, FILES, "path"),
}


def plain(value):
    """A read-back value as plain Python: numpy scalars and arrays, memoryviews made plain."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return bytes(value) if isinstance(value, memoryview) else value


def kind_of(source):
    return type(source).__name__


def check_source(backend, make, count, expected, field, form=None):
    """The contract on one kind: its count, its claims' cut, the run staged, each claim read back
    by a worker and by the results, a missing --id-field refused."""
    source = make()
    assert source.count == count
    counted = source.counted()   # a stream read in; a listing is never counted (listed twice)
    assert (counted is None) == (kind_of(source) == "FileItems") and (counted is None or counted.count == N)
    source = make()
    source.place(backend, {"model": "s"})   # by reference or by copy: first, as stage_run does
    sizes = calque_runs.ClaimSizes(fixed=3)
    assert [(start, stop) for start, stop, _, _ in source.claims(sizes)] == [(0, 3), (3, 6), (6, 7)]
    with pytest.raises(calque_core.UserError, match="--id-field 'nope'"):
        list(make().with_id_field("nope").claims(calque_runs.ClaimSizes(fixed=3)))
    queue = backend.queues.create_queue(f"calque-pool-s{os.urandom(3).hex()}", 30)
    run = calque_runs.stage_run(backend, {"model": "s"}, make().with_id_field(field), 3, queue,
                                "pool")
    assert run["items"] == N and len(run["claims"]) == 3
    got, ids, forms = [], [], set()
    with ThreadPoolExecutor(2) as fetchers:
        for claim in run["claims"]:
            manifest = json.loads(backend.store.get(calque_core.manifest_key(run["run_id"], claim)))
            forms |= {"rows", "refs", "arrays", "bytes"} & set(manifest)
            items = calque_sources.read_claim(backend, manifest, fetchers)
            got += [plain(items[k]) for k in range(len(items))]
            items.close()
            ids += calque_sources.claim_field(backend.store, manifest, field)
    assert got == expected
    assert ids == [e[field] for e in expected]
    if form:
        assert form in forms, forms


FORMS = {"npy": "arrays", "npz ragged": "arrays", "python bytes": "bytes", "arrow media copied": "bytes",
         "parquet media by reference": "rows", "folder by reference": "refs", "parquet": "arrays"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_keeps_the_source_contract(tmp_path, kind):
    make, count, expected, field = KINDS[kind]
    backend = calque_core.LocalBackend(str(tmp_path / "store"))
    check_source(backend, lambda: make(tmp_path), count, expected, field, FORMS.get(kind))


def test_s3_prefixes_and_copied_folders_keep_the_source_contract(aws_env, tmp_path):
    """On an s3:// store: an s3:// prefix is read where it is (refs), a local folder is copied into
    the store (its bytes): both read back alike."""
    import boto3
    backend = backend_for(aws_env)
    s3 = boto3.client("s3", endpoint_url=aws_env["AWS_ENDPOINT_URL"])
    bucket = f"inputs-{os.urandom(4).hex()}"
    s3.create_bucket(Bucket=bucket)
    for f in FILES:
        s3.put_object(Bucket=bucket, Key=f"p/{f['path']}", Body=f["bytes"])
    check_source(backend, lambda: calque_sources.read_items(f"s3://{bucket}/p/"), None, FILES, "path",
                 "refs")
    check_source(backend, lambda: folder(tmp_path), None, FILES, "path", "bytes")


def test_no_dispatch_on_input_kinds_outside_the_sources():
    """No isinstance or issubclass on a source's class outside calque_sources.py: a new kind is one
    class there, and every other part asks the interface."""
    kinds = {n.name for n in ast.walk(ast.parse(open(os.path.join(ROOT, "calque_sources.py")).read()))
             if isinstance(n, ast.ClassDef)}
    found = []
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "modal_shim", "*.py")):
        if path.endswith("calque_sources.py"):
            continue
        for call in ast.walk(ast.parse(open(path).read())):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("isinstance", "issubclass"):
                named = {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(call.args[1])}
                if named & kinds:
                    found.append(f"{os.path.basename(path)}:{call.lineno}")
    assert kinds >= {"Source", "JsonLines", "Items", "ArrayItems", "TableItems", "FileItems"} and not found, found


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_newcomers_inputs_get_one_line_each(local_env, tmp_path, spelling):
    """From a folder of one's own, on a pool with no measured claim: a plan of arrays (a traceback,
    'ArrayItems' object is not subscriptable, before sources) and an --id-field no item or column
    has are refused in one line naming the next step, whatever the input kind; nothing queued."""
    def calque(*args):
        return subprocess.run(SPELLINGS[spelling] + list(args), env=local_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert calque("pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
                  "--workers", "0").returncode == 0
    np.save(tmp_path / "a.npy", np.arange(6.0))
    folder(tmp_path)
    jsonl(tmp_path)
    out = calque("plan", "--pool", "m", "a.npy")
    assert out.returncode == 2 and out.stderr.startswith("calque: error: a.npy: a plan's sample claim ")
    assert "HINT: run a first claim on the pool" in out.stderr and len(out.stderr.splitlines()) == 1
    for items, says in [("items.jsonl", "item 0 has no such field"), ("a.npy", "no array of that name (input)"),
                        ("in", "no column of that name (path)")]:
        out = calque("submit", "--pool", "m", items, "--id-field", "nope", "--wait-for-workers")
        assert out.returncode == 2 and out.stderr == f"calque: error: --id-field 'nope': {says}" + (
            " ---> HINT: give every item one, or drop --id-field\n" if items.endswith("jsonl") else "\n")
    assert calque("runs", "list", "--json").stdout.strip() == "[]"
