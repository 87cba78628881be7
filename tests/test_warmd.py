"""warmd.py's claim semantics, each in real worker processes on the embedded backend: crash redelivery,
duplicate delivery, the dead-letter queue, per-item failure, SIGTERM, and the spot-interruption poller."""
import ast
import http.server
import json
import os
import signal
import threading
import time

import pytest

import calque
import calque_core
import calque_runs
import calque_sources
from conftest import HANDLERS, backend_for, cli, start_worker, wait_for, write_items


def make_pool(env, handler, *extra):
    # no local worker unless asked (pool create starts 1 by default)
    extra = extra if "--workers" in extra else (*extra, "--workers", "0")
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:{handler}", *extra)
    assert out.returncode == 0, out.stderr
    return backend_for(env)


def submit_no_wait(env, tmp_path, items, *extra):
    out = cli(env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", items), "--no-wait", *extra)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def results(backend, run_id, count, claim="c00000"):
    """A claim's result lines, parsed, read from its parts."""
    return [json.loads(line) for line in calque_core.read_claim_results(backend.store, run_id, claim, count)]


def summary(backend, run_id, claim="c00000"):
    try:
        return calque_core.read_json(backend, calque_core.summary_key(run_id, claim))
    except calque.NotFound:
        return None


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


class Gated:
    """A pool of the Gate handler and one worker (logging to a file) provably in the middle of a claim:
    its first batch has started and holds until open() is called."""

    def __init__(self, local_env, tmp_path, items=({"x": 1},), pool_args=(), **settings):
        self.gate = tmp_path / "gate"
        self.gate.mkdir()
        self.env = dict(local_env, GATE_DIR=str(self.gate), **settings)
        self.backend = make_pool(self.env, "Gate", *pool_args)
        self.log = tmp_path / "worker.log"
        with open(self.log, "w") as f:
            self.worker = start_worker(self.env, "--model", "m", log=f)
        self.run_id = submit_no_wait(self.env, tmp_path, list(items))
        wait_for(lambda: os.listdir(self.gate), 30, "the claim to start")

    def logged(self, text, what):
        wait_for(lambda: text in self.log.read_text(), 30, what)

    def open(self):
        (self.gate / "open").touch()

    def queue(self):
        return self.backend.queues.open_queue("calque-pool-m")


def test_kill_9_mid_claim_is_redelivered_to_the_other_worker(local_env, tmp_path):
    """A worker SIGKILLed mid-claim: after the visibility timeout the other worker completes it, no item lost."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    backend = make_pool(env, "Gate", "--visibility-timeout", "2", "--batch-size", "3")
    a = start_worker(env, "--model", "m")
    run_id = submit_no_wait(env, tmp_path, [{"x": i} for i in range(6)])
    started = wait_for(lambda: os.listdir(gate), 30, "a worker to start the claim")
    victim = int(started[0].split("-")[1])
    b = start_worker(env, "--model", "m")     # the survivor, started once the claim is provably held by a
    assert victim == a.pid
    os.kill(victim, signal.SIGKILL)
    (gate / "open").touch()
    done = wait_for(lambda: summary(backend, run_id), 30, "the redelivered claim's summary")
    assert done["worker_id"].endswith(f"-{b.pid}") and done["receive_count"] == 2
    assert done["status"] == "ok" and done["ok"] == 6 and done["failed"] == []
    lines = results(backend, run_id, 6)
    assert [l["i"] for l in lines] == list(range(6)) and all(l["result"]["pid"] == b.pid for l in lines)
    assert stop(b) == 0
    a.wait()


def test_duplicate_delivery_is_acked_without_recompute(local_env, tmp_path):
    """A claim whose summary exists is acked and not run again (SQS delivers at least once)."""
    backend = make_pool(local_env, "Echo")
    w = start_worker(local_env, "--model", "m")
    run_id = submit_no_wait(local_env, tmp_path, [{"x": 1}, {"x": 2}])
    first = wait_for(lambda: summary(backend, run_id), 30, "the summary")
    results_before = results(backend, run_id, 2)
    queue = backend.queues.open_queue("calque-pool-m")
    queue.send(calque_core.make_message(run_id, "m", backend.store.uri(calque_core.manifest_key(run_id, "c00000")), "c00000"))
    wait_for(lambda: queue.counts() == {"visible": 0, "in_flight": 0}, 30, "the duplicate to be acked")
    assert stop(w) == 0
    assert summary(backend, run_id) == first
    assert results(backend, run_id, 2) == results_before
    stats = calque_core.read_worker_stats(backend, "m")[0]
    assert stats["claims"] == 1 and stats["enter_count"] == 1


def test_claims_that_cannot_succeed_go_to_the_dead_letter_queue(local_env, tmp_path):
    """Malformed body, wrong model, manifest outside the store, another model's run, missing manifest, too
    many deliveries: each lands in the DLQ, with a failure summary wherever the run is known; the worker stays up."""
    backend = make_pool(local_env, "Echo", "--max-deliveries", "2", "--visibility-timeout", "5")
    queue, dlq = backend.queues.open_queue("calque-pool-m"), backend.queues.open_queue("calque-dlq-m")
    uri = backend.store.uri(calque_core.manifest_key("m.r-missing", "c00000"))
    queue.send("{not json")
    queue.send(calque_core.make_message("other-model.r1", "other-model",
                                   backend.store.uri(calque_core.manifest_key("other-model.r1", "c00000")), "c00000"))
    queue.send(calque_core.make_message("m.r-outside", "m", "file:///etc/passwd", "c00000"))
    queue.send(calque_core.make_message("n.r-foreign", "m", backend.store.uri(calque_core.manifest_key("n.r-foreign", "c00000")), "c00000"))
    queue.send(calque_core.make_message("m.r-missing", "m", uri, "c00000"))
    w = start_worker(local_env, "--model", "m")
    wait_for(lambda: dlq.counts()["visible"] == 5, 30, "five dead letters")
    assert stop(w) == 0
    # a claim already delivered max-deliveries (2) times: receive and release it twice before the worker runs
    backend.store.put(calque_core.manifest_key("m.r-over", "c00000"), json.dumps({"items": [{"x": 1}]}))
    queue.send(calque_core.make_message("m.r-over", "m", backend.store.uri(calque_core.manifest_key("m.r-over", "c00000")), "c00000"))
    for _ in range(2):
        queue.change_visibility(queue.receive(1), 0)
    w = start_worker(local_env, "--model", "m")
    wait_for(lambda: dlq.counts()["visible"] == 6, 30, "the over-delivered claim's dead letter")
    assert stop(w) == 0
    reasons = []
    while (m := dlq.receive(0)) is not None:
        reasons.append(json.loads(m.body)["reason"])
        dlq.delete(m)
    assert any("malformed" in r for r in reasons)
    assert any("for model 'other-model'" in r for r in reasons)
    assert any("outside this pool's store" in r for r in reasons)
    assert any("run n.r-foreign is not one of this model's runs (m.*)" in r for r in reasons)
    assert any("claim object runs/m.r-missing/manifests/c00000.json does not exist" in r for r in reasons)
    assert any("delivered 3 times" in r for r in reasons)
    for run_id in ("other-model.r1", "m.r-outside", "n.r-foreign", "m.r-missing", "m.r-over"):
        s = summary(backend, run_id)
        assert s["status"] == "failed" and s["error"] and s["failed"] == [], run_id
    assert queue.counts() == {"visible": 0, "in_flight": 0}

def test_per_item_failure_and_wrong_result_count(local_env, tmp_path):
    """An item that raises fails alone; a handler returning the wrong count fails its batch; the worker stays up."""
    backend = make_pool(local_env, "Echo", "--batch-size", "4")
    w = start_worker(local_env, "--model", "m")
    run_id = submit_no_wait(local_env, tmp_path, [{"x": i, "fail": i == 2} for i in range(6)])
    s = wait_for(lambda: summary(backend, run_id), 30, "the summary")
    assert s["status"] == "partial" and s["ok"] == 5 and s["failed"] == [2]
    assert "asked to fail" in s["errors"]["2"]
    stop(w)
    wrong = dict(local_env)
    cli(wrong, "pool", "delete", "--model", "m", "--yes")
    backend = make_pool(wrong, "WrongCount", "--batch-size", "4")
    w = start_worker(wrong, "--model", "m")
    run_id = submit_no_wait(wrong, tmp_path, [{"x": i} for i in range(5)])
    s = wait_for(lambda: summary(backend, run_id), 30, "the summary")
    assert s["status"] == "failed" and s["failed"] == [0, 1, 2, 3, 4]
    assert "returned 3 results for a batch of 4 items" in s["errors"]["0"]
    assert "returned 0 results for a batch of 1 items" in s["errors"]["4"]
    run2 = submit_no_wait(wrong, tmp_path, [{"x": 1}])
    assert wait_for(lambda: summary(backend, run2), 30, "a second claim on the same worker")["worker_id"] == s["worker_id"]
    assert stop(w) == 0


def test_sigterm_finishes_the_running_claim_within_grace(local_env, tmp_path):
    """SIGTERM mid-claim: no new claims, the running one completes and is acked, exit 0."""
    g = Gated(local_env, tmp_path, CALQUE_GRACE="30")
    second = submit_no_wait(g.env, tmp_path, [{"x": 2}])
    g.worker.send_signal(signal.SIGTERM)
    g.logged("warm stop", "the signal to land")
    g.open()
    assert g.worker.wait(30) == 0
    assert summary(g.backend, g.run_id)["status"] == "ok"
    assert summary(g.backend, second) is None            # it stopped claiming
    assert g.queue().counts() == {"visible": 1, "in_flight": 0}

def test_sigterm_past_grace_releases_the_claim_at_once(local_env, tmp_path):
    """A claim that outlives the grace period is released (visibility 0), so another worker takes it at once."""
    g = Gated(local_env, tmp_path, items=[{"x": 1}, {"x": 2}], pool_args=("--batch-size", "1", "--visibility-timeout", "600"),
              CALQUE_GRACE="0")
    g.worker.send_signal(signal.SIGTERM)
    g.logged("warm stop", "the signal to land")
    g.open()                                           # the first batch ends; the loop sees the grace is over
    assert g.worker.wait(30) == 0
    assert summary(g.backend, g.run_id) is None
    assert g.queue().counts() == {"visible": 1, "in_flight": 0}   # released, not left invisible for 600 s
    w2 = start_worker(g.env, "--model", "m")
    done = wait_for(lambda: summary(g.backend, g.run_id), 30, "the released claim to complete")
    assert done["receive_count"] == 2 and done["ok"] == 2
    assert stop(w2) == 0

def test_idle_sigterm_exits_promptly(local_env):
    """An idle worker in its long poll exits 0 on SIGTERM, well before the poll would end."""
    make_pool(local_env, "Echo")
    w = start_worker(dict(local_env, CALQUE_POLL_WAIT="20"), "--model", "m")
    backend = backend_for(local_env)
    wait_for(lambda: calque_core.read_worker_stats(backend, "m"), 30, "the worker to start")
    w.send_signal(signal.SIGTERM)
    assert w.wait(5) == 0
    assert calque_core.read_worker_stats(backend, "m")[0]["state"] == "stopped"


def test_a_stop_on_sqs_lets_the_idle_poll_end_and_gives_back_what_it_brings(aws_env, tmp_path):
    """SQS still sends a claim to a long poll its worker cut short, out of sight for the visibility timeout
    (600 s here). A first SIGTERM lets the poll end: a claim sent after the signal is given back at once, visible
    to the next worker. A second signal cuts the poll short."""
    env = dict(aws_env, CALQUE_POLL_WAIT="20")
    backend = make_pool(env, "Echo", "--visibility-timeout", "600")
    queue = backend.queues.open_queue(calque_core.load_pool(backend, "m")["queue"])
    for signals in (1, 2):
        path = tmp_path / f"worker-{signals}.log"
        with open(path, "w") as log:
            w = start_worker(env, "--model", "m", log=log)
        wait_for(lambda: "@enter done" in path.read_text(), 30, "the worker to be warm")
        time.sleep(1)   # past its first probe, into its long poll (the log line below proves it)
        for _ in range(signals):
            w.send_signal(signal.SIGTERM)
            wait_for(lambda: "stopping as this poll returns" in path.read_text(), 10, "the signal to land in the poll")
        if signals == 2:
            assert w.wait(10) == 0 and "stop requested while polling" in path.read_text()
            continue
        run_id = submit_no_wait(env, tmp_path, [{"x": 1}], "--wait-for-workers")
        assert w.wait(30) == 0
        assert "let go (the worker stops)" in path.read_text()
        assert queue.counts() == {"visible": 1, "in_flight": 0}
        w2 = start_worker(env, "--model", "m")
        assert wait_for(lambda: summary(backend, run_id), 30, "the claim given back to complete")["ok"] == 1
        assert stop(w2) == 0


class SpotStub(http.server.BaseHTTPRequestHandler):
    """The EC2 metadata service's IMDSv2 token and spot instance-action, on 127.0.0.1."""
    notice = False

    def do_PUT(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"token-123")

    def do_GET(self):
        ok = self.headers.get("X-aws-ec2-metadata-token") == "token-123"
        if ok and type(self).notice and self.path == "/latest/meta-data/spot/instance-action":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"action": "terminate", "time": "2026-11-29T12:00:00Z"}')
        else:
            self.send_response(404 if ok else 401)
            self.end_headers()

    def log_message(self, *args):
        pass


