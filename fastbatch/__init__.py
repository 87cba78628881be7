"""fastbatch — gather a batch into one contiguous tensor with exactly one copy, into reused host
buffers (pinned when CUDA is present). stack's copy is C (fastbatch.c via cffi, GIL released,
pthreads above THREAD_MIN_BYTES); fastbatch/reference.py is the same thing in numpy, used when
the C module cannot be built, and pad's copy on either path.

    .venv/bin/python fastbatch/_build.py                     # the C module by hand (pip install builds it)
    .venv/bin/python -m pytest -q tests/test_fastbatch.py    # C and numpy paths vs numpy
    .venv/bin/python bench/bench_fastbatch.py                # GB/s vs torch.stack, np.stack, memcpy
    FASTBATCH_REFERENCE=1 ...                                # force the numpy path

    x = fastbatch.stack(arrays)                        # [B, ...] tensor in fresh memory
    ids, lengths = fastbatch.pad(token_seqs, pad_value=0, max_len=2048)
    ring = fastbatch.PinnedRing(slots=3)
    slot, x = ring.stack(arrays)                       # into a reused (pinned) slot: no allocation
    x_gpu = x.to("cuda", non_blocking=True); copied = torch.cuda.Event(); copied.record()
    copied.synchronize(); ring.release(slot)           # only once the copy has finished reading x
    slot, batch = ring.collate(payloads) or (None, payloads)   # list of dicts -> dict of tensors

Thread-safe: a prefetch thread may gather while another thread drives the model (the C call
releases the GIL; the pointer scratch array is per thread; PinnedRing is locked).
"""
import fcntl
import functools
import logging
import math
import numbers
import os
import subprocess
import sys
import sysconfig
import threading

import numpy as np
import torch

from . import _build, reference

# -----------------------------------------------------------------------------
# defaults; callers and tests may assign them
THREADS = min(4, len(os.sched_getaffinity(0)))  # copy threads; a few saturate host memory bandwidth
THREAD_MIN_BYTES = 8 << 20   # smaller batches (bytes written) copy on one thread (2 lose below ~8 MiB)
STREAM_MIN_BYTES = 16 << 20  # batches this big bypass the cache (x86); smaller stay for a CPU reader
RING_SLOTS = 3          # PinnedRing slots: one being filled, one being copied to the device, one in the model
RING_GROWTH = 1.5       # a slot that must grow is given this much headroom, so ragged batches settle after a few regrowths
RING_ALIGN = 4096       # bytes; slot buffers and the tensors carved from one slot start on a page
# -----------------------------------------------------------------------------

__all__ = ["stack", "pad", "collate_default", "PinnedRing", "FastbatchError", "load", "BACKEND", "THREADS"]

log = logging.getLogger("fastbatch")

_HERE = os.path.dirname(os.path.abspath(__file__))
_SO = os.path.join(_HERE, "_fastbatch_c" + sysconfig.get_config_var("EXT_SUFFIX"))

# The dtypes both paths gather: numpy's and torch's names for the same bytes. torch-only dtypes
# (bfloat16) and complex are refused with a TypeError rather than converted.
_TORCH = {np.dtype(n): t for n, t in [
    (np.bool_, torch.bool), (np.uint8, torch.uint8), (np.int8, torch.int8), (np.int16, torch.int16),
    (np.int32, torch.int32), (np.int64, torch.int64), (np.float16, torch.float16),
    (np.float32, torch.float32), (np.float64, torch.float64)]}
_NUMPY = {t: n for n, t in _TORCH.items()}
_SUPPORTED = ", ".join(str(d) for d in _TORCH)


class FastbatchError(RuntimeError):
    """The C gather returned an error code (the message names it); inputs were already checked."""


def _stale():
    """Why the C module must be (re)built ('' when it was built from the sources beside it)."""
    if not os.path.exists(_SO):
        return "missing"
    with open(_SO, "rb") as f:
        if _build.DIGEST_MARK + _build.sources_digest().encode() not in f.read():
            return "built from other sources"
    return ""


