"""Media in: bytes reach the handler as bytes (Python items, binary and HF Image columns), files as items (a
folder, a glob, an s3:// prefix), by reference where the workers can read them (a changed or vanished object fails
its item alone), claims cut by their media bytes, items over the limit refused, and the handler's collate run ahead
of the model. Real JPEG, PNG and WAV files, real workers, the embedded store and moto_server."""
import hashlib
import io
import json
import os
import signal
import wave

import pytest

import calque
import calque_core
import calque_runs
import calque_sources
from conftest import ROOT, backend_for, cli, start_worker, wait_for

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image", reason="Pillow is in requirements-dev.txt: make setup installs it")
HANDLERS = os.path.join(ROOT, "tests", "media_handlers.py")


def jpeg(width, height, color=(200, 30, 30), kind="JPEG"):
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, kind)
    return buf.getvalue()


def photo(width, height, seed):
    """A JPEG of noise, as large as a photo of its size (a flat colour compresses to nothing)."""
    buf = io.BytesIO()
    noise = hashlib.shake_256(str(seed).encode()).digest(width * height * 3)
    Image.frombytes("RGB", (width, height), noise).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def wav(frames, rate=16000):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(2 * frames))
    return buf.getvalue()


def photo_folder(root):
    """A user's folder: JPEGs, a PNG and a WAV in subfolders, an empty file, a corrupt JPEG (cut short), a WAV
    cut inside its header, and hidden files and folders that are not items. Returns {path: bytes} of the items."""
    files = {"a.jpg": jpeg(32, 24), "b/c.png": jpeg(8, 8, kind="PNG"), "b/d/e.jpg": jpeg(16, 16, (0, 0, 255)),
             "sound.wav": wav(1600), "empty.jpg": b"", "corrupt.jpg": jpeg(32, 24)[:200],
             "short.wav": wav(1600)[:30]}
    hidden = {".DS_Store": b"x", ".cache/f.jpg": jpeg(4, 4), "b/.thumb.jpg": jpeg(4, 4)}
    for name, data in {**files, **hidden}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def make_pool(env, handler="Decode", *extra, cwd):
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:{handler}", *extra, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return backend_for(env)


def result_lines(env, run_id, cwd, *extra):
    out = cli(env, "runs", "results", run_id, *extra, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def run_id_of(out):
    """The run id a waiting submit names in its first line."""
    return next(line.split()[1].rstrip(":") for line in out.stderr.splitlines() if line.startswith("run "))


def stored_bytes(backend, run_id):
    """Bytes the run keeps in the store besides its results (record, manifests, staged inputs, summaries)."""
    if backend.kind == "local":
        folder = os.path.join(backend.store.root, "runs", run_id)
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
                   if "/results" not in d)
    s3, store = backend.store.s3, backend.store
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket, Prefix=store._key(f"runs/{run_id}/"))
    return sum(o["Size"] for p in pages for o in p.get("Contents", []) if "/results/" not in o["Key"])


def staged(items, claim_size=1000):
    """Stage `items` on a fresh local store as submit does; every claim's manifest and its items as a worker
    reads them (calque.manifest_items)."""
    import tempfile
    backend = calque_core.LocalBackend(tempfile.mkdtemp(prefix="calque-media-"))
    queue = backend.queues.create_queue("calque-pool-t", 30)
    run = calque_runs.stage_run(backend, {"model": "t"}, items, claim_size, queue, "pool")
    texts = [backend.store.get(calque_core.manifest_key(run["run_id"], c)) for c in run["claims"]]
    items = [i for text in texts for i in calque_sources.manifest_items(backend.store, json.loads(text))]
    return run, [json.loads(text) for text in texts], items


