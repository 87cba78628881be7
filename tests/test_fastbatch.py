"""fastbatch: the C gather against the numpy reference path, and both against plain numpy.

    .venv/bin/python -m pytest -q tests/test_fastbatch.py    # both paths (C ones skip if unbuilt)

The gather is checked by hypothesis properties (generated dtypes, shapes, ragged lengths, item
kinds, byte offsets, outs, thread and streaming thresholds; derandomized, so every run draws the
same examples) plus named cases for the edges: every dtype once, one item, empty rows, the thread
threshold, each error.
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

DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.int16,
          np.bool_]
BACKENDS = ["c", "reference"]
# (THREADS, THREAD_MIN_BYTES, STREAM_MIN_BYTES): defaults on one thread (tiny batches: plain
# memcpy), 3 threads from 1 byte up, and 2 threads with streaming stores from 0 bytes up.
THREADINGS = [(1, None, None), (3, 1, None), (2, 1, 0)]
# the same examples on every run and machine (CI is deterministic), none kept between runs
PROPERTY = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# --- helpers ----------------------------------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the test on the C path and on the numpy reference path."""
    if request.param == "c" and fastbatch.load() != "c":
        pytest.skip("C module not built (test_c_module_is_built says why)")
    monkeypatch.setattr(fastbatch, "BACKEND", request.param)
    return request.param


def on_path(name, threading_, fn):
    """fn() with fastbatch on path `name` ("c" or "reference") and these thresholds: ("ok", a
    numpy copy of its result, item by item for a tuple) or ("error", type, message)."""
    threads, min_bytes, stream_bytes = threading_
    names = ("BACKEND", "THREADS", "THREAD_MIN_BYTES", "STREAM_MIN_BYTES")
    saved = [getattr(fastbatch, n) for n in names]
    fastbatch.BACKEND, fastbatch.THREADS = name, threads
    fastbatch.THREAD_MIN_BYTES = saved[2] if min_bytes is None else min_bytes
    fastbatch.STREAM_MIN_BYTES = saved[3] if stream_bytes is None else stream_bytes
    try:
        got = fn()
        if isinstance(got, tuple):
            return "ok", tuple(t.numpy().copy() for t in got)
        return "ok", got.numpy().copy()
    except (ValueError, TypeError) as e:
        return "error", type(e), str(e)
    finally:
        for n, v in zip(names, saved):
            setattr(fastbatch, n, v)


def c_and_reference(threading_, fn):
    """fn()'s outcome on the C path, checked to be the reference path's byte for byte (or the same
    error)."""
    if fastbatch.load() != "c":
        pytest.skip("C module not built")
    c, ref = on_path("c", threading_, fn), on_path("reference", threading_, fn)
    assert c[0] == ref[0] and (c[1:] == ref[1:] if c[0] == "error" else True), (c, ref)
    if c[0] == "ok":
        for g, w in zip(*((x,) if not isinstance(x, tuple) else x for x in (c[1], ref[1]))):
            assert g.shape == w.shape and g.dtype == w.dtype and g.tobytes() == w.tobytes()
    return c


def rand(shape, dtype, rng):
    """Random values covering dtype's whole range (an array, even for shape ())."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) > 0.5)
    if dtype.kind == "f":
        return np.asarray(rng.standard_normal(shape) * 100, dtype=dtype)
    info = np.iinfo(dtype)
    return np.asarray(rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True))


def at_offset(a, offset):
    """A copy of a, its data `offset` bytes into a fresh buffer (misaligned unless offset % itemsize
    is 0)."""
    out = np.frombuffer(bytearray(a.nbytes + 8), a.dtype, count=a.size, offset=offset)
    out = out.reshape(a.shape)
    out[...] = a
    return out


def as_kind(a, kind):
    """The same values as a numpy array, a torch tensor, a buffer, a misaligned copy or a view into
    a bigger array (contiguous: a row of it)."""
    if kind == "torch":
        return torch.from_numpy(a.copy())
    if kind == "buffer":
        return memoryview(a.copy())
    if kind == "misaligned":
        return at_offset(a, 3)
    if kind == "view":
        return np.stack([a, a])[1]
    return a


def numpy_pad(seqs, pad_value, max_len=None):
    """The obvious numpy pad loop: fill everything, then write each row's prefix."""
    L = max(len(s) for s in seqs)
    L = L if max_len is None else min(L, max_len)
    out = np.full((len(seqs), L), pad_value, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, :min(len(s), L)] = s[:L]
    return out, np.array([min(len(s), L) for s in seqs], dtype=np.int64)


