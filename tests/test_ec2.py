"""The EC2 cohort (pool create/scale/status/list/delete with --instances, the cold path on EC2), all on moto's
in-process mock_aws: never a real AWS endpoint, never the metadata address (conftest's socket guard)."""
import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys

import boto3
import botocore.client
import pytest
from moto import mock_aws

import calque
import calque_ec2 as ec2
import calque_core
import calque_fleet
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANDLER = os.path.join(ROOT, "tests", "handlers.py") + ":Echo"
MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
BUCKET = "calque-ec2-test"
STORE = f"s3://{BUCKET}/root"
REGION = "us-east-1"


def _moto_new_version_keeps_user_data(monkeypatch):
    """moto 5.2.5 stores a new launch-template version's UserData unparsed (CreateLaunchTemplate parses it), then
    asserts on it when an ASG launches from that version: parse it the same way. Test-only, moto's bug."""
    from moto.ec2.models.launch_templates import LaunchTemplate
    from moto.ec2.utils import parse_user_data
    real = LaunchTemplate.create_version

    def create_version(self, data, description):
        if isinstance(data.get("UserData"), str):
            data = dict(data, UserData=parse_user_data(data["UserData"]))
        return real(self, data, description)
    monkeypatch.setattr(LaunchTemplate, "create_version", create_version)


def amazon_ami(arch, name):
    """The id of an Amazon-owned AMI of `arch` whose name matches `name` in moto's catalogue: filtered by moto, as
    listing all 1,301 of them costs ~1.5 s of CPU per test."""
    images = boto3.client("ec2", region_name=REGION).describe_images(Owners=["amazon"], Filters=[
        {"Name": "architecture", "Values": [arch]}, {"Name": "name", "Values": [name]}])["Images"]
    return images[0]["ImageId"]


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """A mocked account: a bucket, an x86_64 AMI published under a test SSM parameter, no IAM waits."""
    monkeypatch.setenv("CALQUE_ENV", str(tmp_path / "none.env"))
    _moto_new_version_keeps_user_data(monkeypatch)
    with mock_aws():
        boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
        ami = amazon_ami("x86_64", "Deep Learning AMI *")
        boto3.client("ssm", region_name=REGION).put_parameter(Name="/calque-test/dlami", Value=ami, Type="String")
        monkeypatch.setattr(ec2, "DLAMI_PARAMETERS", {"x86_64": "/calque-test/dlami",
                                                      "arm64": "/calque-test/dlami-arm"})
        monkeypatch.setattr(ec2, "IAM_PROPAGATION_WAIT", 0)
        yield argparse.Namespace(backend=calque_core.open_backend(STORE), ami=ami)


def options(**kw):
    """The fleet `--instances 2 --instance-type g5.xlarge` asks for, with kw's changes, checked as the CLI does."""
    return ec2.pool_options(**{"instances": 2, "instance_type": "g5.xlarge", **kw})


def launch(**kw):
    """A cold run's one-shot instances: g5.xlarge, with kw's changes."""
    return ec2.ColdLaunch(**{"ami": None, "instance_type": "g5.xlarge", **kw})


def record(backend, model=MODEL):
    """The record cmd_pool_create builds before it hands an EC2 pool over (no handler: ec2.pool_create snapshots it)."""
    return {"model": model, "slug": calque_core.slug(model), "queue": calque_core.pool_queue_name(model),
            "dlq": calque_core.dlq_name(model), "batch_size": 8, "visibility_timeout": 60, "max_deliveries": 3,
            "created_at": calque_core.now_iso(), "store": backend.describe()}


def client(service):
    return boto3.client(service, region_name=REGION)


def asg_of(model=MODEL):
    groups = client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=[ec2.resource_names(model)["asg"]])["AutoScalingGroups"]
    return groups[0] if groups else None


def role_exists(name):
    try:
        client("iam").get_role(RoleName=name)
        return True
    except client("iam").exceptions.NoSuchEntityException:
        return False


def queue_exists(name):
    return any(u.endswith("/" + name) for u in client("sqs").list_queues(QueueNamePrefix=name).get("QueueUrls", []))


def launch_template_user_data(model=MODEL):
    v = client("ec2").describe_launch_template_versions(LaunchTemplateName=ec2.resource_names(model)["launch_template"],
                                                        Versions=["$Latest"])["LaunchTemplateVersions"][0]
    return base64.b64decode(v["LaunchTemplateData"]["UserData"]).decode(), v


@pytest.fixture
def api_calls(monkeypatch):
    """Every AWS API operation any client in this process makes, as 'service:Operation'."""
    made = []
    real = botocore.client.BaseClient._make_api_call

    def spy(self, operation, params):
        made.append(f"{self.meta.service_model.service_name}:{operation}")
        return real(self, operation, params)
    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", spy)
    return made


def fail_on(monkeypatch, operation, error=None):
    """Make AwsCalls.call raise at the first `operation` (once), as an interruption or an AWS failure would."""
    real = ec2.AwsCalls.call
    state = {"armed": True}

    def call(self, service, op, **params):
        if op == operation and state["armed"]:
            state["armed"] = False
            raise error or KeyboardInterrupt()
        return real(self, service, op, **params)
    monkeypatch.setattr(ec2.AwsCalls, "call", call)


# ------------------------------------------------------------------------------------------------

def test_full_cycle_create_status_scale_list_delete(aws, capsys):
    """create -> status -> scale -> list -> delete on one pool, and a second delete finds nothing left."""
    backend = aws.backend
    names = ec2.resource_names(MODEL)
    full = ec2.pool_create(backend, record(backend), HANDLER, options(), yes_spend_money=True)
    assert full["ec2"]["state"] == "ready" and full["ec2"]["ami"] == aws.ami
    stored = calque_core.read_json(backend, calque_core.pool_key(MODEL))
    assert stored["ec2"]["state"] == "ready" and stored["handler"]["class"] == "Echo"
    assert backend.store.get(stored["handler"]["key"]) == open(HANDLER.rsplit(":", 1)[0], "rb").read()
    assert backend.store.exists(stored["ec2"]["kit"]["key"])
    group = asg_of()
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (2, 2, 2)
    tags = {t["Key"]: t["Value"] for t in group["Tags"]}
    assert (tags["calque:pool-model"] == MODEL and tags["calque:role"] == "pool-worker"
            and tags["calque:managed"] == "true")
    assert re.match(r"\d{4}-\d\d-\d\dT", tags["calque:created-at"])
    assert group["LaunchTemplate"]["LaunchTemplateName"] == names["launch_template"]
    profile = client("iam").get_instance_profile(InstanceProfileName=names["instance_profile"])["InstanceProfile"]
    assert [r["RoleName"] for r in profile["Roles"]] == [names["role"]]
    assert queue_exists(names["queue"]) and queue_exists(names["dlq"])

    status = ec2.pool_status(backend, stored)
    assert status["asg"]["desired"] == 2 and status["instances"] == {"InService": 2}
    assert status["queue"] == {"visible": 0, "in_flight": 0} and status["dlq"] == {"visible": 0, "in_flight": 0}
    assert any("desired 2" in line for line in ec2.format_status(status))

    ec2.pool_scale(backend, stored, 3, yes_spend_money=True)
    assert (asg_of()["DesiredCapacity"] == 3
            and calque_core.read_json(backend, calque_core.pool_key(MODEL))["ec2"]["instances"] == 3)
    with pytest.raises(calque.UserError, match="--yes-spend-money"):
        ec2.pool_scale(backend, calque_core.read_json(backend, calque_core.pool_key(MODEL)), 5)
    ec2.pool_scale(backend, calque_core.read_json(backend, calque_core.pool_key(MODEL)), 1)
    assert asg_of()["DesiredCapacity"] == 1

    listed = ec2.pool_list(backend)
    assert [(p["model"], p["record"], p["asg"], p["desired"]) for p in listed] == [(MODEL, True, names["asg"], 1)]

    capsys.readouterr()
    assert ec2.pool_delete(backend, stored, yes=True)
    out = capsys.readouterr().out
    for thing in (f"auto scaling group {names['asg']}: scaled to 0 and deleted",
                  f"launch template {names['launch_template']}: deleted",
                  f"IAM role {names['role']}: deleted", f"queue {names['queue']}: deleted", "store folder pools/"):
        assert thing in out
    assert asg_of() is None and not role_exists(names["role"]) and not queue_exists(names["queue"])
    assert not backend.store.exists(calque_core.pool_key(MODEL)) and not backend.store.exists(stored["ec2"]["kit"]["key"])
    assert ec2.pool_delete(backend, {"model": MODEL}, yes=True)        # re-runnable: every step "already gone"
    assert capsys.readouterr().out.count("not found (already gone)") == 6


