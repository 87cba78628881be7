"""A run's life after submit, with real CLI processes: interrupted and resumed, cancelled, dead-lettered and
redriven, its pool deleted under a waiting submit; results read from their parts; the one-line refusals."""
import json
import os
import signal
import subprocess
import time
from collections import Counter

import pytest

import calque
import calque_core
from conftest import HANDLERS, PY, ROOT, FaultProxy, backend_for, cli, start_worker, wait_for, write_items


def create_pool(env, *extra, handler="Echo"):
    # no local worker unless asked (pool create starts 1 by default)
    extra = extra if "--workers" in extra else (*extra, "--workers", "0")
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:{handler}", *extra)
    assert out.returncode == 0, out.stderr


def submit_waiting(env, items, *extra):
    """A `submit --pool m` that waits for its run, as a background process."""
    return subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "m", items, "--wait-for-workers",
                             *extra], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def only_run(env):
    runs = json.loads(cli(env, "runs", "list", "--json").stdout)
    assert len(runs) == 1
    return runs[0]["run_id"]


def said(out, code, stdout=None, stderr=None):
    """A finished CLI process's exit code and, where given, exactly what it printed."""
    assert out.returncode == code, (out.stdout, out.stderr)
    assert stdout is None or out.stdout == stdout, out.stdout
    assert stderr is None or out.stderr == stderr, out.stderr


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def totals(run_id, state, ok=0, failed=0, pending=0, dead=0, cancelled=0, mode="pool"):
    """The first line of a run's report."""
    return (f"run {run_id} ({mode}, model m): {ok} items ok, {failed} failed, {pending} pending, {dead} dead-lettered, "
            f"{cancelled} cancelled (of {ok + failed + pending + dead + cancelled} items); state: {state}")


def test_interrupted_submit_then_resume_runs_every_item_once(local_env, tmp_path):
    """SIGINT once the first claim is queued: exit 130, the line says how many were queued and how to resume;
    runs show tells queued from never sent; runs resume sends the rest and every item comes back exactly once."""
    create_pool(local_env)
    queue = backend_for(local_env).queues.open_queue("calque-pool-m")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(1000)])
    proc = submit_waiting(local_env, items, "--claim-size", "1")
    while not queue.counts()["visible"]:   # ~0.1 ms a send: the signal lands ~20x inside the 1,000 (measured)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    run_id = only_run(local_env)
    sent = calque_core.read_run(backend_for(local_env), run_id)["sent"]
    queued = queue.counts()
    assert proc.returncode == 130 and 0 < sent < 1000, (proc.returncode, sent, err)
    assert queued["visible"] == sent
    assert err == (f"calque: interrupted: run {run_id}: {sent} of 1000 claim(s) queued (they finish without you), "
                   f"{1000 - sent} not sent ---> HINT: python calque.py runs resume {run_id}\n")
    show = cli(local_env, "runs", "show", run_id)
    lines = show.stdout.splitlines()
    assert show.returncode == 1
    assert lines[:2] == [totals(run_id, "interrupted", pending=1000), f"  claims: {sent} queued or running (calque-pool-m: "
                         f"{queued['visible']} visible, 0 in flight), {1000 - sent} not queued"]
    assert lines[-2:] == [f"  not finished: {sent} claim(s) still pending; the run goes on ---> HINT: wait, or read "
                          f"it later: python calque.py runs show {run_id}",
                          f"  not finished: {1000 - sent} claim(s) were never sent: nothing will run them ---> HINT: "
                          f"python calque.py runs resume {run_id} (or runs cancel {run_id})"]
    assert cli(local_env, "pool", "scale", "--model", "m", "--workers", "1").returncode == 0
    resume = cli(local_env, "runs", "resume", run_id, "--timeout", "120")
    assert resume.returncode == 0, resume.stderr
    assert f"run {run_id}: {1000 - sent} claim(s) not sent before now sent to calque-pool-m\n" in resume.stderr
    assert resume.stdout.splitlines()[:2] == [totals(run_id, "done", ok=1000), "  claims: 1000 done"]
    results = cli(local_env, "runs", "results", run_id)
    said(results, 0, stderr="")
    assert [(r["i"], r["result"]["y"]) for r in map(json.loads, results.stdout.splitlines())] == \
        [(i, 2 * i) for i in range(1000)]
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0   # nothing left queued


