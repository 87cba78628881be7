"""The sections a bench runs: those named on its command line, or all of them; an unknown one exits with a hint."""
import os
import sys


def chosen(known):
    """The sections named in sys.argv (all of known where none is), or exit naming the unknown ones."""
    picked = sys.argv[1:] or list(known)
    unknown = set(picked) - set(known)
    if unknown:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: no section {', '.join(sorted(unknown))} ---> HINT: "
                 f"pick from {' '.join(known)}")
    return picked