def test_worker_policy_statement_by_statement(aws):
    """The pool role's policy is exactly these eight statements, and it is what IAM holds after
    create."""
    policy = ec2.worker_policy("s3://bkt/calque/root", MODEL, "eu-west-1", "111122223333")
    q = "arn:aws:sqs:eu-west-1:111122223333:"
    obj = "arn:aws:s3:::bkt/calque/root/"
    s = "qwen-qwen2-5-1-5b-instruct"
    assert policy == {"Version": "2012-10-17", "Statement": [
        {"Sid": "ClaimFromPoolQueue", "Effect": "Allow",
         "Action": ["sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl",
                    "sqs:ReceiveMessage"],
         "Resource": q + "calque-pool-" + s},
        {"Sid": "DeadLetterOnly", "Effect": "Allow", "Action": ["sqs:GetQueueAttributes", "sqs:GetQueueUrl",
                                                                "sqs:SendMessage"],
         "Resource": q + "calque-dlq-" + s},
        {"Sid": "ReadPoolAndClaims", "Effect": "Allow", "Action": ["s3:GetObject"],   # only this model's runs
         "Resource": [obj + f"pools/{s}/*", obj + f"runs/{s}.*/manifests/*", obj + f"runs/{s}.*/inputs/*",
                      obj + f"runs/{s}.*/summaries/*", obj + f"runs/{s}.*/results/*"]},   # + take_over's
        {"Sid": "WriteResults", "Effect": "Allow", "Action": ["s3:PutObject"],
         "Resource": [obj + f"runs/{s}.*/results/*", obj + f"runs/{s}.*/summaries/*", obj + f"runs/{s}.*/progress/*",
                      obj + f"pools/{s}/workers/*",
                      obj + f"pools/{s}/instances/*",             # + the bootstrap's report
                      obj + f"pools/{s}/output/*", obj + f"pools/{s}/streams/*"]},   # prints, remote_gen
        {"Sid": "NotFoundIsNotForbidden", "Effect": "Allow", "Action": ["s3:ListBucket"],
         "Resource": "arn:aws:s3:::bkt",
         "Condition": {"StringLike": {"s3:prefix": [f"calque/root/runs/{s}.*", f"calque/root/pools/{s}/*"]}}},
        {"Sid": "PruneOwnOutput", "Effect": "Allow", "Action": ["s3:DeleteObject"],   # its old print chunks
         "Resource": obj + f"pools/{s}/output/*"},
        {"Sid": "ShareOwnVenv", "Effect": "Allow",            # the venv its first instance built
         "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
         "Resource": obj + f"pools/{s}/env/*"},
        {"Sid": "ReplaceOrProtectOwnInstance", "Effect": "Allow",                           # its group only
             "Action": ["autoscaling:SetInstanceHealth", "autoscaling:SetInstanceProtection",
                        "autoscaling:CompleteLifecycleAction"],
         "Resource": "arn:aws:autoscaling:eu-west-1:111122223333:autoScalingGroup:*:autoScalingGroupName/"
                     f"calque-pool-{s}"},
    ]}
    cold = ec2.cold_worker_policy("s3://bkt", "eu-west-1", "111122223333")
    assert [(st["Sid"], st["Action"], st["Resource"]) for st in cold["Statement"]] == [
        ("ClaimFromRunQueues", ["sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:GetQueueAttributes",
                                "sqs:GetQueueUrl", "sqs:ReceiveMessage"], q + "calque-run-*"),
        ("DeadLetterOnly", ["sqs:GetQueueAttributes", "sqs:GetQueueUrl", "sqs:SendMessage"], q + "calque-rundlq-*"),
        ("ReadRunAndClaims", ["s3:GetObject"], ["arn:aws:s3:::bkt/runs/*/pool.json",
                                               "arn:aws:s3:::bkt/runs/*/handler/*", "arn:aws:s3:::bkt/runs/*/kit/*",
                                               "arn:aws:s3:::bkt/runs/*/manifests/*",
                                               "arn:aws:s3:::bkt/runs/*/inputs/*",
                                               "arn:aws:s3:::bkt/runs/*/summaries/*",
                                               "arn:aws:s3:::bkt/runs/*/results/*",
                                               "arn:aws:s3:::bkt/runs/*/workers/*"]),
        ("WriteResults", ["s3:PutObject"], ["arn:aws:s3:::bkt/runs/*/results/*", "arn:aws:s3:::bkt/runs/*/summaries/*",
                                            "arn:aws:s3:::bkt/runs/*/progress/*", "arn:aws:s3:::bkt/runs/*/workers/*",
                                            "arn:aws:s3:::bkt/runs/*/output/*"]),
        ("NotFoundIsNotForbidden", ["s3:ListBucket"], "arn:aws:s3:::bkt"),
        ("PruneOwnOutput", ["s3:DeleteObject"], "arn:aws:s3:::bkt/runs/*/output/*")]
    assert cold["Statement"][4]["Condition"] == {"StringLike": {"s3:prefix": ["runs/*"]}}
    # every action is on a named resource, never "*"
    for st in policy["Statement"] + cold["Statement"]:
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        assert st["Effect"] == "Allow" and "*" not in resources

    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instances=0), yes_spend_money=True)
    iam = client("iam")
    names = ec2.resource_names(MODEL)
    assert iam.list_role_policies(RoleName=names["role"])["PolicyNames"] == ["calque-worker"]
    held = iam.get_role_policy(RoleName=names["role"], PolicyName="calque-worker")["PolicyDocument"]
    held = json.loads(held) if isinstance(held, str) else held
    assert held == ec2.worker_policy(STORE, MODEL, REGION, "123456789012")
    assert iam.list_attached_role_policies(RoleName=names["role"])["AttachedPolicies"] == []
    trust = iam.get_role(RoleName=names["role"])["Role"]["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"] == [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                   "Action": "sts:AssumeRole"}]


def _env_block(script):
    return script.split("<<'CALQUE_ENV_EOF'\n", 1)[1].split("\nCALQUE_ENV_EOF\n", 1)[0]