def test_spot_notice_releases_the_claim_and_exits_0(local_env, tmp_path):
    """With the poller pointed at a loopback stub, a spot notice stops the worker like SIGTERM."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SpotStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        g = Gated(local_env, tmp_path, items=[{"x": 1}, {"x": 2}], pool_args=("--batch-size", "1", "--visibility-timeout", "600"),
                  CALQUE_GRACE="0", CALQUE_SPOT_INTERVAL="0.1", CALQUE_SPOT_POLL=f"http://127.0.0.1:{server.server_port}")
        SpotStub.notice = True
        g.logged("warm stop", "the worker to see the notice")
        g.open()
        assert g.worker.wait(30) == 0
        assert summary(g.backend, g.run_id) is None
        assert g.queue().counts() == {"visible": 1, "in_flight": 0}
    finally:
        SpotStub.notice = False
        server.shutdown()

class LifecycleStub(SpotStub):
    """The same metadata service on an instance its group is terminating (no spot notice)."""

    def do_GET(self):
        body = {"/latest/meta-data/autoscaling/target-lifecycle-state": b"Terminated",
                "/latest/meta-data/instance-id": b"i-1"}.get(self.path)
        if body:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)
        else:
            super().do_GET()


def test_a_terminating_instance_is_seen_and_let_go(tmp_path):
    """SpotPoller reads target-lifecycle-state and calls on_terminating once (the worker's scale-in
    stop); ScaleInProtection then completes the termination hook at the worker's exit (its call's
    parameters, recorded: moto 5.2.5 has no CompleteLifecycleAction). An EC2 pool's worker finds its
    group from the model and its instance id in the metadata; a local pool's has no protection."""
    import calque_ec2
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LifecycleStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen, notices = [], []
    metadata = {"CALQUE_SPOT_POLL": f"http://127.0.0.1:{server.server_port}"}
    try:
        calque_ec2.SpotPoller(metadata["CALQUE_SPOT_POLL"], 0.05, lambda: notices.append(1),
                         lambda: seen.append(1))
        time.sleep(0.3)
        found = calque_ec2.ScaleInProtection.on_instance({"model": "m", "ec2": {}}, metadata)
        assert (found.asg, found.instance_id, found.hook) == ("calque-pool-m", "i-1", "calque-drain")
        assert calque_ec2.ScaleInProtection.on_instance({"model": "m"}, metadata) is None
        assert calque_ec2.ScaleInProtection.on_instance({"model": "m", "ec2": {}}, {}) is None
    finally:
        server.shutdown()
    assert seen == [1] and notices == []

    class Client:   # what release() sends, recorded
        def complete_lifecycle_action(self, **kw):
            seen.append(kw)
    protection = calque_ec2.ScaleInProtection("calque-pool-m", "i-1", Client(), "calque-drain")
    protection.release()
    assert seen == [1]                                        # not terminating: nothing to complete
    protection.leaving = True
    protection.release()
    assert seen[1] == {"LifecycleHookName": "calque-drain", "AutoScalingGroupName": "calque-pool-m",
                       "InstanceId": "i-1", "LifecycleActionResult": "CONTINUE"}


