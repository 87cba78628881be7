"""fastbatch on a GPU machine: build, run the tests with CUDA present (so PinnedRing pins), run the
worker's numeric end-to-end tests (its CUDA side-stream collation), the verbs' pricing of workers that
saw a GPU, the media bench's decode-ahead section on a CUDA model, the image job (examples/image_embed.py's ViT)
on a 2-worker pool against the loop on the same GPU with its busy fraction, and measure host-to-device GB/s from
a pinned ring slot (non_blocking, side stream) vs pageable memory, and the image job's batches fed from pinned
vs pageable memory.

    .venv/bin/python fastbatch/gpu_check.py      # `make gpu-check`: ~2 min, exits 1 without CUDA

Needs a CUDA build of torch; exits non-zero on the first failed step, saying which.
"""
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
B = 64                  # items per batch
ITEM_BYTES = 4 << 20    # 4 MiB of float32 per item: a 256 MiB batch, long enough to time one copy
REPEATS = 10            # median over this many copies
PIPELINE_BATCHES = 20   # batches through gather -> H2D with the ring (the warmd prefetch pattern)
TEST_TIMEOUT_S = 180    # the test suite takes ~15 s on 2 cores; this is the "< 5 minutes" guard
GPU_IMAGES = 2000       # JPEGs of the image job on the GPU (bench_images.py's BENCH_IMAGES)
IMAGE_BATCHES = 20      # batches of 32 images fed to the ViT from pinned, then pageable, memory
# -----------------------------------------------------------------------------


