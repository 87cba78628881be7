"""Nothing lost, nothing stuck: poison items, a hung batch, a store that refuses writes, and random kill -9 of
workers and of the pool supervisor. Real warmd.py processes under the real pool supervisor, on the embedded
backend and (where it says so) on SQS + S3 served by moto_server."""
import contextlib
import json
import os
import random
import re
import signal
import threading
import time
import types

import calque
import calque_core
import calque_runs
import churn
from conftest import HANDLERS, FaultProxy, backend_for, cli, pool_pids, wait_for

KILLS = 6          # kill -9s in the chaos test, one of them the supervisor's


def start_pool(env, *args):
    """A pool of the Faulty handler; claims come back 2 s after a worker dies."""
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Faulty", "--visibility-timeout", "2",
              *args)
    assert out.returncode == 0, out.stderr
    return backend_for(env)


def submit(backend, items, claim_size=1000):
    """A run staged and queued in-process, as `submit --no-wait` does (without a process start per run)."""
    queue = backend.queues.open_queue(calque_core.pool_queue_name("m"))
    return calque_runs.stage_run(backend, calque_core.load_pool(backend, "m"), items, claim_size, queue, "pool")["run_id"]


def finished(backend, runs, timeout):
    """{run id: its summaries} once every claim of `runs` ({run id: claims}) has one."""
    def summaries():
        got = {run_id: calque_core.read_summaries(backend, run_id) for run_id in runs}
        return got if all(len(got[run_id]) == claims for run_id, claims in runs.items()) else None
    return wait_for(summaries, timeout, "every claim's summary")


def results(backend, run_id, summaries):
    """The run's result lines, parsed, read from its claims' parts."""
    return [json.loads(line) for s in summaries
            for line in calque_core.read_claim_results(backend.store, run_id, s["claim"], s["items"])]


def dead_letters(backend):
    return backend.queues.open_queue("calque-dlq-m").counts()["visible"]


def logs(env, name):
    """The text of the pool's logs whose file names start with `name` (worker, supervisor)."""
    folder = os.path.join(env["CALQUE_STATE"], "pools", "m")
    return "".join(open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)) if f.startswith(name))


def delete_pool(env):
    """Once every claim is acked: a worker killed between a summary and its ack (acks wait up to a second to go
    ten to a request) leaves that claim in flight until its visibility timeout (2 s) hands it to a live worker,
    whose duplicate check finds the summary and acks it without running it. Then `pool delete` needs no --force."""
    queue = backend_for(env).queues.open_queue(calque_core.pool_queue_name("m"))
    wait_for(lambda: not any(queue.counts().values()), 30, "every claim acked")
    out = cli(env, "pool", "delete", "--model", "m", "--yes")
    assert out.returncode == 0, out.stderr


def test_poison_items_are_quarantined_and_their_claims_complete(any_env, tmp_path):
    """1,000 items with one os._exit(3) item, and two claims with a kill -9 and a segfault item: every other item
    comes back ok, each poison item failed as poison, nothing is dead-lettered."""
    env = dict(any_env, CALQUE_CHECKPOINT_SECONDS="0", CALQUE_CHECKPOINT_BATCHES="4")
    backend = start_pool(env, "--workers", "4", "--batch-size", "32")
    big, small = [{"x": i} for i in range(1000)], [{"x": i} for i in range(20)]
    big[900]["die"], small[3]["die"], small[15]["die"] = "exit", "kill", "segv"
    big_run, small_run = submit(backend, big), submit(backend, small, 10)
    done = finished(backend, {big_run: 1, small_run: 2}, 120)
    for run_id, poison in ((big_run, [900]), (small_run, [3, 15])):
        lines = results(backend, run_id, done[run_id])
        assert [line["i"] for line in lines] == list(range(len(lines)))
        assert [line["i"] for line in lines if not line["ok"]] == poison
        assert all(line["result"] == {"y": 2 * line["i"]} for line in lines if line["ok"])
        for i in poison:
            assert lines[i]["error"].startswith("poison: the worker died running this item (2 deaths; "), lines[i]
    big_summary = done[big_run][0]
    assert big_summary["ok"] == 999 and big_summary["failed"] == [900] and big_summary["status"] == "partial"
    assert big_summary["resumed"] >= 896             # the parts written before the first death were kept
    assert [s["failed"] for s in done[small_run]] == [[3], [15]]
    assert dead_letters(backend) == 0
    delete_pool(env)


