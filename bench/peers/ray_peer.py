"""The Ray Data side of bench/peers/ray_embed.py: the embedding job as Ray Data's batch-inference guide writes it
(read_parquet -> map_batches with a callable class on a pool of 2 actors -> write_parquet), run by RAY_PY.

    ray_peer.py TEXTS.parquet OUT_FOLDER     # prints: seconds from the read to the last file written, rows

The callable class is examples/embed_model.py's handler, called as a plain object: the same model, tokenizer and
batches of 32 as calque's workers. Ray's read and write tasks are given num_cpus=0: on 2 CPUs the 2 actors hold
both, and a task that waits for a CPU never runs (the job hangs)."""
import os
import sys
import time   # (PYTHONPATH holds examples/ and the checkout: Ray's worker processes import the handler too)

import ray


class Embedder:
    def __init__(self):
        from embed_model import EmbedModel
        self.model = EmbedModel()
        self.model.load()

    def __call__(self, batch):
        embedding = self.model.embed([{"text": t} for t in batch["text"]]).numpy()
        return {"id": batch["id"], "embedding": embedding}


def main(texts, out):
    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    ds = ray.data.read_parquet(texts, ray_remote_args={"num_cpus": 0})
    ds.map_batches(Embedder, batch_size=32, concurrency=2).write_parquet(out, ray_remote_args={"num_cpus": 0})
    seconds = time.perf_counter() - t0
    print(seconds, ray.data.read_parquet(out).count())
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
