"""One contract suite, run against both backends: the SQLite queue + directory store, and SQS + S3
(moto's in-process mock_aws)."""
import time

import pytest

import calque
import calque_core
import calque_runs


@pytest.fixture(params=["local", "aws"])
def backend(request, tmp_path, monkeypatch):
    monkeypatch.setattr(calque_core, "QUEUE_OPEN_RETRY", 0.2)   # a missing queue fails in 0.2 s, not the SQS-lag 10 s
    if request.param == "local":
        yield calque_core.LocalBackend(str(tmp_path / "store"))
        return
    from moto import mock_aws
    with mock_aws():
        import boto3
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="contract")
        yield calque_core.open_backend("s3://contract/root")


def test_store_round_trip(backend):
    """put/get/exists/list, and NotFound for a missing key."""
    backend.store.put("runs/r/summaries/c00000.json", b'{"a": 1}')
    backend.store.put("runs/r/summaries/c00001.json", "text")
    assert backend.store.get("runs/r/summaries/c00000.json") == b'{"a": 1}'
    assert backend.store.exists("runs/r/summaries/c00001.json")
    assert not backend.store.exists("runs/r/summaries/c00002.json")
    assert backend.store.list("runs/r/summaries/") == ["runs/r/summaries/c00000.json", "runs/r/summaries/c00001.json"]
    with pytest.raises(calque.NotFound):
        backend.store.get("runs/r/nothing.json")
    backend.store.delete_prefix("runs/r/")
    assert backend.store.list("runs/r/summaries/") == []


def test_list_start_after(backend):
    """list(prefix, start_after) returns only the keys after it, in order, and counts the keys it returned."""
    for claim in ("c00000", "c00001", "c00002", "c00010"):
        backend.store.put(f"runs/r/summaries/{claim}.json", b"{}")
    listed = backend.store.keys_listed
    assert backend.store.list("runs/r/summaries/", "runs/r/summaries/c00001.json") == [
        "runs/r/summaries/c00002.json", "runs/r/summaries/c00010.json"]
    assert backend.store.list("runs/r/summaries/", "runs/r/summaries/c00010.json") == []
    assert backend.store.keys_listed == listed + 2


def test_list_a_prefix_that_ends_inside_a_name(backend):
    """As S3 lists it: a pool's runs by `runs/<slug>.` (what IAM lets a worker list), folders too."""
    for run in ("emb.1", "emb.2", "embx.1", "orch.1"):
        backend.store.put(f"runs/{run}/run.json", b"{}")
    assert backend.store.list("runs/emb.") == ["runs/emb.1", "runs/emb.2"]
    assert backend.store.list("runs/none.") == [] and backend.store.list("nowhere/x") == []


def test_waiting_lists_each_summary_about_once(backend, monkeypatch):
    """wait_for_run lists past the claims already done: a run of C claims finishing two at a time, the second
    of each pair first (two workers), costs at most 3 C keys listed even when it polls after every summary."""
    import threading
    monkeypatch.setattr(calque_runs, "SUMMARY_POLL_FLOOR", 0.002)   # a poll per summary (the worst case) stays quick:
    monkeypatch.setattr(calque_runs, "SUMMARY_WAIT_MAX", 0.1)       # the gaps it would grow to are not what is tested
    claims = [calque_core.claim_id(i) for i in range(24)]
    run = {"run_id": "m.r", "model": "m", "mode": "pool", "items": 24, "claims": claims, "claim_size": 1,
           "queue": "calque-pool-m", "sent": 24}
    calque_core.write_json(backend, calque_core.run_key("m.r"), run)

    def finish():
        for pair in range(0, len(claims), 2):
            for claim in (claims[pair + 1], claims[pair]):
                polls = backend.requests["store_lists"]
                summary = calque_core.claim_summary(run_id="m.r", claim=claim, model="m", worker_id="w", mode="pool",
                                               backend=backend.kind, receive_count=1, enter_count=1, started=0.0,
                                               finished=0.0, requests={}, items=1)
                calque_core.write_json(backend, calque_core.summary_key("m.r", claim), summary)
                deadline = time.monotonic() + 10
                while backend.requests["store_lists"] == polls and time.monotonic() < deadline:
                    time.sleep(0.001)   # until the waiter has listed again: one poll per summary, the worst case

    writer = threading.Thread(target=finish)
    listed = backend.store.keys_listed
    writer.start()
    summaries, timed_out = calque_runs.wait_for_run(backend, run, 60, progress=False)
    writer.join()
    assert not timed_out and [s["claim"] for s in summaries] == claims
    assert backend.store.keys_listed - listed <= 3 * len(claims)


