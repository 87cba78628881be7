"""`pip install` as a user does it: calque's sdist (the one an EC2 worker gets, packed from the checkout) built into
a wheel by pip in its own isolated build environment, installed into a fresh venv, then run from a folder of the
user's own, away from the checkout. The fresh venv sees this suite's venv's packages after its own (a .pth file,
as the Makefile's peers venv does) instead of installing torch & co. again (~2 minutes here): what calque ships is
installed for real (its files, commands, compiled module, package data), and `pip check` holds the pins it
declares against the packages it runs with."""
import json
import os
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile

import calque
import calque_ec2 as ec2
from conftest import PY, ROOT

HANDLER = '''import calque


class RowSum:
    @calque.enter
    def load(self):
        self.scale = 2

    @calque.batch
    def run(self, batch):   # fastbatch's collated dict of tensors: {"x": [B, 3]}
        return [{"sum": float(row.sum()) * self.scale} for row in batch["x"]]
'''
ITEMS = [{"x": [i, i + 1, i + 2]} for i in range(40)]


def venv_with(tmp, wheel):
    """A fresh venv with `wheel` installed by pip, seeing this venv's packages after its own; its python."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    pip(venv, "install", "-q", "--no-deps", str(wheel))   # first: this venv has a calque too (make setup's)
    with open(os.path.join(site, "calque-test-deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python"


def pip(venv, *args):
    """pip on the venv's python, nothing of the checkout on its path (its calque.egg-info would pass for calque)."""
    return subprocess.run([PY, "-m", "pip", "--python", str(venv / "bin" / "python"), *args], check=True,
                          capture_output=True, text=True, timeout=300, env=without_checkout())


def without_checkout():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def build_wheel(tmp, env=None, *isolation):
    """The wheel pip builds, in an isolated build environment unless told --no-build-isolation, from the
    checkout's EC2 kit (an sdist)."""
    kit = tmp / "calque-kit.tar.gz"
    kit.write_bytes(ec2.kit_archive()[0])
    subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(tmp / "dist"), str(kit)],
                   check=True, capture_output=True, text=True, timeout=300, env=env or without_checkout())
    return next((tmp / "dist").glob("calque-*.whl"))


