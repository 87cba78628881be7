"""fastbatch: the C gather and the numpy reference path, each against plain numpy on the same inputs.

    .venv/bin/python -m pytest -q tests/test_fastbatch.py        # both paths (C ones skip if unbuilt)
    .venv/bin/python -m pytest -q -s tests/test_fastbatch.py     # also print every max difference
"""
import array
import dataclasses
import datetime
import enum
import json
import importlib.util
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fastbatch  # noqa: E402

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.int16, np.bool_]
BACKENDS = ["c", "reference"]
# (THREADS, THREAD_MIN_BYTES, STREAM_MIN_BYTES): defaults on one thread (tiny batches: plain
# memcpy), 3 threads from 1 byte up, and 2 threads with streaming stores from 0 bytes up.
THREADINGS = [(1, None, None), (3, 1, None), (2, 1, 0)]


# --- helpers ----------------------------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the test on the C path and on the numpy reference path."""
    if request.param == "c" and fastbatch.lib is None:
        pytest.skip("C module not built (test_c_module_is_built says why)")
    monkeypatch.setattr(fastbatch, "BACKEND", request.param)
    return request.param


@pytest.fixture(params=THREADINGS, ids=["1thread", "3threads", "2threads-stream"])
def threading_(request, monkeypatch):
    """Run below and above the thread and streaming thresholds (tiny thresholds, tiny batches)."""
    threads, min_bytes, stream_bytes = request.param
    monkeypatch.setattr(fastbatch, "THREADS", threads)
    if min_bytes is not None:
        monkeypatch.setattr(fastbatch, "THREAD_MIN_BYTES", min_bytes)
    if stream_bytes is not None:
        monkeypatch.setattr(fastbatch, "STREAM_MIN_BYTES", stream_bytes)


class use_backend:
    """Context manager version of the backend fixture, for hypothesis tests (no function fixtures)."""
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if self.name == "c" and fastbatch.lib is None:
            pytest.skip("C module not built")
        self.saved = fastbatch.BACKEND, fastbatch.THREADS, fastbatch.THREAD_MIN_BYTES, fastbatch.STREAM_MIN_BYTES
        fastbatch.BACKEND, fastbatch.THREADS, fastbatch.THREAD_MIN_BYTES, fastbatch.STREAM_MIN_BYTES = self.name, 2, 1, 0

    def __exit__(self, *exc):
        fastbatch.BACKEND, fastbatch.THREADS, fastbatch.THREAD_MIN_BYTES, fastbatch.STREAM_MIN_BYTES = self.saved


def rand(shape, dtype, rng):
    """Random values covering dtype's whole range (an array, even for shape ())."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) > 0.5)
    if dtype.kind == "f":
        return np.asarray(rng.standard_normal(shape) * 100, dtype=dtype)
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True))


def numpy_pad(seqs, pad_value, max_len=None):
    """The obvious numpy pad loop: fill everything, then write each row's prefix."""
    L = max(len(s) for s in seqs)
    L = L if max_len is None else min(L, max_len)
    out = np.full((len(seqs), L), pad_value, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, :min(len(s), L)] = s[:L]
    return out, np.array([min(len(s), L) for s in seqs], dtype=np.int64)


def assert_same(got, want, what):
    """got (torch) equals want (numpy) in shape, dtype and every element; prints the max difference."""
    g = got.numpy()
    assert g.shape == want.shape and g.dtype == want.dtype, (g.shape, g.dtype, want.shape, want.dtype)
    with np.errstate(invalid="ignore"):  # NaN == NaN for assert_array_equal; the max skips NaN
        diff = np.fmax.reduce(np.abs(g.astype(np.float64) - want.astype(np.float64)), axis=None, initial=0.0)
    print(f"{what}: max |diff| = {diff}")
    np.testing.assert_array_equal(g, want)


# --- stack ------------------------------------------------------------------------------------

STACK_SHAPES = [(1, (7,)), (4, ()), (3, (0,)), (5, (3, 0, 2)), (8, (33, 17)), (64, (1001,))]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("B,shape", STACK_SHAPES, ids=str)
def test_stack_equals_numpy(backend, threading_, dtype, B, shape):
    """stack equals np.stack for every dtype and shape, fresh, into an exact out, into a larger one."""
    rng = np.random.default_rng(0)
    arrays = [rand(shape, dtype, rng) for _ in range(B)]
    want = np.stack(arrays)
    assert_same(fastbatch.stack(arrays), want, f"{backend} stack {dtype.__name__} {B}x{shape}")
    out = torch.from_numpy(np.zeros((B, *shape), dtype))
    got = fastbatch.stack(arrays, out=out)
    assert got is out
    assert_same(got, want, "  out=exact")
    big = torch.from_numpy(np.zeros(want.size + 5, dtype))
    got = fastbatch.stack(arrays, out=big)
    assert want.size == 0 or got.data_ptr() == big.data_ptr()  # torch reports 0 for empty tensors
    assert_same(got, want, "  out=larger")
    np_out = np.zeros((B, *shape), dtype)
    got = fastbatch.stack(arrays, out=np_out)
    assert want.size == 0 or got.data_ptr() == np_out.ctypes.data
    assert_same(got, want, "  out=numpy")


