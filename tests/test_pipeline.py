"""Claim pipelining and batched acks in real warmd.py processes: a claim received ahead (beside the running claim's
last batch) under kill -9 and SIGTERM, the bound that gives it back to an idle worker, a worker killed
between a claim's summary and its batched ack, and the servers the bench runs: the latency proxy it puts in front of
moto_server, and its moto_server whose SQS reads the clock cheaply."""
import json
import os
import signal
import time
import urllib.request

import boto3

import calque
import calque_core
from conftest import HANDLERS, PY, ROOT, backend_for, cli, serving, start_worker, wait_for, write_items
from latency_proxy import start_proxy


def make_pool(env, *extra):
    """A pool of the Faulty handler with no local worker (tests start their own)."""
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Faulty", "--workers", "0", *extra)
    assert out.returncode == 0, out.stderr
    return backend_for(env)


def submit(env, tmp_path, items, name="items.jsonl"):
    """A run of one-item claims, queued (--no-wait); its id."""
    out = cli(env, "submit", "--pool", "m", write_items(tmp_path / name, items), "--claim-size", "1", "--no-wait")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def summary(backend, run_id, claim):
    try:
        return calque_core.read_json(backend, calque_core.summary_key(run_id, claim))
    except calque.NotFound:
        return None


def calls(path):
    """{x: [pid of each handler call on it]} from the Faulty handler's $CALLS_FILE."""
    by_x = {}
    for line in path.read_text().splitlines():
        x, pid = map(int, line.split())
        by_x.setdefault(x, []).append(pid)
    return by_x


class Ahead:
    """One worker (logging to a file) warmed by a one-item run, then gated in claim c00000 of a two-claim run (its
    only batch, so its last) while it holds c00001, received ahead: both claims in flight, nothing visible."""

    def __init__(self, env, tmp_path, *pool_args, hold, **settings):
        self.gate, self.calls, self.log = tmp_path / "gate", tmp_path / "calls", tmp_path / "worker.log"
        self.gate.mkdir()
        self.env = dict(env, GATE_DIR=str(self.gate), CALLS_FILE=str(self.calls), **settings)
        self.constants = {"AHEAD": True, "AHEAD_HOLD": hold}   # receive ahead on either backend
        self.backend = make_pool(self.env, *pool_args)
        with open(self.log, "w") as f:
            self.worker = start_worker(self.env, "--model", "m", log=f, constants=self.constants)
        warm = submit(self.env, tmp_path, [{"x": 100}], "warm.jsonl")   # a handler call timed: short enough to reach
        wait_for(lambda: summary(self.backend, warm, "c00000"), 60, "the warm-up claim")
        self.queue = self.backend.queues.open_queue("calque-pool-m")
        wait_for(lambda: self.queue.counts() == {"visible": 0, "in_flight": 0}, 30, "the warm-up claim's ack")
        os.kill(self.worker.pid, signal.SIGSTOP)    # both claims queued before it looks: it gets c00000, then
        self.run_id = submit(self.env, tmp_path, [{"x": 0, "hold": True}, {"x": 1}])   # c00001 ahead
        os.kill(self.worker.pid, signal.SIGCONT)
        wait_for(lambda: os.listdir(self.gate), 60, "claim c00000 to start")
        wait_for(lambda: self.queue.counts() == {"visible": 0, "in_flight": 2}, 30, "claim c00001 to be held ahead")

    def open(self):
        (self.gate / "open").touch()


def test_kill_9_of_a_worker_holding_a_claim_ahead_loses_nothing(any_env, tmp_path):
    """kill -9 of a worker in its last batch with the next claim held ahead: both claims come back after their
    visibility timeout, and another worker runs each item exactly once more (the one held ahead never ran)."""
    a = Ahead(any_env, tmp_path, "--visibility-timeout", "2", hold=600)
    os.kill(a.worker.pid, signal.SIGKILL)
    a.worker.wait()
    a.open()
    b = start_worker(a.env, "--model", "m", constants=a.constants)
    done = wait_for(lambda: all(summary(a.backend, a.run_id, c) for c in ("c00000", "c00001")) and
                    [summary(a.backend, a.run_id, c) for c in ("c00000", "c00001")], 60, "both claims' summaries")
    assert all(s["status"] == "ok" and s["worker_id"].endswith(f"-{b.pid}") and s["receive_count"] == 2
               for s in done)
    assert calls(a.calls) == {100: [a.worker.pid], 0: [a.worker.pid, b.pid], 1: [b.pid]}
    for claim, x in (("c00000", 0), ("c00001", 1)):
        lines = [json.loads(line) for line in calque_core.read_claim_results(a.backend.store, a.run_id, claim, 1)]
        assert [(line["i"], line["result"]["y"]) for line in lines] == [(x, 2 * x)]
    wait_for(lambda: a.queue.counts() == {"visible": 0, "in_flight": 0}, 30, "both acks")
    b.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0