def test_user_data_parses_and_carries_model_store_and_flags(aws, tmp_path):
    """bash -n passes on both scripts; they carry the model, store, region, kit digest, Restart=always, the spot
    poller and no credentials; the env file round-trips an awkward model name through bash exactly."""
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    script, _ = launch_template_user_data()
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    cold = ec2.user_data_cold("20261129-101500-ab12cd", STORE, REGION, "runs/x/kit/k.tar.gz", "f" * 64, 90)
    for text in (script, cold):
        check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr
        for needle in (f"CALQUE_STORE={STORE}", f"AWS_REGION={REGION}", "CALQUE_SPOT_POLL=http://169.254.169.254",
                       "CALQUE_STATE=/var/lib/calque", "sha256sum -c",
                       "pip\" install -q -r \"$CALQUE/kit/requirements.txt\"",
                       "--no-build-isolation --no-cache-dir \\\n  \"$CALQUE/kit.tar.gz\"", "import fastbatch",
                       "StandardOutput=journal", "User=calque"):
            assert needle in text, needle
        for banned in ("AKIA", "AWS_SECRET", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "aws_secret_access_key"):
            assert banned not in text
    assert f"CALQUE_POOL_MODEL={MODEL}" in script and 'bin/warmd --model "$CALQUE_POOL_MODEL"' in script
    assert "Restart=always" in script and "systemctl enable --now calque-warmd.service" in script
    assert stored["ec2"]["kit"]["sha256"] in script and f"root/{stored['ec2']['kit']['key']}" in script
    assert "CALQUE_RUN=20261129-101500-ab12cd" in cold and 'bin/warmd --run "$CALQUE_RUN"' in cold
    assert "Restart=no" in cold and "poweroff" in cold and "shutdown -h +90" in cold

    awkward = "it's a \"model\" $HOME `x` ; rm -rf /"
    env = _env_block(ec2.user_data_pool(awkward, STORE, REGION, "pools/x/kit/k.tar.gz", "0" * 64))
    (tmp_path / "worker.env").write_text(env + "\n")
    got = subprocess.run(["bash", "-c", 'set -a; . "$1"; printf %s "$CALQUE_POOL_MODEL"', "_",
                          str(tmp_path / "worker.env")],
                         capture_output=True, text=True, check=True).stdout
    assert got == awkward
    with pytest.raises(calque.UserError, match="control characters"):
        ec2.user_data_pool("two\nlines", STORE, REGION, "k", "0" * 64)
    with pytest.raises(RuntimeError, match="credentials"):
        ec2._refuse_credentials("export AWS_SECRET_ACCESS_KEY=x")
    with pytest.raises(RuntimeError, match="credentials"):
        ec2._refuse_credentials("key AKIAABCDEFGHIJKLMNOP here")


def test_user_data_never_carries_a_key_from_the_environment(monkeypatch):
    """A real-length key in the environment is refused wherever its value appears; a short dummy is no key."""
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SESSION_TOKEN", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    with pytest.raises(RuntimeError, match="credentials"):
        ec2._refuse_credentials(f"echo {secret} > /tmp/x")
    ec2._refuse_credentials("pip install testing")


def test_interrupted_create_rerun_finishes(aws, monkeypatch, capsys):
    """A create interrupted before the ASG says what is in place and what is not; re-running it finishes
    without duplicating anything (same launch-template version, one role)."""
    fail_on(monkeypatch, "CreateAutoScalingGroup")
    with pytest.raises(KeyboardInterrupt):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    err = capsys.readouterr().err
    names = ec2.resource_names(MODEL)
    assert f"stopped at auto scaling group {names['asg']} (interrupted)" in err
    assert (f"in place: queues {names['queue']} + {names['dlq']}, handler, kit and pool record in the store, "
            f"IAM role {names['role']}") in err
    assert f"not done: auto scaling group {names['asg']}, no scale-to-zero alarms, pool record ready" in err
    assert "re-run the same command" in err and "pool delete --model" in err
    assert asg_of() is None and calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))["ec2"]["state"] == "creating"

    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    out = capsys.readouterr().out
    assert f"IAM role {names['role']} found" in out and f"launch template {names['launch_template']} found" in out
    assert f"auto scaling group {names['asg']} created" in out
    assert asg_of()["DesiredCapacity"] == 2
    _, version = launch_template_user_data()
    assert version["VersionNumber"] == 1
    assert calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))["ec2"]["state"] == "ready"

    # a changed re-run
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instances=3, instance_type="g5.2xlarge"),
                    yes_spend_money=True)
    _, version = launch_template_user_data()
    assert version["VersionNumber"] == 2 and version["LaunchTemplateData"]["InstanceType"] == "g5.2xlarge"
    assert asg_of()["DesiredCapacity"] == 3