def test_stack_accepts_tensors_and_buffers(backend, threading_):
    """numpy arrays, torch CPU tensors (even requires_grad) and buffer objects mix in one batch."""
    rng = np.random.default_rng(1)
    base = [rand((300,), np.float64, rng) for _ in range(4)]
    items = [base[0], torch.from_numpy(base[1].copy()).requires_grad_(), array.array("d", base[2]),
             memoryview(base[3].copy())]
    assert_same(fastbatch.stack(items), np.stack(base), f"{backend} mixed items")
    raw = [bytes(range(10)), bytearray(range(10, 20))]
    assert_same(fastbatch.stack(raw), np.stack([np.frombuffer(b, np.uint8) for b in raw]), "  bytes")


@pytest.mark.parametrize("delta", [-8, 0, 8 * 513], ids=["below", "at", "above"])
def test_stack_across_default_thread_threshold(backend, monkeypatch, delta):
    """With the default threshold, batches just below, at and above it gather correctly on 2 threads."""
    monkeypatch.setattr(fastbatch, "THREADS", 2)
    total = fastbatch.THREAD_MIN_BYTES + delta
    rng = np.random.default_rng(2)
    arrays = [rand((total // 8,), np.uint8, rng) for _ in range(8)]
    assert_same(fastbatch.stack(arrays), np.stack(arrays), f"{backend} {total} bytes")


# --- pad --------------------------------------------------------------------------------------

PAD_LENGTHS = [[5], [0, 0], [3, 0, 7, 1], list(range(0, 300, 9))]
PAD_VALUES = {"b": True, "u": 200, "i": -3, "f": -1.5}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("lengths", PAD_LENGTHS, ids=lambda l: f"B{len(l)}")
@pytest.mark.parametrize("max_len", [None, 0, 4, 1000])
def test_pad_equals_numpy(backend, threading_, dtype, lengths, max_len):
    """pad equals the numpy pad loop for every dtype, zero and non-zero pads, truncation, out."""
    rng = np.random.default_rng(3)
    seqs = [rand((n,), dtype, rng) for n in lengths]
    for pad_value in (0, PAD_VALUES[np.dtype(dtype).kind]):
        want, want_len = numpy_pad(seqs, pad_value, max_len)
        got, got_len = fastbatch.pad(seqs, pad_value=pad_value, max_len=max_len)
        assert_same(got, want, f"{backend} pad {np.dtype(dtype).name} B={len(seqs)} max_len={max_len} pad={pad_value}")
        assert_same(got_len, want_len, "  lengths")
        out = torch.full((want.size + 3,), 1, dtype=got.dtype)
        got, _ = fastbatch.pad(seqs, pad_value=pad_value, max_len=max_len, out=out)
        assert want.size == 0 or got.data_ptr() == out.data_ptr()
        assert_same(got, want, "  out=larger")


@pytest.mark.parametrize("offset", [1, 3, 8])
def test_misaligned_out_and_sources(backend, threading_, offset):
    """Destinations and sources at odd byte offsets (the streaming path's unaligned head and tail)."""
    rng = np.random.default_rng(5)
    raw = bytearray(8 * 5 * 301 + 16)
    for dtype in (np.uint8, np.int16, np.float32, np.int64):
        n = 301
        srcs = [np.frombuffer(bytearray(b"x" * 8 + rand((n,), dtype, rng).tobytes()), dtype=dtype,
                              offset=offset % 3, count=n - 1) for _ in range(5)]
        out = np.frombuffer(raw, dtype=dtype, offset=offset, count=5 * (n - 1))
        assert_same(fastbatch.stack(srcs, out=out), np.stack(srcs), f"{backend} stack {np.dtype(dtype).name} @+{offset}")
        seqs = [s[:k] for s, k in zip(srcs, (0, 7, 300, 150, 299))]
        for pad_value in (0, 5):
            got, _ = fastbatch.pad(seqs, pad_value=pad_value, out=out)
            assert_same(got, numpy_pad(seqs, pad_value)[0], f"  pad pad={pad_value}")


def test_pad_nan_and_torch_tokens(backend, threading_):
    """A NaN pad fills float rows; int64 token tensors (torch) pad like numpy arrays."""
    seqs = [np.arange(n, dtype=np.float32) for n in (2, 5)]
    got, _ = fastbatch.pad(seqs, pad_value=float("nan"))
    assert_same(got, numpy_pad(seqs, np.nan)[0], f"{backend} nan pad")
    toks = [torch.randint(0, 50000, (n,)) for n in (16, 2048, 100)]
    got, lens = fastbatch.pad(toks, pad_value=0, max_len=512)
    assert_same(got, numpy_pad([t.numpy() for t in toks], 0, 512)[0], "  torch tokens")
    assert lens.tolist() == [16, 512, 100]


# --- errors -----------------------------------------------------------------------------------

def test_stack_input_errors_name_the_item(backend):
    """Mismatched shape/dtype, non-contiguous, unsupported and empty inputs raise named errors."""
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"item 2 has shape \(3, 2\)"):
        fastbatch.stack([a, a, np.zeros((3, 2), np.float32)])
    with pytest.raises(ValueError, match="item 1 has shape .* float64"):
        fastbatch.stack([a, a.astype(np.float64)])
    with pytest.raises(ValueError, match="item 1 is not C-contiguous"):
        fastbatch.stack([a, np.zeros((2, 6), np.float32)[:, ::2]])
    with pytest.raises(ValueError, match="item 0 is not C-contiguous"):
        fastbatch.stack([torch.zeros(3, 2).t()])
    with pytest.raises(ValueError, match="no arrays"):
        fastbatch.stack([])
    with pytest.raises(TypeError, match="item 1 is a list"):
        fastbatch.stack([a, [[0.0] * 3] * 2])
    with pytest.raises(TypeError, match="item 0 is a str"):
        fastbatch.stack(["abc"])
    with pytest.raises(TypeError, match="item 0 has dtype object"):
        fastbatch.stack([np.array([None, 1])])
    with pytest.raises(TypeError, match="item 0 has dtype complex64"):
        fastbatch.stack([np.zeros(2, np.complex64)])
    with pytest.raises(TypeError, match=r"item 0 has dtype >f4"):
        fastbatch.stack([np.zeros(2, ">f4")])
    with pytest.raises(TypeError, match="item 0 has dtype torch.bfloat16"):
        fastbatch.stack([torch.zeros(2, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="item 1 is on meta"):  # stands in for a CUDA tensor here
        fastbatch.stack([torch.zeros(2), torch.empty(2, device="meta")])


def test_out_errors(backend):
    """out too small, of the wrong dtype, non-contiguous, read-only, on another device or overlapping raises."""
    arrays = [np.ones((4, 4), np.float32)] * 3
    with pytest.raises(ValueError, match=r"out holds 47 elements, the batch \[3, 4, 4\] needs 48"):
        fastbatch.stack(arrays, out=torch.empty(47))
    with pytest.raises(ValueError, match="out has dtype torch.float64"):
        fastbatch.stack(arrays, out=torch.empty(48, dtype=torch.float64))
    with pytest.raises(ValueError, match="out is not contiguous"):
        fastbatch.stack(arrays, out=torch.empty(16, 3).t())
    ro = np.zeros(48, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastbatch.stack(arrays, out=ro)
    with pytest.raises(TypeError, match="out must be a dense CPU tensor"):
        fastbatch.stack(arrays, out=torch.empty(48, device="meta"))
    with pytest.raises(TypeError, match="out must be a torch CPU tensor or numpy array, not list"):
        fastbatch.stack(arrays, out=[0.0] * 48)
    with pytest.raises(ValueError, match=r"out holds 5 elements, the batch \[2, 3\] needs 6"):
        fastbatch.pad([np.zeros(3, np.int64)] * 2, out=torch.empty(5, dtype=torch.int64))
    buf = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="out overlaps one of the inputs"):
        fastbatch.stack([buf[1], buf[2]], out=buf[1:])
    with pytest.raises(ValueError, match="out overlaps one of the inputs"):
        fastbatch.pad([buf[0], buf[2]], out=buf[:2].reshape(-1))


def test_pad_input_errors(backend):
    """Non-1-D sequences, mixed dtypes, bad pad values and bad max_len raise named errors."""
    s = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError, match=r"item 1 has shape \(2, 2\); pad takes 1-D"):
        fastbatch.pad([s, s.reshape(2, 2)])
    with pytest.raises(ValueError, match="item 1 has dtype int64, item 0 has dtype int32"):
        fastbatch.pad([s, s.astype(np.int64)])
    with pytest.raises(ValueError, match="no sequences"):
        fastbatch.pad([])
    with pytest.raises(ValueError, match="pad_value -1 does not fit uint8"):
        fastbatch.pad([s.astype(np.uint8)], pad_value=-1)
    with pytest.raises(ValueError, match="pad_value 0.5 does not fit int32"):
        fastbatch.pad([s], pad_value=0.5)
    with pytest.raises(ValueError, match="pad_value 1000000.0 does not fit float16"):
        fastbatch.pad([s.astype(np.float16)], pad_value=1e6)
    with pytest.raises(TypeError, match="pad_value must be a real number"):
        fastbatch.pad([s], pad_value="0")
    with pytest.raises(ValueError, match="max_len must be >= 0"):
        fastbatch.pad([s], max_len=-1)
    with pytest.raises(TypeError, match="max_len must be an int"):
        fastbatch.pad([s], max_len=2.0)


def test_c_return_codes_raise_named_errors():
    """Every C error code comes back as a named FastbatchError (or ValueError for overlap)."""
    if fastbatch.lib is None:
        pytest.skip("C module not built")
    ffi, lib = fastbatch.ffi, fastbatch.lib
    dst = ffi.new("char[]", 16)
    srcs = ffi.new("const char *[]", [ffi.new("char[]", 8)])
    one = ffi.new("int64_t[]", [1])
    pad = ffi.new("int64_t *")
    cases = {
        "FB_ESIZE": lib.fb_gather(dst, srcs, -1, 8, 1, 0, 0),
        "FB_EOVERFLOW": lib.fb_gather(dst, srcs, 2**62, 8, 1, 0, 0),
        "FB_ENULL": lib.fb_gather(ffi.NULL, srcs, 1, 8, 1, 0, 0),
        "FB_EELEM": lib.fb_pad_gather(dst, srcs, one, 1, 2, 3, pad, 1, 0, 0),
        "FB_EOVERLAP": lib.fb_gather(dst, ffi.new("const char *[]", [dst + 4]), 1, 8, 1, 0, 0),
    }
    for name, rc in cases.items():
        assert rc == getattr(lib, name), (name, rc)
        exc = ValueError if name == "FB_EOVERLAP" else fastbatch.FastbatchError
        with pytest.raises(exc, match=name if exc is fastbatch.FastbatchError else "overlaps"):
            fastbatch._check(rc, "test")
    assert lib.fb_gather(dst, srcs, 1, 8, 1, 0, 0) == 0


def test_c_calls_release_the_gil(tmp_path):
    """The cffi wrappers of fb_gather and fb_pad_gather release the GIL around the C call."""
    spec = importlib.util.spec_from_file_location("fastbatch_build", os.path.join(ROOT, "fastbatch", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.ffibuilder().emit_c_code(str(tmp_path / "gen.c"))
    src = (tmp_path / "gen.c").read_text()
    for fn in ("fb_gather", "fb_pad_gather"):
        body = src.split(f"_cffi_f_{fn}(PyObject")[1].split("\n}\n")[0]
        assert "Py_BEGIN_ALLOW_THREADS" in body and "Py_END_ALLOW_THREADS" in body, fn


# fuzz: random item lists must either equal numpy or raise ValueError/TypeError, never crash.
FUZZ_DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_,
               np.complex64, ">i4", np.object_]


@st.composite
def fuzz_item(draw, shape_st):
    """(item, the numpy array it holds or None if it is not a valid item)."""
    dtype = np.dtype(draw(st.sampled_from(FUZZ_DTYPES)))
    shape = draw(shape_st)
    ok = dtype in fastbatch._TORCH
    a = rand(shape, dtype, np.random.default_rng(draw(st.integers(0, 9)))) if ok else np.zeros(shape, dtype)
    kind = draw(st.sampled_from(["numpy", "torch", "strided", "list"]))
    if kind == "strided" and a.ndim >= 1:
        s = a.repeat(2, axis=-1)[..., ::2]  # still C-contiguous (a plain view) when empty or 1 long
        return s, (s if ok and s.flags.c_contiguous else None)
    if kind == "torch" and ok:
        return torch.from_numpy(a.copy()), a
    if kind == "list":
        return a.tolist(), None
    return a, (a if ok else None)


SHAPE = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(fuzz_item(st.sampled_from([(2, 3), (3,), (0,), ()]) | SHAPE), max_size=4),
       out_kind=st.sampled_from([None, "exact", "short"]))
def test_fuzz_stack(name, items, out_kind):
    """Random shapes/dtypes/kinds/outs: stack equals np.stack when the batch is valid, else raises."""
    arrays = [a for _, a in items]
    valid = bool(items) and all(a is not None for a in arrays) and \
        all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays)
    out = None
    if valid and out_kind is not None:
        want = np.stack(arrays)
        out = torch.from_numpy(np.empty(max(want.size - (out_kind == "short"), 0), want.dtype))
        valid = out_kind == "exact" or want.size == 0
    with use_backend(name):
        try:
            got = fastbatch.stack([it for it, _ in items], out=out)
        except (ValueError, TypeError):
            assert not valid
            return
    assert valid
    np.testing.assert_array_equal(got.numpy(), np.stack(arrays))


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(fuzz_item(st.sampled_from([(0,), (1,), (5,), (17,)]) | SHAPE), max_size=4),
       max_len=st.none() | st.integers(0, 20))
def test_fuzz_pad(name, items, max_len):
    """Random shapes/dtypes/kinds: pad equals the numpy loop when the batch is valid, else raises."""
    arrays = [a for _, a in items]
    valid = bool(items) and all(a is not None and a.ndim == 1 for a in arrays) and \
        all(a.dtype == arrays[0].dtype for a in arrays)
    with use_backend(name):
        try:
            got, lens = fastbatch.pad([it for it, _ in items], max_len=max_len)
        except (ValueError, TypeError):
            assert not valid
            return
    assert valid
    want, want_len = numpy_pad(arrays, 0, max_len)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(lens.numpy(), want_len)


# --- PinnedRing -------------------------------------------------------------------------------

def test_ring_shapes_alignment_and_growth():
    """acquire gives page-aligned views of the requested shape; a slot only grows, never shrinks."""
    ring = fastbatch.PinnedRing(slots=1)
    assert ring.pinned is torch.cuda.is_available()
    slot, t = ring.acquire((4, 5), torch.float32)
    assert (slot, t.shape, t.dtype) == (0, (4, 5), torch.float32) and t.data_ptr() % 4096 == 0
    ring.release(slot)
    slot, small = ring.acquire(8)  # an int is a 1-D shape: 8 bytes of uint8
    assert small.shape == (8,) and small.dtype == torch.uint8 and small.data_ptr() == t.data_ptr()
    ring.release(slot)
    slot, big = ring.acquire((1 << 20,), np.float64)
    assert big.dtype == torch.float64 and big.data_ptr() % 4096 == 0
    ring.release(slot)
    slot, again = ring.acquire((1 << 20,), np.float64)
    assert again.data_ptr() == big.data_ptr()  # no reallocation once grown
    ring.release(slot)


def test_ring_blocks_times_out_and_refuses_double_release():
    """With every slot in use acquire times out; releasing a free slot raises."""
    ring = fastbatch.PinnedRing(slots=2)
    a, _ = ring.acquire(16)
    b, _ = ring.acquire(16)
    assert a != b
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="all 2 slots still in use"):
        ring.acquire(16, timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    ring.release(a)
    with pytest.raises(ValueError, match="not in use"):
        ring.release(a)
    with pytest.raises(ValueError, match="not in use"):
        ring.release(7)
    c, _ = ring.acquire(16, timeout=0)
    assert c == a


def test_ring_never_hands_out_a_slot_in_use(backend):
    """A producer thread fills slots while a slow consumer checks each batch is intact, then releases."""
    ring = fastbatch.PinnedRing(slots=3)
    handed, in_use, lock = queue.Queue(maxsize=8), set(), threading.Lock()
    n_batches, errors = 150, []

    def produce():
        for k in range(n_batches):
            slot, t = ring.stack([np.full(1000 + k, k, np.int64)] * 4, timeout=10)
            with lock:
                if slot in in_use:
                    errors.append(f"batch {k}: slot {slot} handed out while in use")
                in_use.add(slot)
            handed.put((k, slot, t))

    producer = threading.Thread(target=produce)
    producer.start()
    rng = random.Random(0)
    for _ in range(n_batches):
        k, slot, t = handed.get(timeout=10)
        time.sleep(rng.random() * 0.002)  # the "H2D copy" still reading the slot
        if not bool((t == k).all()) or t.shape != (4, 1000 + k):
            errors.append(f"batch {k} overwritten in slot {slot}")
        with lock:
            in_use.discard(slot)
        ring.release(slot)
    producer.join()
    assert errors == []


def test_ring_stack_pad_collate_match_fresh(backend, threading_):
    """ring.stack/pad/collate give what stack/pad/collate_default give, from one slot each."""
    rng = np.random.default_rng(4)
    ring = fastbatch.PinnedRing(slots=2)
    arrays = [rand((3, 70), np.float32, rng) for _ in range(5)]
    slot, t = ring.stack(arrays)
    assert_same(t, np.stack(arrays), f"{backend} ring.stack")
    ring.release(slot)
    seqs = [rand((n,), np.int64, rng) for n in (16, 200, 31)]
    slot, t, lens = ring.pad(seqs, pad_value=-1, max_len=100)
    want, want_len = numpy_pad(seqs, -1, 100)
    assert_same(t, want, "  ring.pad")
    assert_same(lens, want_len, "  ring.pad lengths")
    ring.release(slot)
    payloads = [{"ids": list(range(n)), "img": rand((2, 3), np.float32, rng)} for n in (3, 1, 4)]
    slot, batch = ring.collate(payloads)
    fresh = fastbatch.collate_default(payloads)
    assert batch.keys() == fresh.keys() == {"ids", "ids_lengths", "img"}
    for k in batch:
        assert_same(batch[k], fresh[k].numpy(), f"  ring.collate[{k}]")
    ring.release(slot)


def test_ring_frees_the_slot_when_the_gather_fails(backend):
    """A gather error inside a ring slot releases that slot before raising."""
    ring = fastbatch.PinnedRing(slots=1)
    slot, t = ring.acquire((2, 8), torch.float32)
    ring.release(slot)
    with pytest.raises(ValueError, match="overlaps"):
        ring.stack([t[0], t[1]])  # the slot's own memory as input
    ring.release(ring.acquire(4, timeout=0)[0])


# --- collate_default --------------------------------------------------------------------------

def test_collate_default_stacks_pads_and_promotes(backend):
    """Same-shape keys stack, ragged 1-D keys pad with <key>_lengths, lists convert, dtypes promote."""
    img = [np.full((2, 2), i, np.float32) for i in range(3)]
    payloads = [{"img": img[0], "ids": [1, 2, 3], "score": 1, "w": torch.ones(2)},
                {"img": img[1], "ids": [4], "score": 2.5, "w": torch.zeros(2)},
                {"img": img[2], "ids": np.array([5, 6], np.int64), "score": True, "w": torch.ones(2)}]
    b = fastbatch.collate_default(payloads)
    assert b.keys() == {"img", "ids", "ids_lengths", "score", "w"}
    assert_same(b["img"], np.stack(img), f"{backend} collate img")
    assert_same(b["ids"], np.array([[1, 2, 3], [4, 0, 0], [5, 6, 0]]), "  ids")
    assert_same(b["ids_lengths"], np.array([3, 1, 2]), "  ids_lengths")
    assert_same(b["score"], np.array([1.0, 2.5, 1.0]), "  score (int, float, bool -> float64)")
    assert_same(b["w"], np.array([[1, 1], [0, 0], [1, 1]], np.float32), "  w")


def test_collate_default_large_batch(backend):
    """300 payloads of token lists: one padded [300, L] tensor and lengths, equal to the numpy loop."""
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, 1000, rng.integers(1, 40)).tolist() for _ in range(300)]
    b = fastbatch.collate_default([{"ids": s} for s in seqs])
    want, want_len = numpy_pad([np.array(s) for s in seqs], 0)
    assert_same(b["ids"], want, f"{backend} collate 300 payloads")
    assert_same(b["ids_lengths"], want_len, "  lengths")


