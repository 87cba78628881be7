"""calque.py end to end: real warmd.py processes under the pool supervisor, on the embedded backend and
on SQS + S3 served by moto_server; and the one-line errors for bad input."""
import json
import os
import signal

import pytest

from conftest import HANDLERS, ROOT, backend_for, cli, wait_for, write_items


def create_pool(env, model="m", handler="Echo", *extra):
    # no local worker unless asked (pool create starts 1 by default)
    extra = extra if "--workers" in extra else (*extra, "--workers", "0")
    out = cli(env, "pool", "create", "--model", model, "--handler", f"{HANDLERS}:{handler}", *extra)
    assert out.returncode == 0, out.stderr
    return out


def three_runs_on_two_workers(env, tmp_path):
    """The end-to-end check shared by both backends."""
    create_pool(env, "m", "Echo", "--workers", "2", "--batch-size", "4")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(30)])
    runs = []
    for _ in range(3):
        out = cli(env, "submit", "--pool", "m", items, "--claim-size", "5", "--json")
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout))
    claims = [s for r in runs for s in r["summaries"]]
    assert len(claims) == 18 and all(s["status"] == "ok" and s["ok"] == 5 for s in claims)
    for r in runs:                                    # every item done, results in item order
        out = cli(env, "runs", "results", r["run"]["run_id"])
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [(l["i"], l["result"]["y"]) for l in lines] == [(i, 2 * i) for i in range(30)]
    by_worker = {}
    for s in sorted(claims, key=lambda s: s["started_at"]):
        by_worker.setdefault(s["worker_id"], []).append(s)
    assert len(by_worker) == 2, "both workers served claims"
    for worker, served in by_worker.items():
        assert all(s["enter_count"] == 1 for s in served), f"{worker} loaded its model more than once"
        assert all(s["warm_hit"] and s["enter_seconds_paid"] == 0 for s in served[1:])
    status = json.loads(cli(env, "pool", "status", "--model", "m", "--json").stdout)
    assert status["queue"] == {"visible": 0, "in_flight": 0}
    assert sum(w["alive"] for w in status["local_workers"]) == 2
    assert sorted(w["claims"] for w in status["workers"]) == sorted(len(v) for v in by_worker.values())
    assert all(w["enter_count"] == 1 for w in status["workers"])
    out = cli(env, "pool", "delete", "--model", "m", "--yes")
    assert out.returncode == 0, out.stderr
    pids = [w["pid"] for w in status["local_workers"]] + [status["supervisor"]["pid"]]
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                             for p in pids), 20, "workers and supervisor to exit")
    assert cli(env, "pool", "status", "--model", "m").returncode == 2


def test_end_to_end_local(local_env, tmp_path):
    """2 workers, 3 runs: every item done, enter_count 1 each, every claim after a worker's first warm."""
    three_runs_on_two_workers(local_env, tmp_path)


def test_end_to_end_moto_server(aws_env, tmp_path):
    """The same end-to-end run against SQS + S3 on moto_server (127.0.0.1)."""
    three_runs_on_two_workers(aws_env, tmp_path)


def test_restart_delay_knows_a_crash_loop_from_a_killed_worker():
    """At once after progress (or a long life), whatever killed the worker; 1 s after a SIGKILL without progress;
    doubling to 30 s for a worker that keeps exiting by itself before warm or without progress."""
    import calque_supervisor as supervisor
    kill, segv = -signal.SIGKILL, -signal.SIGSEGV
    assert supervisor.restart_delay(True, True, 0.5, 0, kill) == (0.0, "died after progress")
    assert supervisor.restart_delay(True, True, 0.5, 0, segv) == (0.0, "died after progress")
    assert supervisor.restart_delay(True, False, 61.0, 3, 1) == (0.0, "died after progress")
    assert supervisor.restart_delay(True, False, 0.5, 5, kill) == (1.0, "died without progress")
    assert supervisor.restart_delay(False, False, 0.5, 5, kill) == (1.0, "died before warm")
    assert [supervisor.restart_delay(False, False, 61.0, n, 2)[0] for n in (1, 2, 3, 6, 9)] == [1, 2, 4, 30, 30]
    assert supervisor.restart_delay(True, False, 2.0, 2, segv) == (2.0, "died without progress")