def test_heartbeat_keeps_a_long_claim(local_env, tmp_path):
    """A claim held 3x longer than its visibility timeout is not redelivered while the heartbeat runs."""
    g = Gated(local_env, tmp_path, pool_args=("--visibility-timeout", "1"))
    b = start_worker(g.env, "--model", "m")                  # would take the claim if its lease lapsed
    wait_for(lambda: len(calque_core.read_worker_stats(g.backend, "m")) == 2, 30, "the second worker to be polling")
    queue = g.queue()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:                     # 3 timeouts' worth: the lease must hold throughout
        assert queue.counts() == {"visible": 0, "in_flight": 1}
        time.sleep(0.1)
    g.open()
    done = wait_for(lambda: summary(g.backend, g.run_id), 30, "the summary")
    assert done["worker_id"].endswith(f"-{g.worker.pid}") and done["receive_count"] == 1
    assert sorted(os.listdir(g.gate)) == ["open", f"started-{g.worker.pid}"]   # b never started it
    assert stop(g.worker) == 0 and stop(b) == 0

def test_a_lost_lease_is_not_written(local_env, tmp_path):
    """When another receiver takes the claim (its lease lapsed), the first worker writes nothing for it."""
    g = Gated(local_env, tmp_path, pool_args=("--visibility-timeout", "3"))   # a heartbeat each second

    def steal():   # the lease lapses (as if the heartbeat had stalled); again if a renewal landed in between
        g.backend.queues.db().execute("UPDATE messages SET visible_at = 0")
        return g.queue().receive(0)
    thief = wait_for(steal, 30, "another receiver to take the claim")
    g.queue().change_visibility(thief, 600)                  # the thief's own heartbeat: the claim stays its
    assert thief.receive_count == 2
    g.logged("lease lost", "the heartbeat to notice")
    g.open()
    g.logged("lease lost: not writing it", "the worker to drop the claim")
    assert summary(g.backend, g.run_id) is None
    assert g.backend.store.list(calque_core.results_prefix(g.run_id, "c00000")) == []
    assert g.worker.poll() is None                           # and it stays up for the next claim
    assert stop(g.worker) == 0

