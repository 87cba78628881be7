"""A new user's first mistakes, each with real processes: every one is one line with the next step and an exit
code, never a silent wait or a traceback. Handlers live in the user's own folder (tmp), outside the checkout."""
import glob
import json
import os
import re
import shutil
import subprocess

from conftest import PY, ROOT, cli, wait_for
import calque_core

HANDLER = '''
import os
import calque


class Model:
    @calque.enter
    def load(self):
        {enter}
        self.scale = int(open("scale.txt").read())      # relative: the folder pool create ran in

    @calque.batch
    def run(self, items):
        out = []
        for item in items:
            if item.get("fail"):
                raise ValueError(f"item {{item['x']}} asked to fail")
            out.append({{"y": item["x"] * self.scale, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}})
        return out
'''


def user_folder(tmp_path, enter="pass"):
    """The user's own folder: a handler, a file its @enter reads by a relative path, and items."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "model.py").write_text(HANDLER.format(enter=enter))
    (folder / "scale.txt").write_text("3")
    (folder / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in (
        {"x": 1, "id": "a"}, {"x": 2, "id": "b", "fail": True}, {"x": 3, "id": "c"},
        {"x": 4, "id": "d", "fail": True})))
    return folder


def run(env, folder, *args, **kw):
    """calque.py ARGS run from the user's folder."""
    return subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=folder, capture_output=True,
                          text=True, timeout=120, **kw)


def error(out, code):
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr.strip()


def test_failing_enter_fails_pool_create_with_the_reason(local_env, tmp_path):
    """A handler whose @enter imports a missing package: pool create exits 1 naming the exception and the log, and
    leaves no pool (the log stays); with --no-wait, pool status shows each worker's last exit and submit stops at
    once."""
    folder = user_folder(tmp_path, enter="import no_such_package_here")
    line = error(run(local_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model"), 1)
    assert "worker 0 died before it was warm: ModuleNotFoundError: No module named 'no_such_package_here'" in line
    assert "---> HINT: fix the handler" in line and "no_such_package_here" in open(
        re.search(r"\(log (\S+worker-0\.log)\)", line).group(1)).read()
    assert "no pools in" in run(local_env, folder, "pool", "list").stdout
    out = run(local_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model", "--no-wait")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: re.search(r"\(died before warm, restart after \d+ s\): ModuleNotFoundError", run(
        local_env, folder, "pool", "status", "--model", "m").stdout), 30, "the last exit in pool status")
    line = error(run(local_env, folder, "submit", "--pool", "m", "items.jsonl"), 1)
    assert line.startswith("calque: error: pool m: every local worker dies before it is warm: worker 0 died")


