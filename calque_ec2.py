"""ec2: calque's EC2 cohort (an s3:// store). A pool is its SQS queue plus an Auto Scaling group
of instances, each running `warmd --model M` under systemd; a cold run is one-shot instances on a
run queue. AWS does the fleet work: the group keeps the cohort at size, SQS redelivers a dead
worker's claim, S3 holds the rest. Every AWS call goes through AwsCalls.call, so --dry-run prints
each mutating call instead. Ec2Fleet is its Fleet; calque_fleet.fleet_for, the one place above
that imports this module, does so only for an EC2 pool or run."""
import base64, contextlib, glob, gzip, hashlib, io, json, logging, math, os, pathlib, re, shlex
import string, sys, tarfile, threading, time, urllib.error, urllib.request
from collections import Counter
from dataclasses import dataclass

from calque_core import (DEFAULT_REGION, HERE, NotFound, POOL_PREFIX, QUEUE_REUSE_WAIT,
                         RUN_DLQ_PREFIX, RUN_QUEUE_PREFIX, SQS_DELETED_RECENTLY, SQS_NOT_FOUND,
                         UserError, _aws_error_code, aws_client_config, aws_retry, check_slug_free,
                         command, deleted_queue_key, desired_count, dlq_name, load_pool,
                         measured_seconds, note_queue_deleted, now_iso, package_file, pool_bounds,
                         pool_key, pool_name_claimed, pool_queue_name, pool_version, pyproject,
                         queue_depth, read_json, read_worker_stats, recent_summaries,
                         redrive_policy, refuse_other_version, setting_number, settings, slug,
                         snapshot_handler, volume_key, wait_queue_reusable)
from calque_cost import (instance_rate_per_second, load_rates, measured_enter_seconds)
from calque_runs import cancel_pool_runs

IAM_NAME_MAX = 64                   # characters of an IAM role or instance-profile name
DLAMI_PARAMETERS = {                # SSM public parameters: the current deep-learning GPU AMI
    arch: f"/aws/service/deeplearning/ami/{arch}/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/"
          f"ami-id"
    for arch in ("x86_64", "arm64")
}
STATE_DIR = "/var/lib/calque"       # CALQUE_STATE on an instance (handler cache)
METADATA_URL = "http://169.254.169.254"   # instance metadata: the spot poller's, the bootstrap's
PASSED_SETTINGS = ("CALQUE_GRACE", "CALQUE_POLL_WAIT", "CALQUE_SPOT_INTERVAL")   # workers get ours
IAM_PROPAGATION_WAIT = 10.0         # s after a role's policy changes before its instances may use it
IAM_RETRY_SECONDS = 120.0           # s of retries while EC2 or Auto Scaling refuses a new instance
                                    # profile (IAM propagates in ~10 s to a minute; Terraform's AWS
                                    # provider waits up to 2 min on the same errors)
PROFILE_PROPAGATING = ("Invalid IAM Instance Profile", "has no associated IAM Roles")   # their words
USER_DATA_MAX = 16384               # bytes of user-data EC2 takes (16 KB, before base64)
BOOT_ESTIMATE = 480.0               # s from launch to a polling worker (assumed)
COLD_BOOT_ALLOWANCE = 30            # min a cold instance may run past the submit timeout
ALARM_PERIOD = 60                   # s: SQS publishes its CloudWatch metrics once a minute
MAX_IDLE_MINUTES = 1440             # CloudWatch: evaluation periods x period at most one day
MIN_IDLE_MINUTES = 2                # the newest minute may be a FILLed 0 (late data)
STEP_ADJUSTMENTS_MAX = 20           # steps of one step-scaling policy (Auto Scaling's limit)
DRAIN_TIMEOUT = 900                 # s a terminating instance waits for its worker's claim (hook)
BOOTSTRAP_ATTEMPTS = 5              # tries of each network step of the bootstrap
BOOTSTRAP_BACKOFF = 10              # s before a network step's second try, doubling after each
BOOTSTRAP_FAILURES_SHOWN = 5        # failed bootstraps of replaced instances `pool status` lists


def _digest(text, n):
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def resource_names(model):
    """Every AWS name of a model's EC2 pool, from its slug: `pool delete` needs no record."""
    s = slug(model)
    base = POOL_PREFIX + s          # <= 80 characters: fits every name below
    role = "calque-" + s
    if len(role) > IAM_NAME_MAX:    # cut, + '-' + 8 hex of sha256(slug): unique, and it fits
        role = role[: IAM_NAME_MAX - 9].rstrip("-") + "-" + _digest(s, 8)
    return {"queue": pool_queue_name(model), "dlq": dlq_name(model), "role": role,
            "instance_profile": role, "launch_template": base, "asg": base,
            "alarm_wake": base + "-wake", "alarm_idle": base + "-idle",
            "policy_wake": "calque-wake", "policy_idle": "calque-idle", "hook": "calque-drain",
            "kit_prefix": f"pools/{s}/kit/",
            "env_prefix": f"pools/{s}/env/",    # <key>.json names <key>.<digest>.tar.zst: its venv
            "report_prefix": f"pools/{s}/instances/"}   # <started>.<instance id>.json


def cold_role_name(store, region):
    """One role for every cold run of a store in a region (a role a run would wait on IAM)."""
    return "calque-cold-" + _digest(f"{store}|{region}", 12)


# ------------------------------------------------------------------------------------------------
# the call layer
class AwsCalls:
    """The one door every EC2-cohort AWS call goes through: `call(service, operation, **params)`.
    In dry-run a mutating call (not Get*/Describe*/List*/Head*) is printed as `would call
    iam.CreateRole {...}` and answered with a plausible fake; read-only calls still run, so the
    plan shows what exists."""

    READ_ONLY = ("Get", "Describe", "List", "Head")

    def __init__(self, session, region, dry_run=False, sleep=time.sleep):
        self.session, self.region, self.dry_run, self.sleep = session, region, dry_run, sleep
        self.clients, self._identity = {}, None

    @classmethod
    def for_backend(cls, backend, dry_run=False):
        return cls(backend.session, backend.queues.sqs.meta.region_name, dry_run)

    def client(self, service):
        if service not in self.clients:
            config = aws_client_config(self.region)
            self.clients[service] = self.session.client(service, config=config)
        return self.clients[service]

    def call(self, service, operation, **params):
        if self.dry_run and not operation.startswith(self.READ_ONLY):
            print(f"would call {service}.{operation} {_show_params(params)}")
            return self._fake(service, operation, params)
        import botocore   # lazy: the embedded backend never loads boto3/botocore
        return getattr(self.client(service), botocore.xform_name(operation))(**params)

    def note(self, service, operation, shown):
        """A store write made through the backend: printed in dry-run; True: make it."""
        if self.dry_run:
            print(f"would call {service}.{operation} {json.dumps(shown)}")
        return not self.dry_run

    def identity(self):
        """{account, partition} of the caller (GetCallerIdentity: runs in dry-run too)."""
        if self._identity is None:
            arn = self.call("sts", "GetCallerIdentity")
            self._identity = {"account": arn["Account"], "partition": arn["Arn"].split(":")[1]}
        return self._identity

    def _fake(self, service, operation, params):
        """What a dry-run mutating call answers: the fields the code reads next (the answers of
        the others, CreateRole and CreateQueue among them, are not read)."""
        ident = self.identity()
        account, partition, region = ident["account"], ident["partition"], self.region
        if operation == "CreateLaunchTemplateVersion":
            return {"LaunchTemplateVersion": {"VersionNumber": 0}}
        if operation == "PutScalingPolicy":
            return {"PolicyARN": f"arn:{partition}:autoscaling:{region}:{account}:scalingPolicy:"
                                 f"dry-run:autoScalingGroupName/{params['AutoScalingGroupName']}"
                                 f":policyName/{params['PolicyName']}"}
        if operation == "RunInstances":
            return {"Instances": [{"InstanceId": f"i-dry-run-{k}"}
                                  for k in range(params["MaxCount"])]}
        return {}


