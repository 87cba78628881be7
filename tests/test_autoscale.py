"""Pools that size themselves, in real processes: a local pool between 0 and 2 workers wakes on a run and goes
back to 0 after its idle window; scaling in while every worker holds a claim redelivers nothing; the planner
and submit --plan / --deadline on a measured pool; an EC2 group's policies, alarms and scale-in protection on
moto (created by pool create, removed by pool delete)."""
import json
import os
import re
import subprocess
import time

from conftest import HANDLERS, PY, ROOT, backend_for, cli, wait_for, write_items
import calque_core
import calque_runs


def status(env, model="m"):
    return json.loads(cli(env, "pool", "status", "--model", model, "--json").stdout)


def alive(env, model="m"):
    return sum(w["alive"] for w in status(env, model)["local_workers"])


def test_local_pool_wakes_on_work_and_idles_back_to_zero(local_env, tmp_path):
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--min-workers", "0",
              "--max-workers", "2", "--scale-to-zero-after", "0.05")
    assert out.returncode == 0, out.stderr
    assert "sizes itself between 0 and 2" in out.stdout and alive(local_env) == 0
    assert "sizes itself: 0..2 workers on its backlog (drain target 60 s; after 0.05 idle min -> 0)" in cli(
        local_env, "pool", "status", "--model", "m").stdout
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(20)])
    out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    summaries = json.loads(out.stdout)["summaries"]
    assert len(summaries) == 10 and all(s["status"] == "ok" and s["receive_count"] == 1 for s in summaries)
    wait_for(lambda: alive(local_env) == 0, 30, "the idle workers to exit")
    log_file = os.path.join(local_env["CALQUE_STATE"], "pools", "m", "supervisor.log")
    wait_for(lambda: "exited with 0" in open(log_file).read(), 10, "the supervisor to log the workers' exits")
    log = open(log_file).read()
    assert re.search(r"scale: backlog 10\+0 in flight, unmeasured, .* bounds 0..2: 0 -> 2", log), log
    assert re.search(r"scale: backlog 0\+0 in flight, .*: 2 -> 0", log), log
    assert "exited with 0" in log and status(local_env)["supervisor"]["pid"]    # graceful; the supervisor stays
    out = cli(local_env, "pool", "scale", "--model", "m", "--max-workers", "3")   # the rest kept
    assert out.returncode == 0, out.stderr
    assert "sizes itself between 0 and 3 local worker(s) (idle 0.05 min -> 0)" in out.stdout
    scaling = json.load(open(os.path.join(local_env["CALQUE_STATE"], "pools", "m", "scaling.json")))
    assert (scaling["lo"], scaling["hi"], scaling["idle_window"]) == (0, 3, 3.0)
    assert alive(local_env) == 0
    out = cli(local_env, "pool", "scale", "--model", "m")    # no count: one line and a hint
    assert out.returncode == 2
    assert "---> HINT: e.g. pool scale --model m --min-workers 0" in out.stderr


def test_a_submit_wakes_the_pool_before_its_claims_are_queued(local_env, monkeypatch):
    """announce_run (submit, before staging) makes the supervisor's decision count the run's claims
    until the run is staged: its first claim, queued alone, does not cut them to one; once all are
    queued, the queue's own count takes over."""
    import calque
    import calque_supervisor as supervisor
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
              "--min-workers", "0", "--max-workers", "2", "--scale-to-zero-after", "0.05")
    assert out.returncode == 0, out.stderr
    for key in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_ENV"):
        monkeypatch.setenv(key, local_env[key])
    conf = calque_core.settings()
    scaler = supervisor.LocalScaler(conf, "m", calque_core.state_dir(conf, "m"))
    assert scaler.want(0, time.time()) == 0                   # nothing queued, nothing announced
    items, run_id = [{"x": i} for i in range(6)], calque_core.new_run_id("m")
    calque.announce_run(conf, "m", calque.as_items(items), 2, run_id)   # 3 claims coming
    scaler.checked = -1e9
    assert scaler.want(0, time.time()) == 2                   # one a claim (unmeasured), up to 2
    backend = backend_for(local_env)
    queue = backend.queues.open_queue("calque-pool-m")
    queue.send_batch(["{}"])                                  # a first claim shows; the run is not staged
    scaler.checked = -1e9
    assert scaler.want(2, time.time()) == 2 and scaler.woken is None
    assert queue.receive(1) is not None                       # and is claimed: still 3 coming
    scaler.checked = -1e9
    assert scaler.want(2, time.time()) == 2 and scaler.woken is None
    calque_runs.stage_run(backend, calque_core.load_pool(backend, "m"), items, 2, queue, "pool", run_id)
    scaler.checked = -1e9
    assert scaler.want(2, time.time()) == 2 and scaler.woken is not None   # staged: the real count (3+1)
    cli(local_env, "pool", "delete", "--model", "m", "--yes", "--force")


