"""A pool is one version (docs/contract.md, "Versions"): `pool create` of another handler is refused and of the
same one changes nothing (the worker count neither); `pool deploy` waits for the runs in flight and replaces
the workers, so a run's results all come from one version, a worker killed -9 meanwhile included; a claim of
another version never runs: a stale worker gives it back and restarts on the pool's version, a claim of a
version the pool no longer runs gets a failure summary naming both. Both spellings of the command line."""
import json
import os
import signal
import subprocess
from collections import Counter

import pytest

import calque
import calque_core
import calque_runs
import calque_supervisor
from conftest import PY, ROOT, backend_for, pool_pids, start_worker, wait_for
from test_commands import BIN, SPELLINGS
from test_ec2 import MODEL, STORE, aws, launch_template_user_data  # noqa: F401 (aws: a fixture)

TAGGED = '''
import os, time
import calque


class {name}:
    @calque.enter
    def load(self):
        if os.environ.get("BROKEN") == "{name}":
            raise ImportError("no module named weights")
        self.tag = "{name}"

    @calque.batch
    def run(self, items):
        time.sleep(float(os.environ.get("BATCH_SLEEP", "0")))   # a model's time, so runs stay in flight
        return [{{"v": self.tag, "x": item["x"]}} for item in items]
'''


@pytest.fixture
def folder(tmp_path):
    """A user's folder outside the checkout: a.py:A and b.py:B (each result names its handler), 400 items."""
    work = tmp_path / "work"
    work.mkdir()
    for name in "AB":
        (work / f"{name.lower()}.py").write_text(TAGGED.format(name=name))
    (work / "items.jsonl").write_text("".join(json.dumps({"x": i}) + "\n" for i in range(400)))
    return work


def command(spelling):
    return [os.path.join(BIN, "calque")] if spelling == "installed" else [PY, os.path.join(ROOT, "calque.py")]


