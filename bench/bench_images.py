"""make bench: the image job, examples/image_embed.py (Pillow decode + ViTImageProcessor in collate, a 4 x 192
ViT with random weights, its pooled [192] embedding an image), on calque and in a plain loop, side by side (on
the GPU where there is one: `make gpu-check` runs the job section there, with the GPU's busy fraction).

    .venv/bin/python bench/bench_images.py              # both sections (~1 min here)
    .venv/bin/python bench/bench_images.py job          # one: job rss
    BENCH_IMAGES=1000 BENCH_IMAGES_PARQUET_GB=0.5 .venv/bin/python bench/bench_images.py

job  BENCH_IMAGES JPEGs of 224x224 in a folder: a plain one-process loop (the limit: the handler's own methods,
     files read, batches of 32, torch's default threads, embeddings saved as .npy) against a warm pool of 2 local
     workers on default settings, and the same with --claim-size 50 (`submit photos/`, then `runs results
     --format npy`, timed together), in turns, best of BENCH_IMAGE_ROUNDS; images/s, the ratio to the loop, the
     largest difference from the loop's embeddings, the results' bytes against their raw float32 bytes, and what
     the run stores besides its results against the JPEGs' bytes (read by reference: not copied).
rss  a Parquet file of BENCH_IMAGES_PARQUET_GB GB of JPEGs in an HF Image column (written a row group at a time
     under /tmp, deleted after): the peak RSS of `calque submit --no-wait` staging it by reference.
The machine is shared and noisy: read the ratios measured side by side, not the absolutes.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_embed import calque_cli, folder_bytes   # noqa: E402
from bench_media_in import peak_rss                # noqa: E402
from common import chosen, compile_kit             # noqa: E402
import make_media                                  # noqa: E402
import calque_core

# ------------------------------------------------------------------------------------------------
IMAGES = int(os.environ.get("BENCH_IMAGES", "300"))                  # JPEGs of the job
SIDE = 224                                                           # px, their width and height
ROUNDS = int(os.environ.get("BENCH_IMAGE_ROUNDS", "2"))              # turns of loop and pools; best of them
PARQUET_GB = float(os.environ.get("BENCH_IMAGES_PARQUET_GB", "2"))   # the rss section's Parquet file
DISTINCT = 500                    # distinct JPEGs in that file (repeated to its size: encoding is slow)
BATCH = 32                        # items per handler call, in the loop and the pools (calque's default)
EMBEDDING_BYTES = 192 * 4         # raw bytes of one embedding, float32
HANDLER = os.path.join(ROOT, "examples", "image_embed.py") + ":ImageEmbed"
PY = sys.executable
# the plain loop: the handler loaded, then the clock runs over reading the files, the batches and the .npy
LOOP = """
import os, sys, time
sys.path.insert(0, {examples!r})
import numpy as np, torch
from image_embed import ImageEmbed
model = ImageEmbed()
model.load()
t0 = time.perf_counter()
names = sorted(os.listdir(sys.argv[1]))
out = []
for k in range(0, len(names), {batch}):
    items = []
    for name in names[k:k + {batch}]:
        with open(os.path.join(sys.argv[1], name), "rb") as f:
            items.append({{"path": name, "bytes": f.read()}})
    out.append(model.embed(model.collate(items)).numpy())