def waited_run(backend, claims, done):
    """A pool run of `claims` one-item claims, all sent (the pool queue holds those without a summary), with its
    pool's DLQ, and summaries for the first `done`."""
    queue = backend.queues.create_queue("calque-pool-m", 30)     # the pool's, older than the run
    run = {"run_id": "m.r", "model": "m", "mode": "pool", "items": claims, "claim_size": 1,
           "claims": [calque_core.claim_id(i) for i in range(claims)], "queue": "calque-pool-m", "sent": claims,
           "created_at": calque_core.now_iso(time.time() + 1)}   # a run's time is cut to the ms: not in the queue's
    calque_core.write_json(backend, calque_core.run_key("m.r"), run)
    backend.queues.create_queue(calque_core.dlq_name("m"), 30)
    for claim in run["claims"][done:]:
        queue.send(calque_core.make_message("m.r", "m", backend.store.uri(calque_core.manifest_key("m.r", claim)), claim))
    for claim in run["claims"][:done]:
        write_summary(backend, claim)
    return run


def write_summary(backend, claim):
    summary = calque_core.claim_summary(run_id="m.r", claim=claim, model="m", worker_id="w", mode="pool",
                                   backend=backend.kind, receive_count=1, enter_count=1, started=0.0, finished=0.0,
                                   requests={}, items=1)
    calque_core.write_json(backend, calque_core.summary_key("m.r", claim), summary)


def counting_gets(backend, monkeypatch):
    """Wrap backend.store.get: returns the Counter of keys read, and the monotonic times the run record was read."""
    from collections import Counter
    reads, run_reads, get = Counter(), [], backend.store.get

    def counted(key):
        reads[key] += 1
        if key == calque_core.run_key("m.r"):
            run_reads.append(time.monotonic())
        return get(key)

    monkeypatch.setattr(backend.store, "get", counted)
    return reads, run_reads


def test_a_steady_wait_reads_each_summary_once_and_no_run_record(backend, monkeypatch):
    """While summaries keep landing, wait_for_run reads each one exactly once, and neither the run record nor the
    DLQ: those looks are for a stalled run."""
    import threading
    monkeypatch.setattr(calque_runs, "SUMMARY_WAIT_MAX", 0.05)   # a LIST per summary at worst: never a 1 s stall here
    run = waited_run(backend, 20, 0)
    reads, _ = counting_gets(backend, monkeypatch)

    def finish():   # one summary each time the waiter has listed again (two workers finishing claims)
        for claim in run["claims"]:
            polls = backend.requests["store_lists"]
            write_summary(backend, claim)
            deadline = time.monotonic() + 10
            while backend.requests["store_lists"] == polls and time.monotonic() < deadline:
                time.sleep(0.001)

    writer = threading.Thread(target=finish)
    writer.start()
    queue_calls = backend.requests["queue_other"]
    summaries, timed_out = calque_runs.wait_for_run(backend, run, 60, progress=False)
    writer.join()
    assert not timed_out and [s["claim"] for s in summaries] == run["claims"]
    assert reads == {calque_core.summary_key("m.r", claim): 1 for claim in run["claims"]}
    assert backend.requests["queue_other"] == queue_calls


def test_a_stalled_wait_looks_at_the_run_record_ever_less_often_and_sees_a_cancel(backend, monkeypatch):
    """A run whose last claim never ends: the run record is read after RUN_RECHECK without a summary, then at
    gaps that double up to RUN_RECHECK_MAX (not every RUN_RECHECK); a cancel that wrote no summary (its writes
    failed) is seen at the next look, and the wait ends with the record's cancel in `run`."""
    import threading
    monkeypatch.setattr(calque_runs, "RUN_RECHECK", 0.05)
    monkeypatch.setattr(calque_runs, "RUN_RECHECK_MAX", 0.2)
    monkeypatch.setattr(calque_runs, "SUMMARY_WAIT_MAX", 0.01)   # the looks come on time, not at the next slow LIST
    run = waited_run(backend, 2, 1)
    _, run_reads = counting_gets(backend, monkeypatch)

    def cancel():   # after the waiter's 6th look: gaps 0.05, 0.1, 0.2, 0.2... s
        wait_for = time.monotonic() + 30
        while len(run_reads) < 6 and time.monotonic() < wait_for:
            time.sleep(0.005)
        stored = calque_core.read_json(backend, calque_core.run_key("m.r"))
        calque_core.write_json(backend, calque_core.run_key("m.r"), dict(stored, cancelled={"reason": "test", "at": "now"}))

    canceller = threading.Thread(target=cancel)
    canceller.start()
    started = time.monotonic()
    summaries, timed_out = calque_runs.wait_for_run(backend, run, 60, progress=False)
    stalled = time.monotonic() - started
    canceller.join()
    assert timed_out and [s["claim"] for s in summaries] == ["c00000"] and run["cancelled"]["reason"] == "test"
    reads = len(run_reads) - 1   # the canceller's own read (the waiter's 6th may have seen its write)
    assert 6 <= reads <= 4 + stalled / 0.2   # a look every RUN_RECHECK would be stalled / 0.05 of them