def test_pid_alive_tells_a_zombie_and_a_reaped_process_from_a_live_one():
    """kill(0) answers for a zombie too: pid_alive reads /proc, so an exited child not reaped yet is gone."""
    import subprocess
    import calque_supervisor as supervisor
    child = subprocess.Popen(["sleep", "30"])
    assert supervisor.pid_alive(os.getpid()) and supervisor.pid_alive(child.pid)
    child.kill()
    wait_for(lambda: open(f"/proc/{child.pid}/stat").read().split(")")[-1].split()[0] == "Z", 10, "a zombie")
    assert not supervisor.pid_alive(child.pid)
    child.wait()
    assert not supervisor.pid_alive(child.pid)


def test_a_death_is_recorded_and_told_to_the_warm_siblings(tmp_path):
    """_reap on real processes: a worker's exit status goes to `died`, and each warm sibling (its
    pid in its ready file) gets a SIGUSR2, which warmd takes as a notice to commit under churn; one
    still starting (no ready file) gets none: SIGUSR2 would end a process with no handler yet."""
    import contextlib
    import subprocess
    import sys
    import time

    import calque_supervisor as supervisor
    noted = tmp_path / "noted"
    sibling = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGUSR2, lambda *_: open(sys.argv[1], 'w').close())\n"
               "open(sys.argv[2], 'w').write(str(os.getpid()))\ntime.sleep(30)")
    ready = [str(tmp_path / f"ready-{s}") for s in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
             subprocess.Popen([sys.executable, "-c", sibling, str(noted), ready[1]]),
             subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])]
    slots = {s: {"proc": p, "started": time.time(), "restarts": 0, "ready": ready[s],
                 "log": str(tmp_path / f"log-{s}")} for s, p in enumerate(procs)}
    def exited_and_warm():
        with contextlib.suppress(OSError):
            return procs[0].poll() is not None and open(ready[1]).read() == str(procs[1].pid)
    wait_for(exited_and_warm, 10, "the exit, and the sibling's ready file")
    deaths = []
    assert supervisor._reap(slots, 3, time.time(), lambda *death: deaths.append(death)) == 1
    assert deaths == [(procs[0].pid, 3, ready[0] + ".claims")]   # its receipts file: released claims
    wait_for(noted.exists, 10, "the sibling's SIGUSR2")
    assert procs[2].poll() is None       # the one with no ready file was left alone
    for p in procs[1:]:
        p.kill()
        p.wait()


