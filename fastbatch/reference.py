"""fastbatch.reference — fastbatch's gather in numpy: stack is the C gather's twin (the tests
compare them; fastbatch/__init__.py falls back to it when the C module cannot be built, or
FASTBATCH_REFERENCE=1), pad is fastbatch's only pad, on either path. Both expect
already-checked input (the wrapper validates once, for either path): C-contiguous numpy arrays
of one dtype and, when given, an `out` array of exactly the result's shape and dtype.
"""
import numpy as np


def stack(arrays, out=None):
    """[B, *shape] from B same-shape arrays; with out, one copy per item straight into it."""
    return np.stack(arrays, out=out)


def pad(seqs, pad_value=0, out=None, max_len=None):
    """([B, L] rows of seqs[i][:L] then pad_value, lengths [B] int64); L = longest, cut at max_len."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    L = int(lengths.max(initial=0)) if max_len is None else min(int(lengths.max(initial=0)), max_len)
    np.minimum(lengths, L, out=lengths)
    if out is None:
        out = np.empty((len(seqs), L), dtype=seqs[0].dtype)
    for row, s, n in zip(out, seqs, lengths):
        row[:n] = s[:n]
        row[n:] = pad_value  # the tail only: each byte of out is written once, as in the C path
    return out, lengths