@pytest.mark.parametrize("payloads", [
    [], [{}], [1, 2], [{"a": 1}, [1]], [{"a": 1}, {"b": 1}], [{"a": 1}, {"a": 1, "b": 2}],
    [{"a": "text"}], [{"a": None}], [{"a": {"x": 1}}], [{"a": 1j}], [{"a": b"raw"}],
    [{"a": [[1, 2], [3]]}], [{"a": np.zeros((2, 2))}, {"a": np.zeros((3, 2))}],
    [{"a": [1, 2], "a_lengths": 1}, {"a": [1], "a_lengths": 1}], [{1: [1]}],
    [{"a": torch.empty(2, device="meta")}], [{"a": torch.zeros(2, dtype=torch.bfloat16)}],
    [{"x": 1, "flag": True}, {"x": 2, "flag": False}],
], ids=lambda p: repr(p)[:40])
def test_collate_default_passes_through(backend, payloads):
    """Non-dicts, differing keys, non-numeric values, ragged N-D, name clashes, and dicts of plain
    numbers only (records, not tensors) return None."""
    assert fastbatch.collate_default(payloads) is None


# --- build and fallback -----------------------------------------------------------------------

def test_c_module_is_built():
    """The C path is what a plain import gets (unless FASTBATCH_REFERENCE=1 asks for numpy)."""
    if os.environ.get("FASTBATCH_REFERENCE") == "1":
        assert fastbatch.BACKEND == "reference"
    else:
        assert fastbatch.BACKEND == "c", "C build unavailable; the warning at import says why ---> run make setup"


