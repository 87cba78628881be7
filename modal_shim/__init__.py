"""The kit's stand-in `modal` (modal.py): calque loads it by path as `modal` for a Modal app handler; docs/modal.md."""