def test_aws_failure_midway_is_one_line_user_error(aws, monkeypatch, capsys):
    """An AWS error at a step becomes a UserError naming the step, after the in-place/not-done report."""
    from botocore.exceptions import ClientError
    fail_on(monkeypatch, "CreateLaunchTemplate",
            ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": "not allowed"}}, "CreateLaunchTemplate"))
    with pytest.raises(calque.UserError, match=r"create stopped at launch template .*UnauthorizedOperation"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    assert "not done: launch template" in capsys.readouterr().err


def test_a_role_of_our_name_that_is_not_ours_is_never_adopted_nor_deleted(aws, capsys):
    """The role's tags (GetRole answers them): one without calque:managed=true, or another store's pool's, is
    refused by pool create before it makes anything IAM; pool delete skips it and keeps the record to re-run."""
    name = ec2.resource_names(MODEL)["role"]
    trust = json.dumps(ec2.TRUST_POLICY)
    client("iam").create_role(RoleName=name, AssumeRolePolicyDocument=trust)
    with pytest.raises(calque.UserError, match=f"IAM role {name} exists but is not calque's"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    assert not client("iam").list_role_policies(RoleName=name)["PolicyNames"]
    tags = {"calque:managed": "true", "calque:pool-model": ec2._strict_tag(MODEL),
            "calque:store": "s3://another-bucket/x"}
    client("iam").tag_role(RoleName=name, Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
    with pytest.raises(calque.UserError, match=f"IAM role {name} belongs to the pool of .* \\(store s3://another"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    client("iam").untag_role(RoleName=name, TagKeys=list(tags))
    capsys.readouterr()
    assert not ec2.pool_delete(aws.backend, {"model": MODEL}, yes=True)   # last: a create after it waits SQS's minute
    assert f"IAM role {name}: skipped: {name} is not tagged calque:managed=true" in capsys.readouterr().out
    assert role_exists(name)


def test_delete_of_a_half_created_pool(aws, monkeypatch, capsys):
    """Delete after a create that stopped before its launch template removes what exists and reports the
    rest as already gone; a pool that never got its record is deleted by model name alone."""
    fail_on(monkeypatch, "CreateLaunchTemplate")
    with pytest.raises(KeyboardInterrupt):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    names = ec2.resource_names(MODEL)
    assert role_exists(names["role"])
    capsys.readouterr()
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert ec2.pool_delete(aws.backend, stored, yes=True)
    out = capsys.readouterr().out
    assert f"auto scaling group {names['asg']}: not found (already gone)" in out
    assert f"launch template {names['launch_template']}: not found (already gone)" in out
    assert f"instance profile {names['instance_profile']}: deleted" in out
    assert f"IAM role {names['role']}: deleted" in out
    assert not role_exists(names["role"]) and not queue_exists(names["queue"]) and not queue_exists(names["dlq"])
    assert not aws.backend.store.exists(calque_core.pool_key(MODEL))

    other = "llama-3-8b"
    fail_on(monkeypatch, "PutRolePolicy")          # queues, store and role made; the role's policy not
    with pytest.raises(KeyboardInterrupt):
        ec2.pool_create(aws.backend, record(aws.backend, other), HANDLER, options(), yes_spend_money=True)
    aws.backend.store.delete_prefix(f"pools/{calque_core.slug(other)}/")     # and the record lost too
    assert ec2.pool_delete(aws.backend, {"model": other}, yes=True)
    assert not role_exists(ec2.resource_names(other)["role"]) and not queue_exists(calque_core.pool_queue_name(other))


def test_dry_run_makes_no_mutating_call(aws, api_calls, capsys):
    """--dry-run prints every mutating call (IAM, EC2, ASG, SQS, S3) and makes only read-only ones; also for
    scale, delete and a cold launch."""
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(scale_to_zero_after=10), dry_run=True)
    out = capsys.readouterr().out
    for line in ("would call sqs.CreateQueue", "would call s3.PutObject", "would call iam.CreateRole",
                 "would call iam.PutRolePolicy", "would call iam.CreateInstanceProfile",
                 "would call iam.AddRoleToInstanceProfile", "would call ec2.CreateLaunchTemplate",
                 "would call autoscaling.CreateAutoScalingGroup", "would call autoscaling.PutScalingPolicy",
                 "would call cloudwatch.PutMetricAlarm"):
        assert line in out, line
    assert '"sqs:ReceiveMessage"' in out          # the policy is shown in full
    read_only = re.compile(r"^[a-z0-9-]+:(Get|Describe|List|Head)")
    assert api_calls and all(read_only.match(c) for c in api_calls), [c for c in api_calls if not read_only.match(c)]
    assert not role_exists(ec2.resource_names(MODEL)["role"]) and asg_of() is None
    assert not aws.backend.store.exists(calque_core.pool_key(MODEL))

    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    api_calls.clear()
    ec2.pool_scale(aws.backend, stored, 4, dry_run=True)
    ec2.pool_delete(aws.backend, stored, dry_run=True)
    cold = {"model": MODEL, "queue": "calque-run-r1", "dlq": "calque-rundlq-r1"}
    ids = ec2.cold_launch(aws.backend, cold, "r1", 2, launch(ami=aws.ami), timeout=600.0, dry_run=True)
    assert ids == ["i-dry-run-0", "i-dry-run-1"]
    assert all(read_only.match(c) for c in api_calls), [c for c in api_calls if not read_only.match(c)]
    out = capsys.readouterr().out
    assert "would call autoscaling.UpdateAutoScalingGroup" in out
    assert "would call autoscaling.DeleteAutoScalingGroup" in out
    assert "would call iam.DeleteRole" in out and "would call ec2.RunInstances" in out
    assert asg_of()["DesiredCapacity"] == 2 and role_exists(ec2.resource_names(MODEL)["role"])


def test_refusals_before_any_call(aws, api_calls, tmp_path):
    """No --yes-spend-money, a local store, no --yes on delete, bad sizes: one-line UserErrors, no AWS call made."""
    with pytest.raises(calque.UserError, match="--yes-spend-money"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options())
    local = calque_core.LocalBackend(str(tmp_path / "store"))
    with pytest.raises(calque.UserError, match="s3:// store"):
        ec2.pool_create(local, record(local), HANDLER, options(), yes_spend_money=True)
    with pytest.raises(calque.UserError, match="--yes"):
        ec2.pool_delete(aws.backend, {"model": MODEL})
    with pytest.raises(calque.UserError, match="--min-instances"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(min_instances=3),
                        yes_spend_money=True)
    with pytest.raises(calque.UserError, match="--scale-to-zero-after"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(scale_to_zero_after=0),
                        yes_spend_money=True)
    with pytest.raises(calque.UserError, match="--ami"):
        ec2.cold_launch(aws.backend, {"model": MODEL, "queue": "q"}, "r1", 1, launch(), timeout=600.0,
                        yes_spend_money=True)
    assert api_calls == []
    with pytest.raises(calque.UserError, match="not an instance type"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instance_type="g5.bogus"),
                        yes_spend_money=True)
    with pytest.raises(calque.UserError, match="no such subnet"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(subnet="subnet-0000000000"),
                        yes_spend_money=True)
    with pytest.raises(calque.UserError, match="no such key pair"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(key_name="nope"),
                        yes_spend_money=True)
    assert not role_exists(ec2.resource_names(MODEL)["role"])


def test_ami_parameter_missing_ambiguous_or_wrong(aws, monkeypatch):
    """A missing SSM parameter names itself and --ami; a value that is not one AMI id is refused; a bad --ami too."""
    monkeypatch.setattr(ec2, "DLAMI_PARAMETERS", {"x86_64": "/calque-test/none"})
    with pytest.raises(calque.UserError, match=r"/calque-test/none does not exist .*--ami"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    client("ssm").put_parameter(Name="/calque-test/two", Value=f"{aws.ami},ami-0123456789abcdef0", Type="StringList")
    monkeypatch.setattr(ec2, "DLAMI_PARAMETERS", {"x86_64": "/calque-test/two"})
    with pytest.raises(calque.UserError, match="not exactly one AMI id"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    with pytest.raises(calque.UserError, match="ami-0123456789abcdef0 .* does not exist"):
        ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(ami="ami-0123456789abcdef0"),
                        yes_spend_money=True)
    assert not role_exists(ec2.resource_names(MODEL)["role"])


def test_scale_to_zero_alarms_and_cold_hint(aws, capsys):
    """--scale-to-zero-after: min 0, wake/idle policies (exactly N / 0) and alarms on the pool queue (idle counts
    in-flight claims too); submit's hint says the pool is cold once it is at 0."""
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER,
                    options(instances=3, scale_to_zero_after=15, spot=True), yes_spend_money=True)
    names = ec2.resource_names(MODEL)
    group = asg_of()
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (0, 3, 3)
    assert group["MixedInstancesPolicy"]["InstancesDistribution"]["OnDemandPercentageAboveBaseCapacity"] == 0
    policies = {p["PolicyName"]: p for p in client("autoscaling").describe_policies(
        AutoScalingGroupName=names["asg"])["ScalingPolicies"]}
    wake_policy = policies["calque-wake"]       # unmeasured: one instance a claim, up to 3
    assert (wake_policy["PolicyType"], wake_policy["AdjustmentType"]) == ("StepScaling", "ExactCapacity")
    assert [(a["MetricIntervalLowerBound"], a.get("MetricIntervalUpperBound"), a["ScalingAdjustment"])
            for a in wake_policy["StepAdjustments"]] == [(0.0, 1.5, 1), (1.5, 2.5, 2), (2.5, None, 3)]
    assert policies["calque-idle"]["ScalingAdjustment"] == 0
    alarms = {a["AlarmName"]: a for a in client("cloudwatch").describe_alarms(
        AlarmNames=[names["alarm_wake"], names["alarm_idle"]])["MetricAlarms"]}
    wake, idle = alarms[names["alarm_wake"]], alarms[names["alarm_idle"]]
    assert (wake["ComparisonOperator"], wake["Threshold"], wake["EvaluationPeriods"]) == (
        "GreaterThanThreshold", 0, 1)
    assert wake["Metrics"] == idle["Metrics"]       # both on visible + in flight
    assert {m["MetricStat"]["Metric"]["Dimensions"][0]["Value"] for m in wake["Metrics"] if "MetricStat" in m} == {
        names["queue"]}
    assert wake["AlarmActions"] == [policies["calque-wake"]["PolicyARN"]]
    assert idle["EvaluationPeriods"] == 15 and idle["AlarmActions"] == [policies["calque-idle"]["PolicyARN"]]
    assert {m["Id"]: m.get("Expression") for m in idle["Metrics"]}["backlog"] == "visible + inflight"
    assert {m["MetricStat"]["Metric"]["MetricName"] for m in idle["Metrics"] if "MetricStat" in m} == {
        "ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible"}

    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    fleet = ec2.Ec2Fleet({}, aws.backend)
    assert fleet.waking(stored) == ("starting", f"pool {MODEL}: instances in service, no worker running yet "
                                                "(bootstrapping)")          # 3 in service
    ec2.pool_scale(aws.backend, stored, 0)
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    state, hint = fleet.waking(stored)
    assert state == "starting" and "is cold (0 instances)" in hint and "wake alarm" in hint and "min" in hint
    local = calque_fleet.fleet_for(calque_core.settings(), aws.backend, dict(stored, ec2=None))
    assert not local.waking(dict(stored, ec2=None))    # a pool without EC2: none of its hints

    # re-run without the flag
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instances=3), yes_spend_money=True)
    alarms = client("cloudwatch").describe_alarms(AlarmNames=[names["alarm_wake"], names["alarm_idle"]])
    assert alarms["MetricAlarms"] == []
    assert "scale-to-zero alarms removed" in capsys.readouterr().out


def _moto_policies_keep_min_and_max(monkeypatch):
    """moto 5.2.5 lets an ExactCapacity policy set any capacity; AWS keeps a group's desired capacity between its
    MinSize and MaxSize ("must be greater than or equal to the minimum size of the group and less than or equal to
    the maximum size", UpdateAutoScalingGroup): clamp the same way. Test-only."""
    from moto.autoscaling.models import FakeScalingPolicy
    real = FakeScalingPolicy.execute

    def execute(self):
        if self.adjustment_type != "ExactCapacity":
            return real(self)
        group = self.autoscaling_backend.autoscaling_groups[self.auto_scaling_group_name]
        self.autoscaling_backend.set_desired_capacity(
            group.name, max(group.min_size, min(group.max_size, self.scaling_adjustment)))
    monkeypatch.setattr(FakeScalingPolicy, "execute", execute)


def fire(alarm_name, backlog=1):
    """What CloudWatch does every minute an Auto Scaling alarm stays in ALARM: run its scaling policy; a step
    policy (moto does not pick steps) sets the capacity of the step `backlog` falls in, within MinSize..MaxSize as
    AWS does (a scale-in terminates unprotected instances only, in moto as in AWS)."""
    alarm = client("cloudwatch").describe_alarms(AlarmNames=[alarm_name])["MetricAlarms"][0]
    arn, = alarm["AlarmActions"]
    asg, name = ec2.resource_names(MODEL)["asg"], arn.rsplit("policyName/", 1)[1]
    policy, = client("autoscaling").describe_policies(AutoScalingGroupName=asg, PolicyNames=[name])["ScalingPolicies"]
    if policy["PolicyType"] != "StepScaling":
        client("autoscaling").execute_policy(AutoScalingGroupName=asg, PolicyName=name)
        return
    step, = [a for a in policy["StepAdjustments"] if a["MetricIntervalLowerBound"] <= backlog - alarm["Threshold"]
             < a.get("MetricIntervalUpperBound", float("inf"))]
    group = asg_of()
    client("autoscaling").set_desired_capacity(AutoScalingGroupName=asg, DesiredCapacity=max(
        group["MinSize"], min(group["MaxSize"], step["ScalingAdjustment"])))


def test_pool_scale_holds_a_scale_to_zero_pool(aws, monkeypatch, capsys):
    """On a scale-to-zero pool, `pool scale --instances 3` holds MinSize at 3: its idle alarm, re-run every minute,
    cannot take the group below 3, and a `pool create` re-run keeps the hold and never sets the desired count;
    `--instances 0` hands the pool back to its alarms. Missing SQS data is FILLed explicitly."""
    _moto_policies_keep_min_and_max(monkeypatch)
    names = ec2.resource_names(MODEL)
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(scale_to_zero_after=10),
                    yes_spend_money=True)
    idle = client("cloudwatch").describe_alarms(AlarmNames=[names["alarm_idle"]])["MetricAlarms"][0]
    assert {m["Id"]: m.get("Expression") for m in idle["Metrics"] if "Expression" in m} == {
        "visible": "FILL(visible_raw, 0)", "inflight": "FILL(inflight_raw, 0)", "backlog": "visible + inflight"}
    assert idle["TreatMissingData"] == "breaching"
    fire(names["alarm_idle"])                                    # idle: asleep
    assert asg_of()["DesiredCapacity"] == 0

    ec2.pool_scale(aws.backend, calque_core.read_json(aws.backend, calque_core.pool_key(MODEL)), 3,
                   yes_spend_money=True)
    group = asg_of()
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (3, 3, 3)
    fire(names["alarm_idle"])                                    # a minute later, still in ALARM
    assert asg_of()["DesiredCapacity"] == 3
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert stored["ec2"]["held"] == 3
    status = ec2.format_status(ec2.pool_status(aws.backend, stored))
    assert any("scale to zero: held at 3 by `pool scale`" in line for line in status), status

    capsys.readouterr()
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instances=3, scale_to_zero_after=10),
                    yes_spend_money=True)
    assert f"auto scaling group {names['asg']} updated; desired 3 kept" in capsys.readouterr().out
    fire(names["alarm_idle"])
    assert asg_of()["DesiredCapacity"] == 3 and asg_of()["MinSize"] == 3

    ec2.pool_scale(aws.backend, calque_core.read_json(aws.backend, calque_core.pool_key(MODEL)), 0)
    group = asg_of()
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (0, 3, 0)
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert stored["ec2"]["held"] is None and stored["ec2"]["instances"] == 3
    status = ec2.format_status(ec2.pool_status(aws.backend, stored))
    assert any("scale to zero: alarms in charge (backlog steps up to 3" in line for line in status), status
    fire(names["alarm_wake"], backlog=1)
    assert asg_of()["DesiredCapacity"] == 1
    fire(names["alarm_wake"], backlog=7)
    assert asg_of()["DesiredCapacity"] == 3
    fire(names["alarm_idle"])
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instances=3, scale_to_zero_after=10),
                    yes_spend_money=True)                 # a re-run on a sleeping pool does not wake it
    assert asg_of()["DesiredCapacity"] == 0
    with pytest.raises(calque.UserError, match="--scale-to-zero-after 1: minutes between 2"):
        options(scale_to_zero_after=1)