def test_interrupted_while_waiting_names_the_run_and_loses_nothing(local_env, tmp_path):
    """SIGINT once every claim is queued and submit waits (a pool of no worker): exit 130, one line naming the run
    and how to follow it; the claims stay queued. The same for runs resume waiting (it said only "interrupted")."""
    create_pool(local_env)
    queue = backend_for(local_env).queues.open_queue("calque-pool-m")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(6)])
    proc = submit_waiting(local_env, items, "--claim-size", "2")
    assert " claim(s) of 6 items sent to " in proc.stderr.readline()   # every claim queued: submit waits now
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    run_id = only_run(local_env)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.splitlines()[-1] == (f"calque: interrupted while waiting: run {run_id}: its claims are queued and "
                                    f"finish without you ---> HINT: python calque.py runs show {run_id}")
    assert queue.counts() == {"visible": 3, "in_flight": 0}
    resume = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "runs", "resume", run_id], env=local_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "now sent to" in resume.stderr.readline()   # nothing to send: runs resume waits now
    resume.send_signal(signal.SIGINT)
    out, err = resume.communicate(timeout=60)
    assert resume.returncode == 130 and err.splitlines()[-1].startswith(
        f"calque: interrupted while waiting: run {run_id}: its claims are queued"), (resume.returncode, err)
    assert queue.counts() == {"visible": 3, "in_flight": 0}


