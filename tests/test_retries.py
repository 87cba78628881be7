"""Retries as Modal means them: an item whose call raises is retried inside its claim with its
backoff (modal.Retries, retries=N, pool create --retries N), the rest of its claim not held up;
its attempts in its result line and in `runs show`; on the embedded store and on moto_server,
under both command spellings; out-of-bounds values refused in one line."""
import json
import os
import subprocess

import pytest

from conftest import PY, ROOT, write_items
from test_modal import CALQUE, modal_run, write_app

APP = '''
import os
import time

import modal

app = modal.App("flaky")
TRIES = {log!r} + ".d"


def attempt(x):
    """This input's attempt number, its time noted in a file of its own beside the app."""
    os.makedirs(TRIES, exist_ok=True)
    with open(os.path.join(TRIES, str(x)), "a") as f:
        f.write(f"{{time.time()}}\\n")
    with open(os.path.join(TRIES, str(x))) as f:
        return len(f.read().split())


@app.function(retries=modal.Retries(max_retries=3, initial_delay=0.1, backoff_coefficient=2))
def flaky(x):
    n = attempt(x)
    if x == 0 or n <= 2:   # input 0 always raises; the others on their first 2 attempts
        raise TimeoutError(f"attempt {{n}}")
    return x * 10


@app.local_entrypoint()
def main():
    print(list(flaky.map(range(6), return_exceptions=True)))
'''

NATIVE = '''
import os

import calque


class Once:
    """Item 1 raises on its first attempt (a file beside this one says it was tried)."""
    @calque.enter
    def load(self):
        self.tried = __file__ + ".tried"

    @calque.batch
    def predict(self, items):
        if 1 in items and not os.path.exists(self.tried):
            open(self.tried, "w").close()
            raise ConnectionError("first attempt")
        return [x + 1 for x in items]
'''


def calque(env, installed, *args):
    """`python calque.py ARGS`, or the installed `calque ARGS`, from a folder outside the checkout."""
    argv = [CALQUE] if installed else [PY, os.path.join(ROOT, "calque.py")]
    return subprocess.run([*argv, *args], env=env, cwd=os.path.dirname(env["CALQUE_STATE"]),
                          capture_output=True, text=True, timeout=120)


def times(folder, x):
    with open(os.path.join(folder, str(x))) as f:
        return [float(t) for t in f.read().split()]


@pytest.mark.parametrize("backend,installed", [("local", False), ("aws", True)])
def test_modal_retries_with_backoff(backend, installed, request, tmp_path):
    """modal.Retries(max_retries=3, initial_delay=0.1, backoff_coefficient=2): inputs that raise
    twice succeed on their 3rd attempt, said in their lines; input 0 fails after 4 attempts, each
    after its backoff, while the rest of its claim ran; runs show counts them; modal run's .map
    gives the same values."""
    env = request.getfixturevalue(f"{backend}_env")
    path, log = write_app(tmp_path, APP)
    tries = str(log) + ".d"
    out = calque(env, installed, "pool", "create", "--model", "flaky", "--handler",
                 f"{path}:flaky", "--batch-size", "2")
    assert out.returncode == 0, out.stderr
    run = calque(env, installed, "submit", "--pool", "flaky", "--json",
                 write_items(tmp_path / "items.jsonl", list(range(6))))
    assert run.returncode == 1, run.stderr   # input 0 failed: a failed run
    run_id = json.loads(run.stdout)["run"]["run_id"]
    lines = [json.loads(line) for line in
             calque(env, installed, "runs", "results", run_id).stdout.splitlines()]
    assert [(r["ok"], r.get("result"), r.get("attempts")) for r in lines] == [
        (False, None, 4)] + [(True, 10 * x, 3) for x in range(1, 6)]
    assert lines[0]["error"] == "TimeoutError: attempt 4"
    for x in range(6):   # each retry after its backoff: 0.1, 0.2, 0.4 s
        gaps = [b - a for a, b in zip(times(tries, x), times(tries, x)[1:])]
        assert len(gaps) == (3 if x == 0 else 2)
        assert all(gap >= 0.1 * 2 ** k - 0.002 for k, gap in enumerate(gaps)), (x, gaps)
    # not held up: every other input ran its first attempt before input 0's retries ended
    assert max(times(tries, x)[0] for x in range(1, 6)) < times(tries, 0)[-1]
    show = calque(env, installed, "runs", "show", run_id)
    assert "6 items retried (19 attempts)" in show.stdout, show.stdout
    assert "1 x TimeoutError: attempt 4" in show.stdout
    calque(env, installed, "pool", "delete", "--model", "flaky", "--yes")
    # modal run: the same app's .map, on an ephemeral pool (the attempt files start afresh)
    for name in os.listdir(tries):
        os.remove(os.path.join(tries, name))
    out = modal_run(env, path, installed=installed)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[TimeoutError('attempt 4'), 10, 20, 30, 40, 50]"


@pytest.mark.parametrize("installed", [False, True])
def test_native_handler_retries_option(local_env, installed, tmp_path):
    """pool create --retries N: a calque handler's item that raised once is retried (after 1 s)
    and succeeds; the record keeps it; out-of-bounds values are one line, exit 2."""
    local_env["CALQUE_STATE"] = str(tmp_path / "walk" / "state")
    os.makedirs(tmp_path / "walk")
    handler = tmp_path / "walk" / "once.py"
    handler.write_text(NATIVE)
    bad = calque(local_env, installed, "pool", "create", "--model", "n", "--handler",
                 f"{handler}:Once", "--retries", "11")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "max_retries=11: must be a whole number from 0 to 10" in bad.stderr
    out = calque(local_env, installed, "pool", "create", "--model", "n", "--handler",
                 f"{handler}:Once", "--retries", "2", "--batch-size", "1")
    assert out.returncode == 0, out.stderr
    run = calque(local_env, installed, "submit", "--pool", "n", "--json",
                 write_items(tmp_path / "items.jsonl", [0, 1, 2]))
    assert run.returncode == 0, run.stderr
    run_id = json.loads(run.stdout)["run"]["run_id"]
    lines = [json.loads(line) for line in
             calque(local_env, installed, "runs", "results", run_id).stdout.splitlines()]
    assert lines == [{"i": 0, "ok": True, "result": 1},
                     {"i": 1, "ok": True, "result": 2, "attempts": 2},
                     {"i": 2, "ok": True, "result": 3}]
    assert "1 item retried (2 attempts)" in calque(local_env, installed, "runs", "show",
                                                   run_id).stdout
    calque(local_env, installed, "pool", "delete", "--model", "n", "--yes")


def test_modal_retries_out_of_bounds_refused(local_env, tmp_path):
    """modal.Retries outside Modal's bounds: pool create refuses it in one line, no pool made."""
    path, _ = write_app(tmp_path, APP.replace("initial_delay=0.1", "initial_delay=61"))
    out = calque(local_env, False, "pool", "create", "--model", "bad", "--handler",
                 f"{path}:flaky", "--workers", "0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "initial_delay=61: must be a number from 0 to 60 (Modal's bounds)" in out.stderr
