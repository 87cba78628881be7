"""Streaming submit: claims are staged and sent as the items are read, the run record is completed at the end,
a bad line after the first claims keeps those; queue batches on both backends."""
import json
import os
import subprocess

import pytest

import calque
import calque_core
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
    run, = calque_core.list_runs(backend_for(local_env))
    assert run["staged"] is False and proc.poll() is None
    proc.stdin.write(lines({"x": i} for i in range(5, 9)))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    run = calque_core.read_run(backend_for(local_env), out.decode().strip())
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
                                  '{"a": ', "nul", '"\\ud800"', "1" * 5000, '"\\x"', "[" * 50 + "]" * 50, '"a\tb"',
                                  "[1,]", "01", "1.", '"\\u0000"', "\ufeff{}", "[1] x", "-", '{"a" : 1}'])
def test_json_line_reads_a_line_exactly_as_json_loads(text):
    """The staging fast path parses what json.loads parses, to the same value, and refuses what it refuses with
    the same error (the message `submit` prints for a bad line); the line check (orjson first) takes and refuses
    the same lines, with the same error."""
    assert outcome(calque_core.json_line, text) == outcome(json.loads, text)
    assert outcome(calque_core.checked_json, text)[0::2] == outcome(json.loads, text)[0::2]   # a value, or the same error
    assert calque_core.orjson is not None


def test_a_bad_line_after_the_first_claims_keeps_them(local_env):
    """A bad line read after claims were queued: exit 2, one line naming the line and the claims the run keeps;
    the run record holds exactly those claims and items."""
    proc, queue = submit_from_pipe(local_env, ({"x": i} for i in range(4)))
    out, err = proc.communicate(b'{"x": \n', timeout=60)
    run, = calque_core.list_runs(backend_for(local_env))
    kept = queue.counts()["visible"]
    assert proc.returncode == 2 and err.decode() == (
        f"calque: error: run {run['run_id']} stopped after queueing {kept} claim(s) (items 0 to {2 * kept - 1}; the "
        f"run keeps them): -:5: not valid JSON (Expecting value): one JSON item per line\n")
    assert (run["claims"], run["items"], run["sent"], run["staged"]) == (
        [calque_core.claim_id(i) for i in range(kept)], 2 * kept, kept, True)


def test_send_batch_on_both_backends(any_env):
    """send_batch queues every body in one request; the bodies come back in order on the local queue."""
    backend = backend_for(any_env)
    queue = backend.queues.create_queue("calque-pool-b", 30)
    before = backend.requests["queue_other"]
    queue.send_batch([f"m{i}" for i in range(calque_core.SEND_BATCH)])
    assert backend.requests["queue_other"] == before + 1
    bodies = [queue.receive(1).body for _ in range(calque_core.SEND_BATCH)]
    assert sorted(bodies) == sorted(f"m{i}" for i in range(calque_core.SEND_BATCH))
    assert backend.kind == "aws" or bodies == [f"m{i}" for i in range(calque_core.SEND_BATCH)]


AWKWARD_LINES = ['{"a": 1, "b": [1.5, "x"]}\r', '  {"a": 1}  ', '\t[1, {"k": null}]', '"s\u2028t"', "NaN",
                 "-Infinity", "1e400", "1" * 40, '{"a": 1, "a": 2}', '"caf\u00e9 \\u00e9 \\ud83d\\ude00"',
                 '{"t": "quote \\" backslash \\\\ comma , brackets ]}"}', "[" * 60 + "]" * 60, "true", "null", "-0.0"]


def test_jsonl_lines_reach_the_worker_as_json_loads_reads_them(any_env, tmp_path):
    """A JSONL file's lines are staged as written (not decoded and encoded again): on both backends every manifest
    is JSON, and the items a worker decodes from it are, in order, what json.loads reads from each line."""
    create_pool(any_env)
    path = tmp_path / "awkward.jsonl"
    path.write_bytes("\n".join(AWKWARD_LINES + [""]).encode())
    out = cli(any_env, "submit", "--pool", "m", str(path), "--no-wait", "--claim-size", "4")
    assert out.returncode == 0, out.stderr
    backend = backend_for(any_env)
    run = calque_core.read_run(backend, out.stdout.strip())
    staged = []
    for claim in run["claims"]:
        manifest = json.loads(backend.store.get(calque_core.manifest_key(run["run_id"], claim)))
        assert manifest["first_index"] == len(staged) and manifest["count"] == len(manifest["items"])
        staged += manifest["items"]
    assert repr(staged) == repr([json.loads(line) for line in AWKWARD_LINES])   # repr: NaN is not equal to itself


def test_id_field_is_checked_on_jsonl_lines(local_env, tmp_path):
    """--id-field reads the staged lines again to check them: a line without the field is refused, naming it."""
    create_pool(local_env)
    path = tmp_path / "ids.jsonl"
    path.write_text('{"id": "a", "x": 1}\n{"x": 2}\n')
    out = cli(local_env, "submit", "--pool", "m", str(path), "--no-wait", "--id-field", "id")
    assert out.returncode == 2 and "--id-field 'id': item 1 has no such field" in out.stderr, out.stderr
