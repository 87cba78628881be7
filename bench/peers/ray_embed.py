"""make bench-peers, part 2: the embedding job (bench/bench_embed.py's) on calque and on Ray Data, side by side.

    make bench-peers
    BENCH_EMBED_ITEMS=2000 RAY_PY=.venv-ray/bin/python .venv/bin/python bench/peers/ray_embed.py

The same BENCH_EMBED_ITEMS texts in a Parquet file: calque with 2 local workers on default settings (a warm pool,
`submit`, then `runs results --format npy`), and Ray Data with 2 actors (bench/peers/ray_peer.py: read_parquet ->
map_batches -> write_parquet, timed from the read to the last file written, after ray.init). Ray Data starts its
actors, and so loads the model, inside each job: that is in its time, as the pool's warm-up is not in calque's.
Items/s, the ratio, and the bytes each stored per item. BENCH_PEER_ROUNDS pairs (1), the order swapped in each.
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_embed import EMBED_ITEMS, PY, calque_run, folder_bytes  # noqa: E402

RAY_PY = os.environ.get("RAY_PY", os.path.join(ROOT, ".venv-ray", "bin", "python"))
ROUNDS = int(os.environ.get("BENCH_PEER_ROUNDS", "1"))


def ray_run(tmp, texts, k):
    out = os.path.join(tmp, f"ray-out-{k}")
    env = dict(os.environ, EMBED_MODEL_DIR=os.path.join(tmp, "embed-model"), HF_HUB_OFFLINE="1",
               RAY_DATA_DISABLE_PROGRESS_BARS="1",   # Ray's workers import the handler (and calque) from these
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "examples"), ROOT]))
    done = subprocess.run([RAY_PY, os.path.join(HERE, "ray_peer.py"), texts, out], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seconds, rows = done.stdout.split()[-2:]
    assert int(rows) == EMBED_ITEMS, rows
    return float(seconds), folder_bytes(out) / EMBED_ITEMS


def main():
    tmp = tempfile.mkdtemp(prefix="calque-bench-ray-")
    texts = os.path.join(tmp, "texts.parquet")
    subprocess.run([PY, os.path.join(ROOT, "examples", "make_embed_model.py"), os.path.join(tmp, "embed-model"),
                    "--texts", str(EMBED_ITEMS), texts], check=True, capture_output=True)
    print(f"calque against Ray Data: embeddings of {EMBED_ITEMS:,} texts, 2 workers / 2 actors "
          f"({len(os.sched_getaffinity(0))} cores)")
    for k in range(ROUNDS):
        runs = {}
        for name in (("ray", "calque") if k % 2 == 0 else ("calque", "ray")):
            if name == "ray":
                runs[name] = ray_run(tmp, texts, k)
            else:
                seconds, _, stored, _ = calque_run(tmp, texts, 2)
                runs[name] = seconds, stored
        for name, (seconds, stored) in runs.items():
            print(f"   {name:<7} {EMBED_ITEMS / seconds:7.1f} items/s   stored {stored:,.0f} B an item")
        print(f"   calque / Ray Data: {runs['ray'][0] / runs['calque'][0]:.2f}x")


if __name__ == "__main__":
    main()
