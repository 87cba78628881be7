"""AWS's timing and limits that moto does not have: IAM propagating a new instance profile, SQS deleting a queue
for up to a minute, EC2's 16 KB of user-data, the AMI's root device, the pool queue's redrive policy. The refusals
are AWS's own codes and words, answered at botocore's before-call event (in-process, on moto's mock_aws); the waits
run on a clock that each sleep moves forward at once. The CLI test runs on moto_server."""
import json
import os
import re
import subprocess
import time

import botocore.awsrequest
import pytest

import calque
import calque_ec2 as ec2
import calque_core
import calque_runs
from conftest import HANDLERS, PY, ROOT, backend_for, cli
from test_ec2 import BUCKET, HANDLER, MODEL, REGION, asg_of, aws, client, launch, options, queue_exists, record  # noqa: F401

PROFILE_REFUSED = {   # as AWS words them (Terraform's AWS provider retries on exactly these)
    "autoscaling": ("ValidationError", "You must use a valid fully-formed launch template. Value (calque-x) for "
                                        "parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile "
                                        "name"),
    "ec2": ("InvalidParameterValue", "Value (calque-cold-x) for parameter iamInstanceProfile.name is invalid. "
                                     "Invalid IAM Instance Profile name"),
}


class Clock:
    """time.time() moved forward by each sleep, at once: a minute's wait costs nothing. `slept` lists the waits."""

    def __init__(self, monkeypatch):
        real, self.offset, self.slept = time.time, 0.0, []
        monkeypatch.setattr(time, "time", lambda: real() + self.offset)

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.offset += seconds


def answer(client, operation, reply):
    """Answer the botocore client's `operation` with reply(params) where it returns (status, body) instead of
    sending it: AWS's answers that moto never gives."""
    def before_call(params, **_):
        body = params["body"]     # the query protocol's fields (EC2, Auto Scaling), or JSON (SQS)
        found = reply(body if isinstance(body, dict) else json.loads(body or b"{}"))
        if found is None:
            return None
        status, body = found
        return botocore.awsrequest.AWSResponse("https://aws.test/", status, {}, None), dict(
            body, ResponseMetadata={"HTTPStatusCode": status})
    service = client.meta.service_model.service_id.hyphenize()
    client.meta.events.register(f"before-call.{service}.{operation}", before_call)


def refuse(client, operation, code, message, times):
    """AWS's error `code: message` to the next `times` calls of the operation."""
    left = [times]

    def reply(_):
        if left[0]:
            left[0] -= 1
            return 400, {"Error": {"Code": code, "Message": message, "Type": "Sender"}}
    answer(client, operation, reply)
    return left


def test_a_new_instance_profile_is_waited_for_not_slept_on(aws, monkeypatch, capsys):
    """Auto Scaling refuses a launch template whose instance profile IAM has not propagated (ValidationError ...
    Invalid IAM Instance Profile name) for up to about a minute after it is made. pool create waited a fixed 10 s
    and called CreateAutoScalingGroup once: the first pool of an account stopped there. Now it retries that
    refusal, said in one line, every 5 s for up to 120 s; nothing else is retried; and no fixed sleep is left."""
    clock = Clock(monkeypatch)
    calls = ec2.AwsCalls(aws.backend.session, REGION, sleep=clock.sleep)
    code, words = PROFILE_REFUSED["autoscaling"]
    left = refuse(calls.client("autoscaling"), "CreateAutoScalingGroup", code, words, 3)
    full = ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls)
    assert full["ec2"]["state"] == "ready" and asg_of() is not None and left == [0]
    assert clock.slept == [5.0, 5.0, 5.0]                   # three refusals, three waits: no fixed sleep besides
    err = capsys.readouterr().err
    assert err.count("waiting for IAM to propagate instance profile") == 1, err
    assert "120 s at most" in err and "ValidationError" in err

    # a re-run whose UpdateAutoScalingGroup meets the same refusal for longer than the bound: one line, the step
    clock.slept.clear()
    refuse(calls.client("autoscaling"), "UpdateAutoScalingGroup", code, words, 1000)
    with pytest.raises(calque.UserError, match=r"gave up after 120 s waiting for IAM to propagate instance profile "
                                               r".*ValidationError.*---> HINT: run the command again") as e:
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls)
    assert "\n" not in str(e.value) and sum(clock.slept) == 120.0
    assert "stopped at auto scaling group" in capsys.readouterr().err

    # any other ValidationError is not waited on
    clock.slept.clear()
    calls2 = ec2.AwsCalls(aws.backend.session, REGION, sleep=clock.sleep)
    refuse(calls2.client("autoscaling"), "UpdateAutoScalingGroup", "ValidationError", "Max bounds must be >= min", 1)
    with pytest.raises(calque.UserError, match="Max bounds"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls2)
    assert clock.slept == []