def test_under_churn_a_death_of_the_workers_own_doing_still_quarantines_at_two(local_env, tmp_path):
    """With the pool marked as churning (a churn marker planted), an item that exits, segfaults its
    worker or os.kill's it with -9 is quarantined at 2 deaths, by the exit status its supervisor
    recorded or the last word warmd wrote before the kill; one that sends itself SIGKILL through
    libc, as native code would, looks like a kill from outside and takes the raised bar, 3 deaths."""
    backend = start_pool(local_env, "--workers", "3", "--batch-size", "4")
    backend.store.put(f"{calque_core.worker_stats_prefix('m')}churn-{time.time():012.1f}-planted", b"")
    items = [{"x": i} for i in range(16)]
    for i, kind in ((1, "exit"), (5, "segv"), (9, "kill"), (13, "libc-kill")):
        items[i]["die"] = kind
    run_id = submit(backend, items, 4)
    done = finished(backend, {run_id: 4}, 120)[run_id]
    errors = {i: e for s in done for i, e in s["errors"].items()}
    poison = "poison: the worker died running this item"
    assert errors["1"].startswith(f"{poison} (2 deaths; exit status 3)"), errors
    assert errors["5"].startswith(f"{poison} (2 deaths; killed by SIGSEGV)"), errors
    assert errors["9"].startswith(f"{poison} (2 deaths; killed itself with SIGKILL (os.kill in handler code))"), errors
    assert errors["13"].startswith(f"{poison} (3 deaths; killed by SIGKILL)"), errors
    assert sorted(i for s in done for i in s["failed"]) == [1, 5, 9, 13] and dead_letters(backend) == 0
    delete_pool(local_env)


def test_a_worker_killed_mid_claim_is_resumed_from_its_machines_spool(local_env, tmp_path):
    """A worker killed -9 halfway through a claim that has written no part yet (the checkpoint rule's 30 s are
    not up): the redelivery here takes what it computed from the spool on this machine's disk, so only the
    batch in flight is computed twice, only the two batches the death could be in run one item at a time, and the
    spool file is gone once the claim is done."""
    calls = str(tmp_path / "calls")
    env = dict(local_env, CALLS_FILE=calls)
    backend = start_pool(env, "--workers", "1", "--batch-size", "4")
    run_id = submit(backend, [{"x": i, "spin": 20000} for i in range(200)])
    count = lambda: sum(1 for _ in open(calls)) if os.path.exists(calls) else 0   # noqa: E731
    wait_for(lambda: count() >= 100, 60, "half the claim computed")
    os.kill(pool_pids(env)[1][0], signal.SIGKILL)
    killed_at = count()
    summary = finished(backend, {run_id: 1}, 60)[run_id][0]
    assert summary["receive_count"] == 2 and summary["ok"] == 200
    assert summary["resumed"] >= killed_at - 4                  # all but the batch in flight at the kill
    assert count() <= 200 + 4                                   # that batch alone was computed twice
    assert [line["result"] for line in results(backend, run_id, [summary])] == [{"y": 2 * i} for i in range(200)]
    assert "this machine's spool" in logs(env, "worker")
    assert os.listdir(os.path.join(env["CALQUE_STATE"], "pools", "m", "spool")) == []
    # only the batch it ran and the one it gathered went one at a time, then batches again
    assert re.search(r"offsets (\d+)-(\d+) one at a time, the rest in batches", logs(env, "worker"))
    assert json.loads(backend.store.get(calque_core.attempt_key(run_id, "c00000")))["state"] == "batches"
    delete_pool(env)