def test_second_signal_releases_the_claim_at_once(local_env, tmp_path):
    """A second SIGTERM during a claim releases it immediately, even inside a long batch, and exits 0."""
    g = Gated(local_env, tmp_path, pool_args=("--visibility-timeout", "600"), CALQUE_GRACE="600")
    g.worker.send_signal(signal.SIGTERM)
    g.logged("warm stop", "the first signal to land")
    g.worker.send_signal(signal.SIGTERM)
    assert g.worker.wait(30) == 0                            # the gate never opened: the batch was cut short
    assert summary(g.backend, g.run_id) is None
    assert g.queue().counts() == {"visible": 1, "in_flight": 0}

def test_queue_and_store_errors_do_not_cost_the_warm_model(local_env, tmp_path, monkeypatch):
    """A receive that fails and a claim whose result write fails past its retries: the worker logs, stays up
    with its model loaded (enter_count 1), and the failed claim is redelivered and completed."""
    import warmd
    for key in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_ENV"):
        monkeypatch.setenv(key, local_env[key])
    monkeypatch.setattr(warmd, "ERROR_BACKOFF", (0.01, 0.01))
    monkeypatch.setattr(warmd, "WRITE_RETRY", (0.01, 5))
    monkeypatch.setattr(warmd, "RELEASE_DELAY", 0.01)
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(4)])
    assert cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
               "--workers", "0").returncode == 0
    backend = backend_for(local_env)
    run = calque_runs.stage_run(backend, calque_core.load_pool(backend, "m"), calque_sources.read_items(items), 2,
                           backend.queues.open_queue("calque-pool-m"), "cold")
    record = dict(calque_core.load_pool(backend, "m"))   # served as a cold run: the worker exits once it is drained
    worker = warmd.Worker(backend, record, "test-workers/", calque_core.settings(), True)
    faults = {"receive": 1, "put": 1 + warmd.WRITE_RETRY[1]}   # the first write and every retry of it
    real_receive, real_put = calque_core.LocalQueue.receive, backend.store.put

    def flaky_receive(self, *a, **kw):
        if faults["receive"]:
            faults["receive"] -= 1
            raise ConnectionError("queue unreachable")
        return real_receive(self, *a, **kw)

    def flaky_put(key, data):
        if "/results/" in key and faults["put"]:
            faults["put"] -= 1
            raise OSError("store unreachable")
        return real_put(key, data)
    monkeypatch.setattr(calque_core.LocalQueue, "receive", flaky_receive)
    monkeypatch.setattr(backend.store, "put", flaky_put)
    worker.work()
    summaries = calque_core.read_summaries(backend, run["run_id"])
    assert len(summaries) == 2 and all(s["status"] == "ok" for s in summaries)
    assert worker.accounts.enter_count == 1 and faults == {"receive": 0, "put": 0}
    assert sorted(s["receive_count"] for s in summaries) == [1, 2]    # the claim whose write failed came back