def test_supervisor_restarts_a_dead_worker(local_env, tmp_path):
    """A worker killed with SIGKILL is restarted after 1 s when it made no progress, at once when it had finished a
    claim; pool status counts the restarts and says which was which."""
    create_pool(local_env, "m", "Echo", "--workers", "1")

    def killed_and_restarted(restarts, kind):
        first = wait_for(lambda: [w for w in json.loads(cli(local_env, "pool", "status", "--model", "m", "--json")
                                                        .stdout)["local_workers"] if w["alive"] and w["warm"]],
                         20, "a warm worker")[0]
        os.kill(first["pid"], signal.SIGKILL)

        def restarted():
            status = json.loads(cli(local_env, "pool", "status", "--model", "m", "--json").stdout)
            live = [w for w in status["local_workers"] if w["alive"] and w["pid"] != first["pid"]]
            return status["supervisor"]["restarts"] == restarts and live
        wait_for(restarted, 20, "the supervisor to restart the worker")
        assert kind in cli(local_env, "pool", "status", "--model", "m").stdout
    killed_and_restarted(1, "(died without progress, restart after 1 s): killed by SIGKILL")
    out = cli(local_env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": 1}]))
    assert out.returncode == 0, out.stderr
    killed_and_restarted(2, "(died after progress, restarted at once): killed by SIGKILL")
    out = cli(local_env, "pool", "scale", "--model", "m", "--workers", "2")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: sum(w["alive"] for w in json.loads(cli(local_env, "pool", "status", "--model", "m", "--json")
                                                        .stdout)["local_workers"]) == 2, 20, "scale to 2")
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_cold_run_pays_enter(local_env, tmp_path):
    """Without --pool, fresh workers pay @enter inside their first claim; the run queue is deleted after."""
    create_pool(local_env, "m", "Echo")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(8)])
    out = cli(local_env, "submit", "--model", "m", items, "--shards", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["summaries"]) == 2 and all(s["mode"] == "cold" and s["ok"] == 4 for s in result["summaries"])
    first_of = {}
    for s in sorted(result["summaries"], key=lambda s: s["started_at"]):
        first = first_of.setdefault(s["worker_id"], s) is s
        if first:     # a fresh process loads inside its first claim (the other shard may have taken both claims)
            assert not s["warm_hit"] and s["enter_seconds_paid"] > 0 and s["acquisition_seconds"] > 0
        else:
            assert s["warm_hit"] and s["enter_seconds_paid"] == 0
    import calque
    with pytest.raises(calque.NotFound):
        backend_for(local_env).queues.open_queue(result["run"]["queue"])


def test_cold_run_with_a_handler_and_no_pool(local_env, tmp_path):
    """A cold run can name its handler directly; no pool is needed."""
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}, {"x": 2, "fail": True}])
    out = cli(local_env, "submit", "--model", "solo", "--handler", f"{HANDLERS}:Echo", items)
    assert out.returncode == 1, out.stderr        # one item failed: the work failed
    assert "1 items ok, 1 failed" in out.stdout


def test_no_wait_then_runs_show(local_env, tmp_path):
    """--no-wait prints the run id; runs show and runs results read it later."""
    create_pool(local_env, "m", "Echo", "--workers", "1")
    items = write_items(tmp_path / "items.jsonl", [{"x": 3}])
    out = cli(local_env, "submit", "--pool", "m", items, "--no-wait")
    run_id = out.stdout.strip()
    assert out.returncode == 0 and run_id
    wait_for(lambda: cli(local_env, "runs", "show", run_id).returncode == 0, 20, "the run to finish")
    assert json.loads(cli(local_env, "runs", "results", run_id).stdout)["result"]["y"] == 6
    assert run_id in cli(local_env, "runs", "list").stdout
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_submit_times_out_honestly(local_env, tmp_path):
    """With no worker, submit gives up after --timeout, exit 1, and says the run goes on; pool delete then
    refuses to drop the queued claim unless --force."""
    create_pool(local_env, "m", "Echo")
    items = write_items(tmp_path / "items.jsonl", [{"x": 3}])
    out = cli(local_env, "submit", "--pool", "m", items, "--timeout", "0.5", "--wait-for-workers")
    assert out.returncode == 1
    assert "still pending" in out.stdout and "runs show" in out.stdout
    one_line_error(cli(local_env, "pool", "delete", "--model", "m", "--yes"), "1 queued and 0 in-flight", "--force")
    assert backend_for(local_env).queues.open_queue("calque-pool-m").counts()["visible"] == 1   # nothing lost
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes", "--force").returncode == 0


