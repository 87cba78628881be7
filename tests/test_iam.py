"""Least privilege, evaluated: real warmd processes on the credentials of the role `pool create` made (its one
policy, as written), against a moto_server that enforces IAM (tests/moto_iam.py; enforced from the moment the
setup is done, POST /moto-api/reset-auth, as moto's own set_initial_no_auth_action_count does in server mode).
moto 5.2.5 checks each S3 object call against the policy's Action and Resource (GetObject, PutObject, DeleteObject
on bucket/key), and the SQS calls on their queue's ARN; it does not evaluate conditions (s3:prefix: every LIST
passes) nor Auto Scaling resources (every call is refused). So every request the workers send also goes through a
recording proxy, and each is checked here against the policy as AWS evaluates it (`allowed`)."""
import contextlib
import http.server
import json
import os
import re
import signal
import subprocess
import threading
import urllib.parse
import urllib.request

import boto3
import pytest

import calque_ec2
from conftest import PY, ROOT, FaultProxy, serving, start_worker, wait_for, write_items
from test_warmd import SpotStub

BUCKET = "calque-iam-test"
STORE = f"s3://{BUCKET}/root"
MODEL = "iam-pool"
ACCOUNT, REGION = "123456789012", "us-east-1"
HANDLER = """import time
import calque


class Slow:
    @calque.enter
    def load(self):
        self.loaded = True

    @calque.batch
    def run(self, items):
        time.sleep(sum(x.get("sleep", 0) for x in items))
        print("batch of", len(items), flush=True)   # output chunks, the older pruned (OUTPUT_KEPT 1)
        return [{"bytes": len(x["bytes"])} if "bytes" in x else {"x": x["x"]} for x in items]
"""


# ---- the policy as AWS evaluates it --------------------------------------------------------------
def iam_requests(entry, asg_arn):
    """[(action, resource, condition context)] AWS authorises one recorded request against: an S3 object call
    as its action on bucket/key (and, where S3 answered 404, s3:ListBucket: without it S3 answers 403, with the
    key as s3:prefix, as docs/aws.md assumes); a LIST as s3:ListBucket with its prefix; an SQS call on its
    queue (a batch call as its single action); an Auto Scaling call on its group."""
    if entry["target"].startswith("AmazonSQS."):
        body = json.loads(entry["body"] or b"{}")
        queue = (body.get("QueueUrl") or body.get("QueueName")).rsplit("/", 1)[-1]
        action = "sqs:" + entry["target"].split(".", 1)[1].removesuffix("Batch")
        return [(action, f"arn:aws:sqs:{REGION}:{ACCOUNT}:{queue}", {})]
    form = urllib.parse.parse_qs(entry["body"].decode(errors="replace"))
    if "Action" in form:   # the query protocol: Auto Scaling
        assert form["AutoScalingGroupName"][0] == asg_arn.rsplit("/", 1)[1]
        return [("autoscaling:" + form["Action"][0], asg_arn, {})]
    bucket, _, key = entry["path"].lstrip("/").partition("/")
    if not key:
        assert entry["method"] == "GET", entry
        return [("s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": entry["query"].get("prefix", [None])[0]})]
    action = {"GET": "s3:GetObject", "HEAD": "s3:GetObject", "PUT": "s3:PutObject",
              "DELETE": "s3:DeleteObject"}[entry["method"]]
    asked = [(action, f"arn:aws:s3:::{bucket}/{key}", {})]
    if entry["status"] == 404:
        asked.append(("s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": key}))
    return asked


def like(pattern, value):
    return value is not None and re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), value) is not None