def assert_same(got, want, what=""):
    """got (torch) equals want (numpy) in shape, dtype and every element (NaN equal to NaN)."""
    g = got.numpy()
    assert (g.shape, g.dtype) == (want.shape, want.dtype), (what, g.shape, g.dtype, want.shape)
    np.testing.assert_array_equal(g, want, err_msg=what)


def make_out(kind, n, dtype):
    """An out of at least n elements: None, exact, larger, numpy, misaligned numpy."""
    if kind is None:
        return None
    if kind == "exact":
        return torch.from_numpy(np.zeros(n, dtype))
    if kind == "larger":
        return torch.from_numpy(np.ones(n + 5, dtype))
    return np.zeros(n, dtype) if kind == "numpy" else at_offset(np.zeros(n, dtype), 1)


OUTS = [None, "exact", "larger", "numpy", "misaligned"]
KINDS = ["numpy", "torch", "buffer", "misaligned", "view"]


# --- the properties: C path == reference path == numpy -----------------------------------------

@st.composite
def stack_cases(draw):
    """(items, np.stack of their values, out kind, threading): B items of one dtype and shape, each
    of any kind; rows from empty to over a page (threads then split inside an item)."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.lists(st.integers(0, 4), max_size=3).map(tuple)
                 | st.tuples(st.integers(500, 3000)))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    values = [rand(shape, dtype, rng) for _ in range(draw(st.integers(1, 6)))]
    items = [as_kind(a, draw(st.sampled_from(KINDS))) for a in values]
    return items, np.stack(values), draw(st.sampled_from(OUTS)), draw(st.sampled_from(THREADINGS))


@settings(max_examples=150, **PROPERTY)
@given(stack_cases())
def test_stack_c_equals_reference(case):
    """stack: the C path's bytes are the reference path's, and both are np.stack's, into any out."""
    items, want, out_kind, threading_ = case
    _, got = c_and_reference(threading_, lambda: fastbatch.stack(
        items, out=make_out(out_kind, want.size, want.dtype)))
    np.testing.assert_array_equal(got, want)


def pad_values(dtype):
    """Pad values dtype holds exactly: a bool, an int in range, a float of its width (NaN, inf)."""
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "f":
        return st.floats(width=8 * dtype.itemsize)
    info = np.iinfo(dtype)
    return st.integers(int(info.min), int(info.max))


@st.composite
def pad_cases(draw):
    """(seqs, their numpy values, pad value, max_len, out kind, threading): ragged 1-D sequences
    of one dtype, empty to a few pages long, of any kind."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    lengths = draw(st.lists(st.integers(0, 40) | st.integers(500, 3000), min_size=1, max_size=8))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    values = [rand((n,), dtype, rng) for n in lengths]
    seqs = [as_kind(a, draw(st.sampled_from(KINDS))) for a in values]
    return (seqs, values, draw(pad_values(dtype)), draw(st.none() | st.integers(0, 60)),
            draw(st.sampled_from(OUTS)), draw(st.sampled_from(THREADINGS)))


@settings(max_examples=150, **PROPERTY)
@given(pad_cases())
def test_pad_equals_the_numpy_loop(case):
    """pad (numpy on both paths: reference.pad) equals the obvious numpy pad loop, into any out."""
    seqs, values, pad_value, max_len, out_kind, threading_ = case
    want, want_len = numpy_pad(values, pad_value, max_len)
    _, (got, got_len) = c_and_reference(threading_, lambda: fastbatch.pad(
        seqs, pad_value=pad_value, max_len=max_len, out=make_out(out_kind, want.size, want.dtype)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_len, want_len)


@st.composite
def payload_batches(draw):
    """Payloads as a handler's items: token lists or arrays (ragged or not), a same-shape array,
    a number beside them."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ragged = draw(st.booleans())
    payloads = []
    for n in draw(st.lists(st.integers(0, 30), min_size=1, max_size=6)):
        ids = rand((n if ragged else 4,), np.int64, rng)
        payloads.append({"ids": ids.tolist() if draw(st.booleans()) else ids,
                         "img": as_kind(rand((2, 3), dtype, rng),
                                        draw(st.sampled_from(["numpy", "torch"]))),
                         "label": draw(st.integers(-5, 5))})
    return payloads, draw(st.sampled_from(THREADINGS))