def test_cancel_marks_unfinished_claims_and_workers_ack_them_unrun(local_env, tmp_path):
    """runs cancel while a worker is mid-claim: that claim keeps its real summary, the two others are cancelled
    and acked unrun; runs show counts 10 ok + 15 cancelled = 25 items, exit 1; resume is refused."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    create_pool(env, handler="Gate")
    worker = start_worker(env, "--model", "m")
    out = cli(env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(25)]),
              "--claim-size", "10", "--no-wait")
    run_id = out.stdout.strip()
    wait_for(lambda: os.listdir(gate), 30, "the worker to start claim c00000")
    cancel = cli(env, "runs", "cancel", run_id)
    said(cancel, 0, f"run {run_id}: cancelled: 3 claim(s) without a summary will not run\n")
    (gate / "open").touch()
    queue = backend_for(env).queues.open_queue("calque-pool-m")
    wait_for(lambda: queue.counts() == {"visible": 0, "in_flight": 0}, 30, "the worker to ack every claim")
    stop(worker)
    stats = calque_core.read_worker_stats(backend_for(env), "m")[0]
    assert (stats["claims"], stats["items"]) == (1, 10)      # c00001 and c00002 acked without running
    show = cli(env, "runs", "show", run_id)
    lines = show.stdout.splitlines()
    assert show.returncode == 1
    assert lines[:2] == [totals(run_id, "cancelled", ok=10, cancelled=15), "  claims: 1 done, 2 cancelled"]
    assert lines[5].split() == ["c00001"] + ["-"] * 6 + "cancelled (through c00002: 2 claims)".split()
    assert lines[-1] == ("  not finished: 2 claim(s) were cancelled (runs cancel): nothing will run them ---> HINT: "
                         "submit those items again")
    view = json.loads(cli(env, "runs", "show", run_id, "--json").stdout)
    assert view["items"] == {"ok": 10, "failed": 0, "pending": 0, "dead_lettered": 0, "cancelled": 15}
    assert not view["complete"] and view["claim_counts"]["cancelled"] == 2
    again = cli(env, "runs", "cancel", run_id)
    said(again, 0, f"run {run_id}: already cancelled (runs cancel): nothing left to cancel\n")
    said(cli(env, "runs", "resume", run_id), 2, "", f"calque: error: run {run_id} was cancelled (runs cancel): "
                                                    f"nothing to resume ---> HINT: submit its items again\n")


def test_dead_letters_are_reported_then_redriven(aws_env, tmp_path):
    """On SQS + S3 (moto_server): two claims dead-lettered, one with its failure summary and one whose summary
    write failed (its DLQ copy is all there is): the waiting submit stops and reports both, runs show too
    (the DLQ copies stay); pool redrive sends both back marked resume and the run completes; runs redrive
    then finds nothing."""
    create_pool(aws_env)
    backend = backend_for(aws_env)
    queue, dlq = (backend.queues.open_queue(name) for name in ("calque-pool-m", "calque-dlq-m"))
    proc = submit_waiting(aws_env, write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(20)]),
                          "--claim-size", "10", "--timeout", "120")
    wait_for(lambda: queue.counts()["visible"] == 2, 30, "both claims queued")
    reason = "delivered 4 times, more than the pool's max deliveries 3"
    claims = {}
    for with_summary in (True, False):   # what a worker's dead_letter() leaves, its summary write failing once
        message = queue.receive(1)
        msg = json.loads(message.body)
        claims[with_summary] = msg["claim"]
        if with_summary:
            calque_core.write_json(backend, calque_core.summary_key(msg["run_id"], msg["claim"]), calque_core.claim_summary(
                run_id=msg["run_id"], claim=msg["claim"], model="m", worker_id="gone-1", mode="pool", backend="aws",
                receive_count=4, enter_count=1, started=0.0, finished=0.0, requests={}, error=reason))
        dlq.send(json.dumps({"reason": reason, "body": message.body, "receive_count": 4, "worker_id": "gone-1",
                             "at": calque_core.now_iso()}))
        queue.delete(message)
    summarised, bare = claims[True], claims[False]
    out, _ = proc.communicate(timeout=120)
    run_id = msg["run_id"]
    expected = [f"  claim {summarised} dead-lettered: {reason}",
                f"  claim {bare} dead-lettered: {reason} (its copy in the dead-letter queue; no summary)"]
    hint = (f"  not finished: 2 claim(s) were dead-lettered: nothing will run them ---> HINT: python calque.py runs "
            f"redrive {run_id}")
    assert proc.returncode == 1
    lines = out.splitlines()
    assert lines[:2] == [totals(run_id, "dead-lettered", dead=20), "  claims: 2 dead-lettered"]
    assert sorted(expected) == sorted(lines[5:7]) and hint in lines, out
    show = cli(aws_env, "runs", "show", run_id)
    assert show.returncode == 1 and show.stdout.splitlines()[0] == totals(run_id, "dead-lettered", dead=20)
    assert show.stdout.splitlines()[-1] == hint
    assert dlq.counts() == {"visible": 2, "in_flight": 0}      # looked at, left in place
    said(cli(aws_env, "runs", "results", run_id), 1, "", f"calque: error: run {run_id}: no results for 2 claim(s) "
         f"dead-lettered (c00000..c00001) ---> HINT: python calque.py runs redrive {run_id}\n")
    said(cli(aws_env, "pool", "redrive", "--model", "m"), 0,
         f"run {run_id}: 2 dead-lettered claim(s) sent back to calque-pool-m (c00000..c00001)\n")
    assert dlq.counts() == {"visible": 0, "in_flight": 0}
    assert not backend.store.exists(calque_core.summary_key(run_id, summarised))   # else a worker would ack it unrun
    sent_back = [queue.receive(1) for _ in range(2)]
    assert sorted((json.loads(m.body)["claim"], json.loads(m.body)["resume"]) for m in sent_back) == \
        [("c00000", True), ("c00001", True)]
    for message in sent_back:
        queue.change_visibility(message, 0)
    worker = start_worker(aws_env, "--model", "m")
    wait_for(lambda: len(calque_core.summary_claims(backend, run_id)) == 2, 60, "the redriven claims' summaries")
    stop(worker)
    assert cli(aws_env, "runs", "show", run_id).stdout.splitlines()[:2] == [totals(run_id, "done", ok=20), "  claims: 2 done"]
    [listed] = json.loads(cli(aws_env, "runs", "list", "--json").stdout)   # its summaries read from S3
    assert (listed["state"], listed["ok"], listed["failed"]) == ("done", 20, 0)
    results = cli(aws_env, "runs", "results", run_id)
    assert [r["i"] for r in map(json.loads, results.stdout.splitlines())] == list(range(20))
    said(cli(aws_env, "runs", "redrive", run_id), 0, f"run {run_id}: no dead-lettered claim: nothing to redrive\n")


def test_pool_delete_force_stops_a_waiting_submit(local_env, tmp_path):
    """pool delete --force under a waiting submit: the run is cancelled "pool deleted", and submit stops with
    that reason, exit 1, instead of waiting out its timeout."""
    create_pool(local_env)
    queue = backend_for(local_env).queues.open_queue("calque-pool-m")
    proc = submit_waiting(local_env, write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(5)]),
                          "--timeout", "600")
    wait_for(lambda: queue.counts()["visible"] == 1, 30, "the claim queued")
    run_id = only_run(local_env)
    delete = cli(local_env, "pool", "delete", "--model", "m", "--yes", "--force")
    assert delete.returncode == 0, delete.stderr
    assert f"pool m: run {run_id} cancelled: 1 claim(s) without a summary will not run" in delete.stdout.splitlines()
    out, _ = proc.communicate(timeout=60)
    lines = out.splitlines()
    assert proc.returncode == 1
    assert lines[:2] == [totals(run_id, "cancelled", cancelled=5), "  claims: 1 cancelled"]
    assert ("  not finished: 1 claim(s) were cancelled (pool deleted): nothing will run them ---> HINT: submit those "
            "items again") in lines


def test_runs_results_reads_parts_and_refuses_a_truncated_one(local_env, tmp_path):
    """runs results joins a claim's parts in item order; a truncated or missing part is one error line naming
    the claim and the part, exit 1, and only whole claims reach stdout."""
    create_pool(local_env)
    out = cli(local_env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(12)]),
              "--claim-size", "6", "--no-wait")
    run_id = out.stdout.strip()
    backend = backend_for(local_env)

    def finish(claim, first, parts):
        """What a worker leaves of a claim of 6 items from `first`: parts {(start, stop): lines}, then the summary."""
        for (start, stop), count in parts.items():
            backend.store.put(calque_core.part_key(run_id, claim, start, stop), "".join(
                json.dumps({"i": first + k, "ok": True, "result": {"y": 2 * (first + k)}}) + "\n"
                for k in range(start, start + count)))
        calque_core.write_json(backend, calque_core.summary_key(run_id, claim), calque_core.claim_summary(
            run_id=run_id, claim=claim, model="m", worker_id="w-1", mode="pool", backend="local", receive_count=1,
            enter_count=1, started=0.0, finished=1.0, requests={}, items=6))

    finish("c00000", 0, {(0, 4): 4, (2, 6): 4})           # overlapping parts (a lease lost mid-claim)
    finish("c00001", 6, {(0, 3): 3, (3, 6): 2})           # the second part lost its last line
    part = f"runs/{run_id}/results/c00001/0000003-0000006.jsonl"
    results = cli(local_env, "runs", "results", run_id)
    said(results, 1, stderr=f"calque: error: run {run_id} claim c00001: part {part} is truncated (2 of 3 lines) "
                            f"---> HINT: the store lost these results: submit the claim's items again\n")
    assert [json.loads(line)["i"] for line in results.stdout.splitlines()] == list(range(6))
    os.remove(os.path.join(local_env["CALQUE_STORE"], part))
    said(cli(local_env, "runs", "results", run_id), 1, stderr=f"calque: error: run {run_id} claim c00001: no result "
         f"part holds item offset 3 of 6 ---> HINT: the store lost these results: submit the claim's items again\n")
    finish("c00001", 6, {(3, 6): 3})
    results = cli(local_env, "runs", "results", run_id)
    said(results, 0, stderr="")
    assert [(r["i"], r["result"]["y"]) for r in map(json.loads, results.stdout.splitlines())] == \
        [(i, 2 * i) for i in range(12)]


def test_results_to_a_file_say_what_they_wrote_and_runs_list_has_a_header(local_env, tmp_path):
    """runs results --output, in every format (the installed `calque` spelling), writes the file and says on
    stderr what it wrote: rows, bytes, path; --failed writes 0 rows of an all-ok run. A field no result has is
    one line naming the fields there are (exit 2, no file left), and the same UserError from Run.to_numpy.
    runs list starts with a header line, and says so when there is no run."""
    import numpy as np
    import pyarrow.parquet as pq
    installed = os.path.join(os.path.dirname(PY), "calque")
    said(cli(local_env, "runs", "list"), 0, "no runs in this store\n")
    create_pool(local_env, "--workers", "1")
    out = cli(local_env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(5)]),
              "--claim-size", "2")
    run_id = out.stdout.split()[1]
    for fmt, extra, rows in (("jsonl", (), 5), ("parquet", (), 5), ("npy", ("--field", "y"), 5),
                             ("jsonl", ("--failed",), 0)):
        path = tmp_path / f"out.{fmt}"
        out = subprocess.run([installed, "runs", "results", run_id, "--format", fmt, *extra, "--output", str(path)],
                             env=local_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        said(out, 0, "", f"runs results: wrote {rows} rows, {path.stat().st_size:,} bytes, to {path}\n")
    assert pq.read_table(tmp_path / "out.parquet")["y"].to_pylist() == np.load(tmp_path / "out.npy").tolist() == \
        [0, 2, 4, 6, 8]
    assert (tmp_path / "out.jsonl").read_text() == ""
    out = cli(local_env, "runs", "results", run_id, "--format", "npy", "--field", "embedding", "--output",
              str(tmp_path / "e.npy"))
    said(out, 2, "")
    assert out.stderr.startswith(f"calque: error: run {run_id}: no result has the field 'embedding': its results "
                                 f"have 'y', 'pid' ---> HINT: to_numpy('y'), or ") and len(out.stderr.splitlines()) == 1
    assert not (tmp_path / "e.npy").exists()
    run = calque.Run(run_id, store=local_env["CALQUE_STORE"])
    with pytest.raises(calque.UserError, match="no result has the field 'embedding': its results have 'y', 'pid'"):
        run.to_numpy("embedding")
    assert run.to_numpy("y").tolist() == [0, 2, 4, 6, 8]
    header, line = cli(local_env, "runs", "list").stdout.splitlines()
    assert header.split() == ["run", "mode", "model", "items", "claims", "ok", "failed", "state", "created"]
    assert line.split()[:8] == [run_id, "pool", "m", "5", "3", "5", "0", "done"]
    assert header.index("items") + 5 == line.index(" 5 ") + 2   # right-aligned under its header
    said(cli(local_env, "runs", "list", "--model", "other"), 0, "no runs of model other in this store\n")
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_timeouts_and_batch_timeouts_that_are_not_numbers_are_refused(local_env, tmp_path):
    """--timeout nan / inf / -1 (or CALQUE_TIMEOUT=nan): one line, exit 2, nothing staged; pool create
    --batch-timeout is kept in the pool record, and a bad one is refused the same way."""
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}])
    hint = "---> HINT: e.g. --timeout 600 (CALQUE_TIMEOUT sets the default)"
    for value, shown in (("nan", "nan"), ("inf", "inf"), ("-1", "-1.0")):
        said(cli(local_env, "submit", "--pool", "m", items, "--timeout", value), 2, "",
             f"calque: error: --timeout {shown}: not a number of seconds, 0 or more {hint}\n")
    out = cli(dict(local_env, CALQUE_TIMEOUT="nan"), "runs", "resume", "m.20261129-000000-abcdef")
    said(out, 2, "", f"calque: error: --timeout nan: not a number of seconds, 0 or more {hint}\n")
    assert cli(local_env, "runs", "list", "--json").stdout.strip() == "[]"
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--batch-timeout", "nan")
    said(out, 2, "", "calque: error: --batch-timeout nan: must be a number of seconds above 0\n")
    create_pool(local_env, "--batch-timeout", "30")
    assert calque_core.load_pool(backend_for(local_env), "m")["batch_timeout"] == 30.0


def test_a_waiting_submit_reads_each_summary_once(aws_env, tmp_path):
    """On SQS + S3 (moto_server), through a loopback proxy that sees the submitter's requests: it GETs each
    claim's summary once (its report is made of what its wait read), and the report adds up."""
    proxy = FaultProxy(aws_env["AWS_ENDPOINT_URL"])
    try:
        create_pool(aws_env)
        start_worker(aws_env, "--model", "m")   # straight to moto_server: only the submitter's requests are seen
        out = cli(dict(aws_env, AWS_ENDPOINT_URL=proxy.url), "submit", "--pool", "m", "--wait-for-workers",
                  write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(12)]), "--claim-size", "3", "--json")
    finally:
        proxy.close()
    said(out, 0)
    report = json.loads(out.stdout)
    assert report["items"] == {"ok": 12, "failed": 0, "pending": 0, "dead_lettered": 0, "cancelled": 0}
    assert [s["claim"] for s in report["summaries"]] == report["run"]["claims"] == [f"c0000{i}" for i in range(4)]
    gets = Counter(e["path"].rsplit("/", 1)[1] for e in proxy.seen if e["method"] == "GET" and "/summaries/" in e["path"])
    assert gets == {f"c0000{i}.json": 1 for i in range(4)}