def test_a_cold_run_waits_for_its_new_instance_profile(aws, monkeypatch, capsys):
    """RunInstances refuses a new profile with InvalidParameterValue ... Invalid IAM Instance Profile name: the cold
    launch retries it, said, and launches all its instances once IAM has propagated it."""
    clock = Clock(monkeypatch)
    calls = ec2.AwsCalls(aws.backend.session, REGION, sleep=clock.sleep)
    refuse(calls.client("ec2"), "RunInstances", *PROFILE_REFUSED["ec2"], 2)
    cold = {"model": MODEL, "queue": calque_core.RUN_QUEUE_PREFIX + "r", "dlq": calque_core.RUN_DLQ_PREFIX + "r"}
    ids = ec2.cold_launch(aws.backend, cold, "20261204-101500-ab12cd", 2, launch(ami=aws.ami), timeout=600.0,
                          yes_spend_money=True, calls=calls)
    assert len(ids) == 2 and clock.slept == [5.0, 5.0]
    assert "waiting for IAM to propagate instance profile calque-cold-" in capsys.readouterr().err


class DyingQueues:
    """SQS as AWS has it after DeleteQueue: for 60 s the queue still resolves (GetQueueUrl answers its URL) and
    CreateQueue of its name is refused (QueueDeletedRecently); moto deletes at once."""

    def __init__(self, calls):
        self.deleted = {}      # name -> (time.time() of its deletion, its URL)
        for operation, reply in (("DeleteQueue", self.on_delete), ("GetQueueUrl", self.on_resolve),
                                 ("CreateQueue", self.on_create)):
            answer(calls.client("sqs"), operation, reply)

    def dying(self, name):
        return name in self.deleted and time.time() < self.deleted[name][0] + 60

    def on_delete(self, params):
        url = params["QueueUrl"]
        self.deleted[url.rsplit("/", 1)[1]] = (time.time(), url)   # and sent on: moto deletes it

    def on_resolve(self, params):
        if self.dying(params["QueueName"]):
            return 200, {"QueueUrl": self.deleted[params["QueueName"]][1]}

    def on_create(self, params):
        if self.dying(params["QueueName"]):
            return 400, {"Error": {"Code": "AWS.SimpleQueueService.QueueDeletedRecently", "Type": "Sender",
                                   "Message": "You must wait 60 seconds after deleting a queue before you can "
                                              "create another with the same name."}}


def test_pool_delete_then_create_waits_out_the_dying_queue(aws, monkeypatch, capsys):
    """pool delete, then pool create of the same model within the minute: the dying queue still resolved, so the
    pool was reported ready and its queue vanished under its workers. pool delete now notes when it deleted each
    queue (in the store); pool create waits out the rest of the minute, said, then creates the queues anew."""
    clock = Clock(monkeypatch)
    calls = ec2.AwsCalls(aws.backend.session, REGION, sleep=clock.sleep)
    sqs = DyingQueues(calls)
    names = ec2.resource_names(MODEL)
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls)
    assert ec2.pool_delete(aws.backend, {"model": MODEL}, yes=True, calls=calls)
    assert sqs.dying(names["queue"]) and not queue_exists(names["queue"])
    assert aws.backend.store.exists(calque_core.deleted_queue_key(names["queue"]))
    capsys.readouterr()
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls)
    out, err = capsys.readouterr()
    assert f"queue {names['queue']} created" in out and f"queue {names['dlq']} created" in out, out
    assert queue_exists(names["queue"]) and queue_exists(names["dlq"])          # live ones, not the dying ones
    assert f"queue {names['dlq']} was deleted 0 s ago and SQS may still be deleting it: waiting 65 s" in err, err
    assert 60 <= sum(clock.slept) <= 66                          # one wait covers both queues
    assert not aws.backend.store.exists(calque_core.deleted_queue_key(names["queue"]))   # forgotten once waited out