def allowed(policy, action, resource, context):
    """Whether an identity policy of Allow statements grants `action` on `resource`: Action and Resource
    wildcards, StringLike conditions (a key absent from the request matches nothing)."""
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow" and set(st.get("Condition", {})) <= {"StringLike"}
        listed = lambda v: v if isinstance(v, list) else [v]   # noqa: E731
        conditions = st.get("Condition", {}).get("StringLike", {})
        if (any(like(a, action) for a in listed(st["Action"]))
                and any(like(r, resource) for r in listed(st["Resource"]))
                and all(any(like(p, context.get(k)) for p in listed(v)) for k, v in conditions.items())):
            return True
    return False


def test_the_evaluator_refuses_what_the_policy_does_not_grant():
    """The evaluator itself: a prefix outside the condition, another queue, a key outside the resources."""
    policy = {"Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::b/runs/m.*/results/*"]},
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "arn:aws:s3:::b",
         "Condition": {"StringLike": {"s3:prefix": ["runs/m.*"]}}},
        {"Effect": "Allow", "Action": ["sqs:DeleteMessage"], "Resource": "arn:aws:sqs:r:1:calque-pool-m"}]}
    assert allowed(policy, "s3:GetObject", "arn:aws:s3:::b/runs/m.1/results/c0/attempt.json", {})
    assert not allowed(policy, "s3:GetObject", "arn:aws:s3:::b/runs/n.1/results/c0/attempt.json", {})
    assert not allowed(policy, "s3:PutObject", "arn:aws:s3:::b/runs/m.1/results/c0/attempt.json", {})
    assert allowed(policy, "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "runs/m.1/results/"})
    assert not allowed(policy, "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "runs/"})
    assert not allowed(policy, "s3:ListBucket", "arn:aws:s3:::b", {})
    entry = {"target": "AmazonSQS.DeleteMessageBatch", "body": b'{"QueueUrl": "http://x/1/calque-pool-m"}'}
    assert iam_requests(entry, "") == [("sqs:DeleteMessage", f"arn:aws:sqs:{REGION}:{ACCOUNT}:calque-pool-m", {})]


# ---- the account: moto_server with IAM enforced, an operator, the pool -------------------------------------
class Account:
    def __init__(self, url, tmp):
        self.url, self.tmp, self.proxy = url, tmp, FaultProxy(url)   # never failing: it records each request the workers send
        self.auth(None)
        with self.unauthenticated():
            iam = self.client("iam", {})
            iam.create_user(UserName="operator")
            iam.put_user_policy(UserName="operator", PolicyName="admin", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
            key = iam.create_access_key(UserName="operator")["AccessKey"]
            self.operator = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
            self.client("s3", {}).create_bucket(Bucket=BUCKET)
        self.folder = tmp / "work"
        self.folder.mkdir()
        (self.folder / "h.py").write_text(HANDLER)
        self.env = dict(os.environ, AWS_ENDPOINT_URL=url, CALQUE_STORE=STORE, CALQUE_STATE=str(tmp / "state"),
                        CALQUE_POLL_WAIT="1", PYTHONUNBUFFERED="1", CALQUE_ENV=str(tmp / "none.env"), **self.operator)

    def auth(self, count):
        """Requests moto lets through unauthenticated from now on (None: all; 0: none)."""
        request = urllib.request.Request(self.url + "/moto-api/reset-auth", method="POST",
                                         data=b"inf" if count is None else str(count).encode(),
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request).read()

    @contextlib.contextmanager
    def unauthenticated(self):
        self.auth(None)
        try:
            yield
        finally:
            self.auth(0)

    def client(self, service, keys=None):
        keys = self.operator if keys is None else keys
        return boto3.client(service, endpoint_url=self.url, region_name=REGION,
                            aws_access_key_id=keys.get("AWS_ACCESS_KEY_ID", "testing"),
                            aws_secret_access_key=keys.get("AWS_SECRET_ACCESS_KEY", "testing"),
                            aws_session_token=keys.get("AWS_SESSION_TOKEN"))

    def calque(self, *args, installed=False, **kw):
        command = [os.path.join(os.path.dirname(PY), "calque")] if installed else [PY, os.path.join(ROOT, "calque.py")]
        return subprocess.run(command + list(args), env=self.env, cwd=self.folder, capture_output=True, text=True,
                              timeout=300, **kw)

    def role_keys(self, role):
        """The role's temporary credentials, as an instance profile hands them to an instance (moto 5.2.5 cannot
        check an ec2.amazonaws.com trust policy against a user: asked unauthenticated)."""
        with self.unauthenticated():
            creds = self.client("sts", {}).assume_role(RoleArn=f"arn:aws:iam::{ACCOUNT}:role/{role}",
                                                       RoleSessionName="i-0123456789abcdef0")["Credentials"]
        return {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
                "AWS_SESSION_TOKEN": creds["SessionToken"]}

    def policy(self, role):
        doc = self.client("iam").get_role_policy(RoleName=role, PolicyName="calque-worker")["PolicyDocument"]
        return json.loads(doc) if isinstance(doc, str) else doc

    def worker_env(self, role, **extra):
        return dict(self.env, AWS_ENDPOINT_URL=self.proxy.url, CALQUE_GRACE="0", CALQUE_CHECKPOINT_SECONDS="0",
                    CALQUE_CHECKPOINT_BATCHES="1", **self.role_keys(role), **extra)

    def keys(self, prefix):
        pages = self.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"root/{prefix}")
        return [o["Key"][len("root/"):] for page in pages for o in page.get("Contents", [])]

    def read(self, key):
        return json.loads(self.client("s3").get_object(Bucket=BUCKET, Key=f"root/{key}")["Body"].read())

    def refused(self, role, asg_arn=None):
        """The requests the workers sent since the last call that the role's policy does not grant as AWS
        evaluates it, and those moto refused where it evaluates (all but Auto Scaling)."""
        seen, self.proxy.seen = self.proxy.seen, []
        policy, denied = self.policy(role), []
        for entry in seen:
            for asked in iam_requests(entry, asg_arn):
                if not allowed(policy, *asked):
                    denied.append(asked[:2])
            if entry["status"] == 403 and "Action=" not in entry["body"].decode(errors="replace"):
                denied.append(("moto refused", entry["method"], entry["path"], entry["target"]))
        assert seen, "no request recorded"
        return denied


@pytest.fixture(scope="module")
def account(tmp_path_factory):
    """An account whose pool `iam-pool` was made by `python calque.py pool create --instances 0` (the operator's
    keys, IAM enforced), reading s3://BUCKET/media/ by reference."""
    with serving(lambda port: [PY, os.path.join(ROOT, "tests", "moto_iam.py"), "-H", "127.0.0.1",
                               "-p", str(port)]) as url:
        acct = Account(url, tmp_path_factory.mktemp("iam"))
        acct.auth(0)
        for n in range(3):
            acct.client("s3").put_object(Bucket=BUCKET, Key=f"media/m{n}.bin", Body=b"x" * (n + 1))
        made = acct.calque("pool", "create", "--model", MODEL, "--handler", "h.py:Slow", "--instances", "0",
                           "--instance-type", "g5.xlarge", "--yes-spend-money", "--batch-size", "2",
                           "--visibility-timeout", "6", "--max-deliveries", "2", "--read", f"s3://{BUCKET}/media/")
        assert made.returncode == 0, made.stdout + made.stderr
        acct.role = [r["RoleName"] for r in acct.client("iam").list_roles()["Roles"]
                     if r["RoleName"].startswith("calque-") and "cold" not in r["RoleName"]][0]
        acct.asg_arn = acct.client("autoscaling").describe_auto_scaling_groups(
            AutoScalingGroupNames=[f"calque-pool-{MODEL}"])["AutoScalingGroups"][0]["AutoScalingGroupARN"]
        yield acct


PRINTS = {"PROGRESS_SECONDS": 0.0, "OUTPUT_FLUSH": 0.05, "OUTPUT_KEPT": 1}   # progress, output written and pruned


def submit(account, *args, installed=False):
    out = account.calque("submit", "--pool", MODEL, "--no-wait", *args, installed=installed)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.split()[-1]


def items(account, name, n, sleep=0.0):
    path = account.folder / name
    path.write_text("".join(json.dumps({"x": i, "sleep": sleep}) + "\n" for i in range(n)))
    return name


def summary(account, run_id, claim="c00000"):
    with contextlib.suppress(Exception):
        return account.read(f"runs/{run_id}/summaries/{claim}.json")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_claims_progress_and_media_by_reference_under_the_pool_policy(account, tmp_path):
    """A claim, its progress records, and objects read by reference, each call granted by the role's policy."""
    log = open(tmp_path / "worker.log", "w")
    worker = start_worker(account.worker_env(account.role), "--model", MODEL, log=log, constants=PRINTS)
    run_id = submit(account, items(account, "a.jsonl", 6, sleep=0.05), installed=True)
    done = wait_for(lambda: summary(account, run_id), 60, "the claim's summary")
    assert done["status"] == "ok" and done["items"] == 6, done
    assert account.read(f"runs/{run_id}/progress/c00000.json")["done"] >= 2
    assert stop(worker) == 0
    media = submit(account, f"s3://{BUCKET}/media/")
    account.client("s3").delete_object(Bucket=BUCKET, Key="media/m1.bin")   # gone before a worker reads it
    worker = start_worker(account.worker_env(account.role), "--model", MODEL, log=log)
    done = wait_for(lambda: summary(account, media), 60, "the media claim's summary")
    assert stop(worker) == 0
    assert done["status"] == "partial" and done["failed"] == [1], (done["errors"], done.get("error"))
    assert "media/m1.bin: vanished since submit" in done["errors"]["1"]   # S3's 404, as the policy lets it say
    assert account.calque("runs", "results", media).stdout.count('"bytes"') == 2
    text = (tmp_path / "worker.log").read_text()
    assert "not written" not in text and "AccessDenied" not in text, text
    assert any(e["method"] == "DELETE" and "/output/" in e["path"] for e in account.proxy.seen)
    assert account.refused(account.role, account.asg_arn) == []


def test_redelivery_after_kill_9_resumes_from_the_parts(account, tmp_path):
    """kill -9 mid-claim; the next worker reads the parts written and resumes (take_over), all granted."""
    env = account.worker_env(account.role)
    first = start_worker(env, "--model", MODEL, log=open(tmp_path / "first.log", "w"))
    run_id = submit(account, items(account, "b.jsonl", 8, sleep=0.3))
    wait_for(lambda: account.keys(f"runs/{run_id}/results/c00000/"), 60, "a first result part")
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = start_worker(env, "--model", MODEL, log=open(tmp_path / "second.log", "w"))
    done = wait_for(lambda: summary(account, run_id), 90, "the redelivered claim's summary")
    assert stop(second) == 0
    log = (tmp_path / "second.log").read_text()
    assert done["status"] == "ok" and done["receive_count"] == 2 and done["resumed"] >= 2, (done, log)
    assert account.refused(account.role, account.asg_arn) == []


def test_a_spot_notice_gives_the_claim_back_and_another_takes_it_over(account, tmp_path):
    """A worker on an "instance" (the metadata at a loopback stub: its id, then a spot notice) protects its
    instance while it holds a claim, gives the claim back on the notice (attempt record written, visible at
    once) and exits 0; another resumes it."""
    class Stub(SpotStub):
        def do_GET(self):
            if self.path == "/latest/meta-data/instance-id":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"i-0123456789abcdef0")
            else:
                super().do_GET()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spot = account.worker_env(account.role, CALQUE_SPOT_POLL=f"http://127.0.0.1:{server.server_port}",
                                  CALQUE_SPOT_INTERVAL="0.1")
        first = start_worker(spot, "--model", MODEL, log=open(tmp_path / "first.log", "w"))
        run_id = submit(account, items(account, "c.jsonl", 8, sleep=0.3))
        wait_for(lambda: account.keys(f"runs/{run_id}/results/c00000/"), 60, "a first result part")
        Stub.notice = True
        assert first.wait(60) == 0
    finally:
        Stub.notice = False
        server.shutdown()
    log = (tmp_path / "first.log").read_text()
    assert "let go" in log and "scale-in protection on failed" in log, log   # moto refuses every such call
    assert any(b"Action=SetInstanceProtection" in e["body"] for e in account.proxy.seen)   # the evaluator's
    assert account.read(f"runs/{run_id}/results/c00000/attempt.json")["state"] == "released"
    second = start_worker(account.worker_env(account.role), "--model", MODEL, log=open(tmp_path / "second.log", "w"))
    done = wait_for(lambda: summary(account, run_id), 60, "the given-back claim's summary")
    assert stop(second) == 0
    assert done["status"] == "ok" and done["resumed"] >= 2, done
    assert account.refused(account.role, account.asg_arn) == []


def test_a_role_that_cannot_read_earlier_parts_dead_letters_the_claim_with_its_reason(account, tmp_path):
    """Today's shape of the policy (no GetObject on results/*, no PutObject on progress/*): the redelivered
    claim's take_over is refused; past max deliveries (2) it ends in the dead-letter queue with a failure
    summary naming the refusal, which the waiting submit reports; the progress refusal is logged once."""
    iam = account.client("iam")
    seen_runs = {k.split("/")[1] for k in account.keys(f"runs/{MODEL}.")}
    good = account.policy(account.role)
    narrowed, cut = json.loads(json.dumps(good)), {"ReadPoolAndClaims": "/results/*", "WriteResults": "/progress/*"}
    for st in narrowed["Statement"]:
        st["Resource"] = [r for r in st["Resource"] if not r.endswith(cut.get(st["Sid"], "-"))] \
            if st["Sid"] in cut else st["Resource"]
    assert [len(a["Resource"]) - len(b["Resource"]) for a, b in zip(good["Statement"], narrowed["Statement"])
            if a["Sid"] in cut] == [1, 1]
    iam.put_role_policy(RoleName=account.role, PolicyName="calque-worker", PolicyDocument=json.dumps(narrowed))
    try:
        env = account.worker_env(account.role)
        first = start_worker(env, "--model", MODEL, log=open(tmp_path / "first.log", "w"),
                             constants={"PROGRESS_SECONDS": 0.0})
        waiting = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", MODEL,
                                    items(account, "d.jsonl", 8, sleep=0.3)], env=account.env, cwd=account.folder,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_id = wait_for(lambda: [k.split("/")[1] for k in account.keys(f"runs/{MODEL}.")
                                   if k.endswith("/results/c00000/0000000-0000002.jsonl") and k.split("/")[1] not in
                                   seen_runs], 60, "a first result part")[0]
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_worker(env, "--model", MODEL, log=open(tmp_path / "second.log", "w"),
                              constants={"RELEASE_DELAY": 0.2})
        out = waiting.communicate(timeout=120)[0]
        done = summary(account, run_id)
        assert stop(second) == 0
    finally:
        iam.put_role_policy(RoleName=account.role, PolicyName="calque-worker", PolicyDocument=json.dumps(good))
    assert waiting.returncode != 0 and "cannot be read: AccessDenied" in out, out
    assert done["status"] == "failed" and "cannot be read: AccessDenied" in done["error"], done
    assert "delivered 3 times" in done["error"] and "(GetObject)" in done["error"], done["error"]
    first_log = (tmp_path / "first.log").read_text()
    assert first_log.count("not written (AccessDenied") == 1, first_log
    dlq = account.client("sqs").get_queue_url(QueueName=f"calque-dlq-{MODEL}")["QueueUrl"]
    letters = account.client("sqs").receive_message(QueueUrl=dlq, MaxNumberOfMessages=10)["Messages"]
    assert any(json.loads(m["Body"])["run_id"] == run_id for m in letters)
    account.proxy.seen = []


