"""fastbatch benchmark: one-copy gather into a reused buffer vs the usual ways, against memcpy; and the worker's
result lines, framed in C (fb_frame_lines) vs one by one in Python (warmd.format_each).

    .venv/bin/python bench/bench_fastbatch.py          # `make bench`; ~30 s, ~3 GB of RAM
    FASTBATCH_REFERENCE=1 .venv/bin/python bench/bench_fastbatch.py   # the numpy fallback instead

GB/s is bytes of the batch tensor produced per second, the median over REPEATS rounds; each
round calls every method once, interleaved, so a noisy neighbour on a shared host slows all
methods alike instead of whichever ran during the noise. The physical limit is np.copyto of the
same number of bytes into a pre-faulted buffer, on 1 and 2 threads.
Goals (issue): fastbatch >= 4x torch.stack into a fresh tensor, >= 85 % of 2-thread memcpy.
"""
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fastbatch  # noqa: E402
fastbatch.load()   # the path this machine gets, chosen before the tables name it
import warmd  # noqa: E402

# -----------------------------------------------------------------------------
B = 256                        # items per batch
ITEM_BYTES = 2 << 20           # stack: 2 MiB of float32 per item (a 512 MiB batch)
TOKENS = (16, 2048)            # pad: int64 sequence lengths, uniform in this range
REPEATS_STACK = 9              # rounds; one round calls each stack method once (~1 s a round)
REPEATS_PAD = 100              # pad batches are ~4 MiB (~0.2 ms a call), so many more rounds
LINES_BATCH = 64               # result lines: items per batch (the scale bench's batch size)
REPEATS_LINES = 2000           # result-line rounds (~0.1 ms a call)
GOAL_VS_TORCH = 4.0            # x torch.stack into a fresh tensor
GOAL_VS_MEMCPY = 0.85          # of the same run's 2-thread memcpy bandwidth
# -----------------------------------------------------------------------------


def median_seconds(methods, repeats):
    """[(name, median wall seconds)] for methods [(name, fn)], interleaved: one warm-up call each,
    then repeats rounds of one call each."""
    times = {name: [] for name, _ in methods}
    for name, fn in methods:
        fn()
    for _ in range(repeats):
        for name, fn in methods:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return [(name, statistics.median(times[name])) for name, _ in methods]


