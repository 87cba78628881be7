"""A PEP 517 build backend without setuptools: the bootstrap test's stand-in kit (an sdist of one
module) builds with it offline, and `wheel` makes the packages its loopback index serves."""
import io
import os
import zipfile


def wheel(name, version):
    """(file name, bytes) of a pure-Python wheel whose module `name` holds VERSION."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tiny_backend\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return f"{name}-{version}-py3-none-any.whl", raw.getvalue()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """The sdist's own wheel, named by its PKG-INFO (pip runs this in the unpacked sdist)."""
    with open("PKG-INFO") as f:
        meta = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
    name, data = wheel(meta["Name"], meta["Version"])
    with open(os.path.join(wheel_directory, name), "wb") as f:
        f.write(data)
    return name