def test_nan_and_deep_results_fail_only_their_item(local_env, tmp_path):
    """NaN and a list nested 5,000 deep fail their own item with the reason; the claim's other items are ok, its
    results are strict JSON, and a short claim writes one part and no LIST."""
    backend = make_pool(local_env, "Faulty", "--batch-size", "4")
    w = start_worker(local_env, "--model", "m")
    run_id = submit_no_wait(local_env, tmp_path, [{"x": 0}, {"x": 1, "nan": True}, {"x": 2, "deep": 5000}, {"x": 3}])
    s = wait_for(lambda: summary(backend, run_id), 30, "the summary")
    assert s["status"] == "partial" and s["failed"] == [1, 2] and s["ok"] == 2
    assert "Out of range float values are not JSON compliant" in s["errors"]["1"]
    assert "RecursionError" in s["errors"]["2"]
    text = "".join(calque_core.read_claim_results(backend.store, run_id, "c00000", 4))
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the results"))
              for line in text.splitlines()]
    assert [(line["i"], line["ok"]) for line in strict] == [(0, True), (1, False), (2, False), (3, True)]
    assert s["parts"] == [[0, 4]] and s["resumed"] == 0 and s["requests"]["store_lists"] == 0
    assert backend.store.list(calque_core.results_prefix(run_id, "c00000")) == [calque_core.part_key(run_id, "c00000", 0, 4)]
    assert stop(w) == 0