def _load_c():
    """(ffi, lib) of the compiled gather, built first if missing or stale; raises with the reason."""
    if _stale():
        # Several workers importing at once: one builds under the lock, the others wait on it and
        # then find the .so fresh. _build.py renames the finished .so into place, so a process that
        # skips the lock (the .so looked fresh) never loads a half-written file.
        with open(os.path.join(_HERE, ".build.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _stale():
                r = subprocess.run([sys.executable, os.path.join(_HERE, "_build.py")],
                                   capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    lines = (r.stderr + r.stdout).strip().splitlines() or [f"exit {r.returncode}"]
                    raise RuntimeError(f"_build.py failed: {lines[-1]}")
    from . import _fastbatch_c
    return _fastbatch_c.ffi, _fastbatch_c.lib


ffi = lib = None
BACKEND = None      # "c" or "reference", chosen by load() at first use
_loading = threading.Lock()


def load():
    """The copy path, chosen once at first use (not at import, so that the environment is read
    then): numpy's where FASTBATCH_REFERENCE=1 or the C module cannot be built (one warning says
    why), else C, built first if missing or stale."""
    global BACKEND, ffi, lib
    with _loading:
        if BACKEND is not None:
            return BACKEND
        if os.environ.get("FASTBATCH_REFERENCE") == "1":
            log.info("fastbatch: FASTBATCH_REFERENCE=1; using the numpy reference path")
            BACKEND = "reference"
            return BACKEND
        try:
            ffi, lib = _load_c()
            BACKEND = "c"
        except Exception as e:  # no compiler, no headers, read-only dir, bad .so: one remedy
            BACKEND = "reference"
            reason = (str(e).strip().splitlines() or [""])[-1]
            log.warning("fastbatch: C build unavailable (%s: %s); using the numpy reference path",
                        type(e).__name__, reason)
        return BACKEND


def _check(rc, who):
    """Raise for a nonzero C return code: ValueError for an input error, FastbatchError otherwise."""
    if rc == 0:
        return
    text = ffi.string(lib.fb_strerror(rc)).decode()
    if rc == lib.FB_EOVERLAP:
        raise ValueError(f"{who}: out overlaps one of the inputs ({text}); gather into other memory")
    names = {getattr(lib, n): n for n in ("FB_ENULL", "FB_ESIZE", "FB_EOVERFLOW", "FB_ETHREAD")}
    raise FastbatchError(f"{who}: C gather failed with {names.get(rc, rc)} ({rc}): {text}")


_scratch = threading.local()


def _pointer_array(n):
    """This thread's grow-only `const char *[]` of at least n entries: no allocation per call, and
    per thread because a prefetch thread and the caller may gather at the same time."""
    ptrs = getattr(_scratch, "ptrs", None)
    if ptrs is None or len(ptrs) < n:
        ptrs = _scratch.ptrs = ffi.new("const char *[]", max(n, 256, 2 * len(ptrs or ())))
    return ptrs


# --- input checks, shared by both paths --------------------------------------------------------

def _view(x, i, who):
    """Item i as a numpy array over the same memory (never a copy), or an error naming it."""
    if isinstance(x, np.ndarray):
        a = x
    elif isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(f"{who}: item {i} is on {x.device}; fastbatch gathers host memory "
                            "(pass CPU tensors, or torch.stack on the device)")
        if x.layout != torch.strided:
            raise TypeError(f"{who}: item {i} is a {x.layout} tensor; fastbatch gathers dense tensors")
        if x.dtype not in _NUMPY:
            raise TypeError(f"{who}: item {i} has dtype {x.dtype}, which numpy lacks; supported: {_SUPPORTED}")
        a = x.detach().numpy()
    else:
        try:
            a = np.asarray(memoryview(x))
        except (TypeError, ValueError):
            raise TypeError(f"{who}: item {i} is a {type(x).__name__}; expected a numpy array, a torch "
                            "CPU tensor or a buffer (np.asarray a list first; that is a copy)") from None
    if a.dtype not in _TORCH:
        raise TypeError(f"{who}: item {i} has dtype {a.dtype}; supported: {_SUPPORTED} (native byte order)")
    if not a.flags.c_contiguous:
        raise ValueError(f"{who}: item {i} is not C-contiguous (shape {a.shape}, strides {a.strides}); "
                         "fastbatch will not make a hidden copy: pass np.ascontiguousarray(x) / x.contiguous()")
    return a


def _views(items, who):
    """Every item as a numpy array over its own memory. A plain ndarray passes as it is, for the
    caller's per-item loop to check (the hot path: ~0.1 us an item); the rest go through _view."""
    if isinstance(items, (np.ndarray, torch.Tensor)) or not hasattr(items, "__len__"):
        items = list(items)
    views = [x if type(x) is np.ndarray else _view(x, i, who) for i, x in enumerate(items)]
    if views:
        _view(views[0], 0, who)  # item 0 in full (dtype supported, contiguous); the rest must match it
    return views


def _plan_stack(arrays):
    """(checked views, result shape [B, ...], numpy dtype) for stack."""
    views = _views(arrays, "stack")
    if not views:
        raise ValueError("stack: no arrays (B = 0), so there is no batch shape")
    shape, dtype = views[0].shape, views[0].dtype
    for i, a in enumerate(views):
        if a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
            _view(a, i, "stack")  # raises first for an unsupported dtype or a non-contiguous item
            raise ValueError(f"stack: item {i} has shape {a.shape} {a.dtype}, item 0 has shape {shape} {dtype}")
    return views, (len(views), *shape), dtype


def _plan_pad(seqs, max_len):
    """(checked 1-D views, lengths int64 [B] cut at L, L, numpy dtype) for pad."""
    if max_len is not None:
        max_len = _index(max_len, "pad: max_len")
    views = _views(seqs, "pad")
    if not views:
        raise ValueError("pad: no sequences (B = 0)")
    dtype = views[0].dtype
    for i, a in enumerate(views):
        if a.ndim != 1 or a.dtype != dtype or not a.flags.c_contiguous:
            _view(a, i, "pad")
            if a.ndim != 1:
                raise ValueError(f"pad: item {i} has shape {a.shape}; pad takes 1-D sequences "
                                 "(stack takes same-shape arrays)")
            raise ValueError(f"pad: item {i} has dtype {a.dtype}, item 0 has dtype {dtype}")
    lengths = np.fromiter(map(len, views), np.int64, len(views))
    L = int(lengths.max()) if max_len is None else min(int(lengths.max()), max_len)
    np.minimum(lengths, L, out=lengths)
    return views, lengths, L, dtype


def _index(v, what):
    """v as a non-negative int, or TypeError/ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return int(v)


def _pad_scalar(pad_value, dtype):
    """pad_value as a 0-d array of dtype; refuses a value the dtype cannot hold (ints exactly,
    floats without overflowing to inf) rather than padding with something else."""
    if not isinstance(pad_value, (numbers.Number, np.generic)) or isinstance(pad_value, complex):
        raise TypeError(f"pad: pad_value must be a real number, not {type(pad_value).__name__}")
    try:
        with np.errstate(over="ignore"):  # an overflow to inf is caught below, with a clearer message
            v = np.array(pad_value, dtype=dtype)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"pad: pad_value {pad_value!r} does not fit {dtype} ({e})") from None
    exact = v.item() == pad_value or (dtype.kind == "f" and (np.isfinite(v) or not np.isfinite(pad_value)))
    if not exact:
        raise ValueError(f"pad: pad_value {pad_value!r} does not fit {dtype} (becomes {v.item()!r})")
    return v


def _resolve_out(out, shape, dtype, who):
    """The result tensor: out itself if its shape matches, else a view of its first elements; fresh
    memory when out is None (whose first write page-faults every page, ~3 GB/s: pass out= or use
    a PinnedRing to reuse memory)."""
    tdtype = _TORCH[dtype]
    if out is None:
        return torch.empty(shape, dtype=tdtype)
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise ValueError(f"{who}: out is a read-only numpy array")
        if out.dtype not in _TORCH:
            raise ValueError(f"{who}: out has dtype {out.dtype}, the batch is {dtype}")
        t = torch.from_numpy(out)
    elif isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or out.layout != torch.strided:
            raise TypeError(f"{who}: out must be a dense CPU tensor (a pinned one for a fast H2D copy), "
                            f"got {out.layout} on {out.device}")
        t = out
    else:
        raise TypeError(f"{who}: out must be a torch CPU tensor or numpy array, not {type(out).__name__}")
    need = math.prod(shape)
    if t.dtype != tdtype:
        raise ValueError(f"{who}: out has dtype {t.dtype}, the batch is {tdtype}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: out is not contiguous (strides {t.stride()})")
    if t.numel() < need:
        raise ValueError(f"{who}: out holds {t.numel()} elements, the batch {list(shape)} needs {need}")
    return t if tuple(t.shape) == tuple(shape) else t.view(-1)[:need].view(shape)


# --- the copy: C, or the numpy reference ------------------------------------------------------

def _overlap_check(t, views, who):
    """The reference path's twin of FB_EOVERLAP (numpy would silently read half-written data)."""
    o = t.detach().numpy()
    for a in views:
        if np.may_share_memory(o, a):
            raise ValueError(f"{who}: out overlaps one of the inputs; gather into other memory")


def _fill_stack(views, t):
    """t[i] = views[i] for all i; t is contiguous with the batch's shape and dtype."""
    if (BACKEND or load()) != "c":
        _overlap_check(t, views, "stack")
        reference.stack(views, out=t.detach().numpy())
        return
    ptrs = _pointer_array(len(views))
    ptrs[0:len(views)] = list(map(ffi.from_buffer, views))  # `views` keeps every buffer alive across the call
    rc = lib.fb_gather(ffi.cast("char *", t.data_ptr()), ptrs, len(views), views[0].nbytes,
                       THREADS, THREAD_MIN_BYTES, STREAM_MIN_BYTES)
    _check(rc, "stack")


def _fill_pad(views, lengths, pad_value, t):
    """t[i, :lengths[i]] = views[i][:lengths[i]], the rest of row i = pad_value: numpy on either
    backend (a C pad paid nothing end to end: docs/fastbatch.md#which-fast-paths-pay)."""
    _overlap_check(t, [a[:n] for a, n in zip(views, lengths)], "pad")
    reference.pad(views, pad_value, out=t.detach().numpy(), max_len=t.shape[1])


def _fill_padded(views, lengths, pad_value, t, t_lengths):
    """_fill_pad, and the lengths into t_lengths (a ring's slot, a batch of collate_default)."""
    _fill_pad(views, lengths, pad_value, t)
    t_lengths.copy_(torch.from_numpy(lengths))


# --- public API -------------------------------------------------------------------------------

def stack(arrays, out=None):
    """[B, *shape] tensor of B same-shape, same-dtype numpy arrays / torch CPU tensors / buffers,
    in one copy. `out`: a contiguous CPU tensor or numpy array of the batch's dtype with at least
    B * prod(shape) elements (e.g. from PinnedRing.acquire); the result is out itself when its
    shape matches, else a view of its first elements (a numpy out comes back as a tensor over the
    same memory). Without out the result is fresh memory, page-faulted on this first write."""
    views, shape, dtype = _plan_stack(arrays)
    t = _resolve_out(out, shape, dtype, "stack")
    _fill_stack(views, t)
    return t


def pad(seqs, pad_value=0, out=None, max_len=None):
    """(tensor [B, L], lengths int64 [B]) from B 1-D sequences of one dtype, padded with pad_value
    in the same single copy; L is the longest length, cut to max_len, and lengths[i] counts the
    kept elements of row i. `out` as in stack (at least B * L elements). lengths is a new tensor."""
    views, lengths, L, dtype = _plan_pad(seqs, max_len)
    pv = _pad_scalar(pad_value, dtype)
    t = _resolve_out(out, (len(views), L), dtype, "pad")
    _fill_pad(views, lengths, pv, t)
    return t, torch.from_numpy(lengths)


def _numeric(v):
    """A payload value as a C-contiguous numpy array of a gatherable dtype, or None (not numeric)."""
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu" or v.layout != torch.strided or v.dtype not in _NUMPY:
            return None
        v = v.detach().numpy()
    elif not isinstance(v, (np.ndarray, np.generic, numbers.Number, list, tuple)) or isinstance(v, complex):
        return None
    try:
        a = np.asarray(v)  # a list or tuple is copied here (a second copy: send arrays if it matters)
    except ValueError:     # ragged nested lists
        return None
    if a.dtype not in _TORCH:
        return None
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # a copy, which stack/pad would refuse to make


def _plan_collate(payloads):
    """[({name: (shape, torch dtype)} of a key's tensors, fill(*those tensors))], or None when the
    payloads are not all dicts of the same string keys whose values are numeric and either
    same-shape (stacked) or 1-D (padded)."""
    if not isinstance(payloads, (list, tuple)) or not payloads or not all(isinstance(p, dict) for p in payloads):
        return None
    keys = payloads[0].keys()
    if not keys or not all(isinstance(k, str) for k in keys) or any(p.keys() != keys for p in payloads):
        return None
    plans, arrays_seen = [], False
    for key in keys:
        vals = [_numeric(p[key]) for p in payloads]
        if any(v is None for v in vals):
            return None
        arrays_seen = arrays_seen or any(v.ndim > 0 for v in vals)
        dtype = np.result_type(*{v.dtype for v in vals})  # numpy's promotion: ints with floats -> float64, ...
        if dtype not in _TORCH:
            return None
        vals = [v if v.dtype == dtype else v.astype(dtype) for v in vals]
        if all(v.shape == vals[0].shape for v in vals):
            views, shape, dtype = _plan_stack(vals)
            plans.append(({key: (shape, _TORCH[dtype])}, functools.partial(_fill_stack, views)))
        elif all(v.ndim == 1 for v in vals) and f"{key}_lengths" not in keys:
            views, lengths, L, dtype = _plan_pad(vals, None)
            plans.append(({key: ((len(views), L), _TORCH[dtype]),
                           f"{key}_lengths": ((len(views),), torch.int64)},
                          functools.partial(_fill_padded, views, lengths, 0)))
        else:
            return None
    # dicts of plain numbers ({"x": 3}) are records, not tensors: they pass through; numbers beside an
    # array ({"tokens": [...], "label": 3}) are stacked with it
    return plans if arrays_seen else None


def _collate(plans, tensors):
    """Fill the tensors laid out by _specs(plans) and return the batch dict."""
    batch = dict(zip([name for specs, _ in plans for name in specs], tensors))
    for specs, fill in plans:
        fill(*map(batch.get, specs))
    return batch


def _specs(plans):
    """[(shape, torch dtype)] of every tensor the batch dict holds, in _collate's order."""
    return [spec for specs, _ in plans for spec in specs.values()]


def collate_default(payloads):
    """The default batch for a handler without collate(): payloads (a list of dicts) become one
    dict of tensors per key. A key whose values all have one shape is stacked ([B, *shape]); a key
    of 1-D values of different lengths is padded with 0 ([B, L]) and adds `<key>_lengths` (int64
    [B]). Values may be numpy arrays, torch CPU tensors, numbers or (nested) lists of numbers;
    lists are copied once by np.asarray before the gather, mixed dtypes promote as numpy does.
    Returns None, meaning "pass the payloads through as a list", when no value is an array or list
    (dicts of plain numbers are records, not tensors), when they are not all dicts with
    the same string keys, when any value is non-numeric (str, None, dict, CUDA tensor, ...), when
    a key's values are ragged but not 1-D, or when `<key>_lengths` is already a key. The tensors
    are fresh memory; PinnedRing.collate puts them in a reused slot instead."""
    plans = _plan_collate(payloads)
    if plans is None:
        return None
    return _collate(plans, [torch.empty(shape, dtype=dt) for shape, dt in _specs(plans)])


_logged_memory_kind = False


def _alloc(nbytes, pinned):
    """nbytes of page-aligned host memory as a uint8 tensor: pinned (page-locked) or pageable."""
    # Over-allocate and offset rather than trust the allocator's alignment: torch's pinned
    # allocator may be malloc + cudaHostRegister (16-byte aligned) depending on its settings.
    raw = torch.empty(nbytes + RING_ALIGN, dtype=torch.uint8, pin_memory=pinned)  # pinned: cudaHostAlloc, ms per call
    start = -raw.data_ptr() % RING_ALIGN
    buf = raw[start:start + nbytes]
    if not pinned:
        buf.zero_()  # fault the pages in now, once: a gather into fresh pages runs at page-fault speed (~3 GB/s)
    return buf


class PinnedRing:
    """`slots` reusable host buffers, grow-only. A slot is handed out again only after
    release(slot), so the buffer a host-to-device copy is still reading is never overwritten;
    acquire blocks (up to `timeout` seconds, then TimeoutError) while every slot is in use.

    Memory is pinned (page-locked: the H2D copy is a DMA that can run non_blocking on a side
    stream) when torch.cuda.is_available(), else plain page-aligned memory; the first ring in a
    process logs which. A slot grows (RING_GROWTH headroom) only when a request outgrows it, so
    after warm-up no call allocates. A tensor from a slot stays valid memory after release(), but
    the next acquire of that slot overwrites it."""

    def __init__(self, slots=RING_SLOTS, pinned=None):
        global _logged_memory_kind
        self.slots = _index(slots, "PinnedRing: slots")
        if self.slots < 1:
            raise ValueError("PinnedRing: slots must be >= 1")
        self._pinned = torch.cuda.is_available() if pinned is None else bool(pinned)
        self._bufs = [None] * self.slots   # uint8 tensors, page-aligned, grow-only
        self._busy = [False] * self.slots
        self._free = list(range(self.slots))[::-1]  # a stack: the most recently released slot is the
        self._cv = threading.Condition()            # likeliest to still be in cache, so it goes out first
        if not _logged_memory_kind:
            _logged_memory_kind = True
            log.info("fastbatch: PinnedRing uses %s", "pinned (page-locked) host memory" if self._pinned
                     else "page-aligned pageable memory (no CUDA, so nothing to pin for)")

    @property
    def pinned(self):
        """True when slot memory is page-locked (CUDA available), False for pageable memory."""
        return self._pinned

    def _take(self, timeout):
        """Mark the next free slot in use and return its index, waiting for a release if needed."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"PinnedRing: all {self.slots} slots still in use after {timeout}s; "
                                   "release(slot) each one once its device copy / model step is done")
            k = self._free.pop()
            self._busy[k] = True
            return k

    def release(self, slot):
        """Mark slot free again; call it only after the device copy from it has completed."""
        with self._cv:
            if not (isinstance(slot, int) and 0 <= slot < self.slots) or not self._busy[slot]:
                raise ValueError(f"PinnedRing: slot {slot!r} is not in use (released twice?)")
            self._busy[slot] = False
            self._free.append(slot)
            self._cv.notify()

    def acquire_many(self, specs, timeout=None):
        """(slot, [tensor per (shape, dtype) in specs]): one slot holds them all, each page-aligned."""
        layout, total = [], 0
        for shape, dtype in specs:
            shape = (_index(shape, "PinnedRing: shape"),) if isinstance(shape, numbers.Integral) else \
                tuple(_index(d, "PinnedRing: shape") for d in shape)
            dtype = dtype if isinstance(dtype, torch.dtype) else _TORCH.get(np.dtype(dtype))
            if dtype is None:
                raise TypeError(f"PinnedRing: unsupported dtype; supported: {_SUPPORTED} or any torch dtype")
            layout.append((total, shape, dtype))
            total += -(-math.prod(shape) * dtype.itemsize // RING_ALIGN) * RING_ALIGN
        slot = self._take(timeout)
        try:
            buf = self._bufs[slot]
            if buf is None or buf.numel() < total:  # grow outside the lock: pinning takes milliseconds
                cap = max(total, int(buf.numel() * RING_GROWTH) if buf is not None else RING_ALIGN)
                self._bufs[slot] = None  # free the old buffer before allocating the bigger one
                self._bufs[slot] = buf = _alloc(-(-cap // RING_ALIGN) * RING_ALIGN, self._pinned)
        except BaseException:
            self.release(slot)
            raise
        return slot, [buf[o:o + math.prod(s) * dt.itemsize].view(dt).view(s) for o, s, dt in layout]

    def acquire(self, shape, dtype=torch.uint8, timeout=None):
        """(slot, tensor of shape and dtype) viewing the slot's buffer; an int shape is 1-D, so
        acquire(nbytes) is nbytes of uint8. Blocks while every slot is in use."""
        slot, (t,) = self.acquire_many([(shape, dtype)], timeout)
        return slot, t

    def stack(self, arrays, timeout=None):
        """(slot, fastbatch.stack(arrays) gathered straight into the slot)."""
        views, shape, dtype = _plan_stack(arrays)
        slot, (t,) = self.acquire_many([(shape, _TORCH[dtype])], timeout)
        self._fill(slot, _fill_stack, views, t)
        return slot, t

    def pad(self, seqs, pad_value=0, max_len=None, timeout=None):
        """(slot, tensor [B, L], lengths [B]) as fastbatch.pad, both in the slot."""
        views, lengths, L, dtype = _plan_pad(seqs, max_len)
        pv = _pad_scalar(pad_value, dtype)
        slot, (t, lens) = self.acquire_many([((len(views), L), _TORCH[dtype]), ((len(views),), torch.int64)], timeout)
        self._fill(slot, _fill_padded, views, lengths, pv, t, lens)
        return slot, t, lens

    def collate(self, payloads, timeout=None):
        """(slot, collate_default(payloads) with every tensor in one slot), or None to pass the
        payloads through as a list (no slot is taken then)."""
        plans = _plan_collate(payloads)
        if plans is None:
            return None
        slot, tensors = self.acquire_many(_specs(plans), timeout)
        return slot, self._fill(slot, _collate, plans, tensors)

    def _fill(self, slot, fill, *args):
        """fill(*args) into a slot just taken; on any error the slot is freed and the error re-raised."""
        try:
            return fill(*args)
        except BaseException:
            self.release(slot)
            raise