def runner(spelling, env, folder):
    def run(*args, code=0):
        out = subprocess.run(command(spelling) + list(args), env=env, cwd=folder, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == code and "Traceback" not in out.stderr, out.stdout + out.stderr
        return out
    return run


def versions(run, run_id):
    """Counter of the handler each result of the run came from."""
    lines = run("runs", "results", run_id).stdout.splitlines()
    return Counter(json.loads(line)["result"]["v"] for line in lines)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_create_twice_changes_nothing_and_another_handler_is_refused(local_env, folder, spelling):
    """Re-running create without --workers left 1 of 2 workers, the other "died after progress"; with b.py:B it
    said `handler b.py:B` and exit 0 while the workers kept A. Now: nothing changed, said; B refused, named."""
    run = runner(spelling, local_env, folder)
    shown = "calque" if spelling == "installed" else "python calque.py"
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "2")
    backend = backend_for(local_env)
    before = calque_core.load_pool(backend, "m")
    supervisor, pids = pool_pids(local_env)
    again = run("pool", "create", "--model", "m", "--handler", "a.py:A")
    status = json.loads(run("pool", "status", "--model", "m", "--json").stdout)
    assert status["supervisor"]["desired"] == 2, status["supervisor"]
    assert not [w for w in status["local_workers"] if w["last_exit"]], status["local_workers"]
    assert pool_pids(local_env) == (supervisor, pids) and all(calque_supervisor.pid_alive(p) for p in pids)
    other = run("pool", "create", "--model", "m", "--handler", "b.py:B", "--workers", "2", code=2)
    assert status["version"] == before["version"]
    assert f"version {before['version']} (a.py:A, batch 32): nothing changed" in again.stdout, again.stdout
    assert "its 2 local worker(s) here are left as they are" in again.stdout, again.stdout
    assert len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert f"HINT: {shown} pool deploy --model m --handler b.py:B" in other.stderr, other.stderr
    assert f"runs version {before['version']} (a.py:A" in other.stderr
    assert calque_core.load_pool(backend, "m") == before
    assert backend.store.get(before["handler"]["key"]) == (folder / "a.py").read_bytes()
    assert not backend.store.exists(before["handler"]["key"].replace("a.py", "b.py"))
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--batch-size", "8", code=2)   # shapes results
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "1")   # a count given: set
    assert wait_for(lambda: len(pool_pids(local_env)[1]) == 1, 60, "one worker")
    status = run("pool", "status", "--model", "m").stdout
    assert f"version: {before['version']} (a.py:A, batch 32)" in status and "died after progress" not in status


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_deploy_keeps_each_run_on_one_version_through_a_kill(local_env, folder, spelling):
    """A run of 400 items in flight on A, `pool deploy` to B: it waits (says so), a worker killed -9 meanwhile
    is restarted on A, the run's 400 results all come from A; then the workers run B, a run after is all B, and
    pool status and each worker's log say which version it runs."""
    env = dict(local_env, BATCH_SLEEP="0.2")
    run = runner(spelling, env, folder)
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "2")
    old = calque_core.load_pool(backend_for(env), "m")["version"]
    first = run("submit", "--pool", "m", "items.jsonl", "--claim-size", "10", "--no-wait").stdout.strip()
    deploy = subprocess.Popen(command(spelling) + ["pool", "deploy", "--model", "m", "--handler", "b.py:B"],
                              env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = deploy.stderr.readline()
    assert f"waiting for 1 run(s) of version {old}" in said and first in said, said
    victim = pool_pids(env)[1][0]
    os.kill(victim, signal.SIGKILL)   # mid-change: its claim goes to a worker of A again
    out, err = deploy.communicate(timeout=300)
    assert deploy.returncode == 0 and "Traceback" not in err, out + err
    new = calque_core.load_pool(backend_for(env), "m")["version"]
    assert f"version {new} (b.py:B, batch 32) replaces {old} (a.py:A, batch 32)" in out, out
    assert versions(run, first) == {"A": 400}
    os.kill(pool_pids(env)[1][0], signal.SIGKILL)   # a new worker dies too: restarted on B
    second = run("submit", "--pool", "m", "items.jsonl", "--claim-size", "10", "--json").stdout
    assert versions(run, json.loads(second)["run"]["run_id"]) == {"B": 400}
    status = json.loads(run("pool", "status", "--model", "m", "--json").stdout)
    assert status["version"] == new
    assert {w["version"] for w in status["workers"] if w["state"] == "running"} == {new}
    logs = run("pool", "logs", "--model", "m").stdout
    assert f"pool m, version {old} (a.py:A, batch 32)" in logs and f"pool m, version {new} (b.py:B" in logs
    assert "nothing changed" in run("pool", "deploy", "--model", "m", "--handler", "b.py:B").stdout


def test_deploy_interrupted_while_waiting_changes_nothing(local_env, folder):
    """Ctrl-C while `pool deploy` waits for a run: one line, exit 2, the pool as it was (record, workers)."""
    env = dict(local_env, BATCH_SLEEP="0.2")
    run = runner("script", env, folder)
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "1")
    before, pids = calque_core.load_pool(backend_for(env), "m"), pool_pids(env)
    run_id = run("submit", "--pool", "m", "items.jsonl", "--claim-size", "10", "--no-wait").stdout.strip()
    deploy = subprocess.Popen(command("script") + ["pool", "deploy", "--model", "m", "--handler", "b.py:B"],
                              env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "waiting for 1 run(s)" in deploy.stderr.readline()
    deploy.send_signal(signal.SIGINT)
    out, err = deploy.communicate(timeout=60)
    assert deploy.returncode == 2 and "pool deploy interrupted: nothing changed" in err, out + err
    assert calque_core.load_pool(backend_for(env), "m") == before and pool_pids(env) == pids
    run("runs", "cancel", run_id)


def test_deploy_takes_over_runs_a_broken_version_never_started(local_env, folder):
    """A's @enter fails in every worker while a run waits: `pool deploy` of the fixed B does not wait for it
    forever; the run, none of whose claims started, moves to B whole (its claims say A: the run record rules)."""
    env = dict(local_env, BROKEN="A")
    run = runner("installed", env, folder)
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "0")
    run_id = run("submit", "--pool", "m", "items.jsonl", "--wait-for-workers", "--no-wait").stdout.strip()
    run("pool", "scale", "--model", "m", "--workers", "1", "--no-wait")
    wait_for(lambda: "died before warm" in run("pool", "status", "--model", "m").stdout, 60, "a crash")
    out = run("pool", "deploy", "--model", "m", "--handler", "b.py:B")
    new = calque_core.load_pool(backend_for(env), "m")["version"]
    assert f"version {new} (b.py:B" in out.stdout and "reached version" not in out.stderr, out
    assert f"run {run_id} had not started: it runs on version {new}" in out.stderr, out.stderr
    backend = backend_for(env)
    wait_for(lambda: len(calque_core.summary_claims(backend, run_id)) == len(calque_core.read_run(backend, run_id)["claims"]),
             120, "the run done")
    assert versions(run, run_id) == {"B": 400}
    assert calque_core.read_run(backend, run_id)["version"] == new
    assert f"; version {new}\n" in run("runs", "show", run_id).stdout


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_deploy_whose_workers_die_before_warm_says_where_the_pool_stands(local_env, folder, spelling):
    """A deploy's new workers died in @enter: it said "fix the handler, then create the pool again", the pool was
    left on the new version with no worker, and a second deploy said "nothing changed", exit 0. Now the error says
    the version the pool runs and the two ways on; the repeat says no worker runs it here. A first create that
    fails so names no deploy (its pool is gone)."""
    env = dict(local_env, BROKEN="B")
    run = runner(spelling, env, folder)
    shown = "calque" if spelling == "installed" else "python calque.py"
    failed = run("pool", "create", "--model", "n", "--handler", "b.py:B", "--workers", "1", code=1)
    assert failed.stderr.endswith(f"---> HINT: fix the handler (or install what it imports), then {shown} pool "
                                  "create again\n"), failed.stderr
    run("pool", "create", "--model", "m", "--handler", "a.py:A", "--workers", "2")
    out = run("pool", "deploy", "--model", "m", "--handler", "b.py:B", code=1)
    new = calque_core.load_pool(backend_for(env), "m")["version"]
    assert len(out.stderr.strip().splitlines()) == 1 and "no module named weights" in out.stderr, out.stderr
    assert (f"then {shown} pool deploy it again; pool m runs version {new} (b.py:B" in out.stderr
            and f"{shown} pool scale --model m --workers 2 to start it as it is" in out.stderr), out.stderr
    again = run("pool", "deploy", "--model", "m", "--handler", "b.py:B")
    assert (f"already runs version {new} (b.py:B" in again.stdout
            and f"no local worker runs it here ---> HINT: {shown} pool scale --model m" in again.stdout), again.stdout