def test_status_shows_bootstrap_reports(aws):
    """pool status reads the instances' bootstrap reports: the builds they run (their venv unpacked
    from the store or installed), a WARNING for a failed fastbatch
    build or a torch blind to the GPU, and the failed bootstraps of instances already replaced."""
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(), yes_spend_money=True)
    ready, numpy_cpu = sorted(i["InstanceId"] for i in asg_of()["Instances"])
    prefix = ec2.resource_names(MODEL)["report_prefix"]

    def report(started, instance_id, **fields):
        calque_core.write_json(aws.backend, f"{prefix}{started}.{instance_id}.json",
                          dict({"instance_id": instance_id, "started": started, "state": "ready", "fastbatch": "c",
                                "torch": "2.13.0+cu128", "torch_cuda": "12.8", "torch_gpu": "True",
                                "gpu": "NVIDIA A10G"}, **fields))
    report("20261129T100000Z", "i-0gone0failed0000", state="failed", stage="pip install -r requirements.txt",
           reason="ERROR: Could not install packages\nConnection reset by peer")
    report("20261129T100500Z", "i-0gone0scaledin00")
    report("20261129T101000Z", ready, venv="unpacked")
    report("20261129T101000Z", numpy_cpu, fastbatch="failed: fastbatch.c:1:10: fatal error: Python.h: No such file",
           torch="2.13.0+cpu", torch_cuda="None", torch_gpu="False")
    status = ec2.pool_status(aws.backend, calque_core.read_json(aws.backend, calque_core.pool_key(MODEL)))
    assert sorted(status["bootstrap"]["current"]) == sorted([ready, numpy_cpu])
    assert [r["instance_id"] for r in status["bootstrap"]["failed"]] == ["i-0gone0failed0000"]
    text = "\n".join(ec2.format_status(status))
    assert ("bootstrap: 1 ready with torch 2.13.0+cu128 (CUDA 12.8, GPU visible), fastbatch C, "
            "venv unpacked") in text
    assert (f"WARNING ({numpy_cpu}): fastbatch's C build failed: fastbatch.c:1:10: fatal error: Python.h" in text
            and "gather batches with the numpy path" in text)
    assert f"WARNING ({numpy_cpu}): torch 2.13.0+cpu does not see the GPU (NVIDIA A10G)" in text
    assert ("instances that failed to bootstrap" in text and "i-0gone0failed0000 (started 20261129T100000Z): "
            "pip install -r requirements.txt: ERROR: Could not install packages | Connection reset by peer" in text)
    assert "i-0gone0scaledin00" not in text