def copy_package(tmp_path, with_so):
    """A copy of fastbatch/ under tmp_path (sources keep their mtimes), optionally with its .so."""
    dst = tmp_path / "fastbatch"
    dst.mkdir()
    for f in ("__init__.py", "reference.py", "_build.py", "fastbatch.c", "fastbatch.h"):
        shutil.copy2(os.path.join(ROOT, "fastbatch", f), dst / f)
    if with_so:
        shutil.copy2(fastbatch._SO, dst / os.path.basename(fastbatch._SO))
    return dst


def load_copy(pkg, name):
    """Import the package at pkg under a fresh module name, in this process (torch already loaded)."""
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_failed_build_falls_back_with_one_log_line(tmp_path, monkeypatch, caplog):
    """When the compiler fails, import logs one line with the reason and uses the reference path."""
    pkg = copy_package(tmp_path, with_so=False)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.delenv("FASTBATCH_REFERENCE", raising=False)
    mod = load_copy(pkg, "fastbatch_nocc")
    assert mod.BACKEND == "reference" and mod.lib is None
    lines = [r.getMessage() for r in caplog.records if r.name == "fastbatch"]
    assert len(lines) == 1 and lines[0].startswith("fastbatch: C build unavailable (")
    assert lines[0].endswith("); using the numpy reference path")
    assert_same(mod.stack([np.ones(3)] * 2), np.ones((2, 3)), "fallback stack")


