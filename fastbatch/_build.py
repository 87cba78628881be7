"""cffi out-of-line API-mode build of fastbatch's C gather (fastbatch.c).

    .venv/bin/python fastbatch/_build.py     # writes fastbatch/_fastbatch_c.<abi>.so; `make setup` runs it

fastbatch/__init__.py runs this same script on import when the .so is missing or older than
fastbatch.c, fastbatch.h or this file, and falls back to the numpy reference if it fails.
"""
import os
import shutil
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

ffibuilder = FFI()

# Mirrors fastbatch.h. No GIL annotation is needed: in API mode cffi's generated wrapper brackets
# every C call with Py_BEGIN_ALLOW_THREADS / Py_END_ALLOW_THREADS (cffi docs, since 0.3: "C
# function calls are now done with the GIL released"; see _cffi_f_fb_gather in the C that
# ffibuilder.emit_c_code() writes). That is safe because these functions touch only raw
# pointers, never a Python object. The constants' values ("...") are read from the header at
# compile time, so they cannot drift.
ffibuilder.cdef("""
#define FB_OK ...
#define FB_ENULL ...
#define FB_ESIZE ...
#define FB_EELEM ...
#define FB_EOVERFLOW ...
#define FB_EOVERLAP ...
#define FB_ETHREAD ...

int fb_gather(char *dst, const char *const *srcs, int64_t n_items, int64_t item_bytes,
              int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes);
int fb_pad_gather(char *dst, const char *const *srcs, const int64_t *lens, int64_t n_items,
                  int64_t row_len, int elem_size, const void *pad_value,
                  int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes);
const char *fb_strerror(int code);
""")

ffibuilder.set_source(
    "fastbatch._fastbatch_c",
    '#include "fastbatch.h"',
    sources=[os.path.join(HERE, "fastbatch.c")],
    include_dirs=[HERE],
    # -O3 for the pad fill loop; the bulk is libc memcpy, which picks its own vector code at run
    # time, so no -march=native (a .so that would crash on an older CPU buys nothing here).
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-pthread"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    # Compile in a scratch dir, then rename the .so into fastbatch/: a worker importing while
    # another process builds sees the old file or the new one, never a half-written one, and a
    # process that already mapped the old .so keeps its (unlinked) copy.
    tmp = tempfile.mkdtemp(prefix=".build-", dir=HERE)
    try:
        so = ffibuilder.compile(tmpdir=tmp, verbose=False)
        os.replace(so, os.path.join(HERE, os.path.basename(so)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