def test_the_spool_gives_back_the_longest_whole_run_of_lines_and_where_each_writer_got_to(tmp_path):
    """Spool.left across dead deliveries' files: the longest run of result lines from the offset asked, up to a
    gap, a line not ours or a torn tail (a UTF-8 character cut mid-write); their failures; where each writer got
    to, a claim whose results hold arrays included (it spools how far, not its lines); every file removed."""
    import warmd
    claim = types.SimpleNamespace(run_id="r1", claim_id="c00000")
    line = lambda i, ok=True: json.dumps({"i": i, "ok": True, "result": {"y": i}} if ok else   # noqa: E731
                                         {"i": i, "ok": False, "error": "E"}) + "\n"
    (tmp_path / "r1.c00000.11").write_text('{"from": 3}\n' + "".join(line(i) for i in (3, 4, 6)))
    (tmp_path / "r1.c00000.12").write_bytes(('{"from": 4}\n' + "".join([line(4), line(5, ok=False), line(6), line(7)])
                                             + '{"i": 8, "ok": true, "result": "\u00e9').encode()[:-1])
    (tmp_path / "r1.c00000.13").write_text('{"from": 6}\n' + line(6))          # began past offset 5: not its turn
    text, failed, errors, reached = warmd.Spool(str(tmp_path), claim).left(5)
    assert [json.loads(t)["i"] for t in text.splitlines()] == [5, 6, 7]
    assert failed == [5] and errors == {"5": "E"} and reached == {"11": 5, "12": 8}
    typed = calque_core.TypedLines(line(0))
    typed.cells = [(0, "y", None, "float32")]
    spool = warmd.Spool(str(tmp_path), claim)
    spool.add(0, 1, [typed])
    spool.add(1, 2, [line(1)])
    assert open(spool.path).read() == '{"from":0}\n{"reach":1}\n{"reach":2}\n'
    assert warmd.Spool(str(tmp_path), claim).left(0) == ("", [], {}, {str(os.getpid()): 2})
    assert os.listdir(tmp_path) == []
    spool.close()


def test_a_hung_item_times_out_and_the_pool_keeps_serving(local_env, tmp_path):
    """A batch that never returns: the worker commits what is done, releases the claim and exits 3; the hung item
    alone is quarantined as timed out, the rest of its batch and claim complete, and the next run is served."""
    env = dict(local_env, CALQUE_BATCH_TIMEOUT="1")
    backend = start_pool(env, "--workers", "1", "--batch-size", "4")
    items = [{"x": i} for i in range(8)]
    items[5]["hang"] = True
    hung = submit(backend, items)
    summary = finished(backend, {hung: 1}, 60)[hung][0]
    assert summary["failed"] == [5] and summary["ok"] == 7
    assert summary["errors"]["5"].startswith("timed out after 1 s (the pool's batch_timeout)")
    assert summary["resumed"] >= 4                   # batch [0, 4) was committed before the first exit
    assert [line["ok"] for line in results(backend, hung, [summary])] == [True] * 5 + [False] + [True] * 2
    assert logs(env, "supervisor").count("exited with 3") == 2      # the suspect batch, then the suspect item
    after = submit(backend, [{"x": 1}, {"x": 2}])
    assert finished(backend, {after: 1}, 30)[after][0]["status"] == "ok"
    delete_pool(env)


def test_a_store_refusing_writes_costs_a_pause_not_a_delivery(any_env, tmp_path):
    """The store refuses writes for a few seconds while claims drain (local: the run's results and summaries
    folders cannot be made; S3: 403 AccessDenied from a proxy): the writes are retried, no claim is redelivered
    or dead-lettered, every item is written exactly once."""
    proxy = FaultProxy(any_env["AWS_ENDPOINT_URL"]) if any_env["CALQUE_STORE"].startswith("s3://") else None
    env = dict(any_env, AWS_ENDPOINT_URL=proxy.url) if proxy else any_env
    backend = start_pool(env, "--batch-size", "2", "--workers", "0")   # none may write before the store refuses
    run_id = submit(backend, [{"x": i} for i in range(20)], 5)
    blocked = [os.path.join(env["CALQUE_STORE"], "runs", run_id, folder) for folder in ("results", "summaries")]
    if proxy:
        proxy.failing.set()
    else:
        for path in blocked:       # a file where the folder should be: every write under it fails
            open(path, "w").close()
    assert cli(env, "pool", "scale", "--model", "m", "--workers", "2").returncode == 0
    wait_for(lambda: logs(env, "worker").count("store write of") >= 6, 60, "writes refused and retried for seconds")
    if proxy:
        proxy.failing.clear()
    else:
        for path in blocked:
            os.remove(path)
    summaries = finished(backend, {run_id: 4}, 60)[run_id]
    assert all(s["status"] == "ok" and s["receive_count"] == 1 for s in summaries)
    assert [(line["i"], line["result"]["y"]) for line in results(backend, run_id, summaries)] == \
        [(i, 2 * i) for i in range(20)]
    assert dead_letters(backend) == 0
    delete_pool(env)
    if proxy:
        assert proxy.refused >= 6
        proxy.close()


