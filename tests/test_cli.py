"""The command line as a newcomer meets it, in both spellings (`python calque.py ...` and the installed
`calque ...`), from a folder of the user's own: a mistyped verb, subverb or option is one line naming the
command as it was run with a `did you mean`, exit 2, never argparse's usage block; no option is taken by a
prefix of its name; a command that fails creates nothing (no store folder, no queue, snapshot or record);
hints name only what would work."""
import json
import os
import signal
import sqlite3
import subprocess

import pytest

from conftest import PY, ROOT, free_port, wait_for

BIN = os.path.dirname(PY)   # the venv's bin: pip's `calque` and `warmd` scripts
SPELLINGS = {"script": lambda name: [PY, os.path.join(ROOT, f"{name}.py")],
             "installed": lambda name: [os.path.join(BIN, name)]}
SHOWN = {"script": "python {name}.py", "installed": "{name}"}
HANDLER = '''
import calque


class Up:
    @calque.enter
    def load(self):
        {enter}

    @calque.batch
    def run(self, items):   # a label first; bytes where the item asks for them, else a number
        return [dict({{"label": "cat"}}, **({{"png": b"\\x89PNG\\r\\n\\x1a\\n"}} if item.get("png") else
                                           {{"y": item["x"] + 1}})) for item in items]
'''
VERBS = "pool, submit, plan, runs, cost, dashboard, modal"
POOL_VERBS = "create, deploy, scale, status, list, delete, cost, redrive, logs"
# (arguments, what the one line says after `calque: error: `, {shown} the command as it was run)
TYPOS = [
    (["sumbit", "--pool", "m", "items.jsonl"],
     f"{{shown}} sumbit: no such command ({VERBS}) ---> HINT: did you mean submit? see `{{shown}} --help`"),
    (["pool", "creat", "--model", "m", "--handler", "h.py:Up"],
     f"{{shown}} pool creat: no such command ({POOL_VERBS}) ---> HINT: did you mean create? "
     "see `{shown} pool --help`"),
    (["runs", "lsit"], "{shown} runs lsit: no such command (list, show, results, resume, cancel, redrive, "
                       "report, delete, prune) ---> HINT: did you mean list?"),
    (["pool", "create", "--model", "m", "--handler", "h.py:Up", "--worker", "2"],
     "{shown} pool create --worker: no such option ---> HINT: did you mean --workers? "
     "see `{shown} pool create --help`"),
    (["pool", "create", "--modle", "m", "--handler", "h.py:Up"],   # not "--model is required"
     "{shown} pool create --modle: no such option ---> HINT: did you mean --model?"),
    (["submit", "--pool", "m", "items.jsonl", "--id-feild=id"],
     "{shown} submit --id-feild: no such option ---> HINT: did you mean --id-field?"),
    (["runs", "results", "latest", "--format", "parqet"],
     "{shown} runs results --format parqet: not one of jsonl, parquet, npy ---> HINT: did you mean parquet?"),
    (["--verison"], "{shown} --verison: no such option ---> HINT: did you mean --version?"),
    (["pool", "create", "--model", "m", "--handler", "h.py:Up", "--workers", "two"],
     "{shown} pool create: argument --workers: invalid int value: 'two' ---> HINT: see "
     "`{shown} pool create --help`"),
    (["runs", "show", "a", "b"], "{shown} runs show: unexpected argument 'b'"),
    (["pool"], "{shown} pool: the following arguments are required: {{"   # every verb, deploy too
     + POOL_VERBS.replace(", ", ",") + "}}"),
    (["pool", "create", "--model", "m", "--handler", "h.py:Up", "--workers", "-1"], "--workers -1: must be 0 or more"),
]
# an option's prefix: once taken as the option (`--worker 2` as `--workers 2`), now a mistake
PREFIXES = [
    (["pool", "create", "--model", "m", "--handler", "h.py:Up", "--work", "0"], "--work", "--workers"),
    (["submit", "--pool", "m", "items.jsonl", "--id", "id"], "--id", "--id-field"),
    (["submit", "--pool", "m", "items.jsonl", "--wait-for"], "--wait-for", "--wait-for-workers"),
    (["runs", "results", "latest", "--form", "jsonl"], "--form", "--format"),
    (["pool", "scale", "--model", "m", "--inst", "2"], "--inst", "--instances"),
    (["runs", "prune", "--older", "1d"], "--older", "--older-than"),
]


