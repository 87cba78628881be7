"""Faults that used to end in a traceback or in state that lies: each is one line naming what failed and the
next step, with the right exit code (2 bad input, 1 a failed run or store), and nothing lost or left behind.
Real processes, real SQLite, real signals and sockets; moto_server for SQS + S3."""
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import HANDLERS, PY, ROOT, backend_for, cli, wait_for, write_items


def error_line(out, code):
    """The one line a failed command printed (after checking its exit code, and that nothing else was printed)."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def create_pool(env, model="m", *extra):
    out = cli(env, "pool", "create", "--model", model, "--handler", f"{HANDLERS}:Echo", *extra)
    assert out.returncode == 0, out.stderr
    return out


def nothing_staged(env, queue="calque-pool-m"):
    """No run in the store and the pool queue as it was: empty."""
    assert json.loads(cli(env, "runs", "list", "--json").stdout) == []
    assert backend_for(env).queues.open_queue(queue).counts() == {"visible": 0, "in_flight": 0}


def test_bad_input_is_one_line_and_stages_nothing(local_env, tmp_path):
    """Items that are not UTF-8, nested too deep (RecursionError at ~990 levels) or not numeric arrays, and a
    pool.env that is not UTF-8: exit 2, one line naming file and line, no run staged, the queue unchanged."""
    create_pool(local_env)
    cases = {
        "latin1.jsonl": (b'{"x": 1}\n{"x": "caf\xe9"}\n', "{p}:2: not UTF-8 text (byte 11 of the line) "
                                                          "---> HINT: save the file as UTF-8"),
        "deep.jsonl": (b'{"x": 1}\n' + b"[" * 990 + b"]" * 990 + b"\n", "{p}:2: nested deeper than 512 levels "
                       "---> HINT: flatten the item (calque re-encodes it inside a manifest)"),
        "deeper.jsonl": (b"[" * 5000 + b"]" * 5000 + b"\n", "{p}:1: nested deeper than 512 levels "
                         "---> HINT: flatten the item (calque re-encodes it inside a manifest)"),
        "empty.npy": (b"", "{p}: not a numeric .npy or .npz file (No data left in file) ---> HINT: save plain "
                      "numeric arrays with numpy.save or numpy.savez (object arrays would need pickle)"),
        "broken.npz": (b"PK\x03\x04broken", "{p}: not a numeric .npy or .npz file (File is not a zip file) "
                       "---> HINT: save plain numeric arrays with numpy.save or numpy.savez (object arrays would "
                       "need pickle)"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        out = cli(local_env, "submit", "--pool", "m", str(path), "--timeout", "5")
        assert error_line(out, 2) == "calque: error: " + message.format(p=path)
    env_file = tmp_path / "pool.env"
    env_file.write_bytes(b"CALQUE_GRACE=5\nCALQUE_BATCH_SIZE=\xff\n")
    out = cli(dict(local_env, CALQUE_ENV=str(env_file)), "pool", "list")
    assert error_line(out, 2) == (f"calque: error: {env_file}:2: not UTF-8 text (byte 19 of the line) "
                                  f"---> HINT: save the file as UTF-8")
    nothing_staged(local_env)