def memcpy_methods(nbytes, pool):
    """[(name, fn)]: np.copyto of nbytes into a pre-faulted buffer on 1 and 2 threads."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)  # zeros + the warm-up copy: every page faulted in already
    half = nbytes // 2

    def two():
        list(pool.map(lambda s: np.copyto(dst[s], src[s]), [slice(0, half), slice(half, None)]))
    return [("memcpy np.copyto, 1 thread", lambda: np.copyto(dst, src)), ("memcpy np.copyto, 2 threads", two)]


def table(title, nbytes, rows, baseline, memcpy2):
    """Print rows [(name, seconds)] as GB/s, x baseline and % of 2-thread memcpy; return GB/s by name."""
    gbps = {name: nbytes / s / 1e9 for name, s in rows}
    print(f"\n{title}  ({nbytes / 2**20:.0f} MiB per batch)")
    print(f"{'method':44s} {'GB/s':>7s} {'x ' + baseline:>22s} {'% memcpy 2thr':>14s}")
    for name, _ in rows:
        print(f"{name:44s} {gbps[name]:7.2f} {gbps[name] / gbps[baseline]:21.2f}x {100 * gbps[name] / gbps[memcpy2]:13.0f}%")
    return gbps


def bench_stack(pool):
    """256 x 2 MiB float32: fastbatch into a reused ring slot vs torch/numpy stacking into fresh memory."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(ITEM_BYTES // 4, dtype=np.float32) for _ in range(B)]
    tensors = [torch.from_numpy(a) for a in arrays]
    nbytes = B * ITEM_BYTES
    ring = fastbatch.PinnedRing(slots=2)

    def fb(threads, backend=fastbatch.BACKEND):
        def run():
            fastbatch.THREADS, fastbatch.BACKEND = threads, backend
            slot, x = ring.stack(arrays)
            ring.release(slot)
            fastbatch.BACKEND = DEFAULT_BACKEND
        return run
    reused = torch.empty(B, ITEM_BYTES // 4)
    rows = median_seconds(memcpy_methods(nbytes, pool) + [
        (FB_STACK, fb(DEFAULT_THREADS)),
        ("fastbatch.stack -> ring slot, 1 thread", fb(1)),
        (FB_STACK_REF, fb(DEFAULT_THREADS, "reference")),
        ("torch.stack(out=reused)", lambda: torch.stack(tensors, out=reused)),
        ("torch.stack, fresh tensor", lambda: torch.stack(tensors)),
        ("default_collate (numpy arrays)", lambda: default_collate(arrays)),
        ("np.stack, fresh array", lambda: np.stack(arrays)),
    ], REPEATS_STACK)
    got = fastbatch.stack(arrays)
    assert torch.equal(got, torch.stack(tensors)), "fastbatch.stack disagrees with torch.stack"
    return table(f"stack: {B} x {ITEM_BYTES >> 20} MiB float32  [fastbatch backend: {fastbatch.BACKEND}]",
                 nbytes, rows, "torch.stack, fresh tensor", "memcpy np.copyto, 2 threads")


def numpy_pad_loop(seqs):
    """The usual numpy way: a fresh padded array, then one slice assignment per row."""
    out = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def bench_pad(pool):
    """256 ragged int64 token sequences: fastbatch.pad (numpy) into a ring slot vs pad_sequence and a numpy loop
    into fresh memory."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 50_000, rng.integers(TOKENS[0], TOKENS[1], endpoint=True)) for _ in range(B)]
    seqs_t = [torch.from_numpy(s) for s in seqs]
    L = max(len(s) for s in seqs)
    nbytes = B * L * 8
    ring = fastbatch.PinnedRing(slots=2)

    def fb():
        slot, x, lengths = ring.pad(seqs)
        ring.release(slot)
    rows = median_seconds(memcpy_methods(nbytes, pool) + [
        (FB_PAD, fb),
        ("pad_sequence, fresh tensor", lambda: pad_sequence(seqs_t, batch_first=True)),
        ("numpy pad loop, fresh array", lambda: numpy_pad_loop(seqs)),
    ], REPEATS_PAD)
    got, _ = fastbatch.pad(seqs)
    assert np.array_equal(got.numpy(), numpy_pad_loop(seqs)), "fastbatch.pad disagrees with the numpy loop"
    print("\n(default_collate, torch.stack and np.stack cannot batch ragged sequences: not shown)")
    return table(f"pad: {B} int64 sequences, lengths {TOKENS[0]}-{TOKENS[1]}, L = {L}  [backend: {fastbatch.BACKEND}]",
                 nbytes, rows, "pad_sequence, fresh tensor", "memcpy np.copyto, 2 threads")


DEFAULT_THREADS, DEFAULT_BACKEND = fastbatch.THREADS, fastbatch.BACKEND
def bench_result_lines():
    """The worker's result lines for one batch of the demo model's results ({"label": int, "score": float}):
    µs an item, interleaved: json's encoder an item at a time (what format_each did before orjson), format_each
    (orjson an item at a time), format_outcome (orjson once for the batch, C framing)."""
    rng = np.random.default_rng(0)
    outcome = [(True, {"label": int(rng.integers(4)), "score": round(float(rng.random()), 6)})
               for _ in range(LINES_BATCH)]
    assert warmd.format_outcome(outcome, 0) == warmd.format_each(outcome, 0)

    def json_each():
        return "".join(f'{{"i":{i},"ok":true,"result":{warmd.encode_result(v)}}}\n' for i, (_, v) in enumerate(outcome))
    rows = median_seconds([("json's encoder, one item at a time", json_each),
                           ("format_each (orjson, one item at a time)", lambda: warmd.format_each(outcome, 0)),
                           ("format_outcome (orjson once, C framing)", lambda: warmd.format_outcome(outcome, 0))],
                          REPEATS_LINES)
    print(f"\nresult lines, {LINES_BATCH} demo-model results a batch"
          f"{'' if warmd.framer else ' (C module not loaded: both rows are format_each)'}")
    for name, seconds in rows:
        print(f"{name:44s} {seconds / LINES_BATCH * 1e6:7.2f} us an item {rows[0][1] / seconds:8.2f}x")


FB_STACK = f"fastbatch.stack -> ring slot, {DEFAULT_THREADS} threads"  # the defaults: 512 MiB > THREAD_MIN_BYTES
FB_PAD = "fastbatch.pad -> ring slot"  # numpy on either path: a C pad paid nothing end to end
FB_STACK_REF = "fastbatch.stack -> ring slot, numpy reference"   # the same call with the C module off


def main():
    print(f"torch {torch.__version__}, numpy {np.__version__}, {len(os.sched_getaffinity(0))} CPUs, "
          f"fastbatch backend {fastbatch.BACKEND}, THREADS {DEFAULT_THREADS}, THREAD_MIN_BYTES "
          f"{fastbatch.THREAD_MIN_BYTES}, STREAM_MIN_BYTES {fastbatch.STREAM_MIN_BYTES}")
    with ThreadPoolExecutor(2) as pool:
        s = bench_stack(pool)
        p = bench_pad(pool)
    fastbatch.THREADS = DEFAULT_THREADS
    bench_result_lines()
    vs_torch = s[FB_STACK] / s["torch.stack, fresh tensor"]
    vs_memcpy = s[FB_STACK] / s["memcpy np.copyto, 2 threads"]
    print(f"\ngoal >= {GOAL_VS_TORCH:.0f}x torch.stack-fresh: {'met' if vs_torch >= GOAL_VS_TORCH else 'MISSED'} ({vs_torch:.2f}x)")
    print(f"goal >= {100 * GOAL_VS_MEMCPY:.0f}% of 2-thread memcpy: {'met' if vs_memcpy >= GOAL_VS_MEMCPY else 'MISSED'} ({100 * vs_memcpy:.0f}%)")
    print(f"stack: the C path {s[FB_STACK] / s[FB_STACK_REF]:.2f}x the numpy reference into the same ring slot")
    print(f"pad: {p[FB_PAD] / p['pad_sequence, fresh tensor']:.2f}x pad_sequence, "
          f"{p[FB_PAD] / p['numpy pad loop, fresh array']:.2f}x the numpy loop, "
          f"{100 * p[FB_PAD] / p['memcpy np.copyto, 2 threads']:.0f}% of 2-thread memcpy of the same bytes")


if __name__ == "__main__":
    main()