def one_line_error(out, *needles):
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_input_gets_one_line_errors(local_env, tmp_path):
    """Each user mistake: exit 2, one line naming the problem, nothing created or lost."""
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}])
    one_line_error(cli(local_env, "submit", "--pool", "nope", items), "no pool for model 'nope'", "pool create")
    one_line_error(cli(local_env, "pool", "create", "--model", "m", "--handler", "missing.py:X"), "missing.py not found")
    one_line_error(cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Nope"), "no class Nope")
    one_line_error(cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:NoBatch"), "lacks @calque.batch")
    one_line_error(cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--batch-size", "0"),
                   "--batch-size 0")
    create_pool(local_env, "Foo/Bar", "Echo")
    one_line_error(cli(local_env, "pool", "create", "--model", "foo-bar", "--handler", f"{HANDLERS}:Echo"),
                   "'foo-bar'", "'Foo/Bar'")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n{"x": \n')
    one_line_error(cli(local_env, "submit", "--pool", "Foo/Bar", str(bad)), "bad.jsonl:2", "not valid JSON")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    one_line_error(cli(local_env, "submit", "--pool", "Foo/Bar", str(empty)), "no items")
    one_line_error(cli(local_env, "submit", "--pool", "Foo/Bar", items, "--shards", "2"), "--shards")
    one_line_error(cli(local_env, "runs", "show", "20990101-000000-abcdef"), "no run")
    one_line_error(cli(local_env, "submit", "--pool", "Foo/Bar", str(tmp_path / "none.jsonl")), "cannot read items",
                   "HINT: give the path of a JSONL, .npy or .npz file")
    one_line_error(cli(local_env, "submit", "--pool", "Foo/Bar", "none.npy"), "cannot read items file none.npy",
                   f"(or - for stdin), relative to {ROOT}")
    backend = backend_for(local_env)
    assert backend.queues.open_queue("calque-pool-foo-bar").counts() == {"visible": 0, "in_flight": 0}
    assert [k for k in backend.store.list("pools/")] == ["pools/foo-bar"]


def test_items_from_stdin(local_env):
    """ITEMS may be - for stdin."""
    out = cli(local_env, "submit", "--model", "s", "--handler", f"{HANDLERS}:Echo", "-", stdin='{"x": 4}\n')
    assert out.returncode == 0, out.stderr
    assert "1 items ok, 0 failed" in out.stdout


def test_missing_bucket_is_one_line(aws_env):
    """An s3:// store whose bucket does not exist: one line naming the bucket and the fix."""
    env = dict(aws_env, CALQUE_STORE="s3://no-such-bucket-calque/x")
    one_line_error(cli(env, "pool", "list"), "bucket no-such-bucket-calque does not exist")


def test_unreachable_endpoint_is_one_line(aws_env):
    """An endpoint nobody listens on: one line, exit 2."""
    from conftest import free_port
    env = dict(aws_env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_MAX_ATTEMPTS="1")
    one_line_error(cli(env, "pool", "list"), "cannot reach")


def test_aws_refusals_are_one_line(aws_env, tmp_path):
    """A queue deleted behind calque's back: after the brief retry a new queue gets on SQS, one line, exit 2."""
    assert cli(aws_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
               "--workers", "0").returncode == 0
    backend = backend_for(aws_env)
    backend.queues.delete_queue("calque-pool-m")
    out = cli(aws_env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": 1}]), timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "calque-pool-m not found" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_pool_env_reaches_the_workers(local_env, tmp_path):
    """Settings from a pool.env in the user's folder reach the supervisor's workers, which run elsewhere."""
    env_file = tmp_path / "pool.env"
    env_file.write_text(f"CALQUE_STORE={tmp_path / 'from-env-file'}\nCALQUE_GRACE=7\n")
    env = {k: v for k, v in local_env.items() if k not in ("CALQUE_STORE", "CALQUE_GRACE")}
    env["CALQUE_ENV"] = str(env_file)
    assert cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1").returncode == 0
    items = write_items(tmp_path / "items.jsonl", [{"x": 2}])
    out = cli(env, "submit", "--pool", "m", items, "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    log = wait_for(lambda: [p for p in (tmp_path / "state" / "pools" / "m").glob("worker-0.log")], 20, "the worker log")[0]
    assert "7s grace" in cli(env, "pool", "delete", "--model", "m", "--yes").stdout + log.read_text()


def test_workers_leave_when_their_supervisor_is_killed(local_env, tmp_path):
    """SIGKILL the supervisor: its workers notice within a poll and exit instead of running on as orphans."""
    create_pool(local_env, "m", "Echo", "--workers", "2")
    status = wait_for(lambda: (lambda s: s if sum(w["alive"] for w in s["local_workers"]) == 2 else None)(
        json.loads(cli(local_env, "pool", "status", "--model", "m", "--json").stdout)), 30, "two live workers")
    os.kill(status["supervisor"]["pid"], signal.SIGKILL)
    pids = [w["pid"] for w in status["local_workers"]]
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
                             for p in pids), 30, "the orphaned workers to exit")
    logs = "".join(p.read_text() for p in (tmp_path / "state" / "pools" / "m").glob("worker-*.log"))
    assert logs.count("is gone") == 2


def test_status_names_the_fastbatch_fallback(local_env, tmp_path):
    """A worker collating with fastbatch's numpy fallback (here FASTBATCH_REFERENCE=1) says so in its stats and
    `pool status` notes it: never silently numpy on a GPU pool."""
    env = dict(local_env, FASTBATCH_REFERENCE="1")
    create_pool(env, "m", "RowSum", "--workers", "1")
    items = write_items(tmp_path / "items.jsonl", [{"x": [i, i]} for i in range(4)])
    assert cli(env, "submit", "--pool", "m", items).returncode == 0
    # the worker's stats name its collation once it has run a claim and written them (on running out of claims)
    wait_for(lambda: [w.get("fastbatch") for w in json.loads(cli(env, "pool", "status", "--model", "m", "--json")
                                                               .stdout)["workers"]] == ["reference"],
             what="the worker's stats to name fastbatch's fallback")
    out = cli(env, "pool", "status", "--model", "m")
    assert "collate with fastbatch's numpy fallback" in out.stdout
    assert cli(env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_workers_share_the_cores_unless_told(local_env, tmp_path):
    """Each of 2 CPU workers gets cores / 2 threads (at least 1) in every THREAD_VARS setting the user left unset;
    OMP_NUM_THREADS set by the user is kept; --threads-per-worker N sets them all; pool status shows it."""
    import calque_supervisor as supervisor
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(8)])

    def settings(env):
        out = cli(env, "submit", "--pool", "m", items, "--claim-size", "1")
        assert out.returncode == 0, out.stderr
        return {tuple(sorted(json.loads(line)["result"].items()))
                for line in cli(env, "runs", "results", out.stdout.split()[1]).stdout.splitlines()}

    env = dict(local_env, OMP_NUM_THREADS="5")
    create_pool(env, "m", "Threads", "--workers", "2")
    assert settings(env) == {tuple(sorted(dict(dict.fromkeys(supervisor.THREAD_VARS, share), OMP_NUM_THREADS="5").items()))}
    status = cli(env, "pool", "status", "--model", "m").stdout
    assert status.count("5 thread(s)") == 2, status
    assert cli(env, "pool", "scale", "--model", "m", "--workers", "0").returncode == 0   # running workers keep theirs
    create_pool(local_env, "m", "Threads", "--workers", "1", "--threads-per-worker", "3")
    assert settings(local_env) == {tuple(sorted(dict.fromkeys(supervisor.THREAD_VARS, "3").items()))}
    assert "3 thread(s)" in cli(local_env, "pool", "status", "--model", "m").stdout
    assert "--threads-per-worker 0: must be 1 or more" in cli(local_env, "pool", "scale", "--model", "m", "--workers",
                                                              "1", "--threads-per-worker", "0").stderr
    cli(local_env, "pool", "delete", "--model", "m", "--yes")
