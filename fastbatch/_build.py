"""cffi out-of-line API-mode build of fastbatch's C gather (fastbatch.c).

    pip install .                            # setup.py's cffi_modules builds it (so do pip wheel, make setup)
    .venv/bin/python fastbatch/_build.py     # the same module, written to fastbatch/_fastbatch_c.<abi>.so

fastbatch/__init__.py runs this script on import when the .so is missing or was built from other
sources (the digest compiled into it), and falls back to the numpy reference if it fails.
"""
import hashlib
import os
import re
import shutil
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT_FROM = ("fastbatch.c", "fastbatch.h", "_build.py")
DIGEST_MARK = b"fastbatch sources sha256 "   # + the digest, a string constant in the .so: what it was built from


def sources_digest(folder=HERE):
    """sha256 of the files the module is built from: a .so without it in its bytes is stale. Content, not
    mtimes: pip writes a wheel's .so before fastbatch.c, so an installed .so would look older than its source."""
    h = hashlib.sha256()
    for name in BUILT_FROM:
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def header_declarations(path):
    """fastbatch.h as a cdef: the declarations, without comments, include guard and #include; each
    constant as `#define NAME ...`, so cffi reads its value from the header at compile time. One
    source for the C side and the Python side: a change to the header is a change to the binding."""
    with open(path) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    lines = []
    for line in text.splitlines():
        constant = re.match(r"#define\s+(FB_\w+)\s", line)
        if constant:
            lines.append(f"#define {constant.group(1)} ...")
        elif line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    return "\n".join(lines)


def ffibuilder(here=None):
    """The FFI to compile, its sources named as in `here` (default: relative to the current folder, as setup.py's
    cffi_modules needs: setuptools refuses absolute paths). A function, so that fastbatch/__init__.py can read
    sources_digest here without parsing the header (~0.3 s)."""
    here = here or os.path.relpath(HERE)
    ffi = FFI()
    # No GIL annotation is needed: in API mode cffi's generated wrapper brackets every C call with
    # Py_BEGIN_ALLOW_THREADS / Py_END_ALLOW_THREADS (cffi docs, since 0.3: "C function calls are now
    # done with the GIL released"; see _cffi_f_fb_gather in the C that ffi.emit_c_code() writes).
    # That is safe because these functions touch only raw pointers, never a Python object.
    ffi.cdef(header_declarations(os.path.join(HERE, "fastbatch.h")))
    ffi.set_source(
        "fastbatch._fastbatch_c",
        f'#include "fastbatch.h"\nconst char fb_built_from[] = "{DIGEST_MARK.decode()}{sources_digest()}";',
        sources=[os.path.join(here, "fastbatch.c")],
        include_dirs=[here],
        py_limited_api=False,   # one file name (EXT_SUFFIX's) whichever way it is built
        # -O3 for the pad fill loop; the bulk is libc memcpy, which picks its own vector code at run
        # time, so no -march=native (a .so that would crash on an older CPU buys nothing here).
        extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-pthread"],
        libraries=["pthread"],
    )
    return ffi


if __name__ == "__main__":
    # Compile in a scratch dir, then rename the .so into fastbatch/: a worker importing while
    # another process builds sees the old file or the new one, never a half-written one, and a
    # process that already mapped the old .so keeps its (unlinked) copy.
    tmp = tempfile.mkdtemp(prefix=".build-", dir=HERE)
    try:
        so = ffibuilder(HERE).compile(tmpdir=tmp, verbose=False)
        os.replace(so, os.path.join(HERE, os.path.basename(so)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