def test_scale_in_while_every_worker_holds_a_claim_redelivers_nothing(local_env, tmp_path):
    """Both workers are held mid-claim by the Gate handler; `pool scale --workers 1` asks one to go. It keeps its
    claim past the grace (CALQUE_GRACE=2 here: SIGTERM's timer would release it), finishes it, then exits 0."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate), CALQUE_GRACE="2")
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Gate", "--workers", "2")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(2)])
    run_id = cli(env, "submit", "--pool", "m", items, "--claim-size", "1", "--no-wait").stdout.strip()
    wait_for(lambda: len(list(gate.glob("started-*"))) == 2, 30, "both workers to hold a claim")
    out = cli(env, "pool", "scale", "--model", "m", "--workers", "1", "--no-wait")
    assert out.returncode == 0, out.stderr
    log = os.path.join(env["CALQUE_STATE"], "pools", "m", "worker-1.log")
    wait_for(lambda: "scale-in: no new claims" in open(log).read(), 10, "the scale-in signal")
    time.sleep(3.0)                     # waiting on purpose: past CALQUE_GRACE, no claim was released
    backend = backend_for(env)
    assert backend.queues.open_queue("calque-pool-m").counts() == {"visible": 0, "in_flight": 2}
    (gate / "open").touch()
    wait_for(lambda: json.loads(cli(env, "runs", "show", run_id, "--json").stdout)["complete"], 30,
             "the run to finish")
    summaries = json.loads(cli(env, "runs", "show", run_id, "--json").stdout)["summaries"]
    assert sorted(s["receive_count"] for s in summaries) == [1, 1]
    wait_for(lambda: alive(env) == 1, 20, "the scaled-in worker to exit")
    assert "exited with 0" in open(os.path.join(env["CALQUE_STATE"], "pools", "m", "supervisor.log")).read()


def test_claims_a_lost_queue_dropped_are_named_and_resumed(local_env, tmp_path):
    """The local queue file removed under a queued run: runs show names its claims in no queue (also once the
    pool is created again: that queue is newer than the run), and runs resume sends them again; each runs once."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "0")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(6)])
    run_id = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "2", "--no-wait",
                 "--wait-for-workers").stdout.strip()
    (tmp_path / "store" / "queue.db").unlink()
    out = cli(local_env, "runs", "show", run_id)
    assert "3 in no queue" in out.stdout and f"runs resume {run_id} re-sends them" in out.stdout, out.stdout
    assert "pool create" in cli(local_env, "runs", "resume", run_id, "--no-wait").stderr
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1")
    assert out.returncode == 0, out.stderr
    assert "3 in no queue" in cli(local_env, "runs", "show", run_id).stdout
    out = cli(local_env, "runs", "resume", run_id, "--json")
    assert out.returncode == 0, out.stderr
    assert "3 claim(s) in no queue sent again (c00000..c00002)" in out.stderr
    summaries = json.loads(out.stdout)["summaries"]
    assert len(summaries) == 3 and all(s["status"] == "ok" and s["receive_count"] == 1 for s in summaries)


