"""make bench: media in. What a run stores besides its results when it reads its media by reference, what
`submit` holds in memory while it stages a large Parquet of images, and what decoding ahead of the model buys.

    .venv/bin/python bench/bench_media_in.py                     # every section
    .venv/bin/python bench/bench_media_in.py rss                 # one: reference rss listing prefetch
    BENCH_PARQUET_GB=0.5 .venv/bin/python bench/bench_media_in.py rss

reference  a folder of photos (noise JPEGs, as large as real ones) on the local store, and the same files under an
           s3:// prefix on moto_server, read by reference; the folder copied into the s3:// store beside them;
rss        a `calque submit` process's peak RSS staging a Parquet of BENCH_PARQUET_GB GB of HF Image rows: by
           reference (the local store), and copied (as with an s3:// store, written to a local store here);
listing    `calque submit` by reference of a folder of BENCH_LISTING_FILES small files (the local store), flat and
           in folders of 1000, and of an s3:// prefix of BENCH_LISTING_OBJECTS on moto_server: seconds to its first
           claim queued and to its exit, its peak RSS;
prefetch   the image job (Pillow decode in collate, a small conv net) in one worker, collate beside the model
           (adding threads while the model waits) against collate on the model's thread.
"""
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_pool import make_pool, start_moto   # noqa: E402  (sets the dummy AWS environment)
from common import chosen                      # noqa: E402
import calque  # noqa: E402
import warmd   # noqa: E402
import calque_core
import calque_runs
import calque_sources

PHOTOS = int(os.environ.get("BENCH_PHOTOS", "400"))              # photos of the reference section
PARQUET_GB = float(os.environ.get("BENCH_PARQUET_GB", "2"))     # the rss section's Parquet of images
LISTING_FILES = int(os.environ.get("BENCH_LISTING_FILES", "1000000"))     # the listing section's folder
LISTING_OBJECTS = int(os.environ.get("BENCH_LISTING_OBJECTS", "50000"))    # and its s3:// prefix
PREFETCH_IMAGES = int(os.environ.get("BENCH_PREFETCH_IMAGES", "768"))
HANDLER = os.path.join(ROOT, "bench", "media_model.py") + ":ImageNet"


def photo(width, height, seed):
    """A noise JPEG: as many bytes as a photo of its size (a flat image compresses to nothing)."""
    import hashlib
    from PIL import Image
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), hashlib.shake_256(str(seed).encode()).digest(width * height * 3)).save(
        buf, "JPEG", quality=90)
    return buf.getvalue()


def stored(backend, run_id):
    """(bytes besides results, bytes of results) the run keeps in the store."""
    if backend.kind == "local":
        folder = os.path.join(backend.store.root, "runs", run_id)
        sizes = [(d, os.path.getsize(os.path.join(d, f))) for d, _, fs in os.walk(folder) for f in fs]
        return sum(n for d, n in sizes if "/results" not in d), sum(n for d, n in sizes if "/results" in d)
    pages = backend.store.s3.get_paginator("list_objects_v2").paginate(
        Bucket=backend.store.bucket, Prefix=backend.store._key(f"runs/{run_id}/"))
    sizes = [(o["Key"], o["Size"]) for p in pages for o in p.get("Contents", [])]
    return sum(n for k, n in sizes if "/results/" not in k), sum(n for k, n in sizes if "/results/" in k)


def run_in_process(store, state, source, name):
    """Submit `source` to a fresh pool of the image handler and drain it with one in-process worker: (backend,
    run id, summaries)."""
    conf, backend, record = make_pool(store, state, HANDLER, model=name, batch_size=32)
    queue = backend.queues.open_queue(record["queue"])
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix(name), conf, False)
    worker.start()
    run = calque_runs.stage_run(backend, record, calque_sources.read_items(source), 100, queue, "pool")
    while len(calque_core.list_summaries(backend, run["run_id"])) < len(run["claims"]):
        worker.handle(queue.receive(1))
    summaries = calque_core.read_summaries(backend, run["run_id"])
    assert all(s["status"] == "ok" for s in summaries), [s["errors"] for s in summaries]
    return backend, run["run_id"], summaries