def test_workers_default_and_no_live_worker(local_env, tmp_path):
    """No --workers: one local worker, said so; --workers 0: submit says at once that nothing would claim the run
    (exit 2), and --wait-for-workers queues it anyway."""
    folder = user_folder(tmp_path)
    out = run(local_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model", "--workers", "0")
    assert out.returncode == 0 and "--workers not given" not in out.stdout, out.stderr
    line = error(run(local_env, folder, "submit", "--pool", "m", "items.jsonl"), 2)
    assert line == ("calque: error: pool m has no live worker (no supervisor on this machine, no worker running "
                    "elsewhere): nothing would claim this run ---> HINT: python calque.py pool scale --model m --workers 1 "
                    "(or --instances N), or submit --wait-for-workers to queue it anyway")
    out = run(local_env, folder, "submit", "--pool", "m", "items.jsonl", "--wait-for-workers", "--timeout", "0.2")
    assert out.returncode == 1 and "4 pending" in out.stdout, out.stdout + out.stderr
    out = run(local_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model")
    assert "--workers not given: starting 1 local worker (--workers 0 for none)" in out.stdout
    assert "1 local worker(s) warm" in out.stdout, out.stdout + out.stderr


def test_errors_results_ids_and_the_working_directory(local_env, tmp_path):
    """The user's folder is the workers' working directory; submit prints failed items grouped by error with their
    ids; runs results --failed carries the trace, --id-field the user's ids; `| head` is quiet."""
    folder = user_folder(tmp_path)
    assert run(local_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model").returncode == 0
    out = run(local_env, folder, "submit", "--pool", "m", "items.jsonl", "--id-field", "id", "--claim-size", "2")
    assert out.returncode == 1, out.stderr
    assert "  failed items by error (2 failed):" in out.stdout
    assert "         1 x ValueError: item 2 asked to fail  (items b)" in out.stdout   # each message, by --id-field
    assert "         1 x ValueError: item 4 asked to fail  (items d)" in out.stdout
    run_id = json.loads(run(local_env, folder, "runs", "list", "--json").stdout)[-1]["run_id"]
    failed = [json.loads(line) for line in
              run(local_env, folder, "runs", "results", run_id, "--failed").stdout.splitlines()]
    assert [(r["i"], r["id"], r["error"]) for r in failed] == [(1, "b", "ValueError: item 2 asked to fail"),
                                                               (3, "d", "ValueError: item 4 asked to fail")]
    assert re.fullmatch(r"model\.py:\d+ in run: raise ValueError.*", failed[0]["trace"][-1])
    every = run(local_env, folder, "runs", "results", run_id).stdout.splitlines()
    assert [json.loads(line).get("result", {}).get("y") for line in every] == [3, None, 9, None]   # scale.txt: 3
    piped = subprocess.run(f"{PY} {ROOT}/calque.py runs results {run_id} --follow | head -1", shell=True,
                           env=local_env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert piped.stderr == "" and json.loads(piped.stdout)["id"] == "a"


def test_foreign_interpreter(local_env, tmp_path):
    """A Python without the kit's packages (-S: no site-packages) re-runs itself under the kit's .venv; a kit
    without a .venv fails at once in one line naming the package and make setup."""
    out = subprocess.run([PY, "-S", os.path.join(ROOT, "calque.py"), "pool", "list"], env=local_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("no pools in"), out.stderr
    kit = tmp_path / "kit"
    kit.mkdir()
    for module in glob.glob(os.path.join(ROOT, "calque*.py")):   # the kit's modules, without its .venv
        shutil.copy(module, kit)
    out = subprocess.run([PY, "-S", str(kit / "calque.py"), "pool", "list"], env=local_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    line = error(out, 2)
    assert line.startswith(f"calque: error: this Python ({PY}) lacks the package 'numpy' ---> HINT: run `make setup`")


def test_settings_are_one_mechanism():
    """pool.env.example shows every DEFAULTS key with its default; each CALQUE_* name the kit reads (from
    os.environ or the merged settings) is a DEFAULTS key or CALQUE_ENV, the environment-only one; and no
    kit module reads the environment as it is imported."""
    import ast
    import calque
    with open(os.path.join(ROOT, "pool.env.example")) as f:
        shown = dict(line.strip().split("=", 1) for line in f if re.match(r"CALQUE_\w+=", line))
    assert shown == calque_core.DEFAULTS
    files = [*glob.glob("calque*.py", root_dir=ROOT), "warmd.py", "modal_shim/modal.py"]
    read, at_import = set(), []
    for name in files:
        with open(os.path.join(ROOT, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            key = (node.slice if isinstance(node, ast.Subscript) else
                   node.args[0] if isinstance(node, ast.Call) and node.args[:1] and
                   isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv") else
                   node.args[1] if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setting_number"
                   else None)
            if isinstance(key, ast.Constant) and str(key.value).startswith("CALQUE_"):
                read.add(key.value)
        body = list(tree.body)
        while body:   # what runs at import: module and class bodies, not function bodies
            node = body.pop()
            if isinstance(node, ast.ClassDef):
                body.extend(node.body)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                at_import += [f"{name}:{n.lineno}" for n in ast.walk(node) if isinstance(n, ast.Attribute)
                              and getattr(n.value, "id", "") == "os" and n.attr in ("environ", "getenv")]
    assert read - set(calque_core.DEFAULTS) == {"CALQUE_ENV"} and len(calque_core.DEFAULTS) <= 20   # 20: CALQUE_ROOT_GB
    assert at_import == []


def test_pool_env_mistakes(local_env, tmp_path):
    """pool.env: `export` lines and inline comments are read as a shell would; a misspelt key is one warning with
    did-you-mean; a one-slash s3:/ store is refused instead of becoming a local folder."""
    env_file = tmp_path / "pool.env"
    env_file.write_text('export CALQUE_GRACE=7\nCALQUE_STATE=state # my state\nCALQUE_STOR=s3://b/p\n'
                        'CALQUE_BATCH_SIZE="8 # kept"\n')
    env = dict(local_env, CALQUE_ENV=str(env_file))
    env.pop("CALQUE_GRACE")
    env.pop("CALQUE_STATE")
    out = subprocess.run([PY, "-c", "import calque, json; print(json.dumps(calque.settings()))"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    conf = json.loads(out.stdout)
    assert (conf["CALQUE_GRACE"], conf["CALQUE_STATE"], conf["CALQUE_BATCH_SIZE"]) == ("7", "state", "8 # kept")
    assert out.stderr == (f"calque: warning: {env_file}:3: unknown setting CALQUE_STOR (did you mean CALQUE_STORE?): "
                          f"ignored\n")
    line = error(cli(dict(local_env, CALQUE_STORE="s3:/bucket/p"), "pool", "list"), 2)
    assert line == ("calque: error: CALQUE_STORE='s3:/bucket/p' looks like a mistyped URI ---> HINT: s3://bucket/prefix "
                    "for S3, or a folder path (./s3:/bucket/p if a folder of that name is meant)")


def test_region_from_aws_config_and_the_wrong_region(aws_env, tmp_path):
    """The region comes from boto3's own chain (here a profile in a fake ~/.aws/config); a pool looked for in the
    wrong region says which region was searched."""
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-west-3\n")
    env = {k: v for k, v in aws_env.items() if k not in ("AWS_REGION", "AWS_DEFAULT_REGION")}
    env["AWS_CONFIG_FILE"] = str(config)
    code = f"import calque_core; print(calque_core.AwsBackend({env['CALQUE_STORE']!r}).region)"
    out = subprocess.run([PY, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "eu-west-3", out.stderr
    folder = user_folder(tmp_path)
    assert run(aws_env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model",
               "--workers", "0").returncode == 0
    line = error(run(env, folder, "submit", "--pool", "m", "items.jsonl", "--wait-for-workers"), 2)
    assert line.startswith("calque: error: queue calque-pool-m not found in region eu-west-3 (s3://")
    assert "set AWS_REGION (or the profile's region in ~/.aws/config)" in line


def test_hints_name_the_right_next_step(local_env, tmp_path):
    """A misspelt model gets did-you-mean; deleting a pool that is not there says nothing to delete; a cold
    submit of a model without a pool asks for --handler."""
    folder = user_folder(tmp_path)
    assert run(local_env, folder, "pool", "create", "--model", "demo", "--handler", "model.py:Model",
               "--workers", "0").returncode == 0
    assert "no pool for model 'dmeo' in" in error(run(local_env, folder, "pool", "status", "--model", "dmeo"), 2)
    assert "(did you mean demo?)" in error(run(local_env, folder, "submit", "--pool", "dmeo", "items.jsonl"), 2)
    line = error(run(local_env, folder, "pool", "delete", "--model", "nosuch", "--yes"), 2)
    assert line.endswith("---> HINT: nothing to delete (`python calque.py pool list` lists the pools)")
    line = error(run(local_env, folder, "submit", "--model", "other", "items.jsonl"), 2)
    assert line.endswith("---> HINT: give the cold run its code: submit --model other --handler file.py:Class ITEMS")


INHERITED = '''
import calque
from base_lib import Loaded, Plain


class Base:
    @calque.enter
    def load(self):
        self.k = 2


class Same(Base):
    @calque.batch
    def run(self, items):
        return [{"y": item["x"] * self.k} for item in items]


class Imported(Loaded):
    run = Same.run


class Undecorated(Plain):
    run = Same.run


class Hidden(Base):
    def load(self):   # redefined without @calque.enter: the base's is hidden
        self.k = 3

    @calque.batch
    def run(self, items):
        return items
'''


def test_a_handler_may_inherit_enter_and_batch(local_env, tmp_path):
    """@calque.enter inherited from a base class of the same file (pool create's check reads it without running
    the file) or from an importable module (the worker's import checks it) runs, in both spellings; a method
    the subclass redefines undecorated hides the base's (exit 2 at once); an imported base without @enter
    fails the cold run at once with the worker's reason (exit 1), not after CALQUE_TIMEOUT."""
    folder = user_folder(tmp_path)
    (folder / "h.py").write_text(INHERITED)
    (folder / "base_lib.py").write_text("import calque\n\n\nclass Loaded:\n    @calque.enter\n    def load(self):\n"
                                         "        self.k = 10\n\n\nclass Plain:\n    def load(self):\n        pass\n")
    out = run(local_env, folder, "submit", "--model", "same", "--handler", "h.py:Same", "items.jsonl", "--json")
    assert out.returncode == 0, out.stderr
    installed = subprocess.run([os.path.join(os.path.dirname(PY), "calque"), "submit", "--model", "imported",
                                "--handler", "h.py:Imported", "items.jsonl", "--json"], env=local_env, cwd=folder,
                               capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr
    for out, k in ((out, 2), (installed, 10)):
        run_id = json.loads(out.stdout)["run"]["run_id"]
        results = [json.loads(line) for line in run(local_env, folder, "runs", "results", run_id).stdout.splitlines()]
        assert [r["result"]["y"] for r in results] == [k * x for x in (1, 2, 3, 4)]
    line = error(run(local_env, folder, "submit", "--model", "hidden", "--handler", "h.py:Hidden", "items.jsonl"), 2)
    assert line.endswith("class Hidden lacks @calque.enter: decorate its load and batch methods (its own, or a "
                         "base class's)")
    out = run(local_env, folder, "submit", "--model", "undecorated", "--handler", "h.py:Undecorated", "items.jsonl")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.fullmatch(r"calque: error: run undecorated\.\S+: every cold worker exited with claims left: warmd: "
                        r"error: handler \S+h\.py:Undecorated lacks @calque\.enter \(its own or a base class's\) "
                        r"---> HINT: see \S+", out.stderr.splitlines()[-1]), out.stderr


def test_gpus_per_worker_from_a_faked_device_list(local_env, tmp_path):
    """With four (faked) GPUs and two per worker, each worker gets its own two, round-robin, in
    CUDA_VISIBLE_DEVICES; pool status shows them; pool logs shows each worker's log."""
    import calque_supervisor as supervisor
    assert supervisor.worker_gpus(["0", "1", "2"], 1, 4) == ["1"] and supervisor.worker_gpus([], 1, 0) == []
    folder = user_folder(tmp_path)
    env = dict(local_env, CALQUE_GPUS="0,1,2,3")
    out = run(env, folder, "pool", "create", "--model", "m", "--handler", "model.py:Model", "--workers", "2",
              "--gpus-per-worker", "2")
    assert out.returncode == 0, out.stderr
    status = json.loads(run(env, folder, "pool", "status", "--model", "m", "--json").stdout)
    assert [w["gpus"] for w in status["local_workers"]] == [["0", "1"], ["2", "3"]]
    assert "    slot 1: pid " in run(env, folder, "pool", "status", "--model", "m").stdout
    out = run(env, folder, "submit", "--pool", "m", "items.jsonl", "--json")
    results = run(env, folder, "runs", "results", json.loads(out.stdout)["run"]["run_id"]).stdout.splitlines()
    assert json.loads(results[0])["result"]["gpus"] in ("0,1", "2,3")
    logs = run(env, folder, "pool", "logs", "--model", "m", "--worker", "1").stdout
    assert logs.startswith("==> ") and "worker-1.log <==" in logs and f"working directory {folder}" in logs


def test_pyproject_installs_the_kit_with_requirements_pins(tmp_path):
    """`pip wheel` of the checkout holds calque, warmd, fastbatch with its sources and compiled module, modal_shim,
    calque_data's files (copies of the checkout's), the `calque` and `warmd` commands, and exactly
    requirements.txt's pins (its single source)."""
    import zipfile
    out = subprocess.run([PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                          str(tmp_path), ROOT], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    wheel = zipfile.ZipFile(next(tmp_path.glob("calque-*.whl")))
    names = wheel.namelist()
    assert {"calque.py", "warmd.py", "calque_ec2.py", "fastbatch/__init__.py", "fastbatch/fastbatch.c",
            "fastbatch/fastbatch.h", "modal_shim/modal.py", "calque_data/ec2_bootstrap.sh",
            "calque_data/sdist/setup.py"} <= set(names)
    assert [n for n in names if n.startswith("fastbatch/_fastbatch_c.") and n.endswith(".so")]
    for name in ("rates.json", "sdist/pyproject.toml", "sdist/requirements.txt"):
        with open(os.path.join(ROOT, name.rsplit("/", 1)[-1]), "rb") as f:
            assert wheel.read(f"calque_data/{name}") == f.read(), name
    meta = {name.rsplit("/", 1)[1]: wheel.read(name).decode() for name in names if ".dist-info/" in name}
    assert "calque = calque:main" in meta["entry_points.txt"] and "warmd = warmd:main" in meta["entry_points.txt"]
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
    assert [line[len("Requires-Dist: "):] for line in meta["METADATA"].splitlines()
            if line.startswith("Requires-Dist: ")] == pins