def test_sigterm_gives_a_claim_held_ahead_back_at_once(local_env, tmp_path):
    """SIGTERM with a claim held ahead: that claim is visible again at once, while the running claim still
    finishes within its grace period; exit 0, and the claim given back is left for another worker."""
    a = Ahead(local_env, tmp_path, "--visibility-timeout", "600", hold=600, CALQUE_GRACE="60")
    a.worker.send_signal(signal.SIGTERM)
    wait_for(lambda: a.queue.counts() == {"visible": 1, "in_flight": 1}, 30, "the claim ahead to be given back")
    assert not a.backend.store.exists(calque_core.summary_key(a.run_id, "c00000"))   # still gated: the grace runs
    a.open()
    assert a.worker.wait(30) == 0
    assert summary(a.backend, a.run_id, "c00000")["status"] == "ok"
    assert summary(a.backend, a.run_id, "c00001") is None
    assert a.queue.counts() == {"visible": 1, "in_flight": 0}
    assert 1 not in calls(a.calls)
    record = json.loads(a.backend.store.get(calque_core.attempt_key(a.run_id, "c00001")))
    assert record["state"] == "released" and record["progress_at"] == 1   # its next delivery runs in batches


def test_a_claim_held_ahead_past_the_bound_goes_to_an_idle_worker(local_env, tmp_path):
    """A claim held ahead beside a last batch that runs long is given back after AHEAD_HOLD s, and an idle
    worker runs it (in one batch, not item by item) while the first is still in that batch; the delivery given
    back is not held against max_deliveries (1 here)."""
    a = Ahead(local_env, tmp_path, "--visibility-timeout", "600", "--max-deliveries", "1", hold=2)
    b = start_worker(a.env, "--model", "m", constants=a.constants)
    done = wait_for(lambda: summary(a.backend, a.run_id, "c00001"), 60, "the idle worker to run the claim given back")
    assert done["status"] == "ok" and done["worker_id"].endswith(f"-{b.pid}") and done["receive_count"] == 2
    assert done["parts"] == [[0, 1]] and done["resumed"] == 0
    assert not a.backend.store.exists(calque_core.summary_key(a.run_id, "c00000"))    # a was in that batch throughout
    assert "held ahead 2 s without starting" in a.log.read_text()
    a.open()
    assert wait_for(lambda: summary(a.backend, a.run_id, "c00000"), 30, "the gated claim")["status"] == "ok"
    assert a.backend.queues.open_queue("calque-dlq-m").counts()["visible"] == 0
    for w in (a.worker, b):
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0


