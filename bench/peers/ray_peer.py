"""The Ray Data side of bench/peers/ray_embed.py: the embedding job as Ray Data's batch-inference guide writes it
(read_parquet -> map_batches with a callable class on a pool of 2 actors -> write_parquet), run by RAY_PY.

    ray_peer.py TEXTS.parquet OUT_FOLDER     # prints: seconds from the read to the last file written, rows

The callable class is examples/embed_model.py's handler, called as a plain object: the same model, tokenizer and
batches of 32 as calque's workers. Each actor asks for ACTOR_CPUS of the machine's CPUs (Ray sizes its torch
threads from that: 1): with a whole CPU each, on 2 CPUs the 2 actors hold both, and Ray Data's list-files, read
and write tasks (1 CPU each) wait forever, the job hung with no error (Ray 2.60; num_cpus=0 on the read and the
write is not enough: the listing task takes its CPU regardless)."""
import os
import sys
import time   # (PYTHONPATH holds examples/ and the checkout: Ray's worker processes import the handler too)

import ray

ACTOR_CPUS = 0.5


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
    ds = ray.data.read_parquet(texts)
    ds.map_batches(Embedder, batch_size=32, concurrency=2, num_cpus=ACTOR_CPUS).write_parquet(out)
    seconds = time.perf_counter() - t0
    print(seconds, ray.data.read_parquet(out).count())
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
