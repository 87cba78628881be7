"""Streaming submit: claims are staged and sent as the items are read, the run record is completed at the end,
a bad line after the first claims keeps those; queue batches on both backends."""
import json
import os
import subprocess

import pytest

import calque
from conftest import HANDLERS, PY, ROOT, backend_for, cli, wait_for


def create_pool(env):
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "0")
    assert out.returncode == 0, out.stderr


def submit_from_pipe(env, first_items):
    """A `submit --pool m - --no-wait` of claims of 2, fed `first_items` on a pipe left open once the first claim
    is queued; with the pool's queue."""
    create_pool(env)
    queue = backend_for(env).queues.open_queue("calque-pool-m")
    proc = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "m", "-", "--no-wait",
                             "--claim-size", "2"], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(lines(first_items))
    proc.stdin.flush()
    wait_for(lambda: queue.counts()["visible"] >= 1, 30, "a claim queued while the input is still open")
    return proc, queue


def lines(items):
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def test_stdin_claims_are_sent_before_the_input_ends(local_env):
    """From a pipe still open, the first claims are queued and their run record says `staged: false`; once the
    input ends the record lists every claim, its items and `sent`, and every claim is in the queue."""
    proc, queue = submit_from_pipe(local_env, ({"x": i} for i in range(5)))
    run, = calque.list_runs(backend_for(local_env))
    assert run["staged"] is False and proc.poll() is None
    proc.stdin.write(lines({"x": i} for i in range(5, 9)))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    run = calque.read_run(backend_for(local_env), out.decode().strip())
    assert (run["staged"], run["items"], run["sent"], run["claims"]) == (True, 9, 5, [f"c0000{i}" for i in range(5)])
    assert queue.counts() == {"visible": 5, "in_flight": 0}


def outcome(read, text):
    """("value", repr of what read(text) returned) or ("error", its exception's type and message)."""
    try:
        return "value", repr(read(text))    # repr: NaN is not equal to itself
    except ValueError as e:
        return "error", type(e).__name__, str(e)


@pytest.mark.parametrize("text", ['{"a": 1, "b": [1.5, "x"]}', ' {"a": 1} ', '{"a": 1}\r', "\t[1]", '"s\u2028t"',
                                  "NaN", "-Infinity", "1e400", "1" * 30, "1 2", '{"a": 1}}', '[1],[2]', "", " ",
                                  '{"a": ', "nul", '"\\ud800"', "1" * 5000, '"\\x"', "[" * 50 + "]" * 50])
def test_json_line_reads_a_line_exactly_as_json_loads(text):
    """The staging fast path parses what json.loads parses, to the same value, and refuses what it refuses with
    the same error (the message `submit` prints for a bad line)."""
    assert outcome(calque.json_line, text) == outcome(json.loads, text)


def test_a_bad_line_after_the_first_claims_keeps_them(local_env):
    """A bad line read after claims were queued: exit 2, one line naming the line and the claims the run keeps;
    the run record holds exactly those claims and items."""
    proc, queue = submit_from_pipe(local_env, ({"x": i} for i in range(4)))
    out, err = proc.communicate(b'{"x": \n', timeout=60)
    run, = calque.list_runs(backend_for(local_env))
    kept = queue.counts()["visible"]
    assert proc.returncode == 2 and err.decode() == (
        f"calque: error: run {run['run_id']} stopped after queueing {kept} claim(s) (items 0 to {2 * kept - 1}; the "
        f"run keeps them): -:5: not valid JSON (Expecting value): one JSON item per line\n")
    assert (run["claims"], run["items"], run["sent"], run["staged"]) == (
        [calque.claim_id(i) for i in range(kept)], 2 * kept, kept, True)


def test_send_batch_on_both_backends(any_env):
    """send_batch queues every body in one request; the bodies come back in order on the local queue."""
    backend = backend_for(any_env)
    queue = backend.queues.create_queue("calque-pool-b", 30)
    before = backend.requests["queue_other"]
    queue.send_batch([f"m{i}" for i in range(calque.SEND_BATCH)])
    assert backend.requests["queue_other"] == before + 1
    bodies = [queue.receive(1).body for _ in range(calque.SEND_BATCH)]
    assert sorted(bodies) == sorted(f"m{i}" for i in range(calque.SEND_BATCH))
    assert backend.kind == "aws" or bodies == [f"m{i}" for i in range(calque.SEND_BATCH)]