def test_arm64_gpu_type_is_warned_about(aws, capsys):
    """An arm64 GPU instance type gets a WARNING that the pinned torch may have no CUDA wheel there."""
    arm = amazon_ami("arm64", "amzn2-ami-hvm-*")
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER, options(instance_type="g5g.xlarge", ami=arm),
                    dry_run=True)
    assert "WARNING: g5g.xlarge is arm64: PyPI's torch==2.13.0 wheel for Linux aarch64 may be a CPU-only build" in (
        capsys.readouterr().out)


def test_cold_launch_one_shot_instances(aws):
    """A cold run on EC2 launches --shards instances on the shared cold role, with the run's user-data,
    terminate-on-shutdown and run tags; cleanup terminates the ones still up."""
    run_id = "20261129-101500-ab12cd"
    cold = {"model": MODEL, "queue": calque_core.RUN_QUEUE_PREFIX + run_id, "dlq": calque_core.RUN_DLQ_PREFIX + run_id}
    ids = ec2.cold_launch(aws.backend, cold, run_id, 2, launch(ami=aws.ami), timeout=1200.0,
                          yes_spend_money=True)
    assert len(ids) == 2
    instances = client("ec2")
    for iid in ids:
        assert instances.describe_instance_attribute(InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")[
            "InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        user_data = base64.b64decode(instances.describe_instance_attribute(
            InstanceId=iid, Attribute="userData")["UserData"]["Value"]).decode()
        assert f"CALQUE_RUN={run_id}" in user_data and "shutdown -h +50" in user_data
    inst = instances.describe_instances(InstanceIds=ids)["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["calque:run"] == run_id and tags["calque:role"] == "cold-worker"
    role = ec2.cold_role_name(STORE, REGION)
    held = client("iam").get_role_policy(RoleName=role, PolicyName="calque-worker")["PolicyDocument"]
    held = json.loads(held) if isinstance(held, str) else held
    assert held == ec2.cold_worker_policy(STORE, REGION, "123456789012")
    assert any(k.startswith(f"runs/{run_id}/kit/") for k in aws.backend.store.list(f"runs/{run_id}/kit/"))
    # a second run reuses the role
    ec2.cold_launch(aws.backend, cold, "20261129-101600-cd34ef", 1, launch(ami=aws.ami), timeout=600.0,
                    yes_spend_money=True)
    roles = [r["RoleName"] for r in client("iam").list_roles()["Roles"]]
    assert [r for r in roles if r.startswith("calque-cold-")] == [role]
    assert sorted(ec2.cold_cleanup(aws.backend, ids)) == sorted(ids)
    assert ec2.cold_cleanup(aws.backend, ids) == []


def test_names_fit_aws_limits():
    """IAM names stay within 64 characters, and two long models that share a cut prefix get different names."""
    a, b = "m" * 60 + "-one", "m" * 60 + "-two"          # distinct slugs (64 chars) whose role names must be cut
    na, nb = ec2.resource_names(a), ec2.resource_names(b)
    assert len(na["role"]) <= 64 and na["role"] != nb["role"] and na["role"] == na["instance_profile"]
    assert ec2.resource_names("llama-3-8b")["role"] == "calque-llama-3-8b"
    assert len(ec2.resource_names("x" * 200)["asg"]) == 80
    assert len(ec2.cold_role_name(STORE, REGION)) <= 64


def test_import_never_loads_boto3():
    """Importing calque (as the local backend and every handler do) loads neither boto3 nor botocore."""
    probe = "import sys, calque; assert 'boto3' not in sys.modules and 'botocore' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_every_aws_call_is_documented(aws, api_calls):
    """Every AWS operation the EC2 commands make appears as service:Operation in the README's On AWS section."""
    backend = aws.backend
    ec2.pool_create(backend, record(backend), HANDLER, options(scale_to_zero_after=5), yes_spend_money=True)
    stored = calque_core.read_json(backend, calque_core.pool_key(MODEL))
    ec2.pool_status(backend, stored)
    ec2.pool_scale(backend, stored, 1, yes_spend_money=True)
    ec2.pool_list(backend)
    ec2.Ec2Fleet({}, backend).waking(stored)
    ids = ec2.cold_launch(backend, {"model": MODEL, "queue": "calque-run-r9"}, "r9", 1, launch(ami=aws.ami),
                          timeout=600.0, yes_spend_money=True)
    ec2.cold_cleanup(backend, ids)
    # the update paths
    ec2.pool_create(backend, record(backend), HANDLER, options(instance_type="g5.2xlarge"), yes_spend_money=True)
    ec2.pool_delete(backend, stored, yes=True)
    docs = ""
    for name in (os.path.join("docs", "aws.md"), "README.md"):
        path = os.path.join(ROOT, name)
        if os.path.exists(path):
            docs += open(path).read()
    missing = sorted({c for c in api_calls if f"`{c}`" not in docs})
    assert not missing, f"AWS calls not listed in the On AWS section: {missing}"


def test_the_cli_drives_an_ec2_pool(aws, monkeypatch, capsys, tmp_path):
    """Through `calque.py` itself: dry-run creates nothing; create, status, scale, list, a cold dry-run, delete."""
    monkeypatch.setenv("CALQUE_STORE", STORE)
    monkeypatch.setenv("CALQUE_STATE", str(tmp_path / "state"))
    create = ["pool", "create", "--model", MODEL, "--handler", HANDLER, "--instances", "2", "--instance-type",
              "g5.xlarge"]
    assert calque.main(create) == calque_core.EXIT_USAGE                       # no --yes-spend-money: refused
    assert "--yes-spend-money" in capsys.readouterr().err
    assert calque.main(create + ["--dry-run"]) == 0
    assert "would call" in capsys.readouterr().out and asg_of() is None
    assert calque.main(create + ["--yes-spend-money"]) == 0
    assert asg_of()["DesiredCapacity"] == 2
    assert calque.main(["pool", "status", "--model", MODEL]) == 0
    assert "desired 2" in capsys.readouterr().out
    assert calque.main(["pool", "scale", "--model", MODEL, "--instances", "1"]) == 0
    assert asg_of()["DesiredCapacity"] == 1
    assert calque.main(["pool", "list"]) == 0
    assert "EC2 1/1 in service" in capsys.readouterr().out
    items = os.path.join(ROOT, "examples", "items.jsonl")
    assert calque.main(["submit", "--model", MODEL, items, "--instance-type", "g5.xlarge", "--ami", aws.ami,
                        "--dry-run"]) == 0
    assert "would call ec2.RunInstances" in capsys.readouterr().out
    assert not [k for k in aws.backend.store.list("runs/")], "a cold dry run writes nothing to the store"
    assert calque.main(["pool", "delete", "--model", MODEL]) == calque_core.EXIT_USAGE   # no --yes: refused
    assert calque.main(["pool", "delete", "--model", MODEL, "--yes"]) == 0
    assert asg_of() is None and not queue_exists(calque_core.pool_queue_name(MODEL))


def test_group_that_sizes_itself_protection_and_delete(aws, monkeypatch, capsys):
    """--min-instances 0 --max-instances 3: a backlog step policy on the wake alarm (steps from desired_count, a
    measured seconds per claim once summaries exist) and the idle policy; the user-data tells warmd its group and
    instance; an instance protected while it holds a claim (ScaleInProtection, as warmd calls it) survives a
    scale-in that takes the idle ones, so scaling in costs no redelivery; pool delete removes alarms and policies."""
    _moto_policies_keep_min_and_max(monkeypatch)
    names = ec2.resource_names(MODEL)
    calque_core.write_json(aws.backend, calque_core.run_key(f"{calque_core.slug(MODEL)}.20261201-100000-aaaaaa"), {
        "run_id": f"{calque_core.slug(MODEL)}.20261201-100000-aaaaaa", "model": MODEL, "mode": "pool", "claims": ["c00000"],
        "items": 10, "claim_size": 10, "created_at": "2026-12-01T10:00:00+00:00", "sent": 1, "staged": True})
    calque_core.write_json(aws.backend, calque_core.summary_key(f"{calque_core.slug(MODEL)}.20261201-100000-aaaaaa", "c00000"),
                      {"claim": "c00000", "items": 10, "claim_seconds": 30.0, "enter_seconds_paid": 0.0,
                       "mode": "pool"})
    ec2.pool_create(aws.backend, record(aws.backend), HANDLER,
                    options(instances=None, min_instances=0, max_instances=3), yes_spend_money=True)
    out = capsys.readouterr().out
    assert "backlog -> instances: 1+ -> 1, 3+ -> 2, 5+ -> 3; 30 s a claim, drain target 60 s" in out, out
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert stored["ec2"]["scale_to_zero_after"] == 5 and stored["ec2"]["scaling"]["steps"] == [[1, 1], [3, 2], [5, 3]]
    script, _ = launch_template_user_data()
    assert "CALQUE_ASG" not in script and "CALQUE_INSTANCE_ID" not in script   # warmd derives both
    alarms = {a["AlarmName"]: a for a in client("cloudwatch").describe_alarms(
        AlarmNames=[names["alarm_wake"], names["alarm_idle"]])["MetricAlarms"]}
    assert set(alarms) == {names["alarm_wake"], names["alarm_idle"]} and alarms[names["alarm_idle"]][
        "EvaluationPeriods"] == 5

    fire(names["alarm_idle"])                                 # created at its ceiling; idle: to 0
    calque.apply_count(calque_fleet.fleet_for({}, aws.backend, stored), stored, {
        "count": 2, "noun": "instances", "seconds": 60.0, "cost_usd": 0.1}, "submit")   # submit --deadline's pick
    assert asg_of()["DesiredCapacity"] == 2
    fire(names["alarm_wake"], backlog=6)                      # a burst: to the ceiling
    assert asg_of()["DesiredCapacity"] == 3
    busy = sorted(i["InstanceId"] for i in asg_of()["Instances"])[0]
    protection = ec2.ScaleInProtection(names["asg"], busy, client("autoscaling"), names["hook"])
    protection.hold(True)                                     # its worker received a claim
    fire(names["alarm_wake"], backlog=1)                      # the backlog drains: down to 1
    group = asg_of()
    assert [i["InstanceId"] for i in group["Instances"]] == [busy] and group["Instances"][0]["ProtectedFromScaleIn"]
    fire(names["alarm_idle"])                                 # idle window over: to 0, but the claim is held
    assert [i["InstanceId"] for i in asg_of()["Instances"]] == [busy]
    protection.hold(False)                                    # its poll found nothing
    fire(names["alarm_idle"])
    assert asg_of()["Instances"] == []

    # pool scale --min-instances 1 --max-instances 5: the group's bounds, steps and idle policy put again
    monkeypatch.setenv("CALQUE_STORE", STORE)
    scale = ["pool", "scale", "--model", MODEL, "--min-instances", "1", "--max-instances", "5"]
    assert calque.main(scale) == calque_core.EXIT_USAGE
    assert "--yes-spend-money" in capsys.readouterr().err      # a floor above the desired 0 starts one
    assert calque.main(scale + ["--yes-spend-money"]) == 0
    group, stored = asg_of(), calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert (group["MinSize"], group["MaxSize"], group["DesiredCapacity"]) == (1, 5, 1)
    assert stored["ec2"]["scaling"]["steps"] == [[1, 1], [3, 2], [5, 3], [7, 4], [9, 5]]

    def policies():
        return {p["PolicyName"]: p for p in client("autoscaling").describe_policies(
            AutoScalingGroupName=names["asg"])["ScalingPolicies"]}
    assert policies()[names["policy_idle"]]["ScalingAdjustment"] == 1
    steps = policies()[names["policy_wake"]]["StepAdjustments"]
    assert [(a["MetricIntervalLowerBound"], a["ScalingAdjustment"]) for a in steps] == [
        (0.0, 1), (2.5, 2), (4.5, 3), (6.5, 4), (8.5, 5)]
    assert calque.main(["pool", "scale", "--model", MODEL, "--instances", "2", "--max-instances", "3"]
                       ) == calque_core.EXIT_USAGE
    assert "---> HINT" in capsys.readouterr().err

    # a submit puts the steps again once the measured seconds per claim moved (here 30 s -> 6 s)
    calque_core.write_json(aws.backend, calque_core.summary_key(f"{calque_core.slug(MODEL)}.20261201-100000-aaaaaa",
                                                      "c00000"),
                      {"claim": "c00000", "items": 10, "claim_seconds": 6.0, "enter_seconds_paid": 0.0,
                       "mode": "pool"})
    ec2.refresh_backlog_steps(aws.backend, stored)
    steps = policies()[names["policy_wake"]]["StepAdjustments"]
    assert [(a["MetricIntervalLowerBound"], a["ScalingAdjustment"]) for a in steps] == [
        (0.0, 1), (10.5, 2), (20.5, 3), (30.5, 4), (40.5, 5)]
    stored = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))
    assert stored["ec2"]["scaling"]["seconds_per_claim"] == 6.0

    # the termination hook (the worker's side, SpotPoller on target-lifecycle-state: test_warmd.py)
    hooks = client("autoscaling").describe_lifecycle_hooks(
        AutoScalingGroupName=names["asg"])["LifecycleHooks"]
    assert [(h["LifecycleHookName"], h["LifecycleTransition"], h["HeartbeatTimeout"], h["DefaultResult"])
            for h in hooks] == [(names["hook"], "autoscaling:EC2_INSTANCE_TERMINATING", 900, "CONTINUE")]

    assert ec2.pool_delete(aws.backend, stored, yes=True)
    assert client("cloudwatch").describe_alarms(AlarmNames=[names["alarm_wake"], names["alarm_idle"]])[
        "MetricAlarms"] == []
    assert asg_of() is None or asg_of().get("Status")
    assert client("autoscaling").describe_policies(AutoScalingGroupName=names["asg"])["ScalingPolicies"] == []
    assert client("autoscaling").describe_lifecycle_hooks(
        AutoScalingGroupName=names["asg"])["LifecycleHooks"] == []