def reference(tmp):
    folder = os.path.join(tmp, "photos")
    os.makedirs(folder)
    files = {f"{k:05d}.jpg": photo(320, 240, k) for k in range(PHOTOS)}
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    media = sum(map(len, files.values()))
    print(f"\n1. stored besides results, {PHOTOS} photos (320x240 JPEG, {media / PHOTOS / 1024:.0f} KiB each, "
          f"{media / 2**20:.1f} MiB), claims of 100")
    import boto3
    s3 = boto3.client("s3")
    for name, data in files.items():
        s3.put_object(Bucket="bench", Key=f"media/{name}", Body=data)
    cases = [("local store, by reference", os.path.join(tmp, "ref-local", "store"), folder),
             ("moto_server, by reference", "s3://bench/ref", "s3://bench/media/"),
             ("moto_server, folder copied", "s3://bench/copy", folder)]
    for label, store, source in cases:
        saved, sys.stderr = sys.stderr, open(os.devnull, "w")   # the copy's one-line note
        try:
            backend, run_id, _ = run_in_process(store, os.path.join(tmp, "state-" + label[:5]), source, "media")
        finally:
            sys.stderr = saved
        besides, results = stored(backend, run_id)
        print(f"   {label:<28} besides results {besides / 1024:9.1f} KiB = {besides / media:7.2%} of the media   "
              f"(results {results / 1024:.1f} KiB)")


def peak_rss(argv, env, patch="", queue=None):
    """Peak RSS (MiB, the process's own high-water mark), seconds, and seconds to the first claim in `queue`
    (None without one) of `calque ARGV`, after `patch` (Python)."""
    # VmHWM: this process image's own peak (getrusage's ru_maxrss keeps the forking parent's across exec)
    code = ("import atexit, re, sys\n"
            "atexit.register(lambda: print('peak-rss', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status')"
            ".read())[1], file=sys.stderr))\nimport calque\n" + patch + "\nsys.exit(calque.main(sys.argv[1:]))")
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = None
    while queue is not None and first is None and child.poll() is None:
        if queue.counts()["visible"]:
            first = time.perf_counter() - t0
        time.sleep(0.01)
    stderr = child.communicate()[1]
    seconds = time.perf_counter() - t0
    assert child.returncode == 0, stderr
    kib = int(next(line.split()[1] for line in stderr.splitlines() if line.startswith("peak-rss")))
    return kib / 1024, seconds, first