def test_a_cold_run_under_the_cold_role(account, tmp_path):
    """`submit --model` on EC2 (the operator's keys) stages a cold run and its role; a `warmd --run` on that
    role's credentials writes progress and parts and is killed -9; a second resumes the claim from its parts;
    the waiting submit reports every item, and every call was granted."""
    ami = account.client("ssm").get_parameter(Name=calque_ec2.DLAMI_PARAMETERS["x86_64"])["Parameter"]["Value"]
    cold = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--model", "iam-cold", "--handler",
                             "h.py:Slow", items(account, "e.jsonl", 8, sleep=0.3), "--batch-size", "2",
                             "--instance-type", "g5.xlarge", "--ami", ami, "--yes-spend-money"],
                            env=dict(account.env, CALQUE_VISIBILITY_TIMEOUT="6"), cwd=account.folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        role = calque_ec2.cold_role_name(STORE, REGION)
        wait_for(lambda: cold.poll() is not None or role in [r["RoleName"] for r in account.client(
            "iam").list_roles()["Roles"]] and account.keys("runs/iam-cold."), 120, "the cold run staged")
        assert cold.poll() is None, cold.communicate()[0]
        run = account.keys("runs/iam-cold.")[0].split("/")[1]
        env = account.worker_env(role)
        first = start_worker(env, "--run", run, log=open(tmp_path / "first.log", "w"), constants=PRINTS)
        wait_for(lambda: account.keys(f"runs/{run}/results/c00000/"), 60, "a first result part")
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = start_worker(env, "--run", run, log=open(tmp_path / "second.log", "w"), constants=PRINTS)
        out = cold.communicate(timeout=180)[0]
        assert cold.returncode == 0, out
        assert second.wait(60) == 0, (tmp_path / "second.log").read_text()
    finally:
        if cold.poll() is None:
            cold.kill()
    done = account.read(f"runs/{run}/summaries/c00000.json")
    assert done["status"] == "ok" and done["items"] == 8 and done["resumed"] >= 2, done
    assert "not written" not in (tmp_path / "first.log").read_text()
    assert any(e["method"] == "DELETE" and "/output/" in e["path"] for e in account.proxy.seen)
    assert account.refused(role) == []


