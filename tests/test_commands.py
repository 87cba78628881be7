"""Every command as README.md and the design card write it, in both spellings (`python calque.py ...` and the
installed `calque ...`): the README's code blocks run as written from a folder of the user's own; calque is one
module however it is started; a worker that is starting counts; hints spell the command as it was run."""
import json
import os
import re
import subprocess

import boto3
import pytest

from conftest import PY, ROOT, start_worker

README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(PY)                  # the venv's bin: python, and pip's `calque` and `warmd` scripts
SPELLINGS = {"installed": "{name}", "script": f"python {ROOT}/{{name}}.py"}
# README lines not run here, and why (each must still be in the README: a stale entry fails the test)
NOT_RUN = {
    "make test": "it is what runs this test",
    "make demo": "run once, by test_make_demo_as_the_readme_opens",
    "pip install ./calque": "installs into the user's Python: tests/test_install.py installs the wheel so, "
                            "from a folder of its own",
}
SLOW_ENTER = '''
import os, time
import calque


class Slow:
    @calque.enter
    def load(self):
        time.sleep(float(os.environ.get("ENTER_SECONDS", "3")))   # a model's load
        if os.environ.get("ENTER_FAILS"):
            raise RuntimeError("weights.pt is missing")

    @calque.batch
    def run(self, items):
        return [{"y": item["x"] + 1} for item in items]
'''


def readme_blocks():
    """(language, text) of each fenced block of README.md, in order."""
    with open(README) as f:
        return re.findall(r"^```(\w*)\n(.*?)^```", f.read(), re.M | re.S)


def spelt(text, spelling):
    """The command lines of `text` with calque and warmd as `spelling` writes them."""
    return re.sub(r"(?m)(^\s*|\$\()(calque|warmd)(?= )",
                  lambda m: m.group(1) + SPELLINGS[spelling].format(name=m.group(2)), text)


def readme_script(spelling):
    """The README as one bash script: its sh blocks (but NOT_RUN's lines), its Python files written where its
    walk writes them (a block whose first line is `# name.py`), its other Python blocks run by python."""
    lines, skipped = ["set -euo pipefail"], set()
    for lang, text in readme_blocks():
        if lang == "sh":
            for line in spelt(text, spelling).splitlines():
                why = next((cmd for cmd in NOT_RUN if line.strip().startswith(cmd)), None)
                skipped.add(why) if why else lines.append(line)
        elif lang == "python":
            first = text.splitlines()[0]
            target = first[2:].strip() if re.fullmatch(r"# [\w.]+\.py", first) else None
            lines += [f"cat > {target} <<'PY'" if target else "python - <<'PY'", text.rstrip("\n"), "PY"]
        else:
            assert lang == "text", f"README block of language {lang!r}: sh (run), python or text (output)"
    assert skipped == set(NOT_RUN), f"NOT_RUN names lines the README no longer has: {set(NOT_RUN) - skipped}"
    return "\n".join(lines) + "\n"


