"""make bench-peers, part 3: the image job (bench/bench_images.py's) on calque and on Ray Data, side by side.

    make bench-peers
    BENCH_IMAGES=1000 RAY_PY=.venv-ray/bin/python .venv/bin/python bench/peers/ray_images.py

The same BENCH_IMAGES JPEGs (224x224) in a folder: calque with 2 local workers on default settings and with
--claim-size 50 (a warm pool, `submit photos/`, then `runs results --format npy`), and Ray Data with 2 actors
(read_binary_files -> map_batches of examples/image_embed.py's handler, called as a plain object, batches of 32
-> write_parquet, timed from the read to the last file written, after ray.init; this file again, run by RAY_PY
with --ray). Ray Data starts its actors, and so loads the model, inside each job: that is in its time, as the
pool's warm-up is not in calque's. Images/s and the ratio, BENCH_PEER_ROUNDS pairs (1), the order swapped in each.
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from bench_embed import calque_cli                                              # noqa: E402
from bench_images import IMAGES, SIDE, calque_run, pool_env, warm_pool          # noqa: E402
import make_media                                                               # noqa: E402

RAY_PY = os.environ.get("RAY_PY", os.path.join(ROOT, ".venv-ray", "bin", "python"))
ROUNDS = int(os.environ.get("BENCH_PEER_ROUNDS", "1"))


class Embedder:
    """examples/image_embed.py's handler as Ray Data's callable class: the same decode, model and batches."""

    def __init__(self):
        from image_embed import ImageEmbed
        self.model = ImageEmbed()
        self.model.load()

    def __call__(self, batch):
        items = [{"bytes": data} for data in batch["bytes"]]
        return {"path": batch["path"], "embedding": self.model.embed(self.model.collate(items)).numpy()}


def ray_job(photos, out):
    """The Ray Data side (under RAY_PY): prints the seconds from the read to the last file written, and rows."""
    import ray
    from ray_peer import ACTOR_CPUS   # half a CPU an actor: see ray_peer.py for the hang a whole one gives
    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    ds = ray.data.read_binary_files(photos, include_paths=True)
    ds.map_batches(Embedder, batch_size=32, concurrency=2, num_cpus=ACTOR_CPUS).write_parquet(out)
    print(time.perf_counter() - t0, ray.data.read_parquet(out).count())
    ray.shutdown()


def ray_run(tmp, photos, k):
    env = dict(os.environ, IMAGE_MODEL_DIR=os.path.join(tmp, "vit-model"), HF_HUB_OFFLINE="1",
               RAY_DATA_DISABLE_PROGRESS_BARS="1",   # Ray's workers import the handler (and calque) from these
               PYTHONPATH=os.pathsep.join([HERE, os.path.join(ROOT, "examples"), ROOT]))
    done = subprocess.run([RAY_PY, __file__, "--ray", photos, os.path.join(tmp, f"ray-out-{k}")], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds, rows = done.stdout.split()[-2:]
    assert int(rows) == IMAGES, rows
    return float(seconds)


def main():
    tmp = tempfile.mkdtemp(prefix="calque-bench-ray-images-")
    make_media.build_image_model(os.path.join(tmp, "vit-model"))
    photos = os.path.join(tmp, "photos")
    make_media.write_photos(photos, IMAGES, SIDE)
    print(f"calque against Ray Data: embeddings of {IMAGES} JPEGs ({SIDE}x{SIDE}), 2 workers / 2 actors "
          f"({len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f})")
    cases = {"calque, defaults": (), "calque, claims of 50": ("--claim-size", "50")}
    envs = {name: pool_env(tmp, f"pool-{k}") for k, name in enumerate(cases)}
    for env in envs.values():
        warm_pool(env)
    try:
        for k in range(ROUNDS):
            seconds = {}
            for name in (["ray", *cases] if k % 2 == 0 else [*cases, "ray"]):
                if name == "ray":
                    seconds[name] = ray_run(tmp, photos, k)
                else:
                    seconds[name] = calque_run(envs[name], photos, os.path.join(tmp, f"{k}.npy"), *cases[name])[0]
            for name, s in seconds.items():
                ratio = "" if name == "ray" else f"   {seconds['ray'] / s:.2f}x Ray Data"
                print(f"   {'Ray Data, 2 actors' if name == 'ray' else name:<22} {IMAGES / s:7.1f} images/s{ratio}")
    finally:
        for env in envs.values():
            calque_cli(env, "pool", "delete", "--model", "vit", "--yes")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ray"]:
        ray_job(*sys.argv[2:4])
    else:
        main()