def test_stale_build_is_rebuilt(tmp_path, monkeypatch):
    """A .so built from other sources (its compiled-in digest) is rebuilt on import, and the rebuilt module is
    used; one whose sources are newer files of the same content (a wheel's, as pip writes them) is not."""
    if not os.path.exists(fastbatch._SO):
        pytest.skip("no built .so to copy")
    monkeypatch.delenv("FASTBATCH_REFERENCE", raising=False)
    pkg = copy_package(tmp_path, with_so=True)
    so = pkg / os.path.basename(fastbatch._SO)
    old = os.path.getmtime(pkg / "fastbatch.c") - 100
    os.utime(so, (old, old))
    assert load_copy(pkg, "fastbatch_same").BACKEND == "c" and os.path.getmtime(so) == old
    with open(pkg / "fastbatch.c", "a") as f:
        f.write("/* changed */\n")
    mod = load_copy(pkg, "fastbatch_stale")
    assert mod.BACKEND == "c" and os.path.getmtime(so) > old + 100
    assert_same(mod.stack([np.ones(3)] * 2), np.ones((2, 3)), "rebuilt stack")


def test_concurrent_imports_build_once_and_env_forces_reference(tmp_path):
    """Two processes importing a copy with no .so both get the C path; FASTBATCH_REFERENCE=1 forces numpy."""
    copy_package(tmp_path, with_so=False)
    code = "import fastbatch, numpy as np; print(fastbatch.BACKEND, fastbatch.stack([np.ones(2)] * 2).sum().item())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    env.pop("FASTBATCH_REFERENCE", None)
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=e, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for e in (env, env, dict(env, FASTBATCH_REFERENCE="1"))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["c 4.0", "c 4.0", "reference 4.0"], outs
    assert all("unavailable" not in err for _, err in outs), outs