def test_bytes_in_python_items_and_binary_columns_arrive_as_bytes():
    """bytes at any depth of a Python item, a binary column, an HF Image struct<bytes, path> column (a pyarrow
    Table, a DataFrame, a datasets.Dataset) reach the worker as bytes, b"" included, beside numeric and text
    columns; the manifest holds no byte of them as text (null in its place, one object of bytes beside it)."""
    import datasets
    import pandas
    img = jpeg(8, 8)
    items = [{"img": img, "meta": {"raw": [b"\x00\xff", b""], "n": 1}}, b"top-level", {"x": 2}]
    run, manifests, got = staged(items)
    assert got == items and type(got[1]) is bytes
    assert "bytes" in manifests[0] and img.hex() not in json.dumps(manifests[0]) and manifests[0]["items"][1] is None
    table = pa.table({"image": pa.array([{"bytes": img, "path": "a.jpg"}, {"bytes": None, "path": "b.jpg"}, None]),
                      "raw": pa.array([b"\x01", b"", None], pa.binary()), "label": [1, 2, 3], "text": ["a", "b", "c"]})
    want = [{"image": {"bytes": img, "path": "a.jpg"}, "raw": b"\x01", "text": "a", "label": 1},
            {"image": {"bytes": None, "path": "b.jpg"}, "raw": b"", "text": "b", "label": 2},
            {"image": None, "raw": None, "text": "c", "label": 3}]
    for source in (table, table.to_pandas(), datasets.Dataset(table)):
        run, manifests, got = staged(calque.as_items(source))
        assert got == want and "arrays" in manifests[0] and "bytes" in manifests[0], type(source)
    kinds = pa.table({"large": pa.array([b"ab", None, b"", b"c"], pa.large_binary()),
                      "fixed": pa.array([b"xy", b"zw", None, b"uv"], pa.binary(2)),
                      "deep": pa.array([{"a": {"b": b"1"}}, {"a": None}, None, {"a": {"b": b"4"}}]),
                      "listed": pa.array([[b"p", b"q"], [], None, [b""]], pa.list_(pa.binary()))})
    got = staged(calque.as_items(kinds), claim_size=3)[2]   # two claims: the second a slice of the batch
    assert got == kinds.to_pylist() and type(got[0]["large"]) is bytes and type(got[3]["listed"][0]) is bytes
    dataset = datasets.Dataset.from_dict({"image": [{"bytes": img, "path": "x.jpg"}]},
                                         features=datasets.Features({"image": datasets.Image()}))
    assert staged(calque.as_items(dataset))[2] == [{"image": {"bytes": img, "path": "x.jpg"}}]
    assert isinstance(pandas.DataFrame({"b": [b"x"]}), pandas.DataFrame)


def test_claims_are_cut_at_claim_bytes_and_an_item_over_the_limit_is_refused(monkeypatch):
    """A claim copied into the store holds CLAIM_BYTES of media at most (one item at least); the run records
    its irregular claim sizes so results read back in item order; an item over ITEM_BYTES_MAX is refused by
    index, a table's row by its row."""
    monkeypatch.setattr(calque_sources, "CLAIM_BYTES", 100)
    monkeypatch.setattr(calque_sources, "ITEM_BYTES_MAX", 150)
    items = [{"k": k, "b": bytes(40)} for k in range(5)] + [{"k": 5, "b": bytes(120)}, {"k": 6, "b": b""}]
    run, manifests, got = staged(items, claim_size=4)
    assert [m["count"] for m in manifests] == [2, 2, 1, 1, 1] and run["claim_counts"] == [2, 2, 1, 1, 1]
    assert got == items and [calque_core.claim_items(run, k) for k in range(5)] == [2, 2, 1, 1, 1]
    table = pa.table({"b": [bytes(40)] * 5 + [bytes(120)]})
    assert [m["count"] for m in staged(calque.as_items(table), claim_size=4)[1]] == [2, 2, 1, 1]
    with pytest.raises(calque.UserError, match=r"item 1: 151 B of media, over the limit of 150 B an item"):
        staged([{"b": b"x"}, {"b": bytes(151)}])
    with pytest.raises(calque.UserError, match=r"pyarrow.Table: row 2: 200 B of media, over the limit"):
        staged(calque_sources.TableItems.open(pa.table({"b": [b"", b"", bytes(200)]}), where="pyarrow.Table"))