def test_modal_image_on_an_ec2_pool(aws, tmp_path, monkeypatch):
    """A Modal app's image on an EC2 pool: its pip and apt packages installed by the bootstrap as written (not
    checked on this machine), its add_local_file snapshotted into the store with its sha256 in the pool record."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vocab.txt").write_text("a b c\n")
    (tmp_path / "app.py").write_text(
        "import modal\nimage = modal.Image.debian_slim().apt_install('libsndfile1')"
        ".pip_install('no-such-dist==1.2', 'other>=2').add_local_file('vocab.txt', '/root/vocab.txt')\n"
        "app = modal.App(image=image)\n@app.function()\ndef f(x):\n    return x\n")
    modal, _, _ = calque_fleet.modal_options("app.py:f", workers_here=False)
    ec2.pool_create(aws.backend, dict(record(aws.backend), modal=modal), "app.py:f", options(),
                    yes_spend_money=True)
    script, _ = launch_template_user_data()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "install -q --no-cache-dir no-such-dist==1.2 'other>=2'" in script and "install -y -q libsndfile1" in script
    include = calque_core.read_json(aws.backend, calque_core.pool_key(MODEL))["handler"]["include"]
    assert include["files"] == 1
    assert hashlib.sha256(aws.backend.store.get(include["key"])).hexdigest() == include["sha256"]


def test_the_local_path_runs_without_ec2(local_env, tmp_path):
    """calque's local verbs never import ec2: with `import ec2` made to fail, a local pool is
    created, runs a submit, shows its status and list, and is deleted."""
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(5)))
    no_ec2 = "import sys; sys.modules['calque_ec2'] = None; import calque; sys.exit(calque.main(sys.argv[1:]))"
    for args in (["pool", "create", "--model", "m", "--handler", HANDLER, "--workers", "1"],
                 ["submit", "--pool", "m", str(items)], ["pool", "status", "--model", "m"],
                 ["pool", "list"], ["pool", "delete", "--model", "m", "--yes"]):
        out = subprocess.run([sys.executable, "-c", no_ec2, *args], env=local_env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (args, out.stdout, out.stderr)


def test_inputs_read_by_reference_are_granted_to_the_pool_role(aws, monkeypatch, capsys, tmp_path):
    """`pool create --read s3://b/photos/` lets the instance role GetObject under that prefix only; a run that names
    a new prefix grants it, says so in one line and the record keeps it; a grant IAM refuses refuses the run at
    submit (not at a worker); a cold run on EC2 and --read on a local pool are refused in one line."""
    from botocore.exceptions import ClientError
    monkeypatch.setenv("CALQUE_STORE", STORE)
    monkeypatch.setenv("CALQUE_STATE", str(tmp_path / "state"))
    create = ["pool", "create", "--model", MODEL, "--handler", HANDLER, "--instances", "1", "--instance-type",
              "g5.xlarge", "--yes-spend-money", "--read", f"s3://{BUCKET}/photos"]
    assert calque.main(create) == 0
    role = ec2.resource_names(MODEL)["role"]

    def readable():
        doc = client("iam").get_role_policy(RoleName=role, PolicyName="calque-worker")["PolicyDocument"]
        statement = next(s for s in doc["Statement"] if s["Sid"] == "ReadInputsByReference")
        assert statement["Action"] == ["s3:GetObject"]
        listed = next(s for s in doc["Statement"] if s["Sid"] == "VanishedInputIsNotForbidden")   # 404, not 403
        assert listed["Action"] == ["s3:ListBucket"] and listed["Resource"] == [f"arn:aws:s3:::{BUCKET}"]
        assert [f"arn:aws:s3:::{BUCKET}/{p}" for p in listed["Condition"]["StringLike"]["s3:prefix"]] == \
            statement["Resource"]
        return statement["Resource"]
    assert readable() == [f"arn:aws:s3:::{BUCKET}/photos/*"]
    for key in ("photos/a.jpg", "videos/v/a.mp4", "music/a.wav"):
        client("s3").put_object(Bucket=BUCKET, Key=key, Body=b"x")
    submit = ["submit", "--pool", MODEL, "--no-wait", "--wait-for-workers"]
    assert calque.main(submit + [f"s3://{BUCKET}/photos/"]) == 0
    assert "may now read" not in capsys.readouterr().err
    assert calque.main(submit + [f"s3://{BUCKET}/videos/"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "may now read" in line]
    assert said == [f"pool {MODEL}: its instance role {role} may now read s3://{BUCKET}/videos/ (waiting 0 s for IAM "
                    f"to apply it)"]
    assert readable() == [f"arn:aws:s3:::{BUCKET}/photos/*", f"arn:aws:s3:::{BUCKET}/videos/*"]
    assert calque_core.load_pool(aws.backend, MODEL)["ec2"]["reads"] == [f"s3://{BUCKET}/photos/", f"s3://{BUCKET}/videos/"]
    assert calque.main(submit + [f"s3://{BUCKET}/videos/v/"]) == 0 and "may now read" not in capsys.readouterr().err
    fail_on(monkeypatch, "PutRolePolicy",
            ClientError({"Error": {"Code": "AccessDenied", "Message": "not allowed"}}, "PutRolePolicy"))
    runs = len(calque_core.list_runs(aws.backend))
    assert calque.main(submit + [f"s3://{BUCKET}/music/"]) == calque_core.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"s3://{BUCKET}/music/: pool {MODEL}'s instance role {role} may not read it, and granting it failed" \
        in err and "AccessDenied" in err and len(calque_core.list_runs(aws.backend)) == runs
    assert calque.main(["submit", "--model", MODEL, f"s3://{BUCKET}/photos/", "--instance-type", "g5.xlarge",
                        "--ami", aws.ami, "--yes-spend-money"]) == calque_core.EXIT_USAGE
    assert "a cold run on EC2 cannot read an s3:// prefix" in capsys.readouterr().err
    assert calque.main(["pool", "create", "--model", "local", "--handler", HANDLER, "--workers", "0",
                        "--read", f"s3://{BUCKET}/x/"]) == calque_core.EXIT_USAGE
    assert "--read grants an EC2 pool's instance role" in capsys.readouterr().err