@settings(max_examples=40, **PROPERTY)
@given(payload_batches())
def test_collate_c_equals_reference(case):
    """collate_default and ring.collate: the C path's tensors are the reference path's."""
    payloads, threading_ = case
    ring = fastbatch.PinnedRing(slots=1)

    def in_ring():
        slot, batch = ring.collate(payloads)
        ring.release(slot)
        return tuple(batch[k] for k in sorted(batch))
    def fresh_batch():
        batch = fastbatch.collate_default(payloads)
        return tuple(batch[k] for k in sorted(batch))
    fresh = c_and_reference(threading_, fresh_batch)
    ringed = c_and_reference(threading_, in_ring)
    assert [a.tobytes() for a in ringed[1]] == [a.tobytes() for a in fresh[1]]


# fuzz: random item lists, valid or not: numpy's answer on both paths, or one named error on both
FUZZ_DTYPES = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_,
               np.complex64, ">i4", np.object_]


@st.composite
def fuzz_item(draw, shape_st):
    """(item, the numpy array it holds or None if it is not a valid item)."""
    dtype = np.dtype(draw(st.sampled_from(FUZZ_DTYPES)))
    shape = draw(shape_st)
    ok = dtype in fastbatch._TORCH
    rng = np.random.default_rng(draw(st.integers(0, 9)))
    a = rand(shape, dtype, rng) if ok else np.zeros(shape, dtype)
    kind = draw(st.sampled_from(["numpy", "torch", "strided", "reversed", "list"]))
    if kind in ("strided", "reversed") and a.ndim >= 1:
        s = a.repeat(2, axis=-1)[..., ::2] if kind == "strided" else a[..., ::-1]
        return s, (s if ok and s.flags.c_contiguous else None)   # contiguous if empty or 1 long
    if kind == "torch" and ok:
        return torch.from_numpy(a.copy()), a
    if kind == "list":
        return a.tolist(), None
    return a, (a if ok else None)


SHAPE = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)


@settings(max_examples=100, **PROPERTY)
@given(items=st.lists(fuzz_item(st.sampled_from([(2, 3), (3,), (0,), ()]) | SHAPE), max_size=4),
       out_kind=st.sampled_from([None, "exact", "short"]))
def test_fuzz_stack(items, out_kind):
    """Random shapes/dtypes/kinds/outs: np.stack's answer for a valid batch, else one error."""
    arrays = [a for _, a in items]
    valid = bool(items) and all(a is not None for a in arrays) and \
        all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays)
    out = None
    if valid and out_kind is not None:
        size = np.stack(arrays).size
        out = np.empty(max(size - (out_kind == "short"), 0), arrays[0].dtype)
        valid = out_kind == "exact" or size == 0
    outcome = c_and_reference((1, None, None), lambda: fastbatch.stack(
        [it for it, _ in items], out=None if out is None else torch.from_numpy(out.copy())))
    assert (outcome[0] == "ok") == valid, outcome
    if valid:
        np.testing.assert_array_equal(outcome[1], np.stack(arrays))


@settings(max_examples=100, **PROPERTY)
@given(items=st.lists(fuzz_item(st.sampled_from([(0,), (1,), (5,), (17,)]) | SHAPE), max_size=4),
       max_len=st.none() | st.integers(0, 20))
def test_fuzz_pad(items, max_len):
    """Random shapes/dtypes/kinds: the numpy loop's answer for a valid batch, else one error."""
    arrays = [a for _, a in items]
    valid = bool(items) and all(a is not None and a.ndim == 1 for a in arrays) and \
        all(a.dtype == arrays[0].dtype for a in arrays)
    outcome = c_and_reference((1, None, None),
                              lambda: fastbatch.pad([it for it, _ in items], max_len=max_len))
    assert (outcome[0] == "ok") == valid, outcome
    if valid:
        want, want_len = numpy_pad(arrays, 0, max_len)
        np.testing.assert_array_equal(outcome[1][0], want)
        np.testing.assert_array_equal(outcome[1][1], want_len)


# --- named cases ------------------------------------------------------------------------------

def test_every_dtype_once(backend):
    """Each supported dtype stacks and pads (with a pad value other than 0) as numpy does."""
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        arrays = [rand((2, 5), dtype, rng) for _ in range(3)]
        assert_same(fastbatch.stack(arrays), np.stack(arrays), f"{backend} {np.dtype(dtype)}")
        seqs = [rand((n,), dtype, rng) for n in (3, 0, 7)]
        pad_value = {"b": True, "u": 200, "i": -3, "f": -1.5}[np.dtype(dtype).kind]
        got, lengths = fastbatch.pad(seqs, pad_value=pad_value)
        assert_same(got, numpy_pad(seqs, pad_value)[0], f"{backend} pad {np.dtype(dtype).name}")
        assert lengths.tolist() == [3, 0, 7]