def test_a_folder_of_files_by_reference_end_to_end(local_env, tmp_path):
    """`submit --pool M photos/ --id-field path`, as a user types it from their own folder, on the local store:
    one item a file (hidden ones skipped, an empty file an item), read by reference (the manifest names each file
    with its size and mtime; the run stores under 5 % of the media's bytes), decoded by the handler's collate; a
    corrupt JPEG and a truncated WAV fail alone with their decoder's message."""
    work = tmp_path / "work"
    files = photo_folder(work / "photos")
    make_pool(local_env, cwd=work)
    out = cli(local_env, "submit", "--pool", "m", "photos/", "--id-field", "path", cwd=work)
    assert out.returncode == 1 and "5 items ok, 2 failed" in out.stdout, out.stdout
    run_id = run_id_of(out)
    lines = {line["path"]: line for line in result_lines(local_env, run_id, work)}
    assert sorted(lines) == sorted(files)   # paths as found under photos/, hidden ones not items
    assert lines["a.jpg"]["result"]["shape"] == [24, 32, 3] and lines["b/c.png"]["result"]["shape"] == [8, 8, 3]
    assert lines["sound.wav"]["result"]["shape"] == [1600] and lines["a.jpg"]["result"]["type"] == "bytes"
    assert lines["empty.jpg"]["result"] == {"name": "empty.jpg", "type": "bytes", "shape": None,
                                            "sha": "e3b0c44298fc1c14", "size": 0}
    assert lines["corrupt.jpg"]["error"].startswith("OSError: ")        # Pillow's own message
    assert lines["short.wav"]["error"].startswith(("EOFError", "Error: "))   # wave's
    manifest = json.loads(backend_for(local_env).store.get(calque_core.manifest_key(run_id, "c00000")))
    stat = os.stat(work / "photos" / "a.jpg")
    assert manifest["refs"]["source"] == f"file://{work}/photos/" and "items" not in manifest
    assert manifest["refs"]["objects"][0] == ["a.jpg", stat.st_size, stat.st_mtime_ns]


def test_a_glob_and_mistakes_in_one_line(local_env, tmp_path):
    """A quoted glob ('photos/**/*.jpg') takes only its matches, paths under the folder before its first wildcard;
    a glob matching nothing, a folder with only hidden files, --columns with files, an s3:// input with the local
    store, --id-field other than path: one line each, exit 2, nothing staged."""
    work = tmp_path / "work"
    photo_folder(work / "photos")
    (work / "hidden" / ".x").parent.mkdir(parents=True)
    (work / "hidden" / ".x").write_bytes(b"x")
    make_pool(local_env, "Kinds", cwd=work)
    out = cli(local_env, "submit", "--pool", "m", "photos/**/*.jpg", "--id-field", "path", cwd=work)
    assert out.returncode == 0, out.stderr
    lines = result_lines(local_env, run_id_of(out), work)
    assert [line["path"] for line in lines] == ["a.jpg", "b/d/e.jpg", "corrupt.jpg", "empty.jpg"]
    assert lines[0]["result"] == {"path": "str", "bytes": ["bytes", len((work / "photos/a.jpg").read_bytes())]}
    for args, said in [(("photos/*.gif",), "photos/*.gif: no file there (hidden ones are skipped)"),
                       (("hidden",), "hidden: no file there"),
                       (("photos", "--columns", "x"), "--columns applies to Parquet or Arrow input, not to the files"),
                       (("s3://bucket/photos/",), "an s3:// input needs an s3:// store"),
                       (("photos", "--id-field", "name"), "--id-field 'name': no column of that name (path)")]:
        out = cli(local_env, "submit", "--pool", "m", *args, cwd=work)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
    assert len(calque_core.list_runs(backend_for(local_env))) == 1


def test_a_file_over_the_limit_is_refused_at_submit_by_name(local_env, tmp_path):
    """A file larger than ITEM_BYTES_MAX (a sparse file: nothing written) is refused at submit with its path and
    the limit, before a worker could meet it."""
    work = tmp_path / "work"
    (work / "videos").mkdir(parents=True)
    (work / "videos" / "small.bin").write_bytes(b"ok")
    with open(work / "videos" / "huge.bin", "wb") as f:
        f.truncate(calque_core.ITEM_BYTES_MAX + 1)
    make_pool(local_env, "Kinds", "--workers", "0", cwd=work)
    out = cli(local_env, "submit", "--pool", "m", "videos", "--wait-for-workers", "--no-wait", cwd=work)
    assert out.returncode == 2 and "videos: huge.bin: 256.0 MiB of media, over the limit of 256.0 MiB an item" \
        in out.stderr, out.stderr


@pytest.fixture
def idle_pool(request, tmp_path):
    """A pool of Decode with no worker yet, on the local store or moto_server (the parameter), run from a user's
    folder: (env, backend, work folder)."""
    env = request.getfixturevalue("local_env" if request.param == "local" else "aws_env")
    work = tmp_path / "work"
    work.mkdir()
    return env, make_pool(env, "Decode", "--workers", "0", "--batch-size", "2", cwd=work), work