def test_a_claim_of_another_version_never_runs(any_env, folder):
    """A worker of A given a claim of B, the pool's version now (deployed elsewhere, no supervisor here): it gives
    the claim back and exits 75 to restart on B; B's worker runs it. A claim of a version the pool no longer runs
    (submitted during a change): a failure summary naming both versions, a dead letter; nothing loops. On the
    local store and on S3 + SQS (moto_server), where an EC2 pool's workers restart so. Its own model: the
    session's moto_server keeps other tests' queues of model m."""
    run = runner("script", any_env, folder)
    run("pool", "create", "--model", "vm", "--handler", "a.py:A", "--workers", "0")
    backend = backend_for(any_env)
    old = calque_core.load_pool(backend, "vm")
    stale = start_worker(any_env, "--model", "vm", log=open(folder / "stale.log", "w"))
    wait_for(lambda: "version" in (folder / "stale.log").read_text(), 60, "the stale worker started")
    run("pool", "deploy", "--model", "vm", "--handler", "b.py:B")   # no workers here: the record changes
    new = calque_core.load_pool(backend, "vm")
    submit = subprocess.Popen(command("script") + ["submit", "--pool", "vm", "items.jsonl", "--json"],
                              env=any_env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert stale.wait(120) == calque_core.EXIT_REPLACED
    log = (folder / "stale.log").read_text()
    assert f"claim of version {new['version']}, this worker runs {old['version']}" in log, log
    start_worker(any_env, "--model", "vm")   # what its supervisor (systemd on EC2) does: B now
    out, err = submit.communicate(timeout=300)
    assert submit.returncode == 0, out + err
    assert versions(run, json.loads(out)["run"]["run_id"]) == {"B": 400}
    # a run staged against A's record while the pool changed to B
    queue = backend.queues.open_queue(old["queue"])
    late = calque_runs.stage_run(backend, old, [{"x": 1}, {"x": 2}], 1, queue, "pool")
    assert late["version"] == old["version"]
    wait_for(lambda: len(calque_core.summary_claims(backend, late["run_id"])) == 2, 120, "failure summaries")
    for summary in calque_core.read_summaries(backend, late["run_id"]):
        assert summary["status"] == "failed" and summary["ok"] == 0, summary
        assert f"claim of version {old['version']}; the pool runs version {new['version']}" in summary["error"]
    letters = [json.loads(m.body) for m in calque_runs.receive_all(backend.queues.open_queue(old["dlq"]), 10)]
    assert [x.get("run_id") for x in letters].count(late["run_id"]) == 2, letters   # (moto_server's: others' too)
    shown = subprocess.run(command("script") + ["runs", "show", late["run_id"]], env=any_env, cwd=folder,
                           capture_output=True, text=True, timeout=60)
    assert f"claim of version {old['version']}" in shown.stdout + shown.stderr, shown.stdout + shown.stderr
    assert not run("runs", "results", late["run_id"], code=1).stdout   # no result of B in A's run
    for verb in ("redrive", "resume"):   # they would only dead-letter its claims again
        refused = run("runs", verb, late["run_id"], code=2).stderr
        assert f"runs {verb} would run none of its claims ---> HINT: submit its items again" in refused, refused


def test_ec2_pool_create_refuses_another_version_and_deploy_writes_it(aws, monkeypatch, capsys, tmp_path):  # noqa: F811
    """On moto: create of an EC2 pool with another handler is refused before any AWS call, naming pool deploy;
    pool deploy writes the new snapshot and record (the launch template names no handler: no new version of
    it, no instance replaced: each worker restarts on the record)."""
    monkeypatch.setenv("CALQUE_STORE", STORE)
    monkeypatch.setenv("CALQUE_STATE", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    for name in "AB":
        (tmp_path / f"{name.lower()}.py").write_text(TAGGED.format(name=name))
    fleet = ["--instances", "2", "--instance-type", "g5.xlarge", "--yes-spend-money"]
    assert calque.main(["pool", "create", "--model", MODEL, "--handler", "a.py:A", *fleet]) == 0
    before = calque_core.load_pool(aws.backend, MODEL)
    _, template = launch_template_user_data()
    capsys.readouterr()
    assert calque.main(["pool", "create", "--model", MODEL, "--handler", "b.py:B", *fleet]) == calque_core.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"pool deploy --model {MODEL} --handler b.py:B" in err and len(err.strip().splitlines()) == 1, err
    assert calque_core.load_pool(aws.backend, MODEL) == before
    assert calque.main(["pool", "deploy", "--model", MODEL, "--handler", "b.py:B"]) == 0
    out = capsys.readouterr().out
    after = calque_core.load_pool(aws.backend, MODEL)
    assert after["version"] != before["version"] and after["ec2"] == before["ec2"], out
    assert f"version {after['version']} (b.py:B, batch 32) replaces {before['version']}" in out
    assert "each instance's worker restarts on it" in out, out
    assert aws.backend.store.get(after["handler"]["key"]) == (tmp_path / "b.py").read_bytes()
    assert launch_template_user_data()[1]["VersionNumber"] == template["VersionNumber"]