def test_one_item_and_empty_rows(backend):
    """One item; items of zero elements; sequences all empty; max_len 0: numpy's shapes."""
    one = np.arange(7, dtype=np.int16)
    assert_same(fastbatch.stack([one]), one[None], f"{backend} one item")
    assert_same(fastbatch.stack([np.zeros((3, 0, 2))] * 5), np.zeros((5, 3, 0, 2)), "empty items")
    got, lengths = fastbatch.pad([np.zeros(0, np.int64)] * 2)
    assert got.shape == (2, 0) and lengths.tolist() == [0, 0]
    got, lengths = fastbatch.pad([one, one[:2]], max_len=0)
    assert got.shape == (2, 0) and lengths.tolist() == [0, 0]
    assert_same(fastbatch.pad([one], pad_value=9)[0], one[None], "one sequence")


def test_stack_accepts_tensors_and_buffers(backend):
    """numpy arrays, torch CPU tensors (even requires_grad) and buffer objects mix in one batch."""
    rng = np.random.default_rng(1)
    base = [rand((300,), np.float64, rng) for _ in range(4)]
    items = [base[0], torch.from_numpy(base[1].copy()).requires_grad_(), array.array("d", base[2]),
             memoryview(base[3].copy())]
    assert_same(fastbatch.stack(items), np.stack(base), f"{backend} mixed items")
    raw = [bytes(range(10)), bytearray(range(10, 20))]
    assert_same(fastbatch.stack(raw), np.stack([np.frombuffer(b, np.uint8) for b in raw]), "  bytes")


