"""Media out: a result's bytes (a dict's value, or the result itself) are stored as bytes and read back as bytes
by run.results(), as a binary column by to_arrow() and --format parquet, as {"$bytes": base64} in JSONL, and as
one file an item by `runs results RUN --files DIR`. Real PNGs and WAVs from a real pool's worker, both spellings."""
import base64
import io
import json
import os
import subprocess
import wave

import pytest

import calque
import calque_core
import calque_runs
from conftest import PY, ROOT, backend_for, cli, start_worker

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image", reason="Pillow is in requirements-dev.txt: make setup installs it")
HANDLERS = os.path.join(ROOT, "tests", "media_handlers.py")
BIN = os.path.dirname(PY)
SPELLINGS = {"script": [PY, os.path.join(ROOT, "calque.py")], "installed": [os.path.join(BIN, "calque")]}

from media_handlers import png, wav   # noqa: E402  (the handler's own makers: what it returns, made here)


def image(kind):
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buf, kind)
    return buf.getvalue()


# one file of each kind --files names, and bytes of no known kind
KINDS = {".png": lambda: png((9, 9, 9)), ".jpg": lambda: image("JPEG"), ".gif": lambda: image("GIF"),
         ".webp": lambda: image("WEBP"), ".wav": lambda: wav(10), ".flac": lambda: b"fLaC\x00\x00\x00\x22",
         ".mp3": lambda: b"ID3\x04\x00\x00\x00\x00\x00\x00", ".ogg": lambda: b"OggS\x00\x02",
         ".pdf": lambda: b"%PDF-1.4\n%%EOF\n", ".bin": lambda: b"\x00\x01RIFF"}