def test_queue_deleted_recently_is_waited_on(aws, monkeypatch, capsys):
    """A queue deleted where this store did not see it (by hand, another store): CreateQueue answers
    QueueDeletedRecently until the minute is out; pool create retries it, said, bounded."""
    clock = Clock(monkeypatch)
    calls = ec2.AwsCalls(aws.backend.session, REGION, sleep=clock.sleep)
    refuse(calls.client("sqs"), "CreateQueue", "AWS.SimpleQueueService.QueueDeletedRecently",
           "You must wait 60 seconds after deleting a queue before you can create another with the same name.", 4)
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True, calls=calls)
    assert clock.slept == [5.0] * 4 and queue_exists(ec2.resource_names(MODEL)["dlq"])
    assert "waiting for SQS to free the name calque-dlq-" in capsys.readouterr().err


def test_local_workers_pool_waits_out_queue_deleted_recently(aws, monkeypatch, capsys):
    """A pool of local workers on an s3:// store: Pool.delete notes its queues' deletion, and Pool.create waits
    out the rest of the minute, then retries QueueDeletedRecently (a deletion it did not see), said, bounded."""
    clock = Clock(monkeypatch)
    pool = calque.Pool("m", context=(calque_core.settings(), aws.backend))
    aws.backend.queues.sleep = clock.sleep
    pool.create(f"{HANDLERS}:Echo", 0)
    pool.delete()
    pool.create(f"{HANDLERS}:Echo", 0)
    assert 60 <= sum(clock.slept) <= 65 and queue_exists("calque-pool-m")
    assert "queue calque-dlq-m was deleted 0 s ago" in capsys.readouterr().err
    clock.slept.clear()
    words = "You must wait 60 seconds after deleting a queue before you can create another with the same name."
    refuse(aws.backend.queues.sqs, "CreateQueue", "AWS.SimpleQueueService.QueueDeletedRecently", words, 1000)
    with pytest.raises(calque.UserError, match=r"gave up after 65 s waiting for SQS to free the name calque-dlq-m "
                                               r"\(deleted less than 60 s ago\): AWS.SimpleQueueService."
                                               r"QueueDeletedRecently.*---> HINT: run the command again in a minute"):
        pool.create(f"{HANDLERS}:Echo", 0)
    assert sum(clock.slept) == 65.0


def test_pool_queue_has_a_redrive_policy_behind_the_workers_rule(aws):
    """The pool queue's RedrivePolicy sends a claim to its DLQ after 100 receives (twice max deliveries where
    more): a backstop far behind the workers' own rule, which acts first and says why. A claim moved by it is
    read as a dead letter by the kit, with that reason."""
    full = ec2.pool_create(aws.backend, dict(record(aws.backend), max_deliveries=80), HANDLER, options(),
                           yes_spend_money=True)
    sqs = client("sqs")
    url = sqs.get_queue_url(QueueName=full["queue"])["QueueUrl"]
    policy = json.loads(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])[
        "Attributes"]["RedrivePolicy"])
    assert policy["deadLetterTargetArn"].endswith(":" + full["dlq"]) and int(policy["maxReceiveCount"]) == 160
    body = calque_core.make_message("m.20261204-000000-abcdef", MODEL, "s3://b/x", "c00003")
    assert calque_runs.dead_letter_of(calque_core.Message(body, "r", 1))[:2] == ("m.20261204-000000-abcdef", "c00003")
    assert "redrive policy" in calque_runs.dead_letter_of(calque_core.Message(body, "r", 1))[2]
    # a re-run with the pool's default settings sets the policy it wants on the queue it finds
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    policy = json.loads(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])[
        "Attributes"]["RedrivePolicy"])
    assert int(policy["maxReceiveCount"]) == calque_core.REDRIVE_BACKSTOP