# --- warmd's result lines: fb_frame_lines against format_each ------------------------------------------------

import warmd  # noqa: E402

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)
class Colour(enum.Enum):
    RED = "red"


AWKWARD_RESULTS = [{"a": 1}, [1, 2, {"b": 'x"],}[{'}], 'str \\ " , ] } [ {', "caf\u00e9 \u2028 \U0001F600 \x00 \x1f",
                   True, False, -5, 2 ** 63, 1.5e-300, 1e-07, 1e16, -0.0, {}, [], "", [[[]]], {"": {"": ""}},
                   np.float32(1.5), np.float64(0.1), np.int64(-3), Colour.RED, uuid.UUID(int=7), (1, "t"), {3}]
def nested(levels):
    value = []
    for _ in range(levels - 1):
        value = [value]
    return value


# what orjson does not write as json's encoder would, so format_each takes them item by item: a None (a NaN is
# null in orjson's text too), an integer beyond 64 bits, a key that is not a string, nesting past orjson's 254,
# a lone surrogate
JSON_ONLY_RESULTS = [None, {"a": [1, None]}, 10 ** 40, -2 ** 63 - 1, {1: "x"}, {True: 1}, nested(300), "\ud800"]


def lines_of(values, base=0):
    """format_each's result lines of these values: [(i, the result parsed back)]."""
    (text,), failed, _ = warmd.format_each([(True, v) for v in values], base)
    assert failed == [] and text.endswith("\n")
    return [(line["i"], line["result"]) for line in map(json.loads, text[:-1].split("\n"))]   # U+2028 is no line end