# items of the dict-shaped run: ids that need making safe, one twice, one that is nothing once safe (named by
# its index, 3), one that ends in its PNG's extension already, one that is another's index name, a failure
ITEMS = [{"name": "cat/1 a", "color": [255, 0, 0], "frames": 100}, {"name": "cat/1 a", "color": [0, 255, 0],
         "frames": 200}, {"name": "dog", "color": [0, 0, 0], "frames": 1, "fail": 1},
         {"name": "../..", "color": [0, 0, 255], "frames": 300}, {"name": "owl.PNG", "color": [9, 9, 9], "frames": 0},
         {"name": "3", "color": [1, 1, 1], "frames": 5}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A local pool of Generate and two runs on it: ITEMS by --id-field name (a dict of PNG, WAV and text a
    result), and eleven bare bytes results, one of each kind and a failure (no id field). Yields (env, work,
    dict run id, bare run id, the bare run's bytes)."""
    root = tmp_path_factory.mktemp("media-out")
    env = dict(os.environ, CALQUE_STORE=str(root / "store"), CALQUE_STATE=str(root / "state"), CALQUE_POLL_WAIT="1",
               CALQUE_GRACE="5", PYTHONUNBUFFERED="1", CALQUE_ENV=str(root / "none.env"))
    work = root / "work"
    work.mkdir()
    (work / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    blobs = [make() for make in KINDS.values()]
    (work / "blobs.jsonl").write_text("".join(json.dumps({"blob": b.hex()}) + "\n" for b in blobs) +
                                      json.dumps({"blob": "00", "fail": 1}) + "\n")
    made = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Generate", "--workers", "1", cwd=work)
    assert made.returncode == 0, made.stderr
    try:
        ids = []
        for args in (("items.jsonl", "--id-field", "name"), ("blobs.jsonl",)):
            out = cli(env, "submit", "--pool", "m", *args, cwd=work)
            assert out.returncode == 1 and "1 failed" in out.stdout, out.stdout + out.stderr   # the failure alone
            ids.append(calque_core.list_runs(backend_for(env))[-1]["run_id"])
        yield env, work, ids[0], ids[1], blobs
    finally:
        cli(env, "pool", "delete", "--model", "m", "--yes", cwd=work)


def test_extensions_are_told_from_magic_bytes():
    """PNG, JPEG, GIF, WebP (Pillow's), WAV (wave's), FLAC, MP3 (ID3), OGG and PDF headers get their extension;
    other bytes, a RIFF of neither kind and no bytes at all get .bin."""
    for ext, make in KINDS.items():
        assert calque.file_extension(make()) == ext, ext
    assert calque.file_extension(b"RIFF\x00\x00\x00\x00AVI LIST") == calque.file_extension(b"") == ".bin"


def test_bytes_read_back_as_bytes_through_the_api(runs):
    """run.results() gives bytes, equal to what the handler returned; to_arrow() a binary column (the failed
    item null), the text field a string column beside it; to_pandas() bytes objects; a bare result is a binary
    `result` column; to_numpy() of bytes is refused in one line naming to_arrow()."""
    env, _, dicts, bare, blobs = runs
    run = calque.Run(dicts, store=env["CALQUE_STORE"])
    results = list(run.results())
    pngs = [None if "fail" in item else png(item["color"]) for item in ITEMS]
    wavs = [None if "fail" in item else wav(item["frames"]) for item in ITEMS]
    assert [r["result"]["png"] if r["ok"] else None for r in results] == pngs
    assert [r["result"]["wav"] if r["ok"] else None for r in results] == wavs
    assert type(results[0]["result"]["png"]) is bytes and results[0]["result"]["label"] == "100 frames"
    table = run.to_arrow()
    assert table.schema.field("png").type == pa.binary() and table.schema.field("label").type == pa.string()
    assert table["png"].to_pylist() == pngs and table["wav"].to_pylist() == wavs
    assert table["name"].to_pylist() == [item["name"] for item in ITEMS]
    assert type(run.to_pandas()["wav"][4]) is bytes
    with pytest.raises(calque.UserError, match="png cannot stack into one array .its values are bytes.*to_arrow"):
        run.to_numpy("png")
    run = calque.Run(bare, store=env["CALQUE_STORE"])
    assert [r.get("result") for r in run.results()] == blobs + [None]
    assert run.to_arrow()["result"].to_pylist() == blobs + [None]
    assert run.to_arrow().schema.field("result").type == pa.binary()


def test_jsonl_and_parquet_hold_the_bytes(runs, tmp_path):
    """`runs results` prints bytes as {"$bytes": base64} (that alone: the line is plain JSON), decoding equal;
    --format parquet writes a binary column equal to the bytes."""
    env, work, dicts, bare, blobs = runs
    lines = [json.loads(line) for line in cli(env, "runs", "results", dicts, cwd=work).stdout.splitlines()]
    assert lines[0]["result"]["png"] == {"$bytes": base64.b64encode(png(ITEMS[0]["color"])).decode()}
    assert lines[0]["name"] == "cat/1 a" and lines[2]["ok"] is False and "asked to fail" in lines[2]["error"]
    bare_lines = [json.loads(line) for line in cli(env, "runs", "results", bare, cwd=work).stdout.splitlines()]
    assert [base64.b64decode(line["result"]["$bytes"]) for line in bare_lines[:-1]] == blobs
    out = cli(env, "runs", "results", dicts, "--format", "parquet", "--output", str(tmp_path / "r.parquet"), cwd=work)
    assert out.returncode == 0, out.stderr
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.schema.field("png").type == pa.binary()
    assert table["png"].to_pylist() == [None if "fail" in item else png(item["color"]) for item in ITEMS]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_files_one_an_item_named_by_id_or_index(runs, tmp_path, spelling):
    """--files DIR --field png: one file an item, named by its id made safe (a clash, or an id with nothing safe
    in it, takes the item's index), its kind's extension added unless the id ends in it; the bare run's files by their zero-padded index, each with its kind's
    extension; the failed item skipped and counted in the one line on stderr."""
    env, work, dicts, bare, blobs = runs

    def files(*args):
        out = subprocess.run(SPELLINGS[spelling] + ["runs", "results", *args], env=env, cwd=work,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout == "", out.stderr
        return out.stderr.strip()
    said = files(dicts, "--files", str(tmp_path / "png"), "--field", "png")
    size = sum(len(png(item["color"])) for item in ITEMS if "fail" not in item)
    assert said == (f"runs results: wrote 5 files, {size:,} bytes, to {tmp_path / 'png'}; "
                    f"skipped 1 (failed, or without field 'png')")
    assert {p.name: p.read_bytes() for p in (tmp_path / "png").iterdir()} == {
        "cat_1_a.png": png(ITEMS[0]["color"]), "cat_1_a-1.png": png(ITEMS[1]["color"]),
        "3.png": png(ITEMS[3]["color"]), "owl.PNG": png(ITEMS[4]["color"]), "3-5.png": png(ITEMS[5]["color"])}
    files(dicts, "--files", str(tmp_path / "wav"), "--field", "wav")
    with wave.open(str(tmp_path / "wav" / "cat_1_a-1.wav")) as w:
        assert w.getnframes() == 200
    assert (tmp_path / "wav" / "owl.PNG.wav").read_bytes() == wav(ITEMS[4]["frames"])   # another kind: its own
    assert "wrote 10 files" in files(bare, "--files", str(tmp_path / "bare"))
    named = [f"{k:02d}{ext}" for k, ext in enumerate(KINDS)]
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == sorted(named)
    assert [(tmp_path / "bare" / name).read_bytes() for name in named] == blobs


def test_files_mistakes_in_one_line(runs, tmp_path):
    """No such field, a field that is not bytes, a dict result without --field, DIR an existing file, --files
    with --format: one line each naming the next step, exit 2, no file written."""
    env, work, dicts, bare, _ = runs
    (tmp_path / "taken").write_text("x")
    for args, said in [((dicts, "--field", "nope"), "no result has the field 'nope': its results have 'png', "
                                                    "'wav', 'label' ---> HINT: --field png"),
                       ((dicts, "--field", "label"), "field 'label' is not bytes (item 0: str), and --files "
                                                     "writes bytes ---> HINT: --field png (its bytes)"),
                       ((dicts,), "the result is not bytes (item 0: dict), and --files writes bytes ---> HINT: "
                                  "--field png (its bytes)"),
                       ((bare, "--files", str(tmp_path / "taken")), "that is a file, not a folder"),
                       ((bare, "--format", "parquet"), "--files writes one file an item into a folder: not "
                                                       "with --format")]:
        where = [] if "--files" in args else ["--files", str(tmp_path / "out")]
        out = cli(env, "runs", "results", *args, *where, cwd=work)
        assert out.returncode == 2 and said in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "out")   # a refusal makes no folder


def test_bytes_out_on_moto_server(aws_env, tmp_path):
    """On SQS + S3 (moto_server), a worker's bytes results come back as bytes: run.results(), a binary column,
    --files by index."""
    (tmp_path / "blobs.jsonl").write_text("".join(json.dumps({"blob": make().hex()}) + "\n"
                                                  for make in (KINDS[".png"], KINDS[".wav"])))
    made = cli(aws_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Generate", "--workers", "0",
               cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    worker = start_worker(aws_env, "--model", "m")
    out = cli(aws_env, "submit", "--pool", "m", "blobs.jsonl", "--wait-for-workers", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run = calque.Run(calque_core.list_runs(backend_for(aws_env))[-1]["run_id"], store=aws_env["CALQUE_STORE"])
    assert [r["result"] for r in run.results()] == [KINDS[".png"](), KINDS[".wav"]()]
    assert run.to_arrow().schema.field("result").type == pa.binary()
    out = cli(aws_env, "runs", "results", run.run_id, "--files", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 0 and sorted(os.listdir(tmp_path / "out")) == ["0.png", "1.wav"], out.stderr
    worker.terminate()
    assert worker.wait(30) == 0


def test_a_field_of_bytes_and_numbers_is_one_text_column():
    """A field that is bytes in one result and a number in another fits no Arrow type: its column is each value's
    JSON text, bytes in their JSONL form, as any field of mixed types is."""
    import warmd
    lines, _, _ = warmd.format_outcome([(True, {"x": b"\x01\x02"}), (True, {"x": 2}), (True, {"x": None})], 0)
    suffix, data = calque_core.encode_part(lines)
    text, blocks = calque_core.decode_npz_part(data)
    part = calque_core.Part([line + "\n" for line in text[:-1].split("\n")], blocks)
    batch = calque_runs.claim_batch(None, {"options": {}}, "c00000", [part])
    assert suffix == ".npz" and batch["x"].to_pylist() == ['{"$bytes":"AQI="}', "2", None]