def test_chaos_kill_9_of_workers_and_of_the_supervisor(any_env, tmp_path):
    """Random kill -9 of workers, and once of the pool supervisor (restarted by pool scale), over many small runs
    arriving one per kill: every item has exactly one result, a correct one, and no claim is dead-lettered."""
    calls = tmp_path / "calls"
    env = dict(any_env, CALQUE_CHECKPOINT_SECONDS="0", CALQUE_CHECKPOINT_BATCHES="2", CALLS_FILE=str(calls))
    backend = start_pool(env, "--workers", "3", "--batch-size", "2")
    seed = random.randrange(2 ** 32)
    rng, stop, kills = random.Random(seed), threading.Event(), []

    def chaos():
        while not stop.wait(rng.uniform(0.2, 0.6)) and len(kills) < KILLS:
            supervisor, workers = pool_pids(env)
            if len(kills) == KILLS // 2 and supervisor:
                os.kill(supervisor, signal.SIGKILL)      # its workers leave at their next poll
                kills.append("supervisor")
                assert cli(env, "pool", "scale", "--model", "m", "--workers", "3").returncode == 0
            elif workers:
                victim = rng.choice(workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)

    runs = {}
    thread = threading.Thread(target=chaos, daemon=True)
    try:
        for r in range(KILLS):
            runs[submit(backend, [{"x": 100 * r + i, "spin": 20000} for i in range(30)], 15)] = 2
            if r == 0:       # the chaos starts once the pool serves
                wait_for(calls.exists, 60, "the first claim to start")
                thread.start()
            wait_for(lambda: len(kills) > r or not thread.is_alive(), 60, f"kill {r + 1}")
        done = finished(backend, runs, 120)
    finally:
        stop.set()
        thread.join()
    assert kills.count("supervisor") == 1 and len(kills) == KILLS, kills
    for r, (run_id, summaries) in enumerate(done.items()):
        lines = results(backend, run_id, summaries)
        assert [(line["i"], line.get("result")) for line in lines] == \
            [(i, {"y": 2 * (100 * r + i)}) for i in range(30)], f"seed {seed}, kills {kills}: {lines}"
    assert dead_letters(backend) == 0, f"seed {seed}"
    delete_pool(env)


def test_churn_every_run_done_nothing_lost_no_good_item_quarantined(tmp_path):
    """A kill -9 of a random worker of a 3-worker pool every 0.5-1.5 s while 6 runs drain (the short version of
    bench/bench_churn.py): every run is done, every item has one right result, none fails as poison, nothing is
    dead-lettered; a worker that died after progress was restarted at once."""
    seed = random.randrange(2 ** 32)
    got = churn.churn(str(tmp_path), 6, (0.5, 1.5), seed, sizes=(200, 400), claims=(5, 20), spin=40000,
                      timeout=120)   # ~10 s of work here: kills enough to test, on a faster machine too
    assert got["runs_done"] == 6 and got["ok"] == got["items"], (seed, got)
    assert got["lost"] == got["wrong"] == got["failed"] == got["dead_letters"] == 0, (seed, got)
    assert got["kills"] >= 3 and got["restarts"].get("died after progress"), (seed, got)