def test_result_lines_framed_in_c_are_format_each_s():
    """warmd's C framing is loaded and writes exactly format_each's lines (one orjson encoding of the batch, cut in
    C): awkward strings (quotes, backslashes, brackets and commas inside them, non-ASCII, control characters),
    nesting, empties, floats, numpy scalars, enums, UUIDs, tuples, sets; any index up to int64's."""
    outcome = [(True, value) for value in AWKWARD_RESULTS]
    assert warmd.framer is not None, "fastbatch's C module did not load in warmd (test_c_module_is_built says why)"
    for base in (0, 7, 2 ** 63 - len(outcome)):
        framed = warmd.frame_lines(AWKWARD_RESULTS, base)
        assert framed is not None and [framed] == warmd.format_each(outcome, base)[0]
        assert warmd.format_outcome(outcome, base) == warmd.format_each(outcome, base)


def test_orjson_and_json_write_the_same_values():
    """Each result reads back as json's encoder writes it, whichever encoder wrote its line: orjson for the awkward
    values, json's for what orjson would not write alike (a None, big integers, keys that are not strings, deep
    nesting), which the batch path leaves to format_each."""
    reference = [json.loads(warmd.encode_result(v)) for v in AWKWARD_RESULTS + JSON_ONLY_RESULTS]
    assert [value for _, value in lines_of(AWKWARD_RESULTS + JSON_ONLY_RESULTS, 5)] == reference
    assert all(warmd.encode_fast(v) is not None for v in AWKWARD_RESULTS)
    for value in JSON_ONLY_RESULTS:
        assert warmd.encode_fast(value) is None and warmd.frame_lines([1, value], 0) is None
    assert lines_of([{1: "x"}]) == [(0, {"1": "x"})]