def upload(backend, prefix, files):
    """Put {name: bytes} under s3://<the store's bucket>/<prefix>/ (outside the calque store's prefix)."""
    for name, data in files.items():
        backend.store.s3.put_object(Bucket=backend.store.bucket, Key=f"{prefix}/{name}", Body=data)
    return f"s3://{backend.store.bucket}/{prefix}/"


@pytest.mark.parametrize("idle_pool", ["local", "moto_server"], indirect=True)
def test_a_changed_or_vanished_object_fails_its_item_alone(idle_pool):
    """Between submit and claim one object is rewritten and one deleted: those two items fail, each naming its
    object and why; the others run. A local folder on the local store; an s3:// prefix (If-Match its ETag) on
    moto_server."""
    env, backend, work = idle_pool
    files = {f"p{k}.jpg": jpeg(10 + k, 10) for k in range(6)}
    if backend.kind == "local":
        for name, data in files.items():
            (work / name).write_bytes(data)
        source = "."
    else:
        source = upload(backend, "media", files)
    out = cli(env, "submit", "--pool", "m", source, "--id-field", "path", "--wait-for-workers", "--no-wait",
              cwd=work)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    if backend.kind == "local":
        (work / "p1.jpg").write_bytes(jpeg(99, 99))
        (work / "p4.jpg").unlink()
    else:
        upload(backend, "media", {"p1.jpg": jpeg(99, 99)})
        backend.store.s3.delete_object(Bucket=backend.store.bucket, Key="media/p4.jpg")
    worker = start_worker(env, "--model", "m")
    wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "the claim's summary")
    lines = {line["path"]: line for line in result_lines(env, run_id, work)}
    assert [p for p, line in sorted(lines.items()) if line["ok"]] == ["p0.jpg", "p2.jpg", "p3.jpg", "p5.jpg"]
    assert "p1.jpg: changed since submit (" in lines["p1.jpg"]["error"], lines["p1.jpg"]
    assert lines["p4.jpg"]["error"].endswith("p4.jpg: vanished since submit")
    assert lines["p0.jpg"]["result"]["sha"] == hashlib.sha256(files["p0.jpg"]).hexdigest()[:16]
    worker.send_signal(signal.SIGTERM)
    worker.wait(30)


def test_an_s3_prefix_is_read_where_it_is_and_a_local_folder_is_copied(aws_env, tmp_path):
    """On moto_server: `submit s3://bucket/media/` reads the objects by reference (ETag and size in the
    manifest, the run storing < 5 % of their bytes); the same files from a local folder are copied into the
    store, and submit says so in one line; a prefix over the calque store itself, and one in no bucket, are
    refused in one line."""
    work = tmp_path / "work"
    files = {f"img/{k:03d}.jpg": photo(128, 96, k) for k in range(40)}
    backend = make_pool(aws_env, "Decode", "--batch-size", "8", cwd=work if work.mkdir() is None else work)
    source = upload(backend, "media", files)
    out = cli(aws_env, "submit", "--pool", "m", source, "--id-field", "path", "--claim-size", "16", cwd=work)
    assert out.returncode == 0 and "40 items ok" in out.stdout, out.stdout + out.stderr
    run_id = run_id_of(out)
    lines = result_lines(aws_env, run_id, work)
    assert [line["path"] for line in lines] == sorted(files) and all(line["result"]["shape"] == [96, 128, 3]
                                                                     for line in lines)
    manifest = json.loads(backend.store.get(calque_core.manifest_key(run_id, "c00000")))
    name, size, etag = manifest["refs"]["objects"][0]
    assert (name, size, etag.startswith('"')) == ("img/000.jpg", len(files["img/000.jpg"]), True)
    media = sum(len(b) for b in files.values())
    assert stored_bytes(backend, run_id) < 0.05 * media, (stored_bytes(backend, run_id), media)
    worker_log = (tmp_path / "state" / "pools" / "m" / "worker-0.log").read_text()
    assert f"run {run_id} claim c00000: 16 items" in worker_log, worker_log   # the log of the run's worker
    assert "Connection pool is full" not in worker_log   # a kept connection a fetch thread (aws_client_config)
    for name, data in files.items():
        (work / "photos" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "photos" / name).write_bytes(data)
    out = cli(aws_env, "submit", "--pool", "m", "photos", "--id-field", "path", cwd=work)
    assert out.returncode == 0 and "40 items ok" in out.stdout, out.stdout + out.stderr
    assert "calque: photos: its files are copied into the store: the workers of s3://" in out.stderr
    copied = run_id_of(out)
    assert [line["result"]["sha"] for line in result_lines(aws_env, copied, work)] == \
        [line["result"]["sha"] for line in lines]
    assert stored_bytes(backend, copied) > media
    out = cli(aws_env, "submit", "--pool", "m", f"s3://{backend.store.bucket}/", cwd=work)
    assert out.returncode == 2 and "overlaps the calque store" in out.stderr, out.stderr
    out = cli(aws_env, "submit", "--pool", "m", "s3://no-such-bucket-here/img/", cwd=work)   # a misspelt bucket
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "s3://no-such-bucket-here/img/: NoSuchBucket" in out.stderr and "HINT: check the bucket's name" in out.stderr