np.save(sys.argv[2], np.concatenate(out))
print(time.perf_counter() - t0, torch.get_num_threads())
""".format(examples=os.path.join(ROOT, "examples"), batch=BATCH)
# ------------------------------------------------------------------------------------------------


def pool_env(tmp, name):
    folder = os.path.join(tmp, name)
    return dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"), CALQUE_STATE=os.path.join(folder, "state"),
                BENCH_DIR=tmp, IMAGE_MODEL_DIR=os.path.join(tmp, "vit-model"), HF_HUB_OFFLINE="1")


def warm_pool(env, workers=2):
    """A pool of the image handler with `workers` local workers, once each has loaded the model."""
    calque_cli(env, "pool", "create", "--model", "vit", "--handler", HANDLER, "--workers", str(workers))
    status = os.path.join(env["CALQUE_STATE"], "pools", "vit", "supervisor.json")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with open(status) as f:
                if sum(w["warm"] for w in json.load(f)["workers"]) == workers:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the pool's workers did not warm in 300 s: see `calque pool logs --model vit`")


def calque_run(env, photos, out, *extra):
    """`submit photos/` + `runs results --format npy` on the warm pool: (seconds, run id)."""
    t0 = time.perf_counter()
    run_id = calque_cli(env, "submit", "--pool", "vit", photos, *extra).split()[1]
    calque_cli(env, "runs", "results", run_id, "--format", "npy", "--output", out)
    return time.perf_counter() - t0, run_id


def gpu_busy(env, run_id):
    """The run's GPU busy fraction (NVML, its workers' claims weighted by their seconds), or "" without a GPU."""
    import calque
    measured = [(s["gpu_utilisation"]["value"], s["claim_seconds"]) for s in
                calque_core.read_summaries(calque_core.open_backend(env["CALQUE_STORE"]), run_id)
                if (s.get("gpu_utilisation") or {}).get("measured")]
    seconds = sum(t for _, t in measured)
    return f"   GPU busy {sum(v * t for v, t in measured) / seconds:.0%}" if seconds else ""


def job(tmp):
    import numpy as np
    photos = os.path.join(tmp, "photos")
    make_media.write_photos(photos, IMAGES, SIDE)
    media = folder_bytes(photos)
    print(f"\n1. embeddings of {IMAGES} JPEGs ({SIDE}x{SIDE}, {media / IMAGES / 1024:.0f} KiB each), batches of "
          f"{BATCH}, end to end, best of {ROUNDS} (load average {os.getloadavg()[0]:.2f} before)")
    cases = {"loop": None, "defaults": (), "claims of 50": ("--claim-size", "50")}
    envs = {name: pool_env(tmp, name.replace(" ", "-")) for name in cases if name != "loop"}
    for env in envs.values():
        warm_pool(env)
    best, runs = {}, {}
    try:
        for k in range(ROUNDS):
            for name in (list(cases) if k % 2 == 0 else list(cases)[::-1]):   # turns, the order swapped
                out = os.path.join(tmp, f"{name.replace(' ', '-')}-{k}.npy")
                if name == "loop":
                    done = subprocess.run([PY, "-c", LOOP, photos, out], capture_output=True, text=True,
                                          env=dict(os.environ, IMAGE_MODEL_DIR=os.path.join(tmp, "vit-model"),
                                                   HF_HUB_OFFLINE="1"))
                    assert done.returncode == 0, done.stderr[-3000:]
                    seconds, threads = done.stdout.split()
                    seconds = float(seconds)
                else:
                    seconds, runs[name] = calque_run(envs[name], photos, out, *cases[name])
                if seconds < best.get(name, (float("inf"),))[0]:
                    best[name] = seconds, np.load(out)
        loop_seconds, want = best["loop"]
        print(f"   plain loop, one process ({threads} torch threads)      {IMAGES / loop_seconds:7.1f} images/s   "
              f"1.00x")
        for name in envs:
            seconds, got = best[name]
            run_dir = os.path.join(envs[name]["CALQUE_STORE"], "runs", runs[name])
            results = folder_bytes(os.path.join(run_dir, "results"))
            besides = folder_bytes(run_dir) - results
            print(f"   calque, 2 workers, {name:<22} {IMAGES / seconds:7.1f} images/s   {loop_seconds / seconds:4.2f}x"
                  f"   max |diff| {np.abs(got - want).max():.1e}   results {results / (IMAGES * EMBEDDING_BYTES):.2f}x"
                  f" raw; stored besides {besides / 1024:.1f} KiB = {besides / media:.2%} of the JPEGs"
                  + gpu_busy(envs[name], runs[name]))
    finally:
        for env in envs.values():
            calque_cli(env, "pool", "delete", "--model", "vit", "--yes")


def rss(tmp):
    import pyarrow as pa
    import pyarrow.parquet as pq
    jpegs = [make_media.photo(SIDE, SIDE, k) for k in range(DISTINCT)]
    rows = int(PARQUET_GB * 1e9 / (sum(map(len, jpegs)) / DISTINCT))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image)])
    path = os.path.join(tempfile.gettempdir(), f"calque-bench-images-{os.getpid()}.parquet")
    try:
        with pq.ParquetWriter(path, schema) as writer:   # row groups of make_media.ROW_GROUP, as datasets writes
            for start in range(0, rows, make_media.ROW_GROUP):
                group = [{"bytes": jpegs[k % DISTINCT], "path": f"{k:07d}.jpg"}
                         for k in range(start, min(rows, start + make_media.ROW_GROUP))]
                writer.write_table(pa.table({"image": pa.array(group, image)}, schema))
        print(f"\n2. `calque submit --no-wait` of a Parquet of {os.path.getsize(path) / 1e9:.2f} GB, {rows:,} JPEGs "
              f"({SIDE}x{SIDE}) in an HF Image column, by reference (the local store)")
        env = pool_env(tmp, "rss")
        calque_cli(env, "pool", "create", "--model", "vit", "--handler", HANDLER, "--workers", "0")
        mib, seconds, _ = peak_rss(["submit", "--pool", "vit", path, "--no-wait", "--wait-for-workers"], env)
        print(f"   submit's peak RSS {mib:7.1f} MiB   ({seconds:.1f} s)")
    finally:
        if os.path.exists(path):
            os.remove(path)


SECTIONS = {"job": job, "rss": rss}


def main():
    picked = chosen(SECTIONS)
    compile_kit()
    tmp = tempfile.mkdtemp(prefix="calque-bench-images-")
    print(f"calque bench: images  ({len(os.sched_getaffinity(0))} cores, python {sys.version.split()[0]})")
    try:
        make_media.build_image_model(os.path.join(tmp, "vit-model"))
        for name in picked:
            SECTIONS[name](tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