def test_a_resumed_claim_recomputes_nothing_committed(local_env, tmp_path):
    """A worker killed mid-claim after some parts: the next one resumes after them (the handler is never called
    again on an item they hold), and runs the two batches its death could be in one item at a time behind the
    attempt record (its spool on this machine says where it died), then the rest in batches."""
    calls, gate = tmp_path / "calls", tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, CALLS_FILE=str(calls), GATE_DIR=str(gate), CALQUE_CHECKPOINT_SECONDS="0",
               CALQUE_CHECKPOINT_BATCHES="1")
    backend = make_pool(env, "Faulty", "--batch-size", "2", "--visibility-timeout", "2")
    a = start_worker(env, "--model", "m")
    run_id = submit_no_wait(env, tmp_path, [{"x": i, "hold": i == 12} for i in range(24)], "--claim-size", "24")
    wait_for(lambda: os.listdir(gate), 30, "the worker to hold batch [12, 14)")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    (gate / "open").touch()
    b = start_worker(env, "--model", "m")
    s = wait_for(lambda: summary(backend, run_id), 30, "the resumed claim's summary")
    assert s["status"] == "ok" and s["receive_count"] == 2 and s["resumed"] == 12
    assert s["parts"][:6] == [[k, k + 2] for k in range(0, 12, 2)] and s["parts"][-1][1] == 24
    by_x = {}
    for line in calls.read_text().splitlines():
        x, pid = map(int, line.split())
        by_x.setdefault(x, []).append(pid)
    assert all(by_x[x] == [a.pid] for x in range(12))                    # committed: never recomputed
    assert all(by_x[x] == [a.pid, b.pid] for x in (12, 13))              # the batch A died in
    assert all(by_x[x] == [b.pid] for x in range(14, 24))
    assert [line["i"] for line in results(backend, run_id, 24)] == list(range(24))
    record = json.loads(backend.store.get(calque_core.attempt_key(run_id, "c00000")))
    # items 12-15 (the batch it died in, the one it gathered) ran alone, then batches: the record says so
    assert record["state"] == "batches" and record["running"] == [] and record["receive_count"] == 2
    assert stop(b) == 0