def test_results_neither_encoder_takes_fail_their_item():
    """NaN, Infinity, a dataclass, a datetime, bytes: the item fails with json's message, and the items beside it
    (one of them a None) keep their lines."""
    @dataclasses.dataclass
    class Point:
        x: int
    for bad in (float("nan"), {"x": [float("-inf")]}, np.float32("nan"), Point(1), datetime.datetime(2026, 1, 1),
                b"raw"):
        lines, failed, errors = warmd.format_outcome([(True, 1), (True, bad), (True, None)], 0)
        assert failed == [1] and "not JSON-serialisable" in errors["1"], (bad, errors)
        assert [json.loads(line)["ok"] for line in lines[0].splitlines()] == [True, False, True]


@given(st.lists(JSON_VALUES, min_size=1, max_size=20), st.integers(0, 2 ** 40))
@settings(max_examples=300, deadline=None)
def test_fuzz_result_lines(values, base):
    """The framed lines are format_each's where orjson takes the batch; format_each's read back as the values."""
    if warmd.framer is None:
        pytest.skip("C module not built")
    framed = warmd.frame_lines(values, base)
    if framed is not None:
        assert [framed] == warmd.format_each([(True, v) for v in values], base)[0]
    else:
        assert warmd.encode_fast(values) is None
    assert lines_of(values, base) == list(enumerate(values, base))


def test_a_batch_with_a_failure_or_a_nan_is_framed_item_by_item():
    """A failed item, or a result that is not strict JSON, sends the batch through format_each: the others keep
    their lines, only that item fails."""
    for outcome in ([(True, 1), (False, "ValueError: bad"), (True, 2)], [(True, 1), (True, float("nan")), (True, 2)]):
        lines, failed, errors = warmd.format_outcome(outcome, 10)
        assert (lines, failed, errors) == warmd.format_each(outcome, 10) and failed == [11]
        assert [json.loads(line)["ok"] for line in lines[0].splitlines()] == [True, False, True]


@pytest.mark.parametrize("text, count, error", [
    (b"[1,2]", 3, "FB_EFRAME"), (b"[1,2]", 1, "FB_EFRAME"), (b"[1,]", 2, "FB_EFRAME"), (b'["a,b]', 1, "FB_EFRAME"),
    (b"[[1]", 1, "FB_EFRAME"), (b"1,2", 2, "FB_EFRAME"), (b"[]", 1, "FB_EFRAME"), (b'["\\"]', 1, "FB_EFRAME"),
    (b"[1]", -1, "FB_ESIZE")])
def test_frame_lines_refuses_what_is_not_an_array_of_count(text, count, error):
    """What the C framer cannot cut is refused with a code (warmd then frames that batch in Python), never
    misread; an output buffer too small is refused before a byte past it is written."""
    out = warmd.ffi.new("char[]", 4096)
    assert warmd.framer.fb_frame_lines(text, len(text), 0, count, out, 4096) == getattr(warmd.framer, error)
    assert warmd.framer.fb_frame_lines(b"[1,2]", 5, 0, 2, out, 47) == warmd.framer.FB_ESIZE
    assert warmd.framer.fb_frame_lines(b"[]", 2, 0, 0, out, 0) == 0


def test_a_worker_without_the_c_module_frames_lines_in_python(tmp_path, monkeypatch):
    """No built module (a failed build): the loader says so and gives nothing; format_outcome then frames every
    batch in Python."""
    assert warmd.load_framer(str(tmp_path)) == (None, None)
    monkeypatch.setattr(warmd, "framer", None)
    outcome = [(True, {"x": i}) for i in range(3)]
    assert warmd.format_outcome(outcome, 0) == warmd.format_each(outcome, 0)