def hf_parquet(path, images, row_group_size=None):
    """A Parquet file as Hugging Face datasets writes an Image column (struct<bytes, path>, its features in the
    schema metadata), with a label column."""
    import datasets
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": f"{k}.jpg"} for k, b in enumerate(images)],
                                     "label": list(range(len(images)))},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds.to_parquet(str(path), batch_size=row_group_size or 1000)
    assert pq.ParquetFile(path).schema_arrow.field("image").type == pa.struct([("bytes", pa.binary()),
                                                                               ("path", pa.string())])
    return path


@pytest.mark.parametrize("idle_pool", ["local", "moto_server"], indirect=True)
def test_a_parquet_of_hf_images(idle_pool):
    """A Parquet file as HF datasets writes an Image column: its rows arrive as {"image": {"bytes", "path"},
    "label"}. With the local store by reference (a row range a claim: its manifest holds a few hundred bytes), a
    file changed before its claims ran failing their items by name; on moto_server copied, said so."""
    env, backend, work = idle_pool
    images = [photo(20 + k % 7, 12, k) for k in range(30)]
    hf_parquet(work / "images.parquet", images, row_group_size=7)
    out = cli(env, "submit", "--pool", "m", "images.parquet", "--id-field", "label", "--claim-size", "10",
              "--wait-for-workers", "--no-wait", cwd=work)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    worker = start_worker(env, "--model", "m")
    wait_for(lambda: len(calque_core.read_summaries(backend, run_id)) == 3, 60, "three summaries")
    lines = result_lines(env, run_id, work)
    assert [line["label"] for line in lines] == list(range(30))
    assert [line["result"]["shape"] for line in lines] == [[12, 20 + k % 7, 3] for k in range(30)]
    manifest = json.loads(backend.store.get(calque_core.manifest_key(run_id, "c00001")))
    if backend.kind == "local":
        manifests = sum(len(backend.store.get(calque_core.manifest_key(run_id, c))) for c in ("c00000", "c00001", "c00002"))
        assert manifest["rows"]["files"][0][3:] == [10, 20] and manifests < 0.05 * sum(map(len, images))
        assert "copied" not in out.stderr
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        again = cli(env, "submit", "--pool", "m", "images.parquet", "--wait-for-workers", "--no-wait", cwd=work)
        hf_parquet(work / "images.parquet", images[::-1])   # rewritten before any worker claims the run
        worker = start_worker(env, "--model", "m")
        run_id = again.stdout.strip()
        wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "the summary")
        lines = result_lines(env, run_id, work)
        assert not any(line["ok"] for line in lines) and len(lines) == 30
        assert all(line["error"].startswith(f"{work}/images.parquet: changed since submit (") for line in lines)
    else:
        assert "bytes" in manifest and "calque: images.parquet: its media are copied into the store" in out.stderr
    worker.send_signal(signal.SIGTERM)
    worker.wait(30)


@pytest.mark.parametrize("idle_pool", ["local", "moto_server"], indirect=True)
def test_kill_9_mid_claim_by_reference_loses_nothing(idle_pool, tmp_path):
    """A worker SIGKILLed in the middle of a claim of files by reference: the claim comes back, another worker
    fetches the objects again and completes it; every item once, in order, none lost."""
    env, backend, work = idle_pool
    files = {f"{k:02d}.png": jpeg(5 + k, 5, kind="PNG") for k in range(9)}
    if backend.kind == "local":
        (work / "in").mkdir()
        for name, data in files.items():
            (work / "in" / name).write_bytes(data)
        source = "in"
    else:
        source = upload(backend, "killed", files)
    gate = tmp_path / "gate"
    gate.mkdir()
    gated = dict(env, GATE_DIR=str(gate))
    cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Decode", "--workers", "0",
        "--batch-size", "2", "--visibility-timeout", "3", cwd=work)
    victim = start_worker(gated, "--model", "m")
    out = cli(env, "submit", "--pool", "m", source, "--id-field", "path", "--no-wait", cwd=work)
    run_id = out.stdout.strip()
    wait_for(lambda: os.listdir(gate), 60, "the claim to start")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    (gate / "open").touch()
    survivor = start_worker(env, "--model", "m")
    done = wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "the redelivered claim's summary")[0]
    assert done["receive_count"] == 2 and done["ok"] == 9, done
    lines = result_lines(env, run_id, work)
    assert [line["path"] for line in lines] == sorted(files)
    assert [line["result"]["shape"] for line in lines] == [[5, 5 + k, 3] for k in range(9)]
    survivor.send_signal(signal.SIGTERM)
    survivor.wait(30)