def _show_params(params):
    """The call's parameters as one line of JSON: user-data by size and digest, policies as JSON."""
    def shown(value, key=""):
        if key == "UserData" and isinstance(value, str):
            return f"<user-data: {len(value)} base64 characters, sha256 {_digest(value, 12)}>"
        if key.endswith("PolicyDocument") and isinstance(value, str):
            return json.loads(value)
        if isinstance(value, dict):
            return {k: shown(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [shown(v) for v in value]
        return value
    return json.dumps(shown(params), default=str)


def _exists(fn, *missing_codes):
    """fn()'s answer, or None when it fails with one of the 'does not exist' codes."""
    try:
        return fn()
    except Exception as e:
        if _aws_error_code(e) in missing_codes:
            return None
        raise


def _queue_url(calls, name):
    return _exists(lambda: calls.call("sqs", "GetQueueUrl", QueueName=name)["QueueUrl"],
                   *SQS_NOT_FOUND)


def _find_role(calls, name):
    return _exists(lambda: calls.call("iam", "GetRole", RoleName=name)["Role"], "NoSuchEntity")


def _find_instance_profile(calls, name):
    return _exists(lambda: calls.call("iam", "GetInstanceProfile",
                                      InstanceProfileName=name)["InstanceProfile"], "NoSuchEntity")


def _find_launch_template(calls, name):
    return _exists(lambda: calls.call("ec2", "DescribeLaunchTemplates",
                                      LaunchTemplateNames=[name])["LaunchTemplates"][0],
                   "InvalidLaunchTemplateName.NotFoundException",
                   "InvalidLaunchTemplateId.NotFound")


def _aws_store(backend, what):
    if getattr(backend, "kind", None) != "aws":
        raise UserError(f"{what} needs an s3:// store (CALQUE_STORE={backend.describe()}): EC2 "
                        f"workers read and write everything through S3 ---> HINT: export "
                        f"CALQUE_STORE=s3://your-bucket/calque")
    prefix = backend.store.prefix
    if not re.fullmatch(r"[A-Za-z0-9._/-]*", prefix):
        raise UserError(f"store prefix {prefix!r}: on EC2 use letters, digits and . _ / - only "
                        f"(it goes into IAM policies and shell)")


def _check_text(value, what):
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UserError(f"{what} {value!r} contains control characters: an EC2 pool cannot carry "
                        f"it into its bootstrap")


def _strict_tag(value):
    """An IAM, SQS or CloudWatch tag value: letters, digits, spaces and _ . : / = + - @ only
    (EC2 and Auto Scaling tags take any text, so the raw model goes there)."""
    return re.sub(r"[^\w .:/=+@-]", "_", str(value))[:256]


def _tags(pairs, strict=False):
    return [{"Key": k, "Value": _strict_tag(v) if strict else str(v)[:256]}
            for k, v in pairs.items()]


def _tag_dict(tags):
    return {t["Key"]: t["Value"] for t in tags or []}


# ------------------------------------------------------------------------------------------------
# least privilege: the instance role's policy
def _s3_parts(store, partition):
    bucket, _, prefix = store[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    root = f"{prefix}/" if prefix else ""
    return f"arn:{partition}:s3:::{bucket}", f"arn:{partition}:s3:::{bucket}/{root}", root


def worker_policy(store, model, region, account, partition="aws", reads=(), volumes=(), calls=()):
    """The pool worker's inline policy: claim from its pool queue, dead-letter to its DLQ, read
    its pool's folder and its model's runs (runs/<slug>.*: manifests, inputs, summaries, and the
    results and attempt record a redelivered claim resumes from), write their results, summaries
    and progress, its stats, bootstrap reports, output and streams. ListBucket only on those
    prefixes (its start-up check, a redelivered claim's parts, churn marks), which also makes S3
    answer 404, not 403, for a summary not written yet. On its own group only: SetInstanceHealth
    (a failed bootstrap), SetInstanceProtection (scale-in while it holds a claim) and
    CompleteLifecycleAction (let a terminating instance go). `reads`: the
    s3:// prefixes its runs read by reference (GetObject under each, ListBucket for 404s);
    `volumes`: its Modal app's volumes in the store (read, commit: write and delete, list).
    `calls`: the pools its Modal app's functions call (the record's modal `calls`), exactly
    those: send to their queues, scan their dead letters, write and read their runs (manifests,
    record, summaries: a cancel), read their records and worker stats (a run's claims sized to
    them, as submit's), read and drop their .remote_gen streams; and read its own runs' records
    (the chain of calls a run came from)."""
    s = slug(model)
    kept = [volume_key(name) for name in volumes]
    bucket_arn, obj, root = _s3_parts(store, partition)
    policy = _worker_policy(
        f"arn:{partition}:sqs:{region}:{account}:", pool_queue_name(model), dlq_name(model),
        ("ClaimFromPoolQueue", "ReadPoolAndClaims"), bucket_arn, root,
        reads=[f"{obj}pools/{s}/*", f"{obj}runs/{s}.*/manifests/*", f"{obj}runs/{s}.*/inputs/*",
               f"{obj}runs/{s}.*/summaries/*", f"{obj}runs/{s}.*/results/*"],
        writes=[f"{obj}runs/{s}.*/results/*", f"{obj}runs/{s}.*/summaries/*",
                f"{obj}runs/{s}.*/progress/*",
                f"{obj}pools/{s}/workers/*", f"{obj}pools/{s}/instances/*",
                f"{obj}pools/{s}/output/*", f"{obj}pools/{s}/streams/*"],
        listed=[f"{root}runs/{s}.*", f"{root}pools/{s}/*"] + [f"{root}{k}*" for k in kept],
        pruned=f"{obj}pools/{s}/output/*")
    if kept:
        policy["Statement"].append({
            "Sid": "OwnVolumes", "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
            "Resource": [f"{obj}{k}*" for k in kept]})
    names = resource_names(model)
    if reads:   # and list them: an object gone since submit is a 404 (its item fails), not a 403
        named = [uri[len("s3://"):] for uri in reads]
        policy["Statement"] += [{
            "Sid": "ReadInputsByReference", "Effect": "Allow", "Action": ["s3:GetObject"],
            "Resource": [f"arn:{partition}:s3:::{o}*" for o in named]}, {
            "Sid": "VanishedInputIsNotForbidden", "Effect": "Allow", "Action": ["s3:ListBucket"],
            "Resource": sorted({f"arn:{partition}:s3:::{o.partition('/')[0]}" for o in named}),
            "Condition": {"StringLike": {"s3:prefix": [o.partition("/")[2] + "*" for o in named]}}}]
    if calls:
        sqs, called = f"arn:{partition}:sqs:{region}:{account}:", sorted({slug(p) for p in calls})
        policy["Statement"] += [{
            "Sid": "SendCalls", "Effect": "Allow",
            "Action": ["sqs:GetQueueAttributes", "sqs:GetQueueUrl", "sqs:SendMessage"],
            "Resource": [sqs + pool_queue_name(p) for p in sorted(calls)]}, {
            "Sid": "FollowCallsDeadLetters", "Effect": "Allow",
            "Action": ["sqs:ChangeMessageVisibility", "sqs:GetQueueAttributes",
                       "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
            "Resource": [sqs + dlq_name(p) for p in sorted(calls)]}, {
            "Sid": "RunCalls", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
            "Resource": [f"{obj}runs/{c}.*/*" for c in called]}, {
            "Sid": "ReadCalledPools", "Effect": "Allow", "Action": ["s3:GetObject"],   # + the chain
            "Resource": [f"{obj}runs/{s}.*/run.json"]    # of calls its own run came from
            + [f"{obj}pools/{c}/{k}" for c in called
               for k in ("pool.json", "streams/*", "workers/*")]}, {
            "Sid": "DropCallStreams", "Effect": "Allow", "Action": ["s3:DeleteObject"],
            "Resource": [f"{obj}pools/{c}/streams/*" for c in called]}, {
            "Sid": "ListCalls", "Effect": "Allow", "Action": ["s3:ListBucket"],
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [f"{root}{k}" for c in called for k in (
                f"runs/{c}.*", f"pools/{c}/streams/*", f"pools/{c}/workers/*")]}}}]
    policy["Statement"] += [{
        "Sid": "ShareOwnVenv", "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"],
        "Resource": f"{obj}{names['env_prefix']}*"}, {
        "Sid": "ReplaceOrProtectOwnInstance", "Effect": "Allow",
        "Action": ["autoscaling:SetInstanceHealth", "autoscaling:SetInstanceProtection",
                   "autoscaling:CompleteLifecycleAction"],
        "Resource": f"arn:{partition}:autoscaling:{region}:{account}:autoScalingGroup:*:"
                    f"autoScalingGroupName/{names['asg']}"}]
    return policy


def store_volumes(record):
    """The names of a Modal pool's volumes that live in the store (not a --volume folder)."""
    volumes = record.get("modal", {}).get("volumes", {}).values()
    return [volume["name"] for volume in volumes if "folder" not in volume]


def _worker_policy(sqs, queue, dlq, sids, bucket_arn, root, reads, writes, listed, pruned):
    """The shape both worker roles share: claim from one queue (or pattern), dead-letter to one,
    read and write the given S3 keys, list only under the given prefixes, delete its own old
    output chunks (`pruned`: a worker keeps its last warmd.OUTPUT_KEPT)."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": sids[0], "Effect": "Allow",
         "Action": ["sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:GetQueueAttributes",
                    "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
         "Resource": sqs + queue},
        {"Sid": "DeadLetterOnly", "Effect": "Allow",
         "Action": ["sqs:GetQueueAttributes", "sqs:GetQueueUrl", "sqs:SendMessage"],
         "Resource": sqs + dlq},
        {"Sid": sids[1], "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": reads},
        {"Sid": "WriteResults", "Effect": "Allow", "Action": ["s3:PutObject"], "Resource": writes},
        {"Sid": "NotFoundIsNotForbidden", "Effect": "Allow", "Action": ["s3:ListBucket"],
         "Resource": bucket_arn, "Condition": {"StringLike": {"s3:prefix": listed}}},
        {"Sid": "PruneOwnOutput", "Effect": "Allow", "Action": ["s3:DeleteObject"],
         "Resource": pruned},
    ]}


def cold_worker_policy(store, region, account, partition="aws"):
    """The cold-run worker's policy: a pool worker's shape, on every run queue of this account and
    region and on runs/* of this store (one role serves every cold run of a store); it reads its
    run's worker stats (the poison rule) where a pool worker reads its pool's."""
    bucket_arn, obj, root = _s3_parts(store, partition)
    return _worker_policy(
        f"arn:{partition}:sqs:{region}:{account}:", RUN_QUEUE_PREFIX + "*", RUN_DLQ_PREFIX + "*",
        ("ClaimFromRunQueues", "ReadRunAndClaims"), bucket_arn, root,
        reads=[f"{obj}runs/*/pool.json", f"{obj}runs/*/handler/*", f"{obj}runs/*/kit/*",
               f"{obj}runs/*/manifests/*", f"{obj}runs/*/inputs/*", f"{obj}runs/*/summaries/*",
               f"{obj}runs/*/results/*", f"{obj}runs/*/workers/*"],
        writes=[f"{obj}runs/*/results/*", f"{obj}runs/*/summaries/*", f"{obj}runs/*/progress/*",
                f"{obj}runs/*/workers/*", f"{obj}runs/*/output/*"],
        listed=[f"{root}runs/*"], pruned=f"{obj}runs/*/output/*")


def grant_read(backend, record, uri):
    """Let an EC2 pool's instance role read the s3:// prefix `uri` a run references, said in one line,
    unless a prefix it reads holds it already; the pool record keeps it (`ec2.reads`). IAM refusing
    the change refuses the run at submit, not at a worker."""
    ec2 = record["ec2"]
    if any(uri.startswith(prefix) for prefix in ec2.get("reads", [])):
        return
    model, calls = record["model"], AwsCalls.for_backend(backend)
    current = load_pool(backend, model)   # re-read: another change to the record since is kept
    reads = sorted(set(current["ec2"].get("reads", [])) | {uri})
    ident = calls.identity()
    calls_to = (current.get("modal") or {}).get("calls", {}).values()
    policy = worker_policy(backend.describe(), model, ec2["region"], ident["account"],
                           ident["partition"], reads, store_volumes(current), calls_to)
    try:
        calls.call("iam", "PutRolePolicy", RoleName=ec2["role"], PolicyName="calque-worker",
                   PolicyDocument=json.dumps(policy))
    except Exception as e:
        raise UserError(f"{uri}: pool {model}'s instance role {ec2['role']} may not read it, and granting it "
                        f"failed ({_error_line(e)}) ---> HINT: have it granted by whoever may change IAM: "
                        f"pool create --model {model} ... --read {uri}") from None
    current["ec2"] = dict(current["ec2"], reads=reads)
    _put_pool_record(calls, backend, current)
    record["ec2"] = current["ec2"]
    print(f"pool {model}: its instance role {ec2['role']} may now read {uri} (waiting "
          f"{IAM_PROPAGATION_WAIT:g} s for IAM to apply it)", file=sys.stderr)
    calls.sleep(IAM_PROPAGATION_WAIT)


# instance metadata: session tokens only, one hop (a container on the instance cannot reach it)
IMDS_V2_ONLY = {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1}


def _instance_tag_specs(tags):
    """The same tags on the instances and their volumes: both are found, and priced, by them."""
    return [{"ResourceType": kind, "Tags": _tags(tags)} for kind in ("instance", "volume")]


TRUST_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


# ------------------------------------------------------------------------------------------------
# the kit and the bootstrap (user-data). No credentials: workers use their instance profile.
def kit_archive():
    """(bytes, sha256) of what an EC2 worker installs: an sdist of this calque, packed from
    pyproject.toml's modules, packages and package data (found through their packages) and
    calque_data/sdist's build files. Reproducible: a checkout and an install of one calque pack the
    same bytes, so a re-run `pool create` finds its launch template unchanged."""
    config = pyproject()
    version = config["project"]["version"]
    setup, top = config["tool"]["setuptools"], f"calque-{version}"
    sdist = package_file("calque_data", "sdist")
    files = {name: os.path.join(sdist, name) for name in os.listdir(sdist)}
    files.update({f"{m}.py": os.path.join(HERE, f"{m}.py") for m in setup["py-modules"]})
    for package in setup["packages"]:
        folder = package_file(package, "")
        for pattern in ["*.py", *setup["package-data"].get(package, [])]:
            files.update({os.path.relpath(p, os.path.dirname(folder)): p
                          for p in glob.glob(os.path.join(folder, pattern))})
    contents = {name: pathlib.Path(path).read_bytes() for name, path in files.items()
                if os.path.isfile(path)}
    contents["PKG-INFO"] = f"Metadata-Version: 2.1\nName: calque\nVersion: {version}\n".encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(contents):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(contents[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(contents[name]))
    blob = gzip.compress(raw.getvalue(), mtime=0)
    return blob, hashlib.sha256(blob).hexdigest()


def _pin(name):
    """The `name==version` line of requirements.txt (without its comment), or the bare name."""
    with open(package_file("calque_data", "sdist/requirements.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f]
    return next((pin for pin in pins if pin.startswith(name + "==")), name)


class ShellTemplate(string.Template):
    """Only ${name} (lower case, braced) is a placeholder: the shell's $VAR and ${VAR:-} stay."""
    flags = 0
    pattern = (r"\$(?:\{(?P<braced>[a-z][a-z0-9_]*)\}"
               r"|(?P<escaped>(?!))|(?P<named>(?!))|(?P<invalid>(?!)))")   # the three never match


def _bootstrap(*, worker_args, env, conf=None, **fields):
    """calque_data/ec2_bootstrap.sh with `fields` and the worker's settings (never a credential)
    filled in; a placeholder left unfilled or a field the template lacks is an error."""
    conf = conf or settings()
    store = fields.pop("store")
    bucket, _, prefix = store[len("s3://"):].partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    region = fields["region"]
    lines = {"CALQUE_STORE": store, "CALQUE_STATE": STATE_DIR,
             "CALQUE_SPOT_POLL": METADATA_URL, "AWS_REGION": region, "AWS_DEFAULT_REGION": region,
             "PYTHONUNBUFFERED": "1", **{k: conf[k] for k in PASSED_SETTINGS if k in conf}, **env}
    for key, value in lines.items():
        _check_text(str(value), key)
    for key in ("report_prefix", "env_prefix"):   # under the store's prefix, or none
        fields[key] = shlex.quote(prefix + fields[key] if fields.get(key) else "")
    for key in ("preamble", "image_apt", "image_pip"):
        fields.setdefault(key, "")
    fields.update(
        bucket=shlex.quote(bucket), kit_key=shlex.quote(prefix + fields["kit_key"]),
        region=shlex.quote(region), imds=METADATA_URL,
        state=STATE_DIR, attempts=BOOTSTRAP_ATTEMPTS, backoff=BOOTSTRAP_BACKOFF,
        boto3_pin=shlex.quote(_pin("boto3")), worker_args=worker_args,
        env="\n".join(f"{k}={shlex.quote(str(v))}" for k, v in lines.items()),
        stop_timeout=int(float(conf.get("CALQUE_GRACE", 30)) + 30))
    with open(package_file("calque_data", "ec2_bootstrap.sh")) as f:
        template = ShellTemplate(f.read())
    mismatched = set(fields) ^ set(template.get_identifiers())
    if mismatched:
        raise RuntimeError(f"ec2_bootstrap.sh and its fields disagree on {sorted(mismatched)}")
    script = template.substitute(fields)
    _refuse_credentials(script)
    size = len(script.encode())
    if size > USER_DATA_MAX:   # refused here, before anything is made
        raise UserError(f"{fields['title']}: its bootstrap script is {size:,} bytes, over EC2's "
                        f"user-data limit of {USER_DATA_MAX:,} (16 KB) ---> HINT: fewer image "
                        f"packages (pip_install, apt_install), or an --ami that has them")
    return script


def _refuse_credentials(text):
    """User-data is readable by anyone who can describe the instance: no key may be in it."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    keys = [os.environ.get(var, "") for var in names]   # a real key is long (dummy test ones short)
    banned = [*names, "aws_secret_access_key", *(key for key in keys if len(key) >= 16)]
    if re.search(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b", text) or any(b in text for b in banned):
        raise RuntimeError("refusing to write user-data that contains AWS credentials")


# restart a crashed worker, not one that exited 0 (a stop on purpose: SIGTERM, a spot notice);
# Restart=on-failure would take a death by an uncaught SIGTERM as clean
POOL_SERVICE = "Restart=always\nRestartPreventExitStatus=0\nRestartSec=5"


def user_data_pool(model, store, region, kit_key, kit_sha256, profile="the pool's instance profile",
                   conf=None, image=None, instance_type=None):
    """A pool instance's bootstrap: the kit, a Modal app's image packages, then `warmd --model M`
    under systemd. Its first instance shares the venv it built in the store (env_prefix); later
    ones unpack it. A failed bootstrap reports why and takes its instance out of the group."""
    _check_text(model, "model")
    names = resource_names(model)
    return _bootstrap(
        title=f"pool worker for model {model}"[:200], description="pool worker", verb="pool create",
        profile=profile, store=store, region=region, kit_key=kit_key, kit_sha256=kit_sha256,
        env={"CALQUE_POOL_MODEL": model, **instance_env(instance_type)}, worker_args='--model "$CALQUE_POOL_MODEL"',
        unit="calque-warmd", service=POOL_SERVICE,
        report_prefix=names["report_prefix"], env_prefix=names["env_prefix"],
        on_failure="leave_group", conf=conf, image_apt=image_install(image, "apt"),
        image_pip=image_install(image, "pip"))


def instance_env(instance_type):
    """The worker's CALQUE_INSTANCE_TYPE: its summaries and stats name it, so each verb prices the work
    as the type it ran on (calque.choose_pricing)."""
    if not instance_type:
        return {}
    _check_text(instance_type, "instance type")
    return {"CALQUE_INSTANCE_TYPE": instance_type}


def image_install(image, kind):
    """The bootstrap line that installs a Modal app's apt_install (kind "apt": every boot) or
    pip_install packages (kind "pip": into the venv, when it is built), or ""."""
    command = {"apt": "apt-get -o DPkg::Lock::Timeout=600 install -y -q",
               "pip": '"$CALQUE/venv/bin/pip" install -q --no-cache-dir'}[kind]
    packages = (image or {}).get(kind, [])
    for package in packages:
        _check_text(package, f"image {kind} package")
    if not packages:
        return ""
    return f'retry "image {kind} install" {command} {" ".join(shlex.quote(p) for p in packages)}'


def user_data_cold(run_id, store, region, kit_key, kit_sha256, max_minutes,
                   profile="the cold-run instance profile", conf=None, instance_type=None):
    """A cold run's one-shot instance: the same bootstrap, then `warmd --run RUN` once; the machine
    powers off (terminates) when it exits, when the bootstrap fails, or after max_minutes."""
    return _bootstrap(
        title=f"cold-run worker for run {run_id}", description="cold-run worker", verb="submit",
        profile=profile, store=store, region=region, kit_key=kit_key, kit_sha256=kit_sha256,
        env={"CALQUE_RUN": run_id, **instance_env(instance_type)}, worker_args='--run "$CALQUE_RUN"',
        unit="calque-cold",
        service="Restart=no\nExecStopPost=+/bin/systemctl --no-block poweroff",
        on_failure="power_off", conf=conf,
        preamble=f'shutdown -h +{int(max_minutes)} "calque: cold run over its time limit" || true')


# ------------------------------------------------------------------------------------------------
# pre-flight: everything read-only, before anything is created
def _preflight(calls, launch):
    """The read-only checks of a launch (PoolOptions or ColdLaunch) before anything is created:
    (its instance type's description, AMI, where that came from, root volume, usable subnets)."""
    itype = launch.instance_type
    if not itype:
        raise UserError("--instance-type is required for EC2 workers (e.g. g5.xlarge): see "
                        "rates.json for priced ones")
    info = _exists(lambda: calls.call("ec2", "DescribeInstanceTypes",
                                      InstanceTypes=[itype])["InstanceTypes"][0],
                   "InvalidInstanceType", "InvalidParameterValue")
    if info is None:
        raise UserError(f"--instance-type {itype}: not an instance type in "
                        f"{calls.region} ---> HINT: e.g. g5.xlarge")
    ami, source, root = resolve_ami(calls, launch.ami, info)
    subnets = resolve_subnets(calls, launch.subnet, itype)
    key = launch.key_name
    if key and _exists(lambda: calls.call("ec2", "DescribeKeyPairs", KeyNames=[key]),
                       "InvalidKeyPair.NotFound") is None:
        raise UserError(f"--key-name {key}: no such key pair in {calls.region}")
    return info, ami, source, root, subnets


def resolve_ami(calls, ami, instance_type_info):
    """(ami id, where it came from, its root volume: root_volume): --ami checked to exist, else the
    SSM public parameter of the current deep-learning GPU AMI for the instance type's architecture."""
    archs = [a for a in instance_type_info["ProcessorInfo"]["SupportedArchitectures"]
             if a in DLAMI_PARAMETERS]
    itype = instance_type_info["InstanceType"]
    source = "--ami"
    if not ami:
        if len(archs) != 1:
            raise UserError(f"instance type {itype} supports {archs or 'no known'} "
                            f"architecture(s): cannot pick one deep-learning AMI ---> HINT: pass "
                            f"--ami ami-...")
        param = DLAMI_PARAMETERS[archs[0]]
        value = _exists(lambda: calls.call("ssm", "GetParameter", Name=param)["Parameter"]["Value"],
                        "ParameterNotFound", "ParameterVersionNotFound")
        if value is None:
            raise UserError(f"no current deep-learning AMI: SSM public parameter {param} does "
                            f"not exist in {calls.region} ---> HINT: pass --ami ami-... (an "
                            f"image with an NVIDIA driver)")
        found = [v.strip() for v in value.split(",") if v.strip()]
        if len(found) != 1 or not re.fullmatch(r"ami-[0-9a-f]{8,17}", found[0]):
            raise UserError(f"SSM parameter {param} holds {value!r}, not exactly one AMI id "
                            f"---> HINT: pass --ami ami-...")
        ami, source = found[0], f"ssm:{param}"
    images = _exists(lambda: calls.call("ec2", "DescribeImages", ImageIds=[ami])["Images"],
                     "InvalidAMIID.NotFound", "InvalidAMIID.Malformed", "InvalidAMIID.Unavailable")
    if not images:
        raise UserError(f"AMI {ami} ({source}) does not exist in {calls.region} or is not visible "
                        f"to this account")
    arch = images[0].get("Architecture")
    if archs and arch and arch not in archs:
        raise UserError(f"AMI {ami} is {arch}, instance type {itype} runs {', '.join(archs)}: "
                        f"pick a matching --ami")
    return ami, source, root_volume(images[0])


def root_volume(image):
    """The launch's BlockDeviceMappings: the AMI's root device (by the name it gives) as CALQUE_ROOT_GB
    of gp3, or as the AMI's own size where that is larger (a volume holds its snapshot)."""
    device = image.get("RootDeviceName")
    if not device:
        raise UserError(f"AMI {image['ImageId']} names no root device: pick another --ami")
    own = max([m["Ebs"].get("VolumeSize", 0) for m in image.get("BlockDeviceMappings", [])
               if m.get("DeviceName") == device and "Ebs" in m] or [0])
    size = max(setting_number(settings(), "CALQUE_ROOT_GB", int, 1), own)
    return [{"DeviceName": device,
             "Ebs": {"VolumeSize": size, "VolumeType": "gp3", "DeleteOnTermination": True}}]


def _root_said(root):
    size = root[0]["Ebs"]["VolumeSize"]
    asked = setting_number(settings(), "CALQUE_ROOT_GB", int, 1)
    why = "CALQUE_ROOT_GB" if size == asked else f"the AMI's own size, over CALQUE_ROOT_GB={asked}"
    return f"{size} GB gp3 ({why})"


def resolve_subnets(calls, subnet_arg, instance_type):
    """--subnet (comma-separated) checked to exist, else the default VPC's subnets; only those in
    zones that offer the instance type."""
    if subnet_arg:
        ids = [s.strip() for s in subnet_arg.split(",") if s.strip()]
        subnets = _exists(lambda: calls.call("ec2", "DescribeSubnets", SubnetIds=ids)["Subnets"],
                          "InvalidSubnetID.NotFound", "InvalidSubnetID.Malformed")
        if subnets is None:
            raise UserError(f"--subnet {subnet_arg}: no such subnet in {calls.region}")
    else:
        subnets = calls.call("ec2", "DescribeSubnets",
                             Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        if not subnets:
            raise UserError(f"no default VPC in {calls.region}: pass --subnet subnet-... (one "
                            f"with a route to the internet: the bootstrap installs packages)")
    offerings = calls.call("ec2", "DescribeInstanceTypeOfferings", LocationType="availability-zone",
                           Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    offered = {o["Location"] for o in offerings["InstanceTypeOfferings"]}
    usable = [s["SubnetId"] for s in subnets if s["AvailabilityZone"] in offered]
    if not usable:
        raise UserError(f"instance type {instance_type} is not offered in the zones of subnet(s) "
                        f"{', '.join(s['SubnetId'] for s in subnets)}: pick another --subnet or "
                        f"--instance-type")
    return sorted(usable)


@dataclass(frozen=True)
class PoolOptions:
    """An EC2 pool's fleet as `pool create --instances N` asks for it (pool_options checks it)."""
    instances: int
    instance_type: str | None           # required: the pre-flight refuses None with an example
    min_instances: int | None           # the group's floor; None: always `instances`
    ami: str | None                     # None: the current deep-learning GPU AMI
    spot: bool
    subnet: str | None                  # subnet ids, comma-separated; None: the default VPC's
    key_name: str | None                # an EC2 key pair for SSH; None: no SSH
    scale_to_zero_after: int | None     # idle minutes before the group shrinks to its floor
    reads: tuple = ()                   # s3:// prefixes (ending in /) its instance role may read


def read_prefix(uri):
    """An s3:// prefix a role may read, as `reads` holds it: s3://bucket/prefix/ ('/' at its end)."""
    bucket, _, prefix = uri[len("s3://"):].partition("/") if uri.startswith("s3://") else ("", "", "")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) or glob.has_magic(prefix):
        raise UserError(f"--read {uri}: not an s3:// prefix ---> HINT: --read s3://bucket/photos/")
    return f"s3://{bucket}/" + (prefix.strip("/") + "/" if prefix.strip("/") else "")


def pool_options(instances, instance_type=None, *, min_instances=None, ami=None, spot=False,
                 subnet=None, key_name=None, scale_to_zero_after=None, max_instances=None, reads=()):
    """PoolOptions from the flags, checked (pool_bounds): --instances N is a fixed cohort; a floor
    below the ceiling or an idle window makes a group that sizes itself, its window in whole
    minutes that CloudWatch can evaluate."""
    if instances is max_instances is None or (instances or 0) < 0:
        raise UserError(f"--instances {instances}: give the number of EC2 instances (0 or more)")
    lo, hi, idle = pool_bounds(instances, min_instances, max_instances, scale_to_zero_after,
                               "instances")
    minutes = math.ceil(idle / 60 - 1e-9) if idle is not None else None
    if minutes is not None and not MIN_IDLE_MINUTES <= minutes <= MAX_IDLE_MINUTES:
        raise UserError(f"--scale-to-zero-after {scale_to_zero_after}: minutes between "
                        f"{MIN_IDLE_MINUTES} and {MAX_IDLE_MINUTES} (CloudWatch's one-day window; "
                        f"a one-minute window would take a minute whose data is late for an idle "
                        f"one)")
    return PoolOptions(hi, instance_type, None if minutes is None else lo, ami, bool(spot), subnet,
                       key_name, minutes, tuple(read_prefix(uri) for uri in reads or ()))


@dataclass(frozen=True)
class ColdLaunch:
    """The one-shot EC2 instances of a cold run (`submit --model M` on an s3:// store)."""
    ami: str | None                     # required: cold_launch refuses None with where to find one
    instance_type: str | None
    spot: bool = False
    subnet: str | None = None           # subnet ids, comma-separated (the first usable one)
    key_name: str | None = None


def _hourly(instance_type, spot, count):
    """'~$2.01/h while 2 x g5.xlarge on-demand run (rates.json ...)', or that it is not priced."""
    try:
        rates = load_rates()
        per_hour = instance_rate_per_second(rates, instance_type, spot=spot) * 3600 * count
        return (f"~${per_hour:.2f}/h while {count} x {instance_type} "
                f"{'spot' if spot else 'on-demand'} run (rates.json {rates['updated']})")
    except UserError:
        return (f"{instance_type} is not priced in rates.json: check its hourly price before you "
                f"go on")


def refuse_spending(what, *, dry_run, yes_spend_money):
    if not dry_run and not yes_spend_money:
        raise UserError(f"{what} starts paid EC2 instances: add --yes-spend-money "
                        f"(or --dry-run to see every AWS call first)")


# ------------------------------------------------------------------------------------------------
# idempotent steps: each checks what exists, then creates or updates
def _ensure_queue(calls, backend, name, visibility_timeout, tags, redrive=None):
    """Create the queue, or set what differs on the one found; first wait out a deletion of it
    this store saw less than a minute ago (a dying queue still resolves), then SQS's refusals."""
    wanted = {"VisibilityTimeout": str(int(visibility_timeout))}
    if redrive:
        wanted["RedrivePolicy"] = redrive
    if not calls.dry_run:
        wait_queue_reusable(backend.store, name, calls.sleep)
    url = _queue_url(calls, name)
    if url:
        current = calls.call("sqs", "GetQueueAttributes", QueueUrl=url,
                             AttributeNames=list(wanted))["Attributes"]
        changed = {k: v for k, v in wanted.items() if _attribute(current.get(k)) != _attribute(v)}
        if changed:
            calls.call("sqs", "SetQueueAttributes", QueueUrl=url, Attributes=changed)
        return "found"
    aws_retry(lambda: calls.call("sqs", "CreateQueue", QueueName=name, Attributes=wanted, tags=tags),
              lambda e: _aws_error_code(e) in SQS_DELETED_RECENTLY,
              f"SQS to free the name {name} (deleted less than 60 s ago)", QUEUE_REUSE_WAIT,
              calls.sleep, "run the command again in a minute")
    return "created"


def _attribute(value):
    """A queue attribute as compared: a JSON one (RedrivePolicy) by its fields, as text."""
    if isinstance(value, str) and value.startswith("{"):
        return {k: str(v) for k, v in json.loads(value).items()}
    return value


def _check_owned(kind, name, tags, model, store, region):
    """A resource with our name must be calque's and this pool's: never adopt someone else's."""
    if tags.get("calque:managed") != "true":
        raise UserError(f"{kind} {name} exists but is not calque's (no calque:managed=true tag): "
                        f"rename or remove it first")
    ours = tuple(_strict_tag(v) if kind.startswith("IAM") else str(v)[:256]
                 for v in (model, store, region))
    keys = ("calque:pool-model", "calque:store", "calque:region")
    theirs = tuple(tags.get(key, mine) for key, mine in zip(keys, ours))
    if theirs != ours:
        raise UserError(f"{kind} {name} belongs to the pool of {theirs[0]!r} (store {theirs[1]}, "
                        f"region {theirs[2]}): one model has one EC2 pool per account; delete that "
                        f"one first")


def _ensure_role(calls, name, policy, tags, owner):
    """Create the role (or check the existing one is ours), then put its one inline policy:
    always, so a re-run also repairs a policy edited by hand."""
    found = _find_role(calls, name)   # GetRole answers its tags too
    if found:
        _check_owned("IAM role", name, _tag_dict(found.get("Tags")), *owner)
        state = "found"
    else:
        about = "calque worker instances (least privilege; see the calque README, On AWS)"
        calls.call("iam", "CreateRole", RoleName=name, Tags=_tags(tags, strict=True),
                   AssumeRolePolicyDocument=json.dumps(TRUST_POLICY), Description=about)
        state = "created"
    calls.call("iam", "PutRolePolicy", RoleName=name, PolicyName="calque-worker",
               PolicyDocument=json.dumps(policy))
    return state


def _ensure_instance_profile(calls, name, role, tags):
    profile = _find_instance_profile(calls, name)
    state = "found"
    if not profile:
        calls.call("iam", "CreateInstanceProfile", InstanceProfileName=name,
                   Tags=_tags(tags, strict=True))
        profile, state = {"Roles": []}, "created"
    roles = [r["RoleName"] for r in profile.get("Roles", [])]
    if role not in roles:
        for other in roles:    # a profile holds one role
            calls.call("iam", "RemoveRoleFromInstanceProfile", InstanceProfileName=name,
                       RoleName=other)
        calls.call("iam", "AddRoleToInstanceProfile", InstanceProfileName=name, RoleName=role)
        if state == "found":
            state = "repaired"
    return state


def _once_profile_propagates(calls, profile, fn):
    """fn()'s answer, retried while EC2 (InvalidParameterValue) or Auto Scaling (ValidationError)
    refuses instance profile `profile` as IAM has not propagated it yet: the codes and words
    Terraform's AWS provider retries."""
    def propagating(error):
        return (_aws_error_code(error) in ("ValidationError", "InvalidParameterValue")
                and any(words.lower() in str(error).lower() for words in PROFILE_PROPAGATING))
    return aws_retry(fn, propagating, f"IAM to propagate instance profile {profile} to EC2",
                     IAM_RETRY_SECONDS, calls.sleep,
                     "run the command again in a minute (IAM can be slower in a new account)")


def _ensure_launch_template(calls, name, data, tags, owner):
    """Create it, or add a version when the data differ from its latest (by digest, kept in the
    version description): the group launches $Latest, so new instances pick the change up."""
    wanted = "calque " + _digest(json.dumps(data, sort_keys=True), 16)
    found = _find_launch_template(calls, name)
    if not found:
        calls.call("ec2", "CreateLaunchTemplate", LaunchTemplateName=name,
                   VersionDescription=wanted, LaunchTemplateData=data,
                   TagSpecifications=[{"ResourceType": "launch-template", "Tags": _tags(tags)}])
        return "created"
    _check_owned("launch template", name, _tag_dict(found.get("Tags")), *owner)
    latest = calls.call("ec2", "DescribeLaunchTemplateVersions", LaunchTemplateName=name,
                        Versions=["$Latest"])["LaunchTemplateVersions"][0]
    if latest.get("VersionDescription") == wanted:
        return "found"
    version = calls.call("ec2", "CreateLaunchTemplateVersion", LaunchTemplateName=name,
                         VersionDescription=wanted, LaunchTemplateData=data)
    version = version["LaunchTemplateVersion"]["VersionNumber"]
    calls.call("ec2", "ModifyLaunchTemplate", LaunchTemplateName=name, DefaultVersion=str(version))
    return f"updated (version {version})"


def describe_asg(calls, name):
    groups = calls.call("autoscaling", "DescribeAutoScalingGroups", AutoScalingGroupNames=[name])
    return groups["AutoScalingGroups"][0] if groups["AutoScalingGroups"] else None


def _asg_sizes(ec2):
    """(min, max, desired) of the record's EC2 settings: a fixed cohort (N, N, N); a floor K
    (K, N, N); a scale-to-zero pool held by `pool scale --instances H` (H, N, H), so that its idle
    alarm, which sets capacity within MinSize..MaxSize, cannot take it below H."""
    n, floor, held = ec2["instances"], ec2["min_instances"], ec2.get("held")
    if floor is None:
        return n, n, n
    if held:
        return min(held, n), n, min(held, n)
    return min(floor, n), n, n


def _ensure_asg(calls, names, ec2, tags, owner):
    asg = describe_asg(calls, names["asg"])
    lo, hi, desired = _asg_sizes(ec2)
    template = {"LaunchTemplateName": names["launch_template"], "Version": "$Latest"}
    params = {"AutoScalingGroupName": names["asg"], "MinSize": lo, "MaxSize": hi,
              "DesiredCapacity": desired, "VPCZoneIdentifier": ",".join(ec2["subnets"]),
              "HealthCheckType": "EC2", "HealthCheckGracePeriod": 300}
    if ec2["spot"]:
        params["MixedInstancesPolicy"] = {
            "LaunchTemplate": {"LaunchTemplateSpecification": template},
            "InstancesDistribution": {"OnDemandBaseCapacity": 0,
                                      "OnDemandPercentageAboveBaseCapacity": 0,
                                      "SpotAllocationStrategy": "price-capacity-optimized"}}
        params["CapacityRebalance"] = True     # a replacement starts before the 2-minute notice
    else:
        params["LaunchTemplate"] = template
    asg_tags = [{"ResourceId": names["asg"], "ResourceType": "auto-scaling-group", "Key": k,
                 "Value": str(v), "PropagateAtLaunch": True} for k, v in tags.items()]
    profile = names["instance_profile"]     # Auto Scaling checks the template's profile at once
    if asg is None:
        _once_profile_propagates(calls, profile, lambda: calls.call(
            "autoscaling", "CreateAutoScalingGroup", Tags=asg_tags, **params))
        return "created"
    if asg.get("Status"):    # "Delete in progress"
        raise UserError(f"auto scaling group {names['asg']} is being deleted ({asg['Status']}): "
                        f"wait for it to go, then re-run")
    _check_owned("auto scaling group", names["asg"], _tag_dict(asg.get("Tags")), *owner)
    if ec2["scale_to_zero_after"]:
        # its alarms own the desired count: the idle alarm would undo N within a minute
        del params["DesiredCapacity"]
    _once_profile_propagates(calls, profile,
                             lambda: calls.call("autoscaling", "UpdateAutoScalingGroup", **params))
    if "DesiredCapacity" in params:
        return "updated"
    return f"updated; desired {asg['DesiredCapacity']} kept"


def backlog_steps(lo, hi, seconds_per_claim, target_drain):
    """[(backlog, capacity)]: from each backlog (visible + in flight) on, the capacity
    desired_count gives a growing group (at most STEP_ADJUSTMENTS_MAX steps, the last `hi`)."""
    def need(backlog):
        return desired_count(backlog, 0, 0, seconds_per_claim, target_drain, lo, hi, 0.0, None,
                             0.0).desired
    per = 1.0 if seconds_per_claim is None else target_drain / seconds_per_claim  # claims a drain
    first = max(need(1), 1)
    counts = range(first, hi + 1)
    if len(counts) > STEP_ADJUSTMENTS_MAX:
        counts = sorted({first + round(i * (hi - first) / (STEP_ADJUSTMENTS_MAX - 1))
                         for i in range(STEP_ADJUSTMENTS_MAX)})
    steps = {1 if k == first else max(k, math.floor((k - 1) * per) + 1): k   # k claims at least
             for k in counts}
    return sorted((b, need(b)) for b in steps)


def measured_scaling(backend, model, lo, hi):
    """The record's `scaling` of a group that sizes itself: seconds per claim measured from the
    pool's recent summaries (None before any), the drain target, and the backlog steps."""
    spc = measured_seconds(recent_summaries(backend, model))[0]
    drain = setting_number(settings(), "CALQUE_TARGET_DRAIN", float, 0.001)
    return {"seconds_per_claim": spc, "target_drain": drain,
            "steps": backlog_steps(lo, hi, spc, drain)}


def _show_steps(scaling):
    return ", ".join(f"{b}+ -> {k}" for b, k in scaling["steps"])


def _put_backlog_policy(calls, names, ec2):
    """The wake alarm's step policy: the group to exactly backlog_steps' capacity for the backlog
    (scale-in protection keeps busy instances)."""
    steps = ec2["scaling"]["steps"]
    lower = [0.0] + [b - 0.5 for b, _ in steps[1:]]    # a step ends where the next one starts
    adjustments = [{"MetricIntervalLowerBound": lo, "ScalingAdjustment": k}
                   for lo, (_, k) in zip(lower, steps)]
    for step, upper in zip(adjustments, lower[1:]):
        step["MetricIntervalUpperBound"] = upper
    return calls.call("autoscaling", "PutScalingPolicy", AutoScalingGroupName=names["asg"],
                      PolicyName=names["policy_wake"], PolicyType="StepScaling",
                      AdjustmentType="ExactCapacity", MetricAggregationType="Maximum",
                      StepAdjustments=adjustments)


def _backlog_metrics(queue):
    """Metric math: visible + in flight, each FILLed with 0 where SQS published no point."""
    def stat(name, metric):
        return {"Id": name, "ReturnData": False, "MetricStat": {
            "Metric": {"Namespace": "AWS/SQS", "MetricName": metric,
                       "Dimensions": [{"Name": "QueueName", "Value": queue}]},
            "Period": ALARM_PERIOD, "Stat": "Maximum"}}
    return [stat("visible_raw", "ApproximateNumberOfMessagesVisible"),
            stat("inflight_raw", "ApproximateNumberOfMessagesNotVisible"),
            {"Id": "visible", "Expression": "FILL(visible_raw, 0)", "ReturnData": False},
            {"Id": "inflight", "Expression": "FILL(inflight_raw, 0)", "ReturnData": False},
            {"Id": "backlog", "Expression": "visible + inflight",
             "Label": "claims waiting or running", "ReturnData": True}]


def _ensure_scale_to_zero(calls, names, ec2, tags):
    """The backlog step policy on the wake alarm (any claim visible or in flight: re-run every
    minute it stays in ALARM) and an exact-floor policy on the idle alarm (no backlog for the
    whole window). A queue that publishes nothing (six idle hours) is idle (TreatMissingData)."""
    asg, minutes = names["asg"], ec2["scale_to_zero_after"]
    floor = ec2["min_instances"] or 0
    wake = _put_backlog_policy(calls, names, ec2)

    def alarm(name, about, policy, answer, **rule):
        arn = answer.get("PolicyARN") or calls.call(   # moto 5 answers none: look it up
            "autoscaling", "DescribePolicies", AutoScalingGroupName=asg,
            PolicyNames=[policy])["ScalingPolicies"][0]["PolicyARN"]
        calls.call("cloudwatch", "PutMetricAlarm", AlarmName=name, AlarmDescription=about,
                   ActionsEnabled=True, AlarmActions=[arn],
                   Threshold=0, Tags=_tags(tags, strict=True),
                   Metrics=_backlog_metrics(names["queue"]), **rule)
    idle = calls.call("autoscaling", "PutScalingPolicy", AutoScalingGroupName=asg,
                      PolicyName=names["policy_idle"], PolicyType="SimpleScaling",
                      AdjustmentType="ExactCapacity", ScalingAdjustment=floor, Cooldown=60)
    alarm(names["alarm_wake"], f"calque: size pool {asg} to its backlog in {names['queue']}",
          names["policy_wake"], wake, EvaluationPeriods=1,
          ComparisonOperator="GreaterThanThreshold", TreatMissingData="notBreaching")
    alarm(names["alarm_idle"], f"calque: scale pool {asg} to {floor} after {minutes} idle "
          f"minute(s)", names["policy_idle"], idle, EvaluationPeriods=minutes,
          DatapointsToAlarm=minutes, ComparisonOperator="LessThanOrEqualToThreshold",
          TreatMissingData="breaching")


def _describe_alarms(calls, names):
    """The pool's scale-to-zero alarms that exist."""
    alarms = calls.call("cloudwatch", "DescribeAlarms",
                        AlarmNames=[names["alarm_wake"], names["alarm_idle"]])
    return alarms["MetricAlarms"]


def _remove_scale_to_zero(calls, names):
    """Delete the pool's scale-to-zero alarms and policies that exist; returns their names."""
    removed = [a["AlarmName"] for a in _describe_alarms(calls, names)]
    if removed:
        calls.call("cloudwatch", "DeleteAlarms", AlarmNames=removed)
    if describe_asg(calls, names["asg"]):
        policies = calls.call("autoscaling", "DescribePolicies", AutoScalingGroupName=names["asg"])
        have = {p["PolicyName"] for p in policies["ScalingPolicies"]}
        for policy in (names["policy_wake"], names["policy_idle"]):
            if policy in have:
                calls.call("autoscaling", "DeletePolicy", AutoScalingGroupName=names["asg"],
                           PolicyName=policy)
                removed.append(policy)
    return removed


def _store_put(calls, backend, key, data):
    """Write one store object; a dry run prints the PutObject instead (with its size)."""
    if calls.note("s3", "PutObject", {"uri": backend.store.uri(key), "bytes": len(data)}):
        backend.store.put(key, data)


def _put_pool_record(calls, backend, record):
    _store_put(calls, backend, pool_key(record["model"]), json.dumps(record, indent=1))


def _said(calls, state):
    """A step's outcome as printed: 'created' in a dry run reads 'would be created'."""
    return f"would be {state}" if calls.dry_run and state != "found" else state


def _error_line(error):
    """'Code: first line of the message' of an AWS (or any) error."""
    text = str(error)
    code = _aws_error_code(error) or type(error).__name__
    return f"{code}: {text.splitlines()[0] if text else ''}"


def _run_steps(subject, steps, fix):
    """Run the (title, fn) steps in order. When one fails, say which, what is in place, what is
    not done and `fix`; re-raise a UserError or an interruption, anything else as a UserError."""
    done = []
    for title, fn in steps:
        try:
            fn()
        except (Exception, KeyboardInterrupt) as e:
            reason = "interrupted" if isinstance(e, KeyboardInterrupt) else _error_line(e)
            print(f"{subject}: stopped at {title} ({reason})", file=sys.stderr)
            print(f"  in place: {', '.join(done) or 'nothing'}", file=sys.stderr)
            print(f"  not done: {', '.join(t for t, _ in steps if t not in done)}", file=sys.stderr)
            print(f"  ---> HINT: {fix}", file=sys.stderr)
            if isinstance(e, (UserError, KeyboardInterrupt)):
                raise
            raise UserError(f"{subject} stopped at {title}: {_error_line(e)} (what is in place is "
                            f"listed above)") from e
        done.append(title)


# ------------------------------------------------------------------------------------------------
# the EC2 pool verbs
def pool_create(backend, record, handler, options, *, dry_run=False, yes_spend_money=False,
                calls=None, include=()):
    """`pool create --instances N ...` on an s3:// store: `record` is the pool record
    cmd_pool_create built, `handler` (file.py:Class) is snapshotted, `options` (PoolOptions) say
    the fleet. A read-only pre-flight, then steps that each check what exists first, so a re-run
    finishes an interrupted create and a failure says what is in place. Returns the record."""
    model = record["model"]
    _aws_store(backend, "pool create --instances")
    _check_text(model, "model")
    refuse_spending(f"pool create --model {model} --instances {options.instances}", dry_run=dry_run,
                    yes_spend_money=yes_spend_money)
    calls = calls or AwsCalls.for_backend(backend, dry_run)
    names, store, region = resource_names(model), backend.describe(), calls.region
    existing = check_slug_free(backend, model)
    blobs = {}   # the handler snapshot, put once its version is checked (store_objects)
    files = list(include) + record.get("modal", {}).get("image", {}).get("files", [])
    record["handler"] = snapshot_handler(handler, f"pools/{record['slug']}/", blobs.__setitem__,
                                         files)
    record["version"] = pool_version(record)
    refuse_other_version(existing, record, handler)   # a re-run of the same version finishes it

    ident = calls.identity()     # pre-flight: read-only; nothing is created if any fails
    itype, ami, ami_source, root, subnets = _preflight(calls, options)
    if not itype.get("GpuInfo"):
        print(f"pool {model}: note: {options.instance_type} has no GPU; fine for a CPU handler, "
              f"not for a GPU model")
    elif "x86_64" not in itype["ProcessorInfo"]["SupportedArchitectures"]:
        print(f"pool {model}: WARNING: {options.instance_type} is arm64: PyPI's {_pin('torch')} "
              f"wheel for Linux aarch64 may be a CPU-only build (assumed; check the project's "
              f"wheel list), and then the model runs on the CPU. Each instance records which torch "
              f"it got and whether it sees the GPU: `pool status` warns")
    blob, kit_sha = kit_archive()
    kit_key = f"{names['kit_prefix']}{kit_sha[:16]}.tar.gz"
    profile = names["instance_profile"]
    script = user_data_pool(model, store, region, kit_key, kit_sha, profile=profile,
                            image=record.get("modal", {}).get("image"),
                            instance_type=options.instance_type)
    idle = options.scale_to_zero_after
    previous = (existing or {}).get("ec2") or {}
    created_at = previous.get("created_at") or record.get("created_at") or now_iso()
    held = previous.get("held") if idle else None    # a re-run keeps a `pool scale` hold
    lo, hi = options.min_instances, options.instances
    scaling = measured_scaling(backend, model, lo, hi) if idle else None
    ec2 = {"instances": options.instances, "min_instances": options.min_instances,
           "instance_type": options.instance_type, "ami": ami, "ami_source": ami_source,
           "spot": options.spot, "subnets": subnets, "key_name": options.key_name,
           "scale_to_zero_after": idle, "region": region, "account": ident["account"],
           "role": names["role"], "instance_profile": names["instance_profile"],
           "launch_template": names["launch_template"], "asg": names["asg"],
           "alarms": [names["alarm_wake"], names["alarm_idle"]] if idle else [],
           "kit": {"key": kit_key, "sha256": kit_sha}, "held": min(held, hi) if held else None,
           "scaling": scaling, "state": "creating", "updated_at": now_iso(),
           "created_at": created_at, "reads": sorted(set(previous.get("reads", [])) | set(options.reads))}
    tags = {"calque:pool-model": model, "calque:role": "pool-worker", "calque:managed": "true",
            "calque:created-at": created_at, "calque:store": store, "calque:region": region}
    owner = (model, store, region)
    full = dict(existing or {}, **record)     # a re-run keeps what it does not set
    full["created_at"] = (existing or record).get("created_at") or now_iso()
    print(f"pool {model}: EC2 cohort of {options.instances} x {options.instance_type} "
          f"{'spot' if options.spot else 'on-demand'}, AMI {ami} ({ami_source}), subnets "
          f"{', '.join(subnets)}, root volume {_root_said(root)}")
    print(f"pool {model}: cost {_hourly(options.instance_type, options.spot, max(hi, 1))}"
          + (f"; scales to {lo or 0} after {idle} idle minute(s)" if idle else ""))

    def queues():
        queue_tags = {k: _strict_tag(tags[k]) for k in ("calque:pool-model", "calque:managed")}
        dlq_arn = f"arn:{ident['partition']}:sqs:{region}:{ident['account']}:{names['dlq']}"
        for queue, redrive in ((names["dlq"], None),   # the dead-letter queue first: named by the other
                               (names["queue"], redrive_policy(dlq_arn, record["max_deliveries"]))):
            state = _ensure_queue(calls, backend, queue, record["visibility_timeout"], queue_tags,
                                  redrive)
            print(f"pool {model}: queue {queue} {_said(calls, state)}")

    def store_objects():
        for key, data in blobs.items():
            _store_put(calls, backend, key, data)
        _store_put(calls, backend, kit_key, blob)
        full["ec2"] = ec2
        _put_pool_record(calls, backend, full)
        print(f"pool {model}: handler {full['handler']['file']}:{full['handler']['class']}, kit "
              f"{kit_sha[:16]}, record {_said(calls, 'written')}")

    def role():
        calls_to = (full.get("modal") or {}).get("calls", {}).values()
        policy = worker_policy(store, model, region, ident["account"], ident["partition"],
                               ec2["reads"], store_volumes(record), calls_to)
        state = _ensure_role(calls, names["role"], policy, tags, owner)
        print(f"pool {model}: IAM role {names['role']} {_said(calls, state)}, policy "
              f"{_said(calls, 'put')}")

    def instance_profile():
        state = _ensure_instance_profile(calls, names["instance_profile"], names["role"], tags)
        print(f"pool {model}: instance profile {names['instance_profile']} {_said(calls, state)}")

    def launch_template():
        data = {"ImageId": ami, "InstanceType": options.instance_type, "BlockDeviceMappings": root,
                "UserData": base64.b64encode(script.encode()).decode(),
                "IamInstanceProfile": {"Name": profile}, "MetadataOptions": IMDS_V2_ONLY,
                "TagSpecifications": _instance_tag_specs(tags)}
        if options.key_name:
            data["KeyName"] = options.key_name
        state = _ensure_launch_template(calls, names["launch_template"], data, tags, owner)
        print(f"pool {model}: launch template {names['launch_template']} {_said(calls, state)} "
              f"({len(script):,} bytes of user-data, of EC2's {USER_DATA_MAX:,})")

    def asg():
        state = _ensure_asg(calls, names, ec2, tags, owner)
        lo, hi, desired = _asg_sizes(ec2)
        calls.call("autoscaling", "PutLifecycleHook", LifecycleHookName=names["hook"],
                   AutoScalingGroupName=names["asg"], DefaultResult="CONTINUE",
                   LifecycleTransition="autoscaling:EC2_INSTANCE_TERMINATING",
                   HeartbeatTimeout=DRAIN_TIMEOUT)
        print(f"pool {model}: auto scaling group {names['asg']} {_said(calls, state)} "
              f"(min {lo}, max {hi}{'' if 'kept' in state else f', desired {desired}'}); "
              f"termination hook {names['hook']} (a worker finishes its claim first, "
              f"{DRAIN_TIMEOUT // 60} min at most)")

    def alarms():
        if idle:
            _ensure_scale_to_zero(calls, names, ec2, tags)
            steps = _show_steps(ec2["scaling"])
            spc = ec2["scaling"]["seconds_per_claim"]
            per_claim = "unmeasured: one a claim" if spc is None else f"{spc:.3g} s a claim"
            print(f"pool {model}: alarms {names['alarm_wake']} (backlog -> instances: {steps}; "
                  f"{per_claim}, drain target {ec2['scaling']['target_drain']:g} s) and "
                  f"{names['alarm_idle']} ({idle} idle min -> {options.min_instances or 0}) "
                  f"{_said(calls, 'put')}")
        elif _remove_scale_to_zero(calls, names):
            print(f"pool {model}: scale-to-zero alarms removed (not asked for this time)")

    def ready():
        full["ec2"] = dict(ec2, state="ready", updated_at=now_iso())
        _put_pool_record(calls, backend, full)

    _run_steps(f"pool {model}: create", [
        (f"queues {names['queue']} + {names['dlq']}", queues),
        ("handler, kit and pool record in the store", store_objects),
        (f"IAM role {names['role']}", role),
        (f"instance profile {names['instance_profile']}", instance_profile),
        (f"launch template {names['launch_template']}", launch_template),
        (f"auto scaling group {names['asg']}", asg),
        ("scale-to-zero alarms" if idle else "no scale-to-zero alarms", alarms),
        ("pool record ready", ready),
    ], fix=f"re-run the same command to finish (each step checks what exists first), or "
           f"`{command()} pool delete --model {model} --yes` to remove what is in place")
    if dry_run:
        print(f"pool {model}: dry run: nothing was created or changed; "
              f"the calls above are what --yes-spend-money makes")
    else:
        print(f"pool {model}: ready. Instances boot and bootstrap in ~{BOOT_ESTIMATE / 60:.0f} "
              f"min, then load the model; watch with `{command()} pool status --model "
              f"{model}`")
    return full


def pool_scale(backend, record, instances=None, *, lo=None, hi=None, dry_run=False,
               yes_spend_money=False, calls=None):
    """`pool scale` of an EC2 pool. --instances N: a fixed cohort's min, max and desired to N; a
    scale-to-zero pool held at N (MinSize N), since its idle alarm would undo a plain scale-up
    within a minute, N = 0 releasing the hold (down to its floor now, up on work). --min-instances
    A / --max-instances B (`lo`, `hi`; either kept when None) of a pool that sizes itself: the
    group's bounds, backlog steps and alarms put anew, a hold released. Growing needs
    yes_spend_money (or dry_run)."""
    model, bounds = record["model"], lo is not None or hi is not None
    _aws_store(backend, "pool scale --instances")
    ec2 = dict(record["ec2"])
    sleeps = bool(ec2.get("scale_to_zero_after"))
    if bounds and not sleeps:
        raise UserError(f"pool {model}: a fixed cohort of {ec2['instances']} has no floor or "
                        f"ceiling ---> HINT: `pool scale --instances N`, or re-run `pool create` "
                        f"with --min-instances A --max-instances B")
    if bounds:
        lo = (ec2["min_instances"] or 0) if lo is None else lo
        hi = ec2["instances"] if hi is None else hi
        if not 0 <= lo <= hi or hi < 1:
            raise UserError(f"--min-instances {lo} --max-instances {hi}: give 0 <= min <= max, max "
                            f">= 1 ---> HINT: e.g. --min-instances 0 --max-instances 4")
        ec2.update(min_instances=lo, instances=hi, held=None)
    elif instances is None or instances < 0:
        raise UserError(f"--instances {instances}: 0 or more")
    elif sleeps:
        ec2.update(held=instances or None, instances=instances or ec2["instances"])
    else:
        ec2["instances"] = instances
    calls = calls or AwsCalls.for_backend(backend, dry_run)
    names = resource_names(model)
    asg = describe_asg(calls, names["asg"])
    if asg is None:
        raise UserError(f"pool {model}: auto scaling group {names['asg']} does not exist: re-run "
                        f"`pool create` to finish the pool")
    lo, hi, desired = _asg_sizes(ec2)
    if bounds:
        desired = min(max(asg["DesiredCapacity"], lo), hi)
    elif not instances:
        desired = lo     # a released hold goes down to the floor now
    if desired > asg["DesiredCapacity"]:
        given = f"--min-instances {lo}" if bounds else f"--instances {instances}"
        refuse_spending(f"pool scale --model {model} {given}", dry_run=dry_run,
                        yes_spend_money=yes_spend_money)
    if sleeps:
        ec2["scaling"] = measured_scaling(backend, model, lo, ec2["instances"])
    calls.call("autoscaling", "UpdateAutoScalingGroup", AutoScalingGroupName=names["asg"],
               MinSize=lo, MaxSize=hi, DesiredCapacity=desired)
    if bounds:
        _ensure_scale_to_zero(calls, names, ec2, _tag_dict(asg.get("Tags")))
    elif sleeps:
        _put_backlog_policy(calls, names, ec2)
    full = dict(record, ec2=dict(ec2, updated_at=now_iso()))
    _put_pool_record(calls, backend, full)
    if bounds:
        print(f"pool {model}: auto scaling group {names['asg']} between {lo} and {hi} instance(s), "
              f"desired {asg['DesiredCapacity']} -> {desired}; backlog steps "
              f"{_show_steps(ec2['scaling'])}")
        return full
    cost = _hourly(ec2["instance_type"], ec2["spot"], desired) if desired else "no cost at 0"
    print(f"pool {model}: auto scaling group {names['asg']} {asg['DesiredCapacity']} -> {desired} "
          f"instance(s) (min {lo}, max {hi}); {cost}")
    if sleeps and instances:
        print(f"pool {model}: held at {instances}: the idle alarm cannot scale it in until "
              f"`pool scale --model {model} --instances 0` releases it")
    elif sleeps:
        print(f"pool {model}: the backlog and idle alarms in charge again: up to "
              f"{ec2['instances']} on its backlog")
    return full


def refresh_backlog_steps(backend, record):
    """Put an EC2 pool's backlog policy again when its steps no longer follow its measured seconds
    per claim or the drain target (each submit)."""
    ec2 = record.get("ec2") or {}
    if backend.kind != "aws" or not ec2.get("scale_to_zero_after"):
        return
    scaling = measured_scaling(backend, record["model"], ec2["min_instances"], ec2["instances"])
    if json.loads(json.dumps(scaling)) == ec2.get("scaling"):
        return
    calls, names = AwsCalls.for_backend(backend), resource_names(record["model"])
    _put_backlog_policy(calls, names, dict(ec2, scaling=scaling))
    ec2 = dict(ec2, scaling=scaling, updated_at=now_iso())
    _put_pool_record(calls, backend, dict(record, ec2=ec2))
    print(f"pool {record['model']}: backlog steps now {_show_steps(scaling)}", file=sys.stderr)


def bootstrap_reports(backend, model, instance_ids):
    """{"current": {instance id: its latest bootstrap report}, "failed": [the failed reports of the
    current instances and of the last BOOTSTRAP_FAILURES_SHOWN gone ones]}, oldest first. Keys are
    <started>.<instance id>.json: sorted in launch order, so only those few are read."""
    prefix = resource_names(model)["report_prefix"]
    current, gone = {}, []
    for key in backend.store.list(prefix):
        if key.endswith(".json"):
            instance_id = key[len(prefix):-len(".json")].partition(".")[2]
            if instance_id in instance_ids:
                current[instance_id] = key      # sorted keys: the latest report wins
            else:
                gone.append(key)
    reports = {i: read_json(backend, key) for i, key in current.items()}
    earlier = [read_json(backend, key) for key in gone[-BOOTSTRAP_FAILURES_SHOWN:]]
    failed = [r for r in earlier + list(reports.values()) if r.get("state") == "failed"]
    return {"current": reports, "failed": sorted(failed, key=lambda r: r.get("started", ""))}


def pool_status(backend, record, calls=None):
    """The EC2 side of `pool status`: the group's sizes, its instances, its last scaling
    activities (where a launch failure shows), the alarms, queue depths, worker stats and the
    instances' bootstrap reports."""
    model = record["model"]
    calls = calls or AwsCalls.for_backend(backend)
    names = resource_names(model)
    asg = describe_asg(calls, names["asg"])
    status = {"model": model, "ec2": record.get("ec2"), "asg": None, "instances": {},
              "instance_list": [], "activities": [],
              "alarms": {a["AlarmName"]: a["StateValue"] for a in _describe_alarms(calls, names)},
              "queue": queue_depth(backend, names["queue"]),
              "dlq": queue_depth(backend, names["dlq"]),
              "workers": read_worker_stats(backend, model)}
    if asg:
        status["asg"] = {"name": names["asg"], "min": asg["MinSize"], "max": asg["MaxSize"],
                         "desired": asg["DesiredCapacity"], "status": asg.get("Status")}
        status["instance_list"] = [
            {"id": i["InstanceId"], "state": i["LifecycleState"], "health": i.get("HealthStatus"),
             "zone": i.get("AvailabilityZone"), "type": i.get("InstanceType")}
            for i in asg.get("Instances", [])]
        status["instances"] = dict(Counter(i["state"] for i in status["instance_list"]))
        activities = calls.call("autoscaling", "DescribeScalingActivities",
                                AutoScalingGroupName=names["asg"], MaxRecords=3)
        status["activities"] = [
            {"status": a.get("StatusCode"), "description": a.get("Description"),
             "reason": (a.get("StatusMessage") or a.get("Cause") or "")[:300],
             "start": str(a.get("StartTime", ""))} for a in activities.get("Activities", [])]
    ids = {i["id"] for i in status["instance_list"]}
    status["bootstrap"] = bootstrap_reports(backend, model, ids)
    return status


def format_status(status):
    """pool_status's answer as lines for `pool status`: the group and its instances, its last
    activities, who sets its size (a hold or the alarms), the bootstrap reports, and a note when
    instances run but no worker reports yet."""
    lines, ec2 = [], status.get("ec2") or {}
    asg = status["asg"]
    if asg is None:
        lines.append("auto scaling group: none (re-run `pool create` to finish, or `pool delete` "
                     "to clean up)")
    else:
        by_state = ", ".join(f"{n} {s}" for s, n in sorted(status["instances"].items()))
        deleting = f" {asg['status']}" if asg["status"] else ""
        lines.append(f"auto scaling group {asg['name']}: desired {asg['desired']} (min "
                     f"{asg['min']}, max {asg['max']}){deleting}: {by_state or 'no instances'}")
        lines.append(f"instances: {ec2.get('instance_type', '?')} "
                     f"{'spot' if ec2.get('spot') else 'on-demand'}, AMI {ec2.get('ami', '?')}")
        for a in status["activities"]:
            lines.append(f"  {a['start'][:19]} {a['status']}: {a['description']}"
                         + (f" ({a['reason']})" if a["reason"] else ""))
    alarms = ", ".join(f"{k} {v}" for k, v in sorted(status["alarms"].items()))
    if ec2.get("scale_to_zero_after"):
        if ec2.get("held"):
            mode = (f"held at {ec2['held']} by `pool scale` (MinSize {ec2['held']}: the idle alarm "
                    f"cannot scale it in; `pool scale --instances 0` releases it)")
        else:
            mode = (f"alarms in charge (backlog steps up to {ec2['instances']}, "
                    f"{ec2['min_instances'] or 0} after {ec2['scale_to_zero_after']} idle min)")
        lines.append(f"scale to zero: {mode}" + (f"; {alarms}" if alarms else ""))
    elif alarms:
        lines.append(f"scale-to-zero alarms left over: {alarms} (re-run `pool create` to remove "
                     f"them)")
    lines += format_bootstrap(status.get("bootstrap") or {"current": {}, "failed": []})
    running = [w for w in status["workers"] if w.get("state") == "running"]
    in_service = status["instances"].get("InService", 0)
    if in_service and not running:
        lines.append(f"note: {in_service} instance(s) in service but no worker reports running "
                     f"yet: still bootstrapping (~{BOOT_ESTIMATE / 60:.0f} min), or failed before "
                     f"it could report (no network, no python): see the instance's console output")
    return lines


def _few(ids, shown=3):
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(sorted(ids)[:shown]) + more


def format_bootstrap(boot):
    """Lines for bootstrap_reports' answer: the builds the ready instances run (their venv unpacked
    from the store or installed), a WARNING where fastbatch's build failed or torch does not see
    the GPU, and the instances that failed."""
    lines, builds, warnings = [], Counter(), {}
    for r in boot["current"].values():
        if r.get("state") != "ready":
            continue
        sees_gpu = r.get("torch_gpu") == "True"
        fastbatch = "C" if r.get("fastbatch") == "c" else "numpy"
        builds[f"torch {r.get('torch') or '?'} (CUDA {r.get('torch_cuda') or '?'}, GPU "
               f"{'visible' if sees_gpu else 'not visible'}), fastbatch {fastbatch}"
               + (f", venv {r['venv']}" if r.get("venv") else "")] += 1   # unpacked, or installed
        if r.get("fastbatch") != "c":
            warnings.setdefault(f"fastbatch's C build {r.get('fastbatch') or 'did not run'}: "
                                f"its workers gather batches with the numpy path and frame result "
                                f"lines in Python (slower)", []).append(r["instance_id"])
        if r.get("gpu") and not sees_gpu:
            warnings.setdefault(f"torch {r.get('torch')} does not see the GPU ({r['gpu']}): the "
                                f"model runs on the CPU", []).append(r["instance_id"])
    lines += [f"bootstrap: {n} ready with {build}" for build, n in sorted(builds.items())]
    lines += [f"WARNING ({_few(ids)}): {text}" for text, ids in warnings.items()]
    if boot["failed"]:
        lines.append(f"instances that failed to bootstrap (the latest {len(boot['failed'])}; "
                     f"each is replaced by the group):")
        for r in boot["failed"]:
            reason = " | ".join(line for line in (r.get("reason") or "").splitlines()
                                if line.strip())
            lines.append(f"  {r['instance_id']} (started {r.get('started')}): {r.get('stage')}: "
                         f"{reason[:300]}")
    return lines


def pool_list(backend, calls=None):
    """Every pool in this store, by its record, plus EC2 fleets found only by their group's tags
    (a half-created pool, or one whose record is gone: record False)."""
    calls = calls or AwsCalls.for_backend(backend)
    found = {}
    for folder in backend.store.list("pools/"):
        with contextlib.suppress(NotFound):
            rec = read_json(backend, folder + "/pool.json")
            ec2 = rec.get("ec2") or {}
            found[rec["model"]] = {"model": rec["model"], "record": True, "asg": None,
                                   "desired": None, "in_service": 0,
                                   "instance_type": ec2.get("instance_type"),
                                   "spot": ec2.get("spot"), "store": backend.describe()}
    params = {"Filters": [{"Name": "tag:calque:role", "Values": ["pool-worker"]}]}
    while params:
        page = calls.call("autoscaling", "DescribeAutoScalingGroups", **params)
        for g in page["AutoScalingGroups"]:
            tags = _tag_dict(g.get("Tags"))
            model = tags.get("calque:pool-model")
            if not model or tags.get("calque:managed") != "true":
                continue
            entry = found.setdefault(model, {"model": model, "record": False, "instance_type": None,
                                             "spot": None, "store": tags.get("calque:store")})
            entry.update(asg=g["AutoScalingGroupName"], desired=g["DesiredCapacity"],
                         in_service=sum(i["LifecycleState"] == "InService"
                                        for i in g.get("Instances", [])))
        params = page.get("NextToken") and dict(params, NextToken=page["NextToken"])
    return sorted(found.values(), key=lambda p: p["model"])


def _require_managed(name, tags):
    """Delete refuses what calque did not create, whatever its name."""
    if tags.get("calque:managed") != "true":
        raise UserError(f"{name} is not tagged calque:managed=true; not touching it")


def _delete_step(model, what, fn):
    """Run one delete step and report it; a failed step is reported and the others still run."""
    try:
        state = fn()
        print(f"pool {model}: {what}: {state}")
        return True
    except UserError as e:
        print(f"pool {model}: {what}: skipped: {e}")
    except Exception as e:
        print(f"pool {model}: {what}: FAILED ({_error_line(e)})")
    return False


def pool_delete(backend, record, *, yes=False, dry_run=False, calls=None):
    """`pool delete --model M --yes` of an EC2 pool: alarms, group (to 0, then force-deleted: its
    workers get SIGTERM), launch template, instance profile, role, queues, then the pool's folder
    (record last, so a failed delete can be re-run). Names come from the model: `record` may be
    just {"model": M}. Only what is tagged calque:managed=true goes. True if every step worked."""
    model = record["model"]
    _aws_store(backend, "pool delete of an EC2 pool")
    if not dry_run and not yes:
        raise UserError(f"pool delete {model}: deletes instances, queues and IAM: refusing "
                        f"without --yes")
    calls = calls or AwsCalls.for_backend(backend, dry_run)
    names = resource_names(model)
    asg_name, template_name = names["asg"], names["launch_template"]
    profile_name, role_name = names["instance_profile"], names["role"]

    def alarms():   # and their policies: AWS drops them with the group, moto does not
        removed = _remove_scale_to_zero(calls, names)
        return "deleted " + ", ".join(removed) if removed else "none"

    def asg():
        group = describe_asg(calls, asg_name)
        if group is None:
            return "not found (already gone)"
        if group.get("Status"):
            return f"already {group['Status'].lower()}"
        _require_managed(asg_name, _tag_dict(group.get("Tags")))
        hooks = calls.call("autoscaling", "DescribeLifecycleHooks",
                           AutoScalingGroupName=asg_name)["LifecycleHooks"]
        if any(h["LifecycleHookName"] == names["hook"] for h in hooks):   # instances go now
            calls.call("autoscaling", "DeleteLifecycleHook", AutoScalingGroupName=asg_name,
                       LifecycleHookName=names["hook"])
        calls.call("autoscaling", "UpdateAutoScalingGroup", AutoScalingGroupName=asg_name,
                   MinSize=0, MaxSize=0, DesiredCapacity=0)
        calls.call("autoscaling", "DeleteAutoScalingGroup", AutoScalingGroupName=asg_name,
                   ForceDelete=True)
        return (f"scaled to 0 and deleted ({len(group.get('Instances', []))} instance(s) "
                f"terminating: warmd gets SIGTERM)")

    def template():
        found = _find_launch_template(calls, template_name)
        if not found:
            return "not found (already gone)"
        _require_managed(template_name, _tag_dict(found.get("Tags")))
        calls.call("ec2", "DeleteLaunchTemplate", LaunchTemplateName=template_name)
        return "deleted"

    def profile():
        found = _find_instance_profile(calls, profile_name)
        if not found:
            return "not found (already gone)"
        for role in found.get("Roles", []):
            calls.call("iam", "RemoveRoleFromInstanceProfile", InstanceProfileName=profile_name,
                       RoleName=role["RoleName"])
        calls.call("iam", "DeleteInstanceProfile", InstanceProfileName=profile_name)
        return "deleted"

    def role():
        found = _find_role(calls, role_name)
        if not found:
            return "not found (already gone)"
        _require_managed(role_name, _tag_dict(found.get("Tags")))
        for p in calls.call("iam", "ListRolePolicies", RoleName=role_name)["PolicyNames"]:
            calls.call("iam", "DeleteRolePolicy", RoleName=role_name, PolicyName=p)
        attached = calls.call("iam", "ListAttachedRolePolicies", RoleName=role_name)
        for p in attached["AttachedPolicies"]:
            calls.call("iam", "DetachRolePolicy", RoleName=role_name, PolicyArn=p["PolicyArn"])
        profiles = calls.call("iam", "ListInstanceProfilesForRole", RoleName=role_name)
        for p in profiles["InstanceProfiles"]:
            calls.call("iam", "RemoveRoleFromInstanceProfile", RoleName=role_name,
                       InstanceProfileName=p["InstanceProfileName"])
        calls.call("iam", "DeleteRole", RoleName=role_name)
        return "deleted"

    def queue(name):
        url = _queue_url(calls, name)
        if not url:
            return "not found (already gone)"
        calls.call("sqs", "DeleteQueue", QueueUrl=url)
        if calls.note("s3", "PutObject", {"uri": backend.store.uri(deleted_queue_key(name))}):
            note_queue_deleted(backend.store, name)    # a create within the minute waits
        return "deleted (SQS lets the name be reused after 60 s)"

    def store():
        prefix = f"pools/{slug(model)}/"
        shown = {"uri": backend.store.uri(prefix), "what": "every key under it"}
        if calls.note("s3", "DeleteObjects", shown):
            backend.store.delete_prefix(prefix)
        return (f"deleted (record, handler, kit, shared venvs, worker stats); its runs remain "
                f"---> HINT: {command()} runs prune --model {model} --older-than 0s deletes them")

    ok = all([_delete_step(model, "alarms", alarms),
              _delete_step(model, f"auto scaling group {asg_name}", asg),
              _delete_step(model, f"launch template {template_name}", template),
              _delete_step(model, f"instance profile {profile_name}", profile),
              _delete_step(model, f"IAM role {role_name}", role),
              _delete_step(model, f"queue {names['queue']}", lambda: queue(names["queue"])),
              _delete_step(model, f"queue {names['dlq']}", lambda: queue(names["dlq"]))])
    if ok:
        ok = _delete_step(model, f"store folder pools/{slug(model)}/", store)
    else:
        print(f"pool {model}: record kept (a step failed): fix what is reported above and re-run "
              f"`pool delete --model {model} --yes`")
    if dry_run:
        print(f"pool {model}: dry run: nothing was deleted")
    return ok


# ------------------------------------------------------------------------------------------------
# the cold path on AWS: one-shot instances on a run-scoped queue
def cold_launch(backend, cold_record, run_id, shards, launch, *, timeout, dry_run=False,
                yes_spend_money=False, calls=None):
    """Launch `shards` one-shot instances (ColdLaunch) for a staged cold run, all or none. Each
    bootstraps, runs `warmd --run RUN` once and powers off (terminates) when its queue is drained,
    or after `timeout` + COLD_BOOT_ALLOWANCE minutes whatever happens. Returns the instance ids."""
    _aws_store(backend, "a cold run on EC2")
    if not launch.ami:
        raise UserError("a cold run on EC2 needs --ami ami-... "
                        "(an image with an NVIDIA driver; see the README, On AWS)")
    if shards < 1:
        raise UserError(f"--shards {shards}: at least 1")
    refuse_spending(f"submit (cold, {shards} instance(s))", dry_run=dry_run,
                    yes_spend_money=yes_spend_money)
    calls = calls or AwsCalls.for_backend(backend, dry_run)
    store, region = backend.describe(), calls.region
    ident = calls.identity()
    itype, ami, _, root, subnets = _preflight(calls, launch)
    name = cold_role_name(store, region)
    blob, kit_sha = kit_archive()
    kit_key = f"runs/{run_id}/kit/{kit_sha[:16]}.tar.gz"
    max_minutes = math.ceil(timeout / 60) + COLD_BOOT_ALLOWANCE
    script = user_data_cold(run_id, store, region, kit_key, kit_sha, max_minutes, profile=name,
                            instance_type=itype["InstanceType"])
    tags = {"calque:pool-model": cold_record["model"], "calque:role": "cold-worker",
            "calque:managed": "true", "calque:created-at": now_iso(), "calque:store": store,
            "calque:region": region}
    role_tags = dict(tags, **{"calque:pool-model": "cold-runs"})
    policy = cold_worker_policy(store, region, ident["account"], ident["partition"])
    role_state = _ensure_role(calls, name, policy, role_tags, ("cold-runs", store, region))
    profile_state = _ensure_instance_profile(calls, name, name, role_tags)
    print(f"run {run_id}: cold role {name} {_said(calls, role_state)}, instance profile "
          f"{_said(calls, profile_state)}")
    _store_put(calls, backend, kit_key, blob)
    run_tags = dict(tags, **{"calque:run": run_id, "Name": f"calque-cold-{run_id}"})
    params = {"ImageId": ami, "InstanceType": itype["InstanceType"], "MinCount": shards,
              "MaxCount": shards, "UserData": script, "IamInstanceProfile": {"Name": name},
              "BlockDeviceMappings": root,
              "InstanceInitiatedShutdownBehavior": "terminate", "SubnetId": subnets[0],
              "MetadataOptions": IMDS_V2_ONLY, "TagSpecifications": _instance_tag_specs(run_tags)}
    if launch.key_name:
        params["KeyName"] = launch.key_name
    if launch.spot:
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    answer = _once_profile_propagates(calls, name, lambda: calls.call("ec2", "RunInstances", **params))
    ids = [i["InstanceId"] for i in answer["Instances"]]
    if dry_run:
        print(f"run {run_id}: dry run: no instance was launched")
    print(f"run {run_id}: launched {len(ids)} x {itype['InstanceType']} ({', '.join(ids)}); each "
          f"boots and bootstraps (~{BOOT_ESTIMATE / 60:.0f} min), drains {cold_record['queue']}, "
          f"then terminates itself (at the latest after {max_minutes} min); "
          f"{_hourly(itype['InstanceType'], launch.spot, len(ids))}")
    return ids


def cold_cleanup(backend, instance_ids, calls=None):
    """Terminate a cold run's instances still up (submit timed out or was interrupted); the ones
    that drained have terminated themselves. Returns the ids it terminated."""
    if not instance_ids:
        return []
    calls = calls or AwsCalls.for_backend(backend)
    found = calls.call("ec2", "DescribeInstances", InstanceIds=list(instance_ids))
    live = [i["InstanceId"] for res in found["Reservations"] for i in res["Instances"]
            if i["State"]["Name"] in ("pending", "running", "stopping", "stopped")]
    if live:
        calls.call("ec2", "TerminateInstances", InstanceIds=live)
        print(f"cold run: terminated {len(live)} instance(s) still up: {', '.join(live)}",
              file=sys.stderr)
    return live


# ------------------------------------------------------------------------------------------------
# the EC2 fleet: calque reaches this module through calque_fleet.fleet_for only
class Ec2Fleet:
    """A pool's workers on the instances of an EC2 Auto Scaling group, one worker each (a cold
    run: one-shot instances): the Fleet that calque_fleet.fleet_for documents, counted in
    instances. `args`: the verb's flags (--dry-run, --yes-spend-money, the instances')."""
    unit = "instances"
    here = False   # each instance's venv installs a Modal image's packages at boot; its role reads

    def __init__(self, conf, backend, args=None):
        self.backend, self.args = backend, args
        self.dry_run = bool(getattr(args, "dry_run", False))
        self.spend = bool(getattr(args, "yes_spend_money", False))

    def create(self, pool, modal=None, include=(), suggested=None):
        args = self.args
        snapshot_handler(args.handler, "", lambda key, data: None, include)   # before any AWS call
        record = pool.draft(args.batch_size, args.visibility_timeout, args.max_deliveries,
                            args.batch_timeout, modal, args.retries)
        itype = args.instance_type or (suggested or {}).get("instance_type")   # the app's gpu=
        options = pool_options(args.count, itype,
                               min_instances=args.lo, ami=args.ami, spot=args.spot,
                               subnet=args.subnet, key_name=args.key_name, max_instances=args.hi,
                               scale_to_zero_after=args.scale_to_zero_after, reads=args.read)
        claimed = pool_name_claimed(self.backend, pool.model)
        with contextlib.nullcontext() if self.dry_run else claimed:
            pool_create(self.backend, record, args.handler, options, dry_run=self.dry_run,
                        include=include, yes_spend_money=self.spend)

    def scale(self, pool, record):
        a = self.args
        pool_scale(self.backend, record, a.count, lo=a.lo, hi=a.hi, dry_run=self.dry_run,
                   yes_spend_money=self.spend)

    def bounds(self, record):
        hi, lo = max(1, record["ec2"]["instances"]), record["ec2"].get("min_instances")
        return (hi if lo is None else min(hi, lo)), hi

    def boost(self, record, count, check=False):
        """The group's desired capacity raised to `count` (check: refused first without
        --yes-spend-money); after every run queued, its backlog steps follow its claims."""
        if check:
            return refuse_spending(f"submit --pool {record['model']} at {count} instances",
                                   dry_run=False, yes_spend_money=self.spend)
        calls, name = AwsCalls.for_backend(self.backend), resource_names(record["model"])["asg"]
        asg = describe_asg(calls, name) if count else None
        if asg and asg["DesiredCapacity"] < count:
            calls.call("autoscaling", "SetDesiredCapacity", AutoScalingGroupName=name,
                       DesiredCapacity=count)
        refresh_backlog_steps(self.backend, load_pool(self.backend, record["model"]))

    def waking(self, record):
        """For a submit, no worker running: ("starting", why) while instances boot or its wake
        alarm sizes it, else ("none", how long until a first claim could start, and why)."""
        model, ec2 = record["model"], record["ec2"]
        asg = describe_asg(AwsCalls.for_backend(self.backend), resource_names(model)["asg"])
        if asg is None:
            return "none", (f"pool {model} has no auto scaling group: no instance will claim this "
                            f"run ---> HINT: re-run `pool create` for it")
        states = [i["LifecycleState"] for i in asg.get("Instances", [])]
        if "InService" in states:
            return "starting", (f"pool {model}: instances in service, no worker running yet "
                                "(bootstrapping)")
        enter = measured_enter_seconds(read_worker_stats(self.backend, model))
        load = "@enter (not measured yet)" if enter is None else f"@enter ~{enter:.0f}s (measured)"
        boot = f"boot + bootstrap ~{BOOT_ESTIMATE / 60:.0f} min (assumed)"
        if asg["DesiredCapacity"] == 0 and not ec2.get("scale_to_zero_after"):
            return "none", (f"pool {model} is scaled to 0: nothing will claim this run "
                            f"---> HINT: pool scale --model {model} --instances N")
        if asg["DesiredCapacity"] == 0:
            return "starting", (f"pool {model} is cold (0 instances): its wake alarm sizes it to "
                                f"the backlog (up to {ec2['instances']}) in ~1-3 min (SQS metrics "
                                f"are per minute; up to 15 min more after 6 idle hours, while SQS "
                                f"resumes them), then {boot}, then {load} before the first claim "
                                f"starts")
        pending = sum(s.startswith("Pending") for s in states)
        return "none", (f"pool {model} is cold (0 of {asg['DesiredCapacity']} instances in "
                        f"service, {pending} launching): {boot} from launch, then {load} before "
                        f"the first claim starts")

    def status(self, record):   # the group's status reads the queues and worker stats: not twice
        status = pool_status(self.backend, record)
        return {"queue": status["queue"], "dlq": status["dlq"], "workers": status["workers"],
                "ec2": status}

    def lines(self, status):
        return ["    " + line for line in format_status(status["ec2"])]

    def logs(self, record):
        print(f"pool {record['model']} runs on EC2: each instance's worker log is its journal "
              f"(`journalctl -u calque-warmd` on the instance; the bootstrap's in "
              f"/var/log/cloud-init-output.log); `pool status --model {record['model']}` lists "
              f"the instances")

    def delete(self, pool, record):
        """Every part of the pool, found by name and tag (`record` may be only {"model"}): only
        with --yes, or previewed with --dry-run; --force cancels its unfinished runs first."""
        args = self.args
        if not args.yes and not args.dry_run:
            raise UserError(f"pool delete {pool.model}: an EC2 pool is deleted only with --yes "
                            f"(or previewed with --dry-run)")
        force = args.force and not args.dry_run
        cancelled = cancel_pool_runs(self.backend, pool.model) if force else {}
        pool_delete(self.backend, record, yes=args.yes, dry_run=args.dry_run)
        return cancelled

    def pools(self):
        return pool_list(self.backend)

    @contextlib.contextmanager
    def cold_workers(self, cold, run, shards, timeout):
        """One-shot instances (--ami, --instance-type, --spot, --subnet, --key-name) on the run's
        queue, terminated at the end if still up; a dry run prints the launch and stages nothing."""
        a = self.args
        launch = ColdLaunch(a.ami, a.instance_type, spot=a.spot, subnet=a.subnet,
                            key_name=a.key_name)
        ids = cold_launch(self.backend, cold, run["run_id"], shards, launch, timeout=timeout,
                          dry_run=self.dry_run, yes_spend_money=self.spend)
        try:
            yield lambda: None
        finally:
            cold_cleanup(self.backend, [] if self.dry_run else ids)

    def start_seconds(self, enter, acquisition):
        return enter + BOOT_ESTIMATE

    def grant_read(self, record, uri):
        grant_read(self.backend, record, uri)


# ------------------------------------------------------------------------------------------------
# the worker's side on an instance (warmd imports these where CALQUE_SPOT_POLL names the metadata)
worker_log = logging.getLogger("warmd")


def metadata(base, *paths):
    """The bodies of EC2 instance metadata paths under `base` (IMDSv2: one token for them all); None
    for a path that 404s (no notice, no Auto Scaling group)."""
    token_req = urllib.request.Request(base.rstrip("/") + "/latest/api/token", method="PUT",
                                       headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    token = urllib.request.urlopen(token_req, timeout=2).read().decode()
    bodies = []
    for path in paths:
        req = urllib.request.Request(f"{base.rstrip('/')}/latest/meta-data/{path}",
                                     headers={"X-aws-ec2-metadata-token": token})
        try:
            bodies.append(urllib.request.urlopen(req, timeout=2).read())
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            bodies.append(None)
    return bodies


class SpotPoller:
    """Polls the EC2 metadata (IMDSv2): `on_notice` once a spot `instance-action` appears; with
    `on_terminating`, that once the Auto Scaling `target-lifecycle-state` reads Terminated."""

    def __init__(self, base_url, interval, on_notice, on_terminating=None):
        self.base, self.interval, self.on_notice = base_url.rstrip("/"), interval, on_notice
        self.on_terminating = on_terminating
        if not self._poll():   # the first check before anything loads: a notice given stops it
            threading.Thread(target=self._run, name="spot-poller", daemon=True).start()

    def _poll(self):
        """One check; True when it found a notice (and called on_notice)."""
        try:
            lifecycle = ["autoscaling/target-lifecycle-state"] if self.on_terminating else []
            *state, notice = metadata(self.base, *lifecycle, "spot/instance-action")
            if state == [b"Terminated"]:
                worker_log.warning("its instance is terminating: no new claims; the claim held "
                                   "finishes first")
                self.on_terminating()
                self.on_terminating = None
            if notice is not None:
                worker_log.warning("spot: interruption notice %s; stopping as on SIGTERM",
                                   json.loads(notice or b"{}"))
                self.on_notice()
                return True
        except Exception as e:
            worker_log.warning("spot: metadata check failed (%s)", e)
        return False

    def _run(self):
        time.sleep(self.interval)
        while not self._poll():
            time.sleep(self.interval)


class ScaleInProtection:
    """An EC2 pool instance protected from scale-in while its worker holds a claim, unprotected once
    a poll finds nothing (one call per change), so scaling in costs no redelivery. An instance
    terminating anyway (held by the pool's hook) is let go at the worker's exit."""

    def __init__(self, asg, instance_id, client, hook):
        self.asg, self.instance_id, self.client, self.hook = asg, instance_id, client, hook
        self.protected = None    # unknown: a restarted worker's instance may still be protected
        self.leaving = False

    @classmethod
    def on_instance(cls, record, conf):
        """The protection of this worker's instance when it serves an EC2 pool (None elsewhere): the
        group named after the model, the instance id from the metadata at CALQUE_SPOT_POLL."""
        if "ec2" not in record or not conf.get("CALQUE_SPOT_POLL"):
            return None
        try:
            instance_id = metadata(conf["CALQUE_SPOT_POLL"], "instance-id")[0].decode()
        except Exception as e:
            worker_log.warning("no scale-in protection: the instance id is unreadable (%s)", e)
            return None
        import boto3   # lazy: only an EC2 pool instance needs it
        region = os.environ.get("AWS_REGION") or DEFAULT_REGION
        client = boto3.client("autoscaling", config=aws_client_config(region))
        names = resource_names(record["model"])
        return cls(names["asg"], instance_id, client, names["hook"])

    def release(self):
        """Let a terminating instance go: its worker holds no claim any more."""
        if self.leaving:
            try:
                self.client.complete_lifecycle_action(
                    LifecycleHookName=self.hook, AutoScalingGroupName=self.asg,
                    InstanceId=self.instance_id, LifecycleActionResult="CONTINUE")
            except Exception as e:
                worker_log.warning("completing the termination hook failed (%s: %s)", type(e).__name__, e)

    def hold(self, busy):
        if busy != self.protected:
            try:
                self.client.set_instance_protection(AutoScalingGroupName=self.asg,
                                                    InstanceIds=[self.instance_id],
                                                    ProtectedFromScaleIn=busy)
                self.protected = busy
            except Exception as e:
                worker_log.warning("scale-in protection %s failed (%s: %s)", "on" if busy else "off",
                            type(e).__name__, e)
