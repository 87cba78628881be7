"""What several benches (and tests) share: the sections a bench runs, the kit compiled once before it
is timed, a warmd.py command line with module constants set."""
import json
import os
import py_compile
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chosen(known):
    """The sections named in sys.argv (all of known where none is), or exit naming the unknown ones."""
    picked = sys.argv[1:] or list(known)
    unknown = set(picked) - set(known)
    if unknown:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: no section {', '.join(sorted(unknown))} ---> HINT: "
                 f"pick from {' '.join(known)}")
    return picked


def compile_kit():
    """calque.py and warmd.py compiled once, as an install does: where PYTHONDONTWRITEBYTECODE is set, each
    command a bench times would compile calque.py again."""
    for name in ("calque.py", "warmd.py", "calque_supervisor.py"):
        py_compile.compile(os.path.join(ROOT, name))


def warmd_command(*args, constants=None):
    """The command line of a warmd.py process; `constants`: warmd's module constants it sets first
    ({"AHEAD": True}), as a bench or a test compares them."""
    if not constants:
        return [sys.executable, os.path.join(ROOT, "warmd.py"), *args]
    return [sys.executable, "-c", "import json, sys, warmd; vars(warmd).update(json.loads(sys.argv[1])); "
            "sys.exit(warmd.main(sys.argv[2:]))", json.dumps(constants), *args]
