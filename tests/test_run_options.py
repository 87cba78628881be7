"""A run keeps what it was submitted with: each submit option that shapes a run or its results is in the run
record's `options` from staging on, so a Ctrl-C at any moment keeps it, and runs resume (and redrive) honour it.
Each test sends a real SIGINT to a real `submit` process, in both spellings (`python calque.py`, `calque`)."""
import json
import os
import signal
import subprocess

import pytest

import calque
import calque_core
from conftest import HANDLERS, PY, ROOT, backend_for, wait_for, write_items
from test_runs import create_pool, only_run, said, totals

SPELLINGS = {"script": [PY, os.path.join(ROOT, "calque.py")], "installed": [os.path.join(os.path.dirname(PY), "calque")]}


def run(spelling, env, *args):
    return subprocess.run(SPELLINGS[spelling] + list(args), env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def interrupted_submit(spelling, env, items, *extra, queued=1):
    """`submit --pool m ITEMS` sent SIGINT once `queued` claims are in the pool's queue (visible or held): exit 130;
    the run id."""
    proc = subprocess.Popen(SPELLINGS[spelling] + ["submit", "--pool", "m", items, *extra], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    queue = backend_for(env).queues.open_queue("calque-pool-m")
    wait_for(lambda: proc.poll() is not None or sum(queue.counts().values()) >= queued, 60, "a claim queued")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err)
    return json.loads(run(spelling, env, "runs", "list", "--json").stdout)[-1]["run_id"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_id_field_is_kept_across_ctrl_c_mid_staging(local_env, tmp_path, spelling):
    """--id-field, Ctrl-C while staging (claims of 1 item): the claims sent before the interrupt and those
    runs resume sends each come back with their item's id, from runs results and the API."""
    create_pool(local_env)
    items = write_items(tmp_path / "items.jsonl", [{"id": f"doc-{i}", "x": i} for i in range(1000)])
    run_id = interrupted_submit(spelling, local_env, items, "--wait-for-workers", "--claim-size", "1",
                                "--id-field", "id")
    sent = calque_core.read_run(backend_for(local_env), run_id)["sent"]
    assert 0 < sent < 1000, sent
    said(run(spelling, local_env, "pool", "scale", "--model", "m", "--workers", "1"), 0)
    resume = run(spelling, local_env, "runs", "resume", run_id)
    assert resume.returncode == 0, resume.stderr
    assert resume.stdout.splitlines()[0] == totals(run_id, "done", ok=1000)
    results = run(spelling, local_env, "runs", "results", run_id)
    said(results, 0, stderr="")
    assert [(r["i"], r["id"]) for r in map(json.loads, results.stdout.splitlines())] == \
        [(i, f"doc-{i}") for i in range(1000)]
    assert calque_core.read_run(backend_for(local_env), run_id)["options"]["id_field"] == "id"
    api = calque.Run(run_id, store=local_env["CALQUE_STORE"])
    assert [r["id"] for r in api.results()][sent - 1:sent + 1] == [f"doc-{sent - 1}", f"doc-{sent}"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_timeout_is_kept_across_ctrl_c_mid_wait(local_env, tmp_path, spelling):
    """--timeout 600, Ctrl-C while submit waits (every claim queued, the worker held at a gate): runs resume
    without --timeout waits the run's 600 s, not CALQUE_TIMEOUT's 0 s; an explicit --timeout 0 overrides it."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    create_pool(env, "--workers", "1", handler="Gate")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(200)])
    proc = subprocess.Popen(SPELLINGS[spelling] + ["submit", "--pool", "m", items, "--claim-size", "1",
                                                   "--timeout", "600"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert " claim(s) of 200 items sent to " in proc.stderr.readline()   # every claim queued: submit waits
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    run_id = only_run(env)
    env = dict(env, CALQUE_TIMEOUT="0")
    said(run(spelling, env, "runs", "resume", run_id, "--timeout", "0"), 1)   # the flag wins: still held
    resume = subprocess.Popen(SPELLINGS[spelling] + ["runs", "resume", run_id], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "0 claim(s) not sent before now sent to calque-pool-m" in resume.stderr.readline()
    (gate / "open").touch()   # 200 claims take the worker far longer than a wait of 0 s
    out, err = resume.communicate(timeout=120)
    assert resume.returncode == 0, err
    assert out.splitlines()[0] == totals(run_id, "done", ok=200)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_run_without_wait_for_workers_is_not_resumed_onto_no_worker(local_env, tmp_path, spelling):
    """submit without --wait-for-workers, Ctrl-C mid-staging, the pool scaled to 0: runs resume refuses as submit
    would (exit 2, one line), rather than wait on a queue no worker reads; --no-wait queues the rest anyway; a
    finished run resumes (reports) with no worker."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    create_pool(env, "--workers", "1", handler="Gate")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(1000)])
    run_id = interrupted_submit(spelling, env, items, "--claim-size", "1", queued=2)
    (gate / "open").touch()
    said(run(spelling, env, "pool", "scale", "--model", "m", "--workers", "0"), 0)
    command = "calque" if spelling == "installed" else "python calque.py"
    said(run(spelling, env, "runs", "resume", run_id, "--timeout", "0"), 2, "",
         f"calque: error: pool m has no live worker (no supervisor on this machine, no worker running elsewhere): "
         f"nothing would claim run {run_id} ---> HINT: {command} pool scale --model m --workers 1 (or --instances N), "
         f"or runs resume {run_id} --no-wait to queue it anyway\n")
    out = run(spelling, env, "runs", "resume", run_id, "--no-wait")
    assert out.returncode == 0 and "not sent before now sent to calque-pool-m" in out.stderr, out.stderr
    said(run(spelling, env, "pool", "scale", "--model", "m", "--workers", "1"), 0)
    out = run(spelling, env, "runs", "resume", run_id)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == totals(run_id, "done", ok=1000), out.stderr
    said(run(spelling, env, "pool", "scale", "--model", "m", "--workers", "0"), 0)
    out = run(spelling, env, "runs", "resume", run_id)   # nothing left to run: no worker needed
    assert out.returncode == 0 and out.stdout.splitlines()[0] == totals(run_id, "done", ok=1000), out.stderr


@pytest.mark.parametrize("spelling,verb", [("script", ("runs", "redrive")), ("installed", ("pool", "redrive"))])
def test_id_field_is_kept_across_ctrl_c_and_redrive(local_env, tmp_path, spelling, verb):
    """--id-field, Ctrl-C while staging, one of the claims sent before it dead-lettered (its failure summary and
    DLQ copy, as a worker leaves them): after runs resume --no-wait and runs redrive (pool redrive), every result,
    the redriven claim's too, carries its item's id."""
    create_pool(local_env)
    backend = backend_for(local_env)
    queue, dlq = (backend.queues.open_queue(name) for name in ("calque-pool-m", "calque-dlq-m"))
    items = write_items(tmp_path / "items.jsonl", [{"id": f"doc-{i}", "x": i} for i in range(300)])
    run_id = interrupted_submit(spelling, local_env, items, "--wait-for-workers", "--claim-size", "1",
                                "--id-field", "id")
    message = queue.receive(1)
    msg = json.loads(message.body)
    reason = "delivered 4 times, more than the pool's max deliveries 3"
    calque_core.write_json(backend, calque_core.summary_key(run_id, msg["claim"]), calque_core.claim_summary(
        run_id=run_id, claim=msg["claim"], model="m", worker_id="gone-1", mode="pool", backend="local",
        receive_count=4, enter_count=1, started=0.0, finished=0.0, requests={}, error=reason))
    dlq.send(json.dumps({"reason": reason, "body": message.body, "receive_count": 4, "worker_id": "gone-1",
                         "at": calque_core.now_iso()}))
    queue.delete(message)
    said(run(spelling, local_env, "runs", "resume", run_id, "--no-wait"), 0)
    redrive = run(spelling, local_env, *verb, *(["--model", "m"] if verb[0] == "pool" else [run_id]))
    said(redrive, 0, f"run {run_id}: 1 dead-lettered claim(s) sent back to calque-pool-m ({msg['claim']})\n")
    said(run(spelling, local_env, "pool", "scale", "--model", "m", "--workers", "1"), 0)
    resume = run(spelling, local_env, "runs", "resume", run_id)
    assert resume.returncode == 0 and resume.stdout.splitlines()[0] == totals(run_id, "done", ok=300), resume.stderr
    results = run(spelling, local_env, "runs", "results", run_id)
    said(results, 0, stderr="")
    assert [(r["i"], r["id"]) for r in map(json.loads, results.stdout.splitlines())] == \
        [(i, f"doc-{i}") for i in range(300)]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_planned_count_is_kept_across_ctrl_c_mid_staging(local_env, tmp_path, spelling):
    """submit --deadline 1h on a pool sizing itself (plan measured its claims first), Ctrl-C while staging: the run
    keeps the count its plan picked; runs resume gives it that count again once the rest is sent, and runs show
    sets the plan against the actual time."""
    said(run(spelling, local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
             "--min-workers", "1", "--max-workers", "2"), 0)
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(1000)])
    said(run(spelling, local_env, "plan", "--pool", "m", items, "--claim-size", "1"), 0)   # its sample claim
    run_id = interrupted_submit(spelling, local_env, items, "--claim-size", "1", "--deadline", "1h")
    record = calque_core.read_run(backend_for(local_env), run_id)
    assert 0 < record["sent"] < 1000, record["sent"]
    resume = run(spelling, local_env, "runs", "resume", run_id)
    assert resume.returncode == 0 and resume.stdout.splitlines()[0] == totals(run_id, "done", ok=1000), resume.stderr
    assert "runs resume: running at 1 worker (predicted " in resume.stderr
    assert "plan: predicted " in run(spelling, local_env, "runs", "show", run_id).stdout
    assert calque_core.read_run(backend_for(local_env), run_id)["options"]["plan"]["count"] == 1