def fail(msg):
    print(f"gpu_check: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def step(name, cmd, timeout):
    """Run cmd in the repo root, streaming its output; fail naming the step on a nonzero exit."""
    print(f"gpu_check: {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, timeout=timeout).returncode
    if rc != 0:
        fail(f"{name} exited {rc}")
    print(f"gpu_check: {name} ok in {time.monotonic() - t0:.1f}s", flush=True)


def h2d_seconds(src, dst, stream):
    """Wall seconds from issuing dst.copy_(src, non_blocking=True) on stream to its completion,
    and the seconds the issuing call itself took (near zero only when the copy is async)."""
    done = torch.cuda.Event()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done.record(stream)
    issued = time.perf_counter() - t0
    done.synchronize()
    return time.perf_counter() - t0, issued


def image_copies():
    """The image job's decoded batches ([32, 3, 224, 224] float32) through host-to-device and the ViT, from
    pageable memory (as collate returns them) and pinned (pin_memory(), copied non_blocking): images/s each."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import make_media
    from image_embed import ImageEmbed
    os.environ["IMAGE_MODEL_DIR"] = folder = tempfile.mkdtemp(prefix="gpu-check-vit-")
    make_media.build_image_model(folder)
    model = ImageEmbed()
    model.load()
    jpegs = [{"bytes": make_media.photo(224, 224, k)} for k in range(32)]
    pageable = [model.collate(jpegs)] * IMAGE_BATCHES
    pinned = [pageable[0].pin_memory()] * IMAGE_BATCHES
    print(f"\nthe image job's batches (32 x 3 x 224 x 224 float32) -> H2D -> ViT, {IMAGE_BATCHES} batches")
    for name, batches in [("pageable (as collate returns them)", pageable), ("pinned, non_blocking", pinned)]:
        model.embed(batches[0])   # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for batch in batches:
            model.embed(batch)
        torch.cuda.synchronize()
        print(f"{name:46s} {32 * IMAGE_BATCHES / (time.perf_counter() - t0):9.1f} images/s")


def main():
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False) "
              "---> run `make gpu-check` on a GPU machine with a CUDA build of torch", file=sys.stderr)
        return 1
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    step("build", [sys.executable, os.path.join("fastbatch", "_build.py")], timeout=120)
    step("tests", [sys.executable, "-m", "pytest", "-q", os.path.join("tests", "test_fastbatch.py")],
         timeout=TEST_TIMEOUT_S)
    # warmd's collation on CUDA: ring slot -> side-stream copy -> the handler gets device tensors; the
    # numeric end-to-end tests (prefetch on and off must agree) run that path when CUDA is present
    step("worker drain loop on CUDA", [sys.executable, "-m", "pytest", "-q", os.path.join("tests", "test_arrays.py")],
         timeout=TEST_TIMEOUT_S)
    # workers that see a GPU: every verb keeps the GPU instance and its card's serverless rate alike
    step("one price across the verbs", [sys.executable, "-m", "pytest", "-q", os.path.join("tests", "test_cost.py"),
                                        "-k", "every_verb_prices"], timeout=TEST_TIMEOUT_S)

    # media decoded ahead: Pillow in the handler's collate beside a conv net on the GPU (its images/s and
    # the seconds the model waited on decoding, collate on its thread against beside it)
    step("media decoded ahead of a CUDA model", [sys.executable, os.path.join("bench", "bench_media_in.py"),
                                                 "prefetch"], timeout=TEST_TIMEOUT_S)
    # the image job on the GPU: the ViT embedder on a warm 2-worker pool against the plain loop on the same GPU,
    # and the GPU's busy fraction (NVML, from the workers' claims; needs nvidia-ml-py)
    os.environ["BENCH_IMAGES"] = str(GPU_IMAGES)
    step("the image job on CUDA", [sys.executable, os.path.join("bench", "bench_images.py"), "job"],
         timeout=TEST_TIMEOUT_S)
    image_copies()

    sys.path.insert(0, ROOT)
    import fastbatch
    if fastbatch.load() != "c":
        fail(f"fastbatch.BACKEND is {fastbatch.BACKEND!r} right after a successful build")
    try:
        fastbatch.stack([torch.zeros(2, device="cuda")])
        fail("a CUDA tensor input was accepted")
    except TypeError as e:
        print(f"gpu_check: CUDA input refused as documented: {e}")

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(ITEM_BYTES // 4, dtype=np.float32) for _ in range(B)]
    nbytes = B * ITEM_BYTES
    ring = fastbatch.PinnedRing(slots=3)
    slot, pinned = ring.stack(arrays)
    if not (ring.pinned and pinned.is_pinned()):
        fail(f"ring.pinned={ring.pinned}, slot tensor is_pinned()={pinned.is_pinned()}: expected pinned memory")
    pageable = torch.from_numpy(np.stack(arrays))  # plain malloc'd memory, already faulted in
    dev = torch.empty(pinned.shape, dtype=pinned.dtype, device="cuda")
    side = torch.cuda.Stream()

    rows = {}
    for name, src in [("pinned ring slot, non_blocking, side stream", pinned), ("pageable tensor", pageable)]:
        h2d_seconds(src, dev, side)  # warm-up
        runs = [h2d_seconds(src, dev, side) for _ in range(REPEATS)]
        rows[name] = (nbytes / statistics.median(r[0] for r in runs) / 1e9, statistics.median(r[1] for r in runs))
        if not torch.equal(dev.cpu(), pageable):
            fail(f"{name}: device copy differs from np.stack")
    ring.release(slot)

    # The warmd pattern: gather batch k+1 into a free slot while batch k's copy runs; a slot is
    # released only after its copy's event completed.
    in_flight = collections.deque()
    t0 = time.perf_counter()
    for _ in range(PIPELINE_BATCHES):
        slot, x = ring.stack(arrays)
        done = torch.cuda.Event()
        with torch.cuda.stream(side):
            dev.copy_(x, non_blocking=True)
            done.record(side)
        in_flight.append((slot, done))
        if len(in_flight) == ring.slots - 1:
            old, ev = in_flight.popleft()
            ev.synchronize()
            ring.release(old)
    for old, ev in in_flight:
        ev.synchronize()
        ring.release(old)
    rows["pipeline: fastbatch.stack -> ring -> H2D"] = (PIPELINE_BATCHES * nbytes / (time.perf_counter() - t0) / 1e9, 0.0)
    tensors = [torch.from_numpy(a) for a in arrays]
    t0 = time.perf_counter()
    for _ in range(PIPELINE_BATCHES // 4):
        torch.stack(tensors).to("cuda")
    torch.cuda.synchronize()
    rows["naive: torch.stack (fresh) .to('cuda')"] = (PIPELINE_BATCHES // 4 * nbytes / (time.perf_counter() - t0) / 1e9, 0.0)

    base = rows["pageable tensor"][0]
    print(f"\nhost-to-device, {nbytes >> 20} MiB batches (THREADS={fastbatch.THREADS})")
    print(f"{'method':46s} {'GB/s':>7s} {'x pageable':>11s} {'issue ms':>9s}")
    for name, (gbps, issued) in rows.items():
        print(f"{name:46s} {gbps:7.2f} {gbps / base:10.2f}x {issued * 1e3:9.2f}")
    pinned_gbps, issue_s = rows["pinned ring slot, non_blocking, side stream"]
    if issue_s * 1e9 > 0.5 * nbytes / pinned_gbps:
        fail(f"the non_blocking copy from pinned memory took {issue_s * 1e3:.1f} ms to issue: not async")
    print("gpu_check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