def user_env(tmp, **extra):
    """The user's environment: no PYTHONPATH (nothing of the checkout), a fresh store and state."""
    return {**without_checkout(), "CALQUE_STORE": str(tmp / "store"), "CALQUE_STATE": str(tmp / "state"),
            "CALQUE_POLL_WAIT": "1", "CALQUE_ENV": str(tmp / "none.env"), "PYTHONUNBUFFERED": "1", **extra}


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def user_folder(tmp):
    folder = tmp / "work"
    folder.mkdir()
    (folder / "model.py").write_text(HANDLER)
    (folder / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    return folder


def calque_cmd(python, env, folder, *args):
    out = subprocess.run([str(python.parent / "calque"), *args], env=env, cwd=folder, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def plain_walk(python, env, folder):
    """The module of the installed calque_values.plain: calque_plain (its C walk) or calque_values."""
    out = subprocess.run([str(python), "-c", "import calque_values; print(calque_values.plain.__module__)"],
                         env=env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_installed_wheel_runs_every_verb_from_a_folder_of_its_own(tmp_path, moto_endpoint):
    """From the user's folder, nothing of the checkout on the path: calque, warmd, fastbatch and calque_data load
    from the venv, fastbatch on the C module the wheel holds (not rebuilt at first use), calque_values on the
    wheel's calque_plain (its C walk); pool create, submit, runs
    results, cost and runs report work, its hints say `calque`, the worker gathers in C, `--version` is the
    package's, pip check holds; and `pool create --instances 1 --dry-run` on moto_server creates nothing and
    would upload the checkout's kit."""
    python = venv_with(tmp_path, build_wheel(tmp_path))
    env, folder = user_env(tmp_path), user_folder(tmp_path)
    where = subprocess.run([str(python), "-c", "import calque, warmd, calque_data, importlib.metadata as m, "
                            "importlib.util as u; print(calque.__file__, warmd.__file__, calque_data.__file__, "
                            "u.find_spec('fastbatch').origin, m.files('calque')[0].locate())"],
                           env=env, cwd=folder, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    files = where.stdout.split()   # the modules, and the metadata `--version` reads
    assert plain_walk(python, env, folder) == "calque_plain"   # the typed encoding's check in C
    assert len(files) == 5 and all(f.startswith(str(tmp_path / "venv")) for f in files), files
    version = pyproject()["project"]["version"]
    assert calque_cmd(python, env, folder, "--version").strip() == f"calque {version}"
    calque_cmd(python, env, folder, "pool", "create", "--model", "m", "--handler", "model.py:RowSum", "--workers", "1")
    try:
        run_id = json.loads(calque_cmd(python, env, folder, "submit", "--pool", "m", "items.jsonl", "--json"))[
            "run"]["run_id"]
        results = [json.loads(line) for line in calque_cmd(python, env, folder, "runs", "results",
                                                           run_id).splitlines()]
        assert [r["result"]["sum"] for r in results] == [2.0 * sum(i["x"]) for i in ITEMS]
        shown = calque_cmd(python, env, folder, "runs", "show", run_id)   # hints name the command as it was run
        assert f"(calque runs results {run_id})" in shown and "python calque.py" not in shown, shown
        assert "$" in calque_cmd(python, env, folder, "cost", run_id)          # priced from the wheel's rates.json
        calque_cmd(python, env, folder, "runs", "report", run_id, "--html", "report.html")   # calque_dashboard.py's
        assert run_id in (folder / "report.html").read_text()
        status = json.loads(calque_cmd(python, env, folder, "pool", "status", "--model", "m", "--json"))
        assert [w["fastbatch"] for w in status["workers"]] == ["c"]
    finally:
        calque_cmd(python, env, folder, "pool", "delete", "--model", "m", "--yes")
    assert not os.path.exists(os.path.join(os.path.dirname(files[3]), ".build.lock"))   # the wheel's .so, as built
    pip(tmp_path / "venv", "check")

    import boto3
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket="calque-install")
    ami = boto3.client("ec2", endpoint_url=moto_endpoint).describe_images(
        Filters=[{"Name": "architecture", "Values": ["x86_64"]}])["Images"][0]["ImageId"]
    env = dict(env, CALQUE_STORE="s3://calque-install/root", AWS_ENDPOINT_URL=moto_endpoint)
    out = calque_cmd(python, env, folder, "pool", "create", "--model", "m", "--handler", "model.py:RowSum",
                     "--instances", "1", "--instance-type", "g5.xlarge", "--ami", ami, "--dry-run")
    assert f"kit {ec2.kit_archive()[1][:16]}" in out and "would call autoscaling.CreateAutoScalingGroup" in out
    assert s3.list_objects_v2(Bucket="calque-install").get("KeyCount") == 0


def test_without_a_compiler_the_install_succeeds_on_the_numpy_path(tmp_path):
    """No working compiler (CC fails) at build and at run time: the wheel still builds, without the C modules; it
    installs; calque_values checks plain JSON in Python; its worker gathers on numpy and `pool status` says so."""
    env = user_env(tmp_path, CC="/bin/false")
    wheel = build_wheel(tmp_path, env, "--no-build-isolation")   # the isolated build is the test above's
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    python = venv_with(tmp_path, wheel)
    folder = user_folder(tmp_path)
    assert plain_walk(python, env, folder) == "calque_values"   # the Python walk, as correct
    calque_cmd(python, env, folder, "pool", "create", "--model", "m", "--handler", "model.py:RowSum", "--workers", "1")
    try:
        calque_cmd(python, env, folder, "submit", "--pool", "m", "items.jsonl")
        want, deadline = "1 running worker(s) collate with fastbatch's numpy fallback", time.monotonic() + 60
        while True:   # the worker writes its stats at its first idle poll after the claim, not before
            status = calque_cmd(python, env, folder, "pool", "status", "--model", "m")
            if want in status or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert want in status, status
    finally:
        calque_cmd(python, env, folder, "pool", "delete", "--model", "m", "--yes")


def test_the_build_pins_are_requirements_pins():
    """pyproject.toml's build requirements (setuptools, cffi) are requirements.txt's pinned lines."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = {line.split("#")[0].strip() for line in f}
    requires = pyproject()["build-system"]["requires"]
    assert set(requires) <= pins, requires