def test_interrupted_elsewhere_says_what_to_do_without_claiming_a_run(local_env, monkeypatch, capsys):
    """Ctrl-C outside the steps that say what they left (before a run is staged, in a pool verb): exit 130 and one
    line that claims no run, pointing at `runs list`."""
    monkeypatch.setattr(os, "environ", dict(local_env))

    def interrupted(store):
        raise KeyboardInterrupt
    monkeypatch.setattr(calque, "open_backend", interrupted)
    assert calque.main(["pool", "list"]) == 130
    assert capsys.readouterr().err == ("calque: interrupted ---> HINT: run the command again; `python calque.py runs "
                                       "list` shows the runs already queued\n")


def test_delete_and_prune_runs(any_env, tmp_path):
    """runs list --model lists one model's runs; runs prune deletes the runs older than the age but each model's
    --keep newest, skipping (and naming) a run with claims queued; runs delete refuses that run unless --force; both say what they freed, and the store keeps
    nothing of a deleted run (S3: DeleteObjects)."""
    env = any_env
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(6)])
    cold = []
    for _ in range(2):
        out = cli(env, "submit", "--model", "c", "--handler", f"{HANDLERS}:Echo", items, "--claim-size", "2")
        assert out.returncode == 0, out.stderr
        cold.append(out.stdout.split()[1])
    create_pool(env)
    live = cli(env, "submit", "--pool", "m", items, "--no-wait", "--claim-size", "2").stdout.strip()
    backend = backend_for(env)
    assert backend.store.list(f"runs/{cold[0]}/")
    listed = {model: [r["run_id"] for r in json.loads(cli(env, "runs", "list", "--model", model, "--json").stdout)]
              for model in ("c", "m")}
    assert listed == {"c": cold, "m": [live]}, "runs list --model lists that model's runs, oldest first"
    assert cli(env, "runs", "prune", "--older-than", "7d").stdout == "freed 0 B in 0 object(s) of 0 run(s)\n"
    out = cli(env, "runs", "prune", "--older-than", "0s", "--keep", "1", "--model", "c")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"run {cold[0]}: deleted (") and cold[1] not in out.stdout and live not in out.stdout
    assert out.stdout.splitlines()[-1].startswith("freed ") and out.stdout.endswith(" of 1 run(s)\n")
    assert backend.store.list(f"runs/{cold[0]}/") == [] and backend.store.list(f"runs/{cold[1]}/")
    out = cli(env, "runs", "delete", cold[1], live)   # each is checked before any is deleted: nothing goes
    assert out.returncode == 2 and f"run {live} has 3 claim(s) queued or running" in out.stderr, out.stderr
    assert backend.store.list(f"runs/{cold[1]}/")
    out = cli(env, "runs", "prune", "--older-than", "0s")
    assert out.returncode == 0, out.stderr
    assert f"run {cold[1]}: deleted (" in out.stdout and f"run {live}: kept: 3 claim(s) queued or running" in out.stdout
    out = cli(env, "runs", "delete", live, "--force")
    assert out.returncode == 0 and f"run {live}: deleted (" in out.stdout, out.stderr
    objects = int(out.stdout.splitlines()[-1].split(" in ")[1].split()[0])
    assert objects == 4, out.stdout   # its record and 3 manifests
    assert json.loads(cli(env, "runs", "list", "--json").stdout) == [] and backend.store.list("runs/") == []
    assert "---> HINT: a number and a unit" in cli(env, "runs", "prune", "--older-than", "week").stderr
    out = cli(env, "pool", "delete", "--model", "m", "--yes", "--force")
    assert "its runs remain in the store ---> HINT: python calque.py runs prune --model m" in out.stdout, out.stdout + out.stderr