def test_uri_round_trip(backend):
    """A key's URI maps back to the key."""
    key = "runs/r1/manifests/c00000.json"
    assert backend.store.key_for_uri(backend.store.uri(key)) == key


def test_queue_create_is_idempotent_and_open_missing_fails(backend):
    """Creating a queue twice is fine; opening one that does not exist raises NotFound."""
    backend.queues.create_queue("calque-pool-x", 30)
    backend.queues.create_queue("calque-pool-x", 30)
    assert backend.queues.open_queue("calque-pool-x").visibility_timeout == 30
    with pytest.raises(calque.NotFound):
        backend.queues.open_queue("calque-pool-missing")


def test_receive_delete_and_counts(backend):
    """A received message is in flight, not visible; delete removes it; an empty long poll returns None."""
    q = backend.queues.create_queue("calque-pool-c", 30)
    q.send("one")
    q.send("two")
    assert q.counts() == {"visible": 2, "in_flight": 0}
    m = q.receive(1)
    assert m.body == "one" and m.receive_count == 1
    assert q.counts() == {"visible": 1, "in_flight": 1}
    assert q.delete(m)
    m2 = q.receive(1)
    assert q.delete(m2)
    t0 = time.monotonic()
    assert q.receive(1) is None
    assert time.monotonic() - t0 >= 0.9     # it waited (long poll), it did not spin back at once
    assert q.counts() == {"visible": 0, "in_flight": 0}
    assert backend.requests["queue_receives"] == 2 and backend.requests["queue_empty_receives"] == 1


def test_visibility_expiry_redelivers(backend):
    """A message not deleted within its visibility timeout is delivered again, with receive_count 2."""
    q = backend.queues.create_queue("calque-pool-v", 1)
    q.send("job")
    assert q.receive(1) is not None
    assert q.receive(0) is None                    # invisible while its lease holds
    second = q.receive(3)                          # the lease expires after 1 s
    assert second is not None and second.body == "job" and second.receive_count == 2
    assert q.delete(second)


def test_heartbeat_extends_visibility(backend):
    """change_visibility keeps a message invisible past its original timeout; 0 releases it at once."""
    q = backend.queues.create_queue("calque-pool-h", 1)
    q.send("job")
    m = q.receive(1)
    q.change_visibility(m, 3)
    time.sleep(1.5)                               # past the original 1 s lease
    assert q.receive(0) is None
    q.change_visibility(m, 0)                     # release
    again = q.receive(1)
    assert again is not None and again.receive_count == 2


def test_stale_receipt_loses_the_lease_local(tmp_path):
    """After redelivery to another receiver, the first receipt can neither renew nor ack (local backend)."""
    q = calque_core.LocalBackend(str(tmp_path / "s")).queues.create_queue("calque-pool-s", 1)
    q.send("job")
    first = q.receive(1)
    second = q.receive(3)
    with pytest.raises(calque_core.LeaseLost):
        q.change_visibility(first, 10)
    assert not q.delete(first)
    assert q.delete(second)


def test_local_queue_survives_restart(tmp_path):
    """Nothing queued is lost when every process goes away: a new backend on the same folder sees it."""
    calque_core.LocalBackend(str(tmp_path / "s")).queues.create_queue("calque-pool-r", 30).send("kept")
    again = calque_core.LocalBackend(str(tmp_path / "s")).queues.open_queue("calque-pool-r")
    assert again.receive(1).body == "kept"


def test_delete_queue(backend):
    """A deleted queue is gone."""
    backend.queues.create_queue("calque-pool-d", 30).send("x")
    backend.queues.delete_queue("calque-pool-d")
    with pytest.raises(calque.NotFound):
        backend.queues.open_queue("calque-pool-d")


def test_local_backend_never_imports_boto3(tmp_path):
    """The embedded backend works in a process where boto3 is not importable."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
            "import calque\n"
            f"b = calque.open_backend({str(tmp_path / 's')!r})\n"
            "b.queues.create_queue('calque-pool-z', 5).send('x')\n"
            "print(b.queues.open_queue('calque-pool-z').receive(1).body)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=calque_core.HERE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "x"