def rss(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path, rows, size = os.path.join(tmp, "images.parquet"), int(PARQUET_GB * 2**30 / 100_000), 100_000
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", struct), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:   # row groups of 100, as datasets writes
        for start in range(0, rows, 1000):
            n = min(1000, rows - start)
            images = pa.array([{"bytes": os.urandom(size), "path": f"{start + k}.jpg"} for k in range(n)], struct)
            writer.write_table(pa.table({"image": images, "label": range(start, start + n)}, schema),
                               row_group_size=100)
    one = os.path.join(tmp, "one.jsonl")
    with open(one, "w") as f:
        f.write('{"x": 1}\n')
    print(f"\n2. submit's peak RSS staging a Parquet of {os.path.getsize(path) / 2**30:.2f} GiB of HF Image rows "
          f"({rows:,} x {size // 1000} KB), claims of 1000 rows")
    copied = ("import calque_sources\n"
              "place = calque_sources.TableItems.place\n"
              "def copied(self, backend, record):\n"
              "    place(self, backend, record)\n"
              "    self.by_reference = False\n"
              "calque_sources.TableItems.place = copied")
    for label, items, patch in [("a JSONL of 1 item (the floor)", one, ""), ("by reference (local store)", path, ""),
                                ("copied (as to an s3:// store)", path, copied)]:
        store = os.path.join(tmp, "rss")
        env = dict(os.environ, CALQUE_STORE=os.path.join(store, "store"), CALQUE_STATE=os.path.join(store, "state"))
        subprocess.run([sys.executable, os.path.join(ROOT, "calque.py"), "pool", "create", "--model", "m",
                        "--handler", HANDLER, "--workers", "0"], env=env, capture_output=True, check=True)
        mib, seconds, _ = peak_rss(["submit", "--pool", "m", items, "--no-wait", "--wait-for-workers"], env, patch)
        print(f"   {label:<32} peak RSS {mib:7.1f} MiB   {seconds:6.1f} s")
        shutil.rmtree(store)


def listing(tmp):
    print(f"\n3. submit of a listing by reference, --no-wait, claims sized to the run (no --claim-size): "
          f"{LISTING_FILES:,} files of 16 bytes in a folder (local store), {LISTING_OBJECTS:,} under an s3:// prefix "
          f"(moto_server)")
    import boto3
    from concurrent.futures import ThreadPoolExecutor
    s3 = boto3.client("s3")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket="bench", Key=f"listing/{k:07d}.bin",
                                              Body=k.to_bytes(16, "little")), range(LISTING_OBJECTS)))
    cases = [("folder, flat", LISTING_FILES, os.path.join(tmp, "listing-store")),
             ("folder, in 1000s", 1000, os.path.join(tmp, "listing-store")),
             ("s3:// prefix", None, "s3://bench/listing-store")]
    for label, per_folder, store in cases:
        source = "s3://bench/listing/" if per_folder is None else os.path.join(tmp, "listing")
        for k in range(LISTING_FILES if per_folder else 0):
            sub = os.path.join(source, f"{k // per_folder:05d}")
            if k % per_folder == 0:
                os.makedirs(sub)
            with open(os.path.join(sub, f"{k:07d}.bin"), "wb") as f:
                f.write(k.to_bytes(16, "little"))
        _, backend, record = make_pool(store, os.path.join(tmp, "listing-state", label), HANDLER, model="listing")
        queue = backend.queues.open_queue(record["queue"])
        mib, total, first = peak_rss(["submit", "--pool", "listing", source, "--no-wait", "--wait-for-workers"],
                                     dict(os.environ), queue=queue)
        print(f"   {label:<17} first claim queued {first:5.2f} s   all {queue.counts()['visible']:,} claims "
              f"{total:6.1f} s   peak RSS {mib:6.1f} MiB")
        if per_folder:
            shutil.rmtree(store)
            shutil.rmtree(source)


def prefetch(tmp):
    folder = os.path.join(tmp, "prefetch")
    os.makedirs(folder)
    for k in range(PREFETCH_IMAGES):
        with open(os.path.join(folder, f"{k:05d}.jpg"), "wb") as f:
            f.write(photo(320, 240, k))
    print(f"\n4. the image job, {PREFETCH_IMAGES} photos (320x240 JPEG -> Pillow decode + resize 128 in collate, "
          f"a conv net), batches of 32, one worker, local store, by reference")
    rates = {}
    for on in (False, True):
        warmd.PREFETCH = on
        t0 = time.perf_counter()
        backend, run_id, summaries = run_in_process(os.path.join(tmp, f"pf-{on}", "store"),
                                                    os.path.join(tmp, f"pf-{on}", "state"), folder, f"pf-{on}")
        wall = time.perf_counter() - t0
        model = sum(s["model_seconds"] for s in summaries)
        claims = sum(s["claim_seconds"] for s in summaries)
        rates[on] = PREFETCH_IMAGES / claims
        print(f"   collate {'beside the model' if on else 'on its thread  '}  {rates[on]:7.1f} images/s of claim "
              f"time   (model {model:.2f} s, waiting on collate {sum(s['collate_wait_seconds'] for s in summaries):.2f}"
              f" s, claims {claims:.2f} s, wall {wall:.1f} s)")
    print(f"   beside / on its thread: {rates[True] / rates[False]:.2f}x")


SECTIONS = {"reference": reference, "rss": rss, "listing": listing, "prefetch": prefetch}


def main():
    picked = chosen(SECTIONS)
    moto = start_moto() if {"reference", "listing"} & set(picked) else None
    tmp = tempfile.mkdtemp(prefix="calque-bench-media-")
    print(f"calque bench: media in  ({os.cpu_count()} cores, collate threads up to {warmd.COLLATE_THREADS})")
    try:
        for name in picked:
            SECTIONS[name](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if moto:
            moto.terminate()
            moto.wait()


if __name__ == "__main__":
    main()