def user_folder(tmp_path, enter="self.k = 1"):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "h.py").write_text(HANDLER.format(enter=enter))
    (folder / "items.jsonl").write_text("".join(json.dumps({"x": i}) + "\n" for i in range(3)))
    return folder


def fresh_env(tmp_path):
    """A user's shell with no calque setting: the store and state are ./.calque and ./.calque-state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALQUE_")}
    env.update(HOME=str(tmp_path / "home"), CALQUE_ENV=str(tmp_path / "none.env"), PYTHONUNBUFFERED="1",
               CALQUE_POLL_WAIT="1", CALQUE_GRACE="5")
    return env


def calque(spelling, env, folder, *args, name="calque"):
    return subprocess.run(SPELLINGS[spelling](name) + list(args), env=env, cwd=folder, capture_output=True,
                          text=True, timeout=120)


def one_line(out, code=2):
    """The one stderr line of a failed command: exit `code`, no usage block, no traceback."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "usage:" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    return out.stderr.strip()


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_typos_are_one_line_with_did_you_mean(tmp_path, spelling):
    """Each mistyped verb, subverb, option or choice: `calque: error: <the command as run> ...: did you mean`,
    exit 2; warmd's too. Nothing is created in the folder."""
    folder, env = user_folder(tmp_path), fresh_env(tmp_path)
    shown = SHOWN[spelling].format(name="calque")
    for args, said in TYPOS:
        assert f"calque: error: {said.format(shown=shown)}" in one_line(calque(spelling, env, folder, *args)), args
    shown = SHOWN[spelling].format(name="warmd")
    line = one_line(calque(spelling, env, folder, "--mod", "m", name="warmd"))
    assert line == f"warmd: error: {shown} --mod: no such option ---> HINT: did you mean --model? see `{shown} --help`"
    line = one_line(calque(spelling, env, folder, "--model", name="warmd"))
    assert line.startswith(f"warmd: error: {shown}: argument --model: expected one argument ---> HINT:"), line
    assert sorted(os.listdir(folder)) == ["h.py", "items.jsonl"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_no_option_is_taken_by_a_prefix(tmp_path, spelling):
    """`--work 0`, `--id id`, `--form jsonl`...: each a mistake naming the option it resembles, never taken as
    it; a pool created with `--worker 2` would have started 2 workers."""
    folder, env = user_folder(tmp_path), fresh_env(tmp_path)
    shown = SHOWN[spelling].format(name="calque")
    for args, given, meant in PREFIXES:
        line = one_line(calque(spelling, env, folder, *args))
        assert f"{given}: no such option ---> HINT: did you mean {meant}?" in line and shown in line, line
    line = one_line(calque(spelling, env, folder, "--mod", "m", name="warmd"))
    assert "--mod: no such option ---> HINT: did you mean --model?" in line
    assert sorted(os.listdir(folder)) == ["h.py", "items.jsonl"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_failed_command_leaves_no_store_behind(tmp_path, spelling):
    """From a fresh folder with no store: a submit to no pool, a read of none, a pool create of a missing file,
    class or include: each fails in one line and leaves the folder as it was (no empty .calque)."""
    folder, env = user_folder(tmp_path), fresh_env(tmp_path)
    for args in (["submit", "--pool", "m", "items.jsonl"], ["pool", "status", "--model", "m"],
                 ["runs", "show", "latest"], ["pool", "delete", "--model", "m", "--yes"],
                 ["pool", "create", "--model", "m", "--handler", "nope.py:Up"],
                 ["pool", "create", "--model", "m", "--handler", "h.py:Nope"],
                 ["pool", "create", "--model", "m", "--handler", "h.py:Up", "--include", "nosuch"],
                 ["submit", "--model", "m", "--handler", "h.py:Nope", "items.jsonl"]):
        one_line(calque(spelling, env, folder, *args))
        assert sorted(os.listdir(folder)) == ["h.py", "items.jsonl"], args
    assert calque(spelling, env, folder, "pool", "list").returncode == 0   # reading none makes none either
    assert sorted(os.listdir(folder)) == ["h.py", "items.jsonl"]


def local_queues(store):
    """The queue names in a local store's queue file."""
    if not os.path.exists(os.path.join(store, "queue.db")):
        return []
    with sqlite3.connect(os.path.join(store, "queue.db")) as db:
        return [name for name, in db.execute("SELECT name FROM queues")]


def store_files(store):
    """The store's objects (not its queue file, which local_queues reads)."""
    return sorted(os.path.relpath(os.path.join(d, f), store) for d, _, files in os.walk(store) for f in files
                  if not f.startswith("queue.db"))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_failed_pool_create_leaves_no_pool(local_env, tmp_path, spelling):
    """pool create of a missing handler, class or include, a clashing name, a bad worker option, an @enter that
    raises, a queue file that cannot open: each fails, and leaves no queue, snapshot or record of the pool (the
    worker log its error names stays); the pool whose name it clashed with is untouched; the same create,
    fixed, then works."""
    folder, store = user_folder(tmp_path), local_env["CALQUE_STORE"]
    bad_enter = tmp_path / "bad"
    bad_enter.mkdir()
    (bad_enter / "h.py").write_text(HANDLER.format(enter="raise RuntimeError('weights.pt is missing')"))
    assert calque(spelling, local_env, folder, "pool", "create", "--model", "Foo/Bar", "--handler", "h.py:Up",
                  "--workers", "0").returncode == 0
    before = {path: open(os.path.join(store, path), "rb").read() for path in store_files(store)}
    create = ["pool", "create", "--handler", "h.py:Up", "--workers", "0"]
    for args, code, said in [
            (["--model", "m", "--handler", "nope.py:Up"], 2, "file nope.py not found"),
            (["--model", "m", "--handler", "h.py:Nope"], 2, "no class Nope"),
            (["--model", "m", "--include", "nosuch"], 2, "nosuch: not found"),
            (["--model", "foo-bar"], 2, "shares its queue name calque-pool-foo-bar with the pool of 'Foo/Bar'"),
            (["--model", "g", "--workers", "1", "--gpus-per-worker", "-1"], 2, "--gpus-per-worker -1"),
            (["--model", "t", "--workers", "1", "--threads-per-worker", "0"], 2, "--threads-per-worker 0"),
            (["--model", "m", "--handler", f"{bad_enter}/h.py:Up", "--workers", "1"], 1,
             "worker 0 died before it was warm: RuntimeError: weights.pt is missing")]:
        out = calque(spelling, local_env, folder, *create, *args)
        assert out.returncode == code and said in out.stderr.strip().splitlines()[-1], (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert sorted(local_queues(store)) == ["calque-dlq-foo-bar", "calque-pool-foo-bar"], args
        assert {path: open(os.path.join(store, path), "rb").read() for path in store_files(store)} == before, args
    assert "weights.pt is missing" in open(os.path.join(local_env["CALQUE_STATE"], "pools", "m", "worker-0.log")).read()
    assert os.listdir(os.path.join(local_env["CALQUE_STATE"], "pools")) == ["m"]   # the refused options made none
    listed = calque(spelling, local_env, folder, "pool", "list")
    assert "Foo/Bar" in listed.stdout and "\nm " not in listed.stdout, listed.stdout
    os.rename(os.path.join(store, "queue.db"), os.path.join(store, "queue.db.kept"))
    os.mkdir(os.path.join(store, "queue.db"))   # the queue file cannot open: a failing store
    out = calque(spelling, local_env, folder, *create, "--model", "m")
    assert out.returncode == 1 and "the local queue in" in one_line(out, 1)
    assert not os.path.exists(os.path.join(store, "pools", "m"))
    os.rmdir(os.path.join(store, "queue.db"))
    os.rename(os.path.join(store, "queue.db.kept"), os.path.join(store, "queue.db"))
    out = calque(spelling, local_env, folder, *create, "--model", "m")
    assert out.returncode == 0, out.stderr
    assert sorted(local_queues(store)) == ["calque-dlq-foo-bar", "calque-dlq-m", "calque-pool-foo-bar",
                                           "calque-pool-m"]


def test_a_pool_create_that_fails_on_sqs_leaves_nothing_in_s3(aws_env, tmp_path):
    """On SQS + S3 (moto_server), a pool create whose queues cannot be made (SQS unreachable) takes its handler
    snapshot and name out of the bucket again: nothing under pools/."""
    import boto3
    folder = user_folder(tmp_path)
    env = dict(aws_env, AWS_ENDPOINT_URL_SQS=f"http://127.0.0.1:{free_port()}", CALQUE_ENDPOINT_RETRY="0")
    out = calque("script", env, folder, "pool", "create", "--model", "m", "--handler", "h.py:Up", "--workers", "0")
    assert out.returncode == 1 and "unreachable" in one_line(out, 1)
    bucket, prefix = aws_env["CALQUE_STORE"][len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=aws_env["AWS_ENDPOINT_URL"])
    assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/pools/").get("KeyCount") == 0


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_an_ec2_pool_create_of_a_bad_handler_makes_nothing(aws_env, tmp_path, spelling):
    """pool create --instances of a missing class or include (moto_server): one line, exit 2, before any AWS
    call: no queue, nothing in the bucket."""
    import boto3
    folder = user_folder(tmp_path)
    for args in (["--handler", "h.py:Nope"], ["--handler", "h.py:Up", "--include", "nosuch"]):
        out = calque(spelling, aws_env, folder, "pool", "create", "--model", "m", *args, "--instances", "1",
                     "--instance-type", "g5.xlarge", "--yes-spend-money")
        assert out.returncode == 2 and not out.stdout and ("no class Nope" in one_line(out) or "nosuch" in out.stderr)
    assert not boto3.client("sqs", endpoint_url=aws_env["AWS_ENDPOINT_URL"]).list_queues().get("QueueUrls")
    bucket, prefix = aws_env["CALQUE_STORE"][len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=aws_env["AWS_ENDPOINT_URL"])
    assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount") == 0


def test_files_and_npy_hints_name_only_fields_that_work(local_env, tmp_path):
    """`runs results RUN --files DIR` (or `--format npy --field F`) of results whose first field is a string:
    the hint names the field that holds bytes (numbers), never `--field label`, or says that none does; in both
    spellings."""
    folder = user_folder(tmp_path)
    assert calque("script", local_env, folder, "pool", "create", "--model", "m", "--handler", "h.py:Up",
                  "--workers", "1").returncode == 0
    (folder / "png.jsonl").write_text('{"x": 1, "png": true}\n')
    runs = []
    for items in ("items.jsonl", "png.jsonl"):
        out = calque("script", local_env, folder, "submit", "--pool", "m", items, "--json")
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout)["run"]["run_id"])
    plain, png = runs
    for spelling in SPELLINGS:
        shown = SHOWN[spelling].format(name="calque")
        for run, args, said in [
                (plain, [], f"the result is not bytes (item 0: dict), and --files writes bytes ---> HINT: no field "
                            f"of its results holds bytes: read them with `{shown} runs results {plain}`"),
                (plain, ["--field", "label"], "field 'label' is not bytes (item 0: str), and --files writes bytes "
                                              "---> HINT: no field of its results holds bytes"),
                (plain, ["--field", "nope"], "no result has the field 'nope': its results have 'label', 'y' "
                                             "---> HINT: no field of its results holds bytes"),
                (png, [], "the result is not bytes (item 0: dict), and --files writes bytes ---> HINT: --field png "
                          "(its bytes)"),
                (png, ["--field", "label"], "---> HINT: --field png (its bytes)"),
                (png, ["--field", "nope"], "---> HINT: --field png (its bytes)")]:
            out = calque(spelling, local_env, folder, "runs", "results", run, "--files", str(tmp_path / "out"), *args)
            assert said in one_line(out), (spelling, args, out.stderr)
            assert not os.path.exists(tmp_path / "out")   # a refusal makes no folder
        for run, said in [(plain, f"its results have 'label', 'y' ---> HINT: to_numpy('y'), or {shown} runs results "
                                  f"{plain} --format npy --field y"),
                          (png, f"its results have 'label', 'png', none of them numbers ---> HINT: read them with "
                                f"to_arrow() or `{shown} runs results {png}`")]:
            out = calque(spelling, local_env, folder, "runs", "results", run, "--format", "npy", "--field", "nope",
                         "--output", str(tmp_path / "o.npy"))
            assert said in one_line(out), (spelling, run, out.stderr)
    out = calque("script", local_env, folder, "runs", "results", png, "--files", str(tmp_path / "out"),
                 "--field", "png")
    assert out.returncode == 0 and os.listdir(tmp_path / "out") == ["0.png"], out.stderr


APP = '''
import modal

app = modal.App()


@app.local_entrypoint()
def main(name: str = "you", times: int = 1):
    print(name * times)
'''


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_modal_run_options_are_one_line_too(tmp_path, spelling):
    """`modal run app.py --nam x`: the entrypoint's options as Modal's CLI takes them, mistyped or a prefix:
    one line with its did-you-mean, nothing created; spelt right, the entrypoint runs."""
    folder, env = user_folder(tmp_path), fresh_env(tmp_path)
    (folder / "app.py").write_text(APP)
    shown = SHOWN[spelling].format(name="calque")
    for args, said in [(["--nam", "hi"], "--nam: no such option ---> HINT: did you mean --name?"),
                       (["--tim", "2"], "--tim: no such option ---> HINT: did you mean --times?"),
                       (["--times", "two"], "argument --times: invalid int value: 'two'")]:
        line = one_line(calque(spelling, env, folder, "modal", "run", "app.py", *args))
        assert line.startswith(f"calque: error: {shown} modal run app.py") and said in line, line
    assert sorted(os.listdir(folder)) == ["app.py", "h.py", "items.jsonl"]
    out = calque(spelling, env, folder, "modal", "run", "app.py", "--name", "hi", "--times", "2")
    assert out.returncode == 0 and out.stdout.strip() == "hihi", out.stderr


def test_ctrl_c_while_pool_create_waits_says_the_workers_go_on(local_env, tmp_path):
    """Ctrl-C while `pool create` waits for @enter: one line saying the workers go on loading and how to watch
    them, exit 130; the pool stays, its worker still loading."""
    folder = user_folder(tmp_path, enter="import time; time.sleep(30)")   # a model's long load
    proc = subprocess.Popen(SPELLINGS["installed"]("calque") + ["pool", "create", "--model", "m", "--handler",
                            "h.py:Up", "--workers", "1"], env=local_env, cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def status():
        return calque("installed", local_env, folder, "pool", "status", "--model", "m").stdout
    wait_for(lambda: "local workers: 1 alive of 1 desired" in status(), 60, "the worker loading")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "calque: interrupted while waiting: pool m: its workers go on loading ---> HINT: calque pool status --model m"]
    assert "local workers: 1 alive of 1 desired" in status()
    assert calque("installed", local_env, folder, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_a_command_error_is_one_line_by_its_kind(capsys):
    """calque's and warmd's mains triage alike (calque_core.cli_error): a mistake exits 2, a failure
    given or AWS refusing exits 1, each one line; any other error is raised again, a bug."""
    from botocore.exceptions import ClientError
    from calque_core import StoreFault, UserError, cli_error
    refused = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "CreateQueue")
    assert cli_error(UserError("bad --x"), "calque", "check it", StoreFault) == 2
    assert cli_error(StoreFault("store down"), "warmd", "check it", StoreFault) == 1
    assert cli_error(refused, "warmd", "check the role") == 1
    assert capsys.readouterr().err.splitlines() == [
        "calque: error: bad --x", "warmd: error: store down",
        "warmd: error: AWS: AccessDenied: no (CreateQueue): check the role"]
    with pytest.raises(StoreFault):   # not among those given: a bug's traceback
        cli_error(StoreFault("x"), "warmd", "check it")