def user_env(tmp_path, spelling, moto_endpoint):
    """A user's shell: a home of its own, the venv's python first on PATH (its `calque` too, when installed is
    the spelling), no calque setting but what the README sets; AWS only on moto_server."""
    path = tmp_path / "bin"
    path.mkdir()
    (path / "python").write_text(f'#!/bin/sh\nexec {PY} "$@"\n')   # the venv's python (a link would not be)
    (path / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALQUE_")}
    env.update(HOME=str(tmp_path / "home"), AWS_ENDPOINT_URL=moto_endpoint, PYTHONUNBUFFERED="1",
               PATH=os.pathsep.join([str(path)] + ([BIN] if spelling == "installed" else []) + [
                   p for p in os.environ["PATH"].split(os.pathsep) if os.path.realpath(p) != os.path.realpath(BIN)]))
    os.makedirs(env["HOME"])
    return env


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_readme_runs_as_written(tmp_path, moto_endpoint, spelling):
    """Every sh block of README.md in order, in one shell from a fresh home, as `calque` and as `python
    calque.py`: the walk's results are right, a worker started by hand serves the pool, and the EC2 dry run
    names its calls."""
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="my-calque-bucket")
    env = user_env(tmp_path, spelling, moto_endpoint)
    out = subprocess.run(["bash", "-c", readme_script(spelling)], env=env, cwd=env["HOME"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    job = tmp_path / "home" / "my-job"
    results = [json.loads(line) for line in (job / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["result"]) for r in results] == [("a", {"y": 2}), ("b", {"y": 4}), ("c", {"y": 6})]
    assert (job / "results.parquet").stat().st_size > 0
    assert out.stdout.count("(pool, model my-model): 3 items ok") == 2, out.stdout   # by the pool, by warmd
    assert "would call autoscaling.CreateAutoScalingGroup" in out.stdout, out.stdout[-2000:]
    shown = "calque" if spelling == "installed" else "python calque.py"
    assert f"({shown} runs results my-model." in out.stdout, out.stdout[-3000:]


def test_make_demo_as_the_readme_opens():
    """`make demo`, the README's first command: 3 warm runs, 1 cold, their costs, the workers stopped."""
    out = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("(pool, model demo): 40 items ok") == 3, out.stdout[-3000:]
    assert "pool demo: scaled to 0 local workers" in out.stdout


MODES = {   # how calque starts, as `python calque.py --help`, `python -m calque --help`, ... would
    "script": "runpy.run_path(os.path.join(root, 'calque.py'), run_name='__main__')",
    "module": "runpy.run_module('calque', run_name='__main__', alter_sys=True)",
    "import": "import calque",
    "warmd": "runpy.run_path(os.path.join(root, 'warmd.py'), run_name='__main__')",
}


@pytest.mark.parametrize("mode", MODES)
def test_one_calque_module_however_it_starts(mode):
    """calque started as a script, with -m, imported, or by warmd.py as __main__; then each role file imported:
    one calque module (not a second copy) and one calque_core, whose error classes every role shares."""
    code = f"""
import json, os, runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
sys.argv = ["x", "--help"]
try:
    {MODES[mode]}
except SystemExit:
    pass
ran = sys.modules.get("calque") or __import__("calque")   # what ran, as a handler imports it (warmd: none)
import calque_core, calque_ec2, calque_supervisor, calque_dashboard, warmd
copies = [name for name, m in list(sys.modules.items())
          if os.path.basename(getattr(m, "__file__", None) or "") in ("calque.py", "calque_core.py")]
print(json.dumps({{"copies": sorted(copies), "shared": [
    role.NotFound is ran.NotFound and role.UserError is ran.UserError
    for role in (calque_core, calque_ec2, calque_supervisor)]}}))
"""
    out = subprocess.run([PY, "-c", code, ROOT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["copies"] == ["calque", "calque_core"] and all(seen["shared"]), seen


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_ec2_verbs_as_the_design_card_writes_them(aws_env, tmp_path, spelling):
    """pool create --instances 2 --yes-spend-money on moto_server creates the group; pool status, pool scale
    --instances 3 and pool delete --yes work the same way; the hints name the command as it was run."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "h.py").write_text(SLOW_ENTER)
    command = [os.path.join(BIN, "calque")] if spelling == "installed" else [PY, os.path.join(ROOT, "calque.py")]

    def run(*args):
        out = subprocess.run(command + list(args), env=aws_env, cwd=folder, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
        return out.stdout
    shown = "calque" if spelling == "installed" else "python calque.py"
    made = run("pool", "create", "--model", "M", "--handler", "h.py:Slow", "--instances", "2", "--instance-type",
               "g5.xlarge", "--yes-spend-money")
    assert f"watch with `{shown} pool status --model M`" in made, made
    asg = boto3.client("autoscaling", endpoint_url=aws_env["AWS_ENDPOINT_URL"])

    def desired():
        groups = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["calque-pool-m"])["AutoScalingGroups"]
        return groups[0]["DesiredCapacity"] if groups else None
    assert desired() == 2
    assert "desired 2" in run("pool", "status", "--model", "M")
    run("pool", "scale", "--model", "M", "--instances", "3", "--yes-spend-money")
    assert desired() == 3
    gone = run("pool", "delete", "--model", "M", "--yes")
    assert f"HINT: {shown} runs prune --model M" in gone, gone
    assert desired() is None


@pytest.mark.parametrize("backend", ["local", "moto_server"])
def test_a_starting_worker_counts(request, tmp_path, backend):
    """`warmd.py --model M &`, then at once `submit --pool M`: queued, "1 worker starting", done once the worker is
    warm. A worker that dies before warm: the waiting submit says why (exit 1), and a later one too (exit 2)."""
    env = request.getfixturevalue("local_env" if backend == "local" else "aws_env")
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "h.py").write_text(SLOW_ENTER)
    (folder / "items.jsonl").write_text("".join(json.dumps({"x": i}) + "\n" for i in range(5)))
    calque = [PY, os.path.join(ROOT, "calque.py")]
    make = subprocess.run(calque + ["pool", "create", "--model", "M", "--handler", "h.py:Slow", "--workers", "0"],
                          env=env, cwd=folder, capture_output=True, text=True, timeout=120)
    assert make.returncode == 0, make.stderr
    worker = start_worker(env, "--model", "M")
    out = subprocess.run(calque + ["submit", "--pool", "M", "items.jsonl"], env=env, cwd=folder,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pool M: 1 worker starting (@enter)" in out.stderr and "5 items ok" in out.stdout, out.stderr
    worker.terminate()
    assert worker.wait(30) == 0
    dying = start_worker(dict(env, ENTER_FAILS="1", ENTER_SECONDS="1"), "--model", "M")
    out = subprocess.run(calque + ["submit", "--pool", "M", "items.jsonl"], env=env, cwd=folder,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert "died before it was warm: RuntimeError: weights.pt is missing; the run stays queued" in out.stderr
    assert dying.wait(30) != 0
    out = subprocess.run(calque + ["submit", "--pool", "M", "items.jsonl"], env=env, cwd=folder,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "died before it was warm: RuntimeError: weights.pt is missing" in out.stderr


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_hints_spell_the_command_as_it_was_run(local_env, tmp_path, spelling):
    """A few errors with a hint, run as `calque` and as `python calque.py`: each hint names the command so."""
    command = [os.path.join(BIN, "calque")] if spelling == "installed" else [PY, os.path.join(ROOT, "calque.py")]
    shown = "calque" if spelling == "installed" else "python calque.py"
    (tmp_path / "h.py").write_text(SLOW_ENTER)
    (tmp_path / "items.jsonl").write_text('{"x": 1}\n')

    def error(*args):
        out = subprocess.run(command + list(args), env=local_env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr
    assert f"(`{shown} pool list` lists the pools)" in error("pool", "delete", "--model", "nosuch", "--yes")
    assert f"see `{shown} runs list`" in error("runs", "show", "no-such.run")
    assert subprocess.run(command + ["pool", "create", "--model", "m", "--handler", "h.py:Slow", "--workers", "0"],
                          env=local_env, cwd=tmp_path, capture_output=True, timeout=60).returncode == 0
    assert f"HINT: {shown} pool scale --model m --workers 1" in error("submit", "--pool", "m", "items.jsonl")
    assert f"HINT: {shown} submit first" in error("runs", "show", "latest")