def test_user_data_over_16_kb_is_refused_before_anything_is_made(aws, capsys):
    """EC2 takes 16 KB of user-data; an image's package list grows it. pool create says the size in one line, in
    its pre-flight: no queue, role or record is made."""
    big = dict(record(aws.backend), modal={"image": {"pip": [f"package-{k}==1.0" for k in range(600)]}})
    with pytest.raises(calque.UserError, match=r"bootstrap script is [\d,]+ bytes, over EC2's user-data limit of "
                                               r"16,384 \(16 KB\) ---> HINT") as e:
        ec2.pool_create(aws.backend, big, HANDLER, options(), yes_spend_money=True)
    assert "\n" not in str(e.value)
    assert not queue_exists(ec2.resource_names(MODEL)["queue"])
    assert not aws.backend.store.exists(calque_core.pool_key(MODEL))


def test_root_volume_on_the_amis_root_device(aws, monkeypatch):
    """The launch template maps the AMI's root device (its RootDeviceName, looked up) to CALQUE_ROOT_GB of gp3;
    an AMI whose own root is larger keeps its size; a cold run's instances get the same."""
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    data = client("ec2").describe_launch_template_versions(
        LaunchTemplateName=ec2.resource_names(MODEL)["launch_template"], Versions=["$Latest"])[
        "LaunchTemplateVersions"][0]["LaunchTemplateData"]
    device = client("ec2").describe_images(ImageIds=[aws.ami])["Images"][0]["RootDeviceName"]
    [mapping] = data["BlockDeviceMappings"]
    assert mapping["DeviceName"] == device and mapping["Ebs"]["VolumeSize"] == 150
    assert mapping["Ebs"]["VolumeType"] == "gp3"
    image = {"ImageId": "ami-1", "RootDeviceName": "/dev/sda1", "BlockDeviceMappings": [
        {"DeviceName": "/dev/sdb", "Ebs": {"VolumeSize": 900}}, {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 200}}]}
    assert ec2.root_volume(image)[0]["Ebs"]["VolumeSize"] == 200 and ec2.root_volume(image)[0]["DeviceName"] == "/dev/sda1"
    monkeypatch.setenv("CALQUE_ROOT_GB", "300")
    assert ec2.root_volume(image)[0]["Ebs"]["VolumeSize"] == 300
    monkeypatch.setenv("CALQUE_ROOT_GB", "lots")
    with pytest.raises(calque.UserError, match="CALQUE_ROOT_GB='lots' is not a number"):
        ec2.root_volume(image)