def test_stack_across_default_thread_threshold(backend, monkeypatch):
    """With the default threshold, batches just below, at and above it gather correctly on 2 threads."""
    monkeypatch.setattr(fastbatch, "THREADS", 2)
    rng = np.random.default_rng(2)
    for delta in (-8, 0, 8 * 513):
        arrays = [rand(((fastbatch.THREAD_MIN_BYTES + delta) // 8,), np.uint8, rng) for _ in range(8)]
        assert_same(fastbatch.stack(arrays), np.stack(arrays), f"{backend} threshold {delta:+d} bytes")


def test_pad_nan_and_torch_tokens(backend):
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
    if fastbatch.load() != "c":
        pytest.skip("C module not built")
    ffi, lib = fastbatch.ffi, fastbatch.lib
    dst = ffi.new("char[]", 16)
    srcs = ffi.new("const char *[]", [ffi.new("char[]", 8)])
    cases = {
        "FB_ESIZE": lib.fb_gather(dst, srcs, -1, 8, 1, 0, 0),
        "FB_EOVERFLOW": lib.fb_gather(dst, srcs, 2**62, 8, 1, 0, 0),
        "FB_ENULL": lib.fb_gather(ffi.NULL, srcs, 1, 8, 1, 0, 0),
        "FB_EOVERLAP": lib.fb_gather(dst, ffi.new("const char *[]", [dst + 4]), 1, 8, 1, 0, 0),
    }
    for name, rc in cases.items():
        assert rc == getattr(lib, name), (name, rc)
        exc = ValueError if name == "FB_EOVERLAP" else fastbatch.FastbatchError
        with pytest.raises(exc, match=name if exc is fastbatch.FastbatchError else "overlaps"):
            fastbatch._check(rc, "test")
    assert lib.fb_gather(dst, srcs, 1, 8, 1, 0, 0) == 0


def test_c_calls_release_the_gil(tmp_path):
    """The cffi wrapper of fb_gather releases the GIL around the C call."""
    spec = importlib.util.spec_from_file_location("fastbatch_build", os.path.join(ROOT, "fastbatch", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.ffibuilder().emit_c_code(str(tmp_path / "gen.c"))
    src = (tmp_path / "gen.c").read_text()
    for fn in ("fb_gather",):
        body = src.split(f"_cffi_f_{fn}(PyObject")[1].split("\n}\n")[0]
        assert "Py_BEGIN_ALLOW_THREADS" in body and "Py_END_ALLOW_THREADS" in body, fn


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


def test_ring_stack_pad_collate_match_fresh(backend):
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


def test_collate_default_passes_through(backend):
    """Non-dicts, differing keys, non-numeric values, ragged N-D, name clashes, and dicts of plain
    numbers only (records, not tensors) return None."""
    for payloads in (
            [], [{}], [1, 2], [{"a": 1}, [1]], [{"a": 1}, {"b": 1}], [{"a": 1}, {"a": 1, "b": 2}],
            [{"a": "text"}], [{"a": None}], [{"a": {"x": 1}}], [{"a": 1j}], [{"a": b"raw"}],
            [{"a": [[1, 2], [3]]}], [{"a": np.zeros((2, 2))}, {"a": np.zeros((3, 2))}],
            [{"a": [1, 2], "a_lengths": 1}, {"a": [1], "a_lengths": 1}], [{1: [1]}],
            [{"a": torch.empty(2, device="meta")}], [{"a": torch.zeros(2, dtype=torch.bfloat16)}],
            [{"x": 1, "flag": True}, {"x": 2, "flag": False}]):
        assert fastbatch.collate_default(payloads) is None, payloads


# --- build and fallback -----------------------------------------------------------------------

def test_c_module_is_built():
    """The C path is what the first use gets (unless FASTBATCH_REFERENCE=1 asks for numpy)."""
    if os.environ.get("FASTBATCH_REFERENCE") == "1":
        assert fastbatch.load() == "reference"
    else:
        assert fastbatch.load() == "c", "C build unavailable; the warning at import says why ---> run make setup"


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
    """When the compiler fails, the first use logs one line with the reason and uses the reference path."""
    pkg = copy_package(tmp_path, with_so=False)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.delenv("FASTBATCH_REFERENCE", raising=False)
    mod = load_copy(pkg, "fastbatch_nocc")
    assert mod.BACKEND is None and not caplog.records, "nothing is built or read at import"
    assert mod.load() == "reference" and mod.lib is None
    lines = [r.getMessage() for r in caplog.records if r.name == "fastbatch"]
    assert len(lines) == 1 and lines[0].startswith("fastbatch: C build unavailable (")
    assert lines[0].endswith("); using the numpy reference path")
    assert_same(mod.stack([np.ones(3)] * 2), np.ones((2, 3)), "fallback stack")


def test_stale_build_is_rebuilt(tmp_path, monkeypatch):
    """A .so built from other sources (its compiled-in digest) is rebuilt at first use, and the rebuilt module is
    used; one whose sources are newer files of the same content (a wheel's, as pip writes them) is not."""
    if not os.path.exists(fastbatch._SO):
        pytest.skip("no built .so to copy")
    monkeypatch.delenv("FASTBATCH_REFERENCE", raising=False)
    pkg = copy_package(tmp_path, with_so=True)
    so = pkg / os.path.basename(fastbatch._SO)
    old = os.path.getmtime(pkg / "fastbatch.c") - 100
    os.utime(so, (old, old))
    assert load_copy(pkg, "fastbatch_same").load() == "c" and os.path.getmtime(so) == old
    with open(pkg / "fastbatch.c", "a") as f:
        f.write("/* changed */\n")
    mod = load_copy(pkg, "fastbatch_stale")
    assert mod.load() == "c" and os.path.getmtime(so) > old + 100
    assert_same(mod.stack([np.ones(3)] * 2), np.ones((2, 3)), "rebuilt stack")


def test_concurrent_imports_build_once_and_env_forces_reference(tmp_path):
    """Two processes using a copy with no .so both get the C path; FASTBATCH_REFERENCE=1 forces numpy."""
    copy_package(tmp_path, with_so=False)
    code = "import fastbatch, numpy as np; s = fastbatch.stack([np.ones(2)] * 2).sum().item(); print(fastbatch.BACKEND, s)"
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
    """NaN, Infinity, a dataclass, a datetime: the item fails with json's message, and the items beside it (one
    of them a None) keep their lines. (Bytes are typed: test_media_out.py.)"""
    @dataclasses.dataclass
    class Point:
        x: int
    for bad in (float("nan"), {"x": [float("-inf")]}, np.float32("nan"), Point(1), datetime.datetime(2026, 1, 1)):
        lines, failed, errors = warmd.format_outcome([(True, 1), (True, bad), (True, None)], 0)
        assert failed == [1] and "not JSON-serialisable" in errors["1"], (bad, errors)
        assert [json.loads(line)["ok"] for line in lines[0].splitlines()] == [True, False, True]


@given(st.lists(JSON_VALUES, min_size=1, max_size=20), st.integers(0, 2 ** 40))
@settings(max_examples=100, **PROPERTY)
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
