"""cffi out-of-line API-mode build of fastbatch's C gather (fastbatch.c).

    .venv/bin/python fastbatch/_build.py     # writes fastbatch/_fastbatch_c.<abi>.so; `make setup` runs it

fastbatch/__init__.py runs this same script on import when the .so is missing or older than
fastbatch.c, fastbatch.h or this file, and falls back to the numpy reference if it fails.
"""
import os
import re
import shutil
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

ffibuilder = FFI()

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


# No GIL annotation is needed: in API mode cffi's generated wrapper brackets every C call with
# Py_BEGIN_ALLOW_THREADS / Py_END_ALLOW_THREADS (cffi docs, since 0.3: "C function calls are now
# done with the GIL released"; see _cffi_f_fb_gather in the C that ffibuilder.emit_c_code() writes).
# That is safe because these functions touch only raw pointers, never a Python object.
ffibuilder.cdef(header_declarations(os.path.join(HERE, "fastbatch.h")))

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
