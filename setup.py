"""pip's build of calque (pyproject.toml has the rest): fastbatch's C module through cffi's setuptools hook, as
argon2-cffi-bindings builds its own, so `pip install`, `pip wheel` and `make setup` compile it. A failed compile
(no gcc, no Python headers) still installs: fastbatch then says at import that its numpy reference path is used.
calque_plain (fastbatch/plain.c) is calque_values.plain in C; without it, the Python walk does."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExtOptional(build_ext):
    """build_ext where a compile error is a warning, not a failed install (distutils' Extension.optional)."""

    def build_extensions(self):
        for ext in self.extensions:
            ext.optional = True
        super().build_extensions()


setup(cffi_modules=["fastbatch/_build.py:ffibuilder"], cmdclass={"build_ext": BuildExtOptional},
      ext_modules=[Extension("calque_plain", ["fastbatch/plain.c"])])