def test_a_worker_killed_before_its_batched_ack_costs_no_recompute(local_env, tmp_path):
    """kill -9 after a claim's summary while its ack waits to go with others (the worker went on to the next
    claim): the claim is redelivered, its duplicate check finds the summary, and it is acked without running the
    handler again; the claim the worker died in is run again."""
    gate, log = tmp_path / "gate", tmp_path / "calls"
    gate.mkdir()
    env = dict(local_env, CALLS_FILE=str(log), GATE_DIR=str(gate))
    backend = make_pool(env, "--visibility-timeout", "600")
    a = start_worker(env, "--model", "m", constants={"ACK_WAIT": 600})
    wait_for(lambda: calque_core.read_worker_stats(backend, "m"), 60, "the worker to start")
    os.kill(a.pid, signal.SIGSTOP)          # both claims queued before it looks: the queue never runs empty
    run_id = submit(env, tmp_path, [{"x": 7}, {"x": 8, "hold": True}])
    os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: os.listdir(gate), 60, "the worker to hold claim c00001")
    first = wait_for(lambda: summary(backend, run_id, "c00000"), 30, "claim c00000's summary")
    os.kill(a.pid, signal.SIGKILL)          # c00000's ack waits up to min(600, 600 / 4) s: it has not gone
    a.wait()
    queue = backend.queues.open_queue("calque-pool-m")
    assert queue.counts() == {"visible": 0, "in_flight": 2}
    backend.queues.db().execute("UPDATE messages SET visible_at = 0")   # the leases lapse now, not in 600 s
    (gate / "open").touch()
    b = start_worker(env, "--model", "m", constants={"ACK_WAIT": 600})
    wait_for(lambda: summary(backend, run_id, "c00001") and queue.counts() == {"visible": 0, "in_flight": 0}, 30,
             "both claims acked")
    b.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0
    assert summary(backend, run_id, "c00000") == first
    assert calls(log) == {7: [a.pid], 8: [a.pid, b.pid]}
    assert [s["claims"] for s in calque_core.read_worker_stats(backend, "m") if s["pid"] == b.pid] == [1]


def test_latency_proxy_forwards_s3_and_sqs(moto_endpoint):
    """bench/latency_proxy.py in front of moto_server passes S3 writes, reads, HEADs and SQS calls through intact."""
    url, stop = start_proxy(moto_endpoint, 5)
    try:
        s3, sqs = boto3.client("s3", endpoint_url=url), boto3.client("sqs", endpoint_url=url)
        s3.create_bucket(Bucket="proxied")
        s3.put_object(Bucket="proxied", Key="k", Body=b"x" * 100_000)
        assert s3.get_object(Bucket="proxied", Key="k")["Body"].read() == b"x" * 100_000
        assert s3.head_object(Bucket="proxied", Key="k")["ContentLength"] == 100_000
        queue = sqs.create_queue(QueueName="proxied")["QueueUrl"]
        sqs.send_message(QueueUrl=queue, MessageBody="hello")
        got = sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1)["Messages"]
        assert [m["Body"] for m in got] == ["hello"]
        reply = sqs.delete_message_batch(QueueUrl=queue,
                                         Entries=[{"Id": "0", "ReceiptHandle": got[0]["ReceiptHandle"]}])
        assert [e["Id"] for e in reply["Successful"]] == ["0"]
    finally:
        stop()


def test_bench_moto_server_keeps_sqs_timing():
    """bench/peers/moto_counted.py's cheap clock reads the time moto's own clock reads, and moto's SQS keeps its
    timing with it: a received message stays invisible for its visibility timeout, a delayed one is held for its
    delay, and the queue's counts say so; the server counts what it served."""
    import moto.core.utils
    assert abs(moto.core.utils.unix_time() - time.time()) < 0.01
    server = os.path.join(ROOT, "bench", "peers", "moto_counted.py")
    with serving(lambda port: [PY, server, "--port", str(port)]) as url:
        sqs = boto3.client("sqs", endpoint_url=url)
        queue = sqs.create_queue(QueueName="clock")["QueueUrl"]

        def counts():
            names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                     "ApproximateNumberOfMessagesDelayed"]
            got = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=names)["Attributes"]
            return [int(got[name]) for name in names]

        sqs.send_message(QueueUrl=queue, MessageBody="now")
        sqs.send_message(QueueUrl=queue, MessageBody="later", DelaySeconds=2)
        assert counts() == [1, 0, 1]
        (got,) = sqs.receive_message(QueueUrl=queue, VisibilityTimeout=1)["Messages"]
        assert got["Body"] == "now"
        assert counts() == [0, 1, 1]
        assert "Messages" not in sqs.receive_message(QueueUrl=queue)   # one in flight, one delayed
        wait_for(lambda: counts()[0] == 1, 5, "the received message visible again after its timeout")
        wait_for(lambda: counts() == [2, 0, 0], 5, "the delayed message visible after its delay")
        assert sorted(m["Body"] for m in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]) \
            == ["later", "now"]
        with urllib.request.urlopen(url + "/_bench/counts") as reply:
            served = json.load(reply)
        assert served["SQS SendMessage"] == 2 and served["SQS ReceiveMessage"] == 3