def test_an_s3_listing_streams_a_page_at_a_time():
    """Listing an s3:// prefix of 2,500 objects hands out the first claim's 1,000 after one LIST page: claims go
    out while the listing goes on, and submit never holds the whole listing."""
    import boto3
    from moto import mock_aws
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bkt")
        for k in range(2500):
            s3.put_object(Bucket="bkt", Key=f"p/{k:05d}.bin", Body=b"x")
        items = calque_sources.read_items("s3://bkt/p/")
        requests = calque_core.Requests()
        items.source = calque_core.S3Store(s3, "bkt", "p", requests)
        chunks = items.claims(calque_runs.ClaimSizes(fixed=1000))
        first = next(chunks)
        assert (first[0], first[1], requests["store_lists"]) == (0, 1000, 1)
        assert [c[1] for c in chunks] == [2000, 2500] and requests["store_lists"] == 3


def test_collate_runs_ahead_on_more_threads_while_the_model_waits(local_env, tmp_path):
    """A handler whose collate (a decoder that releases the GIL) is slower than its model: the worker collates
    more batches ahead, on more threads, as long as the model waits on them (up to COLLATE_THREADS), says so in
    its log, and results stay in item order."""
    import warmd
    if warmd.COLLATE_THREADS < 2:
        pytest.skip("one core: no second collate thread would pay")
    work = tmp_path / "work"
    (work / "in").mkdir(parents=True)
    for k in range(24):
        (work / "in" / f"{k:02d}.png").write_bytes(jpeg(4 + k, 4, kind="PNG"))
    env = dict(local_env, COLLATE_SLEEP="0.1")
    backend = make_pool(env, "Decode", "--workers", "0", "--batch-size", "2", cwd=work)
    log = tmp_path / "worker.log"
    with open(log, "w") as f:
        worker = start_worker(env, "--model", "m", log=f)
        out = cli(env, "submit", "--pool", "m", "in", "--id-field", "path", "--wait-for-workers", cwd=work)
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert out.returncode == 0, out.stderr
    assert "batches ahead" in log.read_text(), log.read_text()
    lines = result_lines(env, run_id_of(out), work)
    assert [line["result"]["shape"][1] for line in lines] == [4 + k for k in range(24)]
    assert calque_core.read_summaries(backend, run_id_of(out))[0]["prefetch"] is True


def test_python_items_with_bytes_through_the_api_in_claims_cut_by_bytes(local_env, tmp_path, monkeypatch):
    """calque.submit() of Python items holding bytes, claims cut short at CLAIM_BYTES: a real worker receives each
    value as bytes; run.results() and `runs results` read the irregular claims back in item order."""
    monkeypatch.setattr(calque_sources, "CLAIM_BYTES", 1000)
    for key in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_POLL_WAIT", "CALQUE_ENV"):
        monkeypatch.setenv(key, local_env[key])
    monkeypatch.chdir(tmp_path)
    calque.Pool("m").create(handler=f"{HANDLERS}:Kinds", workers=1)
    items = [{"k": k, "raw": bytes(100 * (k % 7)), "nested": [b"x" * k]} for k in range(40)]
    run = calque.submit(items, pool="m")
    assert run.wait(120) and len(run.record["claims"]) > 2 and "claim_counts" in run.record
    want = [{"k": "int", "raw": ["bytes", 100 * (k % 7)], "nested": [["bytes", k]]} for k in range(40)]
    assert [line["result"] for line in run.results()] == want
    assert [json.loads(line)["result"] for line in cli(local_env, "runs", "results", run.run_id).stdout.splitlines()] == want
    calque.Pool("m").delete()