VOLUME_APP = """import modal

app = modal.App("iam-volume")
notes = modal.Volume.from_name("iam-notes")


@app.function(volumes={{{mount!r}: notes}})
def note(x):
    notes.reload()
    with open(f"{mount}/n{{x}}.txt", "w") as f:
        f.write(str(x))
    notes.commit()
    return sorted(e.path for e in notes.listdir("/"))
"""


def test_a_modal_pools_worker_fetches_and_commits_its_volume_under_its_role(account, tmp_path):
    """A Modal app's pool on EC2 (`pool create --instances 0`, the operator's keys) grants its role
    its volume's prefix: a warmd on that role's credentials fills its copy at start, and a function
    reloads, writes, commits and lists it; every call granted, and the volume's files in the
    store."""
    (account.folder / "vol.py").write_text(VOLUME_APP.format(mount=str(tmp_path / "notes")))
    account.client("s3").put_object(Bucket=BUCKET, Key="root/volumes/iam-notes/seed.txt",
                                    Body=b"seed")
    made = account.calque("pool", "create", "--model", "iam-vol", "--handler", "vol.py:note",
                          "--instances", "0", "--instance-type", "g5.xlarge", "--yes-spend-money",
                          installed=True)
    assert made.returncode == 0, made.stdout + made.stderr
    role = calque_ec2.resource_names("iam-vol")["role"]
    asg = account.client("autoscaling").describe_auto_scaling_groups(
        AutoScalingGroupNames=["calque-pool-iam-vol"])["AutoScalingGroups"][0]
    account.proxy.seen = []
    run_id = account.calque("submit", "--pool", "iam-vol", "--no-wait",
                            str(write_items(account.folder / "n.jsonl", [1]))).stdout.split()[-1]
    worker = start_worker(account.worker_env(role), "--model", "iam-vol",
                          log=open(tmp_path / "w.log", "w"))
    done = wait_for(lambda: summary(account, run_id), 60, "the claim's summary")
    assert stop(worker) == 0
    assert (tmp_path / "notes" / "seed.txt").read_text() == "seed"      # its copy, filled at start
    assert done["status"] == "ok", done
    listed = json.loads(account.calque("runs", "results", run_id).stdout)["result"]
    assert listed == ["n1.txt", "seed.txt"]
    assert account.keys("volumes/iam-notes/") == ["volumes/iam-notes/n1.txt",
                                                  "volumes/iam-notes/seed.txt"]
    assert "AccessDenied" not in (tmp_path / "w.log").read_text()
    assert account.refused(role, asg["AutoScalingGroupARN"]) == []