def test_a_waiting_submit_ends_when_its_queue_is_lost(local_env, tmp_path):
    """The queue file removed while submit waits on its run: the wait ends (not at its timeout) naming the
    claims in no queue and runs resume."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "0")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(4)])
    proc = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "m", items, "--claim-size",
                             "2", "--wait-for-workers", "--timeout", "600"], env=local_env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    queue = backend_for(local_env).queues.open_queue("calque-pool-m")
    wait_for(lambda: queue.counts()["visible"] == 2, 60, "the run's claims to be queued")
    (tmp_path / "store" / "queue.db").unlink()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "2 in no queue" in stdout and "runs resume" in stdout, (stdout, stderr)


def test_plan_and_planned_submits(local_env, tmp_path):
    """plan on a pool with no measured claim runs a sample claim first and says so; --json has the options per
    worker count; submit --plan without a terminal refuses unless --yes; --deadline picks the fewest workers
    that meet it, and runs show / cost print predicted against actual."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--min-workers", "1",
              "--max-workers", "2")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(40)])
    out = cli(local_env, "plan", "--pool", "m", items, "--claim-size", "4")
    assert out.returncode == 0, out.stderr
    assert "no measured claim yet: ran one sample claim of 4 item(s) first" in out.stderr
    assert "40 items in 10 claim(s) of 4" in out.stdout and "cold start" in out.stdout and "serverless" in out.stdout
    plan = json.loads(cli(local_env, "plan", "--pool", "m", items, "--claim-size", "4", "--json").stdout)
    assert [o["workers"] for o in plan["options"]] == [1, 2] and plan["measured_claims"] == 1
    assert all(o["seconds"] > 0 and o["cost_usd"] > o["spot_cost_usd"] > 0 for o in plan["options"])
    out = cli(local_env, "submit", "--pool", "m", items, "--plan", stdin="")
    assert out.returncode == 2 and "stdin is not a terminal ---> HINT: add --yes" in out.stderr
    assert len(json.loads(cli(local_env, "runs", "list", "--json").stdout)) == 1     # the sample only: nothing ran
    out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "4", "--deadline", "0.000001s")
    assert out.returncode == 2 and "no count of 1..2 workers meets --deadline" in out.stderr
    out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "4", "--deadline", "1h", "--json")
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["run"]
    assert "submit: running at 1 worker (predicted" in out.stderr and run["options"]["plan"]["count"] == 1
    assert re.search(r"plan: predicted .* on 1 worker; actual [\d.]+ s \([+-]\d+%\)",
                     cli(local_env, "runs", "show", run["run_id"]).stdout)
    assert "plan: predicted" in cli(local_env, "cost", run["run_id"]).stdout


def test_a_planned_run_gets_the_count_its_plan_picked(local_env, tmp_path):
    """A pool sizing itself from 0: plan's sample claim measures it, and the supervisor counts that sample as the
    plan did, so the planned run of 30 short claims (a few seconds of work, 60 s drain target) runs at the 1
    worker the plan picked, not at one worker a claim as an unmeasured pool would."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Spin", "--min-workers", "0",
              "--max-workers", "2", "--scale-to-zero-after", "1")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i, "spin": 20000} for i in range(120)])
    out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "4", "--plan", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert "ran one sample claim" in out.stderr and json.loads(out.stdout)["run"]["options"]["plan"]["count"] == 1
    with open(os.path.join(local_env["CALQUE_STATE"], "pools", "m", "supervisor.log")) as f:
        log = f.read()
    assert "0 -> 1" in log and "-> 2" not in log, log


def test_gpus_go_to_the_pool_with_work(local_env, tmp_path):
    """Two faked GPUs on one machine: a fixed pool's worker holds GPU 0, so a pool that sizes itself to 2 runs one
    worker, on GPU 1, and starts its second on GPU 0 once the fixed pool lets it go."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate), CALQUE_GPUS="0,1")

    def workers(model):
        with open(os.path.join(env["CALQUE_STATE"], "pools", model, "supervisor.json")) as f:
            return [w["gpus"] for w in json.load(f)["workers"] if w["pid"]]
    assert cli(env, "pool", "create", "--model", "a", "--handler", f"{HANDLERS}:Gate", "--workers", "1").returncode == 0
    assert workers("a") == [["0"]]
    out = cli(env, "pool", "create", "--model", "b", "--handler", f"{HANDLERS}:Gate", "--max-workers", "2")
    assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(4)])
    run_id = cli(env, "submit", "--pool", "b", items, "--claim-size", "1", "--no-wait").stdout.strip()
    wait_for(lambda: workers("b") == [["1"]], 30, "pool b's first worker, on the free GPU")
    time.sleep(1.0)                                     # a second look: its other slot still waits
    assert workers("b") == [["1"]]
    assert cli(env, "pool", "scale", "--model", "a", "--workers", "0").returncode == 0
    wait_for(lambda: sorted(workers("b")) == [["0"], ["1"]], 30, "pool b's second worker, on the freed GPU")
    (gate / "open").touch()
    wait_for(lambda: json.loads(cli(env, "runs", "show", run_id, "--json").stdout)["complete"], 30, "the run")