def test_a_resume_message_takes_the_parts_on_its_first_delivery(local_env, tmp_path):
    """A message with "resume": true (what a redrive sends) lists the claim's parts even on a first delivery and
    runs only what they do not hold, in batches (no death to track)."""
    calls = tmp_path / "calls"
    env = dict(local_env, CALLS_FILE=str(calls))
    backend = make_pool(env, "Faulty", "--batch-size", "4")
    run_id = submit_no_wait(env, tmp_path, [{"x": i} for i in range(6)])
    queue = backend.queues.open_queue("calque-pool-m")
    original = queue.receive(1)
    queue.delete(original)               # as if dead-lettered: a redrive sends it again, marked
    backend.store.put(calque_core.part_key(run_id, "c00000", 0, 3),
                      "".join(json.dumps({"i": i, "ok": True, "result": {"y": 2 * i}}) + "\n" for i in range(3)))
    queue.send(json.dumps(dict(json.loads(original.body), resume=True)))
    w = start_worker(env, "--model", "m")
    s = wait_for(lambda: summary(backend, run_id), 30, "the summary")
    assert s["status"] == "ok" and s["receive_count"] == 1 and s["resumed"] == 3 and s["parts"] == [[0, 3], [3, 6]]
    assert s["requests"]["store_lists"] == 1
    assert sorted(int(line.split()[0]) for line in calls.read_text().splitlines()) == [3, 4, 5]
    assert not backend.store.exists(calque_core.attempt_key(run_id, "c00000"))
    assert [line["result"]["y"] for line in results(backend, run_id, 6)] == [0, 2, 4, 6, 8, 10]
    assert stop(w) == 0