@pytest.mark.parametrize("spelling", ["python calque.py", "installed"])
def test_cli_pool_delete_then_create_waits_for_the_queue_name(aws_env, tmp_path, spelling):
    """On the command line, local workers on SQS (moto_server): pool delete notes when its queues went; a pool
    create within the minute says how long it waits, then creates them. The note is aged here by 55 s, so that
    the kit's own wait is 10 s at most, not a minute. The pool queue carries its redrive policy."""
    command = [os.path.join(os.path.dirname(PY), "calque")] if spelling == "installed" else [
        PY, os.path.join(ROOT, "calque.py")]

    def run(*args):
        return subprocess.run([*command, *args], env=aws_env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    create = ("pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "0")
    assert run(*create).returncode == 0
    out = run("pool", "delete", "--model", "m", "--yes")
    assert out.returncode == 0, out.stderr
    backend = backend_for(aws_env)
    for name in ("calque-pool-m", "calque-dlq-m"):
        note = json.loads(backend.store.get(calque_core.deleted_queue_key(name)))
        assert time.time() - note["deleted_at"] < 60
        backend.store.put(calque_core.deleted_queue_key(name), json.dumps(dict(note, deleted_at=note["deleted_at"] - 55)))
    out = run(*create)
    assert out.returncode == 0, out.stderr
    assert re.search(r"queue calque-dlq-m was deleted \d+ s ago and SQS may still be deleting it: waiting \d+ s "
                     r"before creating it again", out.stderr), out.stderr
    assert not backend.store.exists(calque_core.deleted_queue_key("calque-pool-m"))
    queue = backend.queues.open_queue("calque-pool-m")
    policy = json.loads(backend.queues.sqs.get_queue_attributes(QueueUrl=queue.url, AttributeNames=[
        "RedrivePolicy"])["Attributes"]["RedrivePolicy"])
    assert policy["deadLetterTargetArn"].endswith(":calque-dlq-m") and int(policy["maxReceiveCount"]) == 100
    assert cli(aws_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_a_claim_moved_by_the_redrive_policy_is_reported_and_redriven(aws_env, tmp_path):
    """The backstop end to end on moto_server: a claim received past the pool queue's maxReceiveCount by workers
    that never ended it (here: received by hand, its policy set to 2 so that the test needs not 100) lands in the
    DLQ as it was sent; `runs show` names it dead-lettered by the redrive policy, and `runs redrive` sends it
    back, where a worker completes it."""
    from conftest import start_worker, wait_for, write_items
    assert cli(aws_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
               "--workers", "0").returncode == 0
    backend = backend_for(aws_env)
    queue, dlq = backend.queues.open_queue("calque-pool-m"), backend.queues.open_queue("calque-dlq-m")
    policy = json.loads(backend.queues.sqs.get_queue_attributes(QueueUrl=queue.url, AttributeNames=[
        "RedrivePolicy"])["Attributes"]["RedrivePolicy"])
    backend.queues.sqs.set_queue_attributes(QueueUrl=queue.url, Attributes={
        "RedrivePolicy": json.dumps(dict(policy, maxReceiveCount=2))})
    out = cli(aws_env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", [{"x": 1}]), "--no-wait")
    run_id = out.stdout.strip()
    for _ in range(2):                         # two deliveries nobody ends (visibility 0: at once again)
        message = queue.receive(1)
        queue.change_visibility(message, 0)
    assert queue.receive(1) is None            # the third receive: SQS moved it
    wait_for(lambda: dlq.counts()["visible"] == 1, 10, "the claim in the DLQ")
    shown = cli(aws_env, "runs", "show", run_id)
    assert "dead-lettered" in shown.stdout and "redrive policy" in shown.stdout, shown.stdout
    assert cli(aws_env, "runs", "redrive", run_id).returncode == 0
    w = start_worker(aws_env, "--model", "m")
    def done():
        return backend.store.exists(calque_core.summary_key(run_id, "c00000")) and calque_core.read_json(
            backend, calque_core.summary_key(run_id, "c00000"))["status"] == "ok"
    wait_for(done, 60, "the redriven claim to complete")
    w.terminate()
    assert w.wait(30) == 0


def test_a_missing_key_answered_403_is_asked_again_as_the_listing_the_role_may_make(aws):
    """S3 answers HEAD of a missing key with 403 where it deems the caller may not list it (a ListBucket
    limited by s3:prefix may be such): the store asks the one-key listing instead, so "no summary yet" is
    not "forbidden"; a listing refused too is the refusal."""
    store = calque_core.open_backend(f"s3://{BUCKET}/root").store
    store.put("runs/r/summaries/c0.json", b"{}")
    answer(store.s3, "HeadObject", lambda _: (403, {"Error": {"Code": "403", "Message": "Forbidden"}}))
    assert store.exists("runs/r/summaries/c0.json") and not store.exists("runs/r/summaries/c1.json")
    refuse(store.s3, "ListObjectsV2", "AccessDenied", "Access Denied", 1)
    with pytest.raises(Exception, match="AccessDenied"):
        store.exists("runs/r/summaries/c1.json")