def test_a_modal_function_calls_another_pool_under_its_role(account, tmp_path):
    """An orchestrator's pool made after its class's pool calls it (pool create fills `calls`): its
    worker, on its own role, stages the .map's run on the class's pool and follows it, each request
    granted; the class's worker serves it on its role. Killed -9 while the call waits at a gate, it
    is replaced by one that takes the claim again and cancels the dead one's call (granted too)."""
    from test_calls import FANOUT, embed
    gate = tmp_path / "gate"
    (account.folder / "fanout.py").write_text(FANOUT.format(gate=str(gate)))
    roles = {}
    for model, target in (("iam-emb", "Embedder.embed"), ("iam-orch", "orchestrate")):
        made = account.calque("pool", "create", "--model", model, "--handler", f"fanout.py:{target}",
                              "--instances", "0", "--instance-type", "g5.xlarge", "--yes-spend-money")
        assert made.returncode == 0, made.stdout + made.stderr
        roles[model] = calque_ec2.resource_names(model)["role"]
    assert "its calls go to: Embedder.embed -> iam-emb" in made.stdout
    assert {s["Sid"] for s in account.policy(roles["iam-orch"])["Statement"]} >= {"SendCalls", "RunCalls"}
    log = open(tmp_path / "workers.log", "w")
    account.proxy.seen = []
    served = dict(account.worker_env(roles["iam-emb"]), AWS_ENDPOINT_URL=account.url)   # not recorded:
    workers = [start_worker(served, "--model", "iam-emb", log=log),        # moto checks its role
               start_worker(account.worker_env(roles["iam-orch"]), "--model", "iam-orch", log=log)]
    path = account.folder / "texts.jsonl"
    path.write_text(json.dumps(["ab", "abc"]) + "\n")
    out = account.calque("submit", "--pool", "iam-orch", "--no-wait", "texts.jsonl")
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[-1]
    first = wait_for(lambda: [k for k in account.keys("runs/iam-emb.") if k.endswith("/run.json")],
                     60, "the call's run")[0]
    workers[1].send_signal(signal.SIGKILL)
    workers[1].wait()
    workers[1] = start_worker(account.worker_env(roles["iam-orch"]), "--model", "iam-orch", log=log)
    wait_for(lambda: account.read(first).get("cancelled"), 60, "the dead worker's call cancelled")
    gate.write_text("open")
    done = wait_for(lambda: summary(account, run_id), 90, "the orchestrator's summary")
    assert all(stop(w) == 0 for w in workers)
    denied = account.refused(roles["iam-orch"])
    assert denied == [], json.dumps(denied)   # every request the orchestrator sent, granted
    assert done["status"] == "ok", done["errors"]
    result = json.loads(account.calque("runs", "results", run_id).stdout)["result"]
    assert result["vectors"] == [embed("ab"), embed("abc")]