def test_a_claim_stops_before_sqs_caps_its_invisibility(aws_env, tmp_path):
    """SQS keeps a received message invisible 12 h at most: a ChangeMessageVisibility past that fails, which was
    taken for a lost lease (the claim not written, redelivered, again and again). A claim that could pass the cap
    stops at a batch boundary with a batch_timeout and a visibility timeout in hand: its done items kept in a
    part, the claim dead-lettered with why and how to split it, which `submit` reports. The cap is scaled down to
    6 s here (warmd's module constant): the same code path as at 12 h, on moto_server (which has no such cap)."""
    env = dict(aws_env, TIMELINE_FILE=str(tmp_path / "timeline"), TIMELINE_MODEL_MS="250")
    # its own model: the session's moto_server keeps other tests' "m" queues, which a worker of theirs still
    # stopping may poll (it would refuse a claim of another store's run)
    assert cli(env, "pool", "create", "--model", "cap", "--handler", f"{HANDLERS}:Timeline", "--workers", "0",
               "--batch-size", "1", "--visibility-timeout", "1", "--batch-timeout", "1").returncode == 0
    backend = backend_for(env)
    log = tmp_path / "worker.log"
    with open(log, "w") as f:
        w = start_worker(env, "--model", "cap", log=f, constants={"SQS_MAX_INVISIBLE": 6.0})
    items = [{"id": k, "text": "a b"} for k in range(60)]     # 15 s of work: 4 s fit under the cap
    out = cli(env, "submit", "--pool", "cap", write_items(tmp_path / "items.jsonl", items), "--claim-size", "60",
              "--wait-for-workers", timeout=120)
    assert out.returncode == 1, (out.stdout, out.stderr)
    run_id = json.loads(cli(env, "runs", "list", "--json").stdout)[0]["run_id"]
    s = summary(backend, run_id)
    assert s["status"] == "failed" and "SQS keeps a claim invisible 12 h at most" in s["error"], s
    assert "split such claims" in s["error"] and f"runs redrive {run_id}" in s["error"]
    done = int(s["error"].split(" of 60 items done")[0].rsplit(" ", 1)[1])
    assert 5 <= done < 60 and any("stopped near SQS's 12 h cap" in n for n in s["notes"])
    assert len(results(backend, run_id, done)) == done            # what it did is kept, in a part
    assert "SQS keeps a claim invisible 12 h at most" in out.stdout + out.stderr
    assert "lease lost" not in log.read_text()                    # never past the cap, never taken for a lost lease
    dlq = backend.queues.open_queue("calque-dlq-cap")
    letters = [json.loads(m.body) for m in calque_runs.receive_all(dlq, 10)]   # the session's moto_server: others' too
    assert any(letter.get("run_id") == run_id and "12 h" in letter["reason"] for letter in letters), letters
    assert w.poll() is None and stop(w) == 0                      # the worker serves on


def test_the_worker_is_in_rooms_none_over_600_lines():
    """Issue #44: the worker in rooms (the process, one claim's run, the redelivery and poison rules,
    the model's calls, the accounting), each readable alone: no class of warmd.py over 600 lines."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "warmd.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    sizes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"Worker", "ClaimRun", "Rules", "Model", "Accounts"} <= set(sizes), sizes
    assert max(sizes.values()) <= 600, sizes


def test_a_cold_worker_whose_run_queue_is_deleted_exits_drained(aws_env, monkeypatch):
    """A cold run's submit deletes the run's queue once every summary is in: a cold worker whose
    next receive finds the queue gone is done ("cold run drained"), not backing off on it forever
    (it was, when the delete came between its last claim and its idle check)."""
    import warmd
    assert cli(aws_env, "pool", "create", "--model", "gone", "--handler", f"{HANDLERS}:Echo",
               "--workers", "0").returncode == 0
    backend = backend_for(aws_env)
    for key in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_ENV"):
        monkeypatch.setenv(key, aws_env[key])
    record = calque_core.load_pool(backend, "gone")
    worker = warmd.Worker(backend, record, "runs/gone.cold/workers/", calque_core.settings(), True)
    worker.start()
    backend.queues.delete_queue(record["queue"])
    worker.backoff = 0.0   # as work() starts its loop
    assert worker._loop_once() == "cold run drained"
