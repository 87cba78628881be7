"""Unmodified Modal app files on calque pools: as a pool handler (real warmd.py processes) and under
`calque modal run`, on the embedded backend and on moto_server; lifecycle hooks on SIGTERM; the stand-in's
refusals; and the stand-in loaded even where a real `modal` package is importable."""
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import PY, ROOT, backend_for, cli, wait_for, write_items
import calque_core
import calque_fleet
import calque_values

APP = '''
import json
import os
import modal

app = modal.App("shaped")
LOG = {log!r}
OFFSET = 100   # a module-level constant the methods read


def shift(x):
    return x + OFFSET


@app.cls(gpu="A10G", retries=1)
class Batcher:
    scale: int = modal.parameter(default=1)

    @modal.enter()
    def load(self):
        with open(LOG, "a") as f:
            f.write(f"enter {{os.getpid()}}\\n")
        self.pid = os.getpid()

    @modal.method()
    def double(self, x):
        if x % 7 == 3:
            raise ValueError(f"item {{x}} is unlucky")
        return {{"y": shift(x) * 2 * self.scale}}

    @modal.method()
    def add(self, a, b):
        return a + b

    @modal.batched(max_batch_size=4, wait_ms=10)
    def sizes(self, xs):
        return [len(xs)] * len(xs)


@app.function()
def square(x):
    return x * x


@app.local_entrypoint()
def main(count: int = 3, strict: bool = False):
    out = {{"double": [r if not isinstance(r, ValueError) else f"error: {{type(r).__name__}}: {{r}}"
                       for r in Batcher().double.map(range(count), return_exceptions=not strict)],
           "add": list(Batcher().add.starmap([(1, 2), (3, 4)])),
           "square": list(square.map(range(count), order_outputs=False)),
           "remote": square.remote(5), "spawn": square.spawn(6).get()}}
    print(json.dumps(out))
'''

LIFECYCLE = '''
import modal

app = modal.App("life")
LOG = {log!r}


def note(line):
    with open(LOG, "a") as f:
        f.write(line + "\\n")


@app.cls()
class Old:
    def __enter__(self):
        note("__enter__")

    def __exit__(self, *exc):
        note("__exit__")

    @modal.exit()
    def bye(self):
        note("exit")

    @modal.method()
    def echo(self, x):
        return x
'''


def write_app(tmp_path, template=APP, name="app.py"):
    log = tmp_path / "events.log"
    path = tmp_path / name
    path.write_text(template.format(log=str(log)))
    return str(path), log


def direct_results(path, items):
    """What calling the class directly gives: the same file under the stand-in, in this process."""
    import calque
    handler, enter, batch, collate = calque_core.load_handler(path, "Batcher.double")
    enter()
    out = []
    for x in items:
        try:
            out.append({"ok": True, "result": batch([x])[0]})
        except ValueError as e:
            out.append({"ok": False, "error": f"ValueError: {e}"})
    return out


@pytest.mark.parametrize("backend", ["local", "aws"])
def test_modal_app_as_pool_and_under_modal_run(backend, request, tmp_path):
    """@app.cls + @modal.enter + @modal.method as a pool handler: results equal to direct calls, failing items
    isolated, @enter once per worker; then modal run with --pool, ephemeral pools, starmap, remote, spawn."""
    env = request.getfixturevalue(f"{backend}_env")
    path, log = write_app(tmp_path)
    out = cli(env, "pool", "create", "--model", "shaped", "--handler", f"{path}:Batcher.double", "--workers", "2",
              "--batch-size", "4")
    assert out.returncode == 0, out.stderr
    assert "g5.xlarge" in out.stdout and "max deliveries 2" in out.stdout   # gpu= and retries= read from the app
    items = list(range(20))
    run = cli(env, "submit", "--pool", "shaped", write_items(tmp_path / "items.jsonl", items), "--claim-size", "5",
              "--json")
    assert run.returncode == 1, run.stderr   # some items fail: a failed run
    run_id = json.loads(run.stdout)["run"]["run_id"]
    got = [json.loads(line) for line in cli(env, "runs", "results", run_id).stdout.splitlines()]
    assert [{k: r[k] for k in ("ok", "result", "error") if k in r} for r in got] == direct_results(path, items)
    pids = [line.split()[1] for line in log.read_text().splitlines()]
    assert len(pids) == 3 and len(set(pids)) == 3   # one @enter per worker (2), and the direct call's

    out = cli(env, "modal", "run", path, "--pool", "shaped", "--count", "5")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"double": [{"y": 200}, {"y": 202}, {"y": 204}, "error: ValueError: item 3 is unlucky",
                                 {"y": 208}], "add": [3, 7], "square": [0, 1, 4, 9, 16], "remote": 25, "spawn": 36}
    # square, Batcher.add and (its workers may call it) Batcher.sizes; Batcher.double is --pool shaped
    assert out.stderr.count("ephemeral pool") == 3 and "for Batcher.sizes: 0 to 1" in out.stderr
    pools = cli(env, "pool", "list").stdout
    assert "shaped" in pools and "modal-app" not in pools   # the ephemeral pools are gone
    strict = cli(env, "modal", "run", f"{path}::main", "--pool", "shaped", "--count", "5", "--strict")
    assert strict.returncode == 1 and strict.stderr.strip().splitlines()[-1].startswith(
        "calque: error: entrypoint main: an item failed: ValueError: item 3 is unlucky")
    assert cli(env, "pool", "delete", "--model", "shaped", "--yes").returncode == 0


def test_enter_and_exit_hooks_on_sigterm(local_env, tmp_path):
    """__enter__ runs once before the first claim; @modal.exit and __exit__ run when scale-down SIGTERMs the worker."""
    path, log = write_app(tmp_path, LIFECYCLE)
    assert cli(local_env, "pool", "create", "--model", "life", "--handler", f"{path}:Old",
               "--workers", "1").returncode == 0
    assert log.read_text().split() == ["__enter__"]
    assert cli(local_env, "pool", "scale", "--model", "life", "--workers", "0").returncode == 0
    wait_for(lambda: log.read_text().split() == ["__enter__", "exit", "__exit__"], 20, "the exit hooks")


def test_batched_concurrent_async_generator_in_process(tmp_path):
    """@modal.batched splits a batch at max_batch_size; @modal.concurrent async and generator methods give one
    result per item; a method that raises fails only its items."""
    import calque
    app = tmp_path / "kinds.py"
    app.write_text('''
import asyncio
import modal

app = modal.App()


@app.cls()
@modal.concurrent(max_inputs=8)
class Kinds:
    @modal.method()
    async def slow(self, x):
        await asyncio.sleep(0)
        return -x

    @modal.method(is_generator=True)
    def count(self, n):
        yield from range(n)


@app.function()
@modal.concurrent(max_inputs=3)
def threaded(x):
    if x < 0:
        raise KeyError(x)
    return x + 1
''')
    path, log = write_app(tmp_path)
    _, enter, batch, _ = calque_core.load_handler(path, "Batcher.sizes")
    enter()
    assert batch(list(range(10))) == [4] * 8 + [2] * 2
    _, enter, batch, _ = calque_core.load_handler(str(app), "Kinds.slow")
    enter()
    assert batch([1, 2, 3]) == [-1, -2, -3]
    _, enter, batch, _ = calque_core.load_handler(str(app), "Kinds.count")
    enter()
    assert batch([2, 0]) == [[0, 1], []]
    _, enter, batch, _ = calque_core.load_handler(str(app), "threaded")
    enter()
    items = [1, -1, 2]
    with pytest.raises(KeyError):
        batch(items)
    assert batch([items[0]]) == [2] and batch([items[2]]) == [3]   # warmd's one-by-one retry: replayed, not re-run
    with pytest.raises(KeyError):
        batch([items[1]])


def test_unsupported_construct_and_a_real_modal_installed(local_env, tmp_path):
    """modal.Dict is refused at import in one line naming it; a `modal` package on the path is shadowed by the
    stand-in (the file still loads and runs)."""
    bad = tmp_path / "bad.py"
    bad.write_text('import modal\napp = modal.App()\ncache = modal.Dict.from_name("c")\n\n\n'
                   '@app.function()\ndef f(x):\n    return x\n')
    out = cli(local_env, "pool", "create", "--model", "bad", "--handler", f"{bad}:f", "--workers", "0")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "modal.Dict is not supported on a calque pool ---> HINT:" in out.stderr
    real = tmp_path / "site" / "modal"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text('raise RuntimeError("the real modal was imported")\n')
    path, _ = write_app(tmp_path)
    env = dict(local_env, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}")
    out = cli(env, "modal", "run", path, "--count", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["double"] == [{"y": 200}, {"y": 202}]


IDIOMS = '''
import os
import sys
import time
import modal

image = (modal.Image.debian_slim(python_version="3.11").apt_install("libgomp1").pip_install("numpy")
         .env({{"GREETING": "hello"}}).add_local_python_source("shapes")
         .add_local_file("table.txt", "/root/table.txt"))
app = modal.App("idioms", image=image)

with image.imports():   # Modal's way to import what only the image has
    import shapes


@app.function()
def work(x: int = 2, y: int = 3):
    print(f"work {{x}} {{y}}")
    print("to stderr", file=sys.stderr)
    if x < 0:
        raise ValueError(f"negative {{x}}")
    with open("table.txt") as f:   # add_local_file(..., "/root/table.txt"): beside the app, as in Modal's /root
        rows = f.read().split()
    return {{"area": shapes.area(x, y), "env": os.environ["GREETING"], "rows": rows}}


@app.function()
def count(n, flag=""):
    for i in range(n):
        yield i
        if flag and i == 0:   # streamed: the caller has item 0 while this waits for it to say so
            for _ in range(200):
                if os.path.exists(flag):
                    break
                time.sleep(0.1)
            yield os.path.exists(flag)


@app.function()
@modal.batched(max_batch_size=4, wait_ms=10)
async def doubles(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


@app.function()
@modal.fastapi_endpoint(method="POST")
def web(item: dict):   # a web endpoint beside the batch functions: the file still imports and runs
    return item


@app.local_entrypoint()
async def main():
    import json
    streamed = []
    for i in count.remote_gen(3, "streamed.flag"):
        streamed.append(i)
        open("streamed.flag", "w").close()
    call = work.spawn(4, y=5)
    work.spawn_map([7], kwargs={{"y": 1}})   # fire and forget: modal run waits for it before it cleans up
    out = {{"noargs": work.remote(), "kwargs": await work.remote.aio(x=3, y=1),
            "aio_map": [r["area"] async for r in work.map.aio([1, 2])],
            "gen": streamed, "gen_aio": [i async for i in count.remote_gen.aio(2)],
            "batched": [d async for d in doubles.map.aio(range(6))],
            "gather": modal.FunctionCall.gather(call, modal.FunctionCall.from_id(call.object_id)),
            "id": call.object_id.startswith("fc-")}}
    try:
        work.remote(-1)
    except ValueError as e:   # the original type, as Modal re-raises it
        out["raised"] = str(e)
    try:
        work.remote(object())
    except TypeError as e:   # arguments are JSON values (bytes too: they travel as bytes)
        out["not_json"] = str(e)
    print(json.dumps(out))
'''


def write_idioms(tmp_path):
    (tmp_path / "shapes.py").write_text("def area(x, y):\n    return x * y\n")
    (tmp_path / "table.txt").write_text("a b\n")
    path = tmp_path / "idioms.py"
    path.write_text(IDIOMS.format())
    return str(path)


def test_modal_idioms_under_modal_run(local_env, tmp_path):
    """Modal's own call forms under `modal run`: no-argument and keyword calls, .remote.aio /
    .map.aio, remote_gen (its items reach the caller while the generator runs; and .aio), an async
    @modal.batched, spawn + FunctionCall.gather / from_id, spawn_map, the original exception type;
    the image's env, add_local_python_source and add_local_file reach the workers; a web endpoint
    beside them is kept; what the functions print reaches our stderr, prefixed with the worker,
    while they run. (The calls are the shim's and submit's, the same on both backends; the include's
    S3 path is the next test's.)"""
    env = local_env
    path = write_idioms(tmp_path)
    out = cli(env, "modal", "run", path, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    row = {"env": "hello", "rows": ["a", "b"]}
    assert json.loads(out.stdout) == {
        "noargs": dict(row, area=6), "kwargs": dict(row, area=3), "aio_map": [3, 6],
        "gen": [0, True, 1, 2],
        "gen_aio": [0, 1], "batched": [0, 2, 4, 6, 8, 10], "gather": [dict(row, area=20)] * 2, "id": True,
        "raised": "negative -1",
        "not_json": f"work's arguments: a builtins.object does not travel "
                    f"({calque_values.TRAVELS})"}
    assert "[work w0] work 3 1" in out.stderr and "[work w0] to stderr" in out.stderr
    assert "[work w0] work 7 1" in out.stderr   # the spawn_map call ran
    assert "Traceback" not in out.stderr and "modal-idioms" not in cli(env, "pool", "list").stdout
    assert os.listdir(tmp_path / "state" / "pools") == []   # the ephemeral pools' logs, shown as they ran


TAGGER = '''
import calque
import helper


class Tagger:
    @calque.enter
    def load(self):
        with open("data/words.txt") as f:   # relative to the handler's folder, as on the machine it came from
            self.words = f.read().split()

    @calque.batch
    def run(self, items):
        return [helper.tag(self.words, x) for x in items]
'''

MODAL_TAGGER = '''
import modal
import helper

app = modal.App(image=modal.Image.debian_slim().add_local_python_source("helper").add_local_dir("data", "/root/data"))


@app.function()
def tag(x):
    print("tagging", x, flush=x == 1)
    with open("data/words.txt") as f:
        return helper.tag(f.read().split(), x)
'''


def test_multi_file_app_on_a_worker_with_only_the_store(aws_env, tmp_path):
    """A handler importing a sibling module and reading a data file, snapshotted with --include (a
    native handler) or add_local_python_source / add_local_dir (a Modal app), runs on a worker
    started in an empty folder once the folder it came from is gone, as on an EC2 instance: the
    files come from the store, checked by sha256. What the Modal function prints there reaches
    `submit --follow-logs`, through the store, labelled with the host."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "words.txt").write_text("zero one two\n")
    (folder / "helper.py").write_text("def tag(words, x):\n    return f'{x}:{words[x]}'\n")
    (folder / "tagger.py").write_text(TAGGER)
    (folder / "modal_tagger.py").write_text(MODAL_TAGGER)
    for model, handler, extra in (("native", "tagger.py:Tagger", ["--include", "helper.py", "--include", "data"]),
                                  ("modalapp", "modal_tagger.py:tag", [])):
        out = cli(aws_env, "pool", "create", "--model", model, "--handler", handler, "--workers", "0", *extra,
                  cwd=str(folder))
        assert out.returncode == 0, out.stderr
    folder.rename(tmp_path / "gone")   # the record's workdir no longer exists on this machine
    empty = tmp_path / "empty"
    empty.mkdir()
    for model in ("native", "modalapp"):
        worker = subprocess.Popen([PY, os.path.join(ROOT, "warmd.py"), "--model", model], env=aws_env, cwd=empty,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            run = cli(aws_env, "submit", "--pool", model, "--wait-for-workers", "--json",
                      "--follow-logs",
                      write_items(tmp_path / "items.jsonl", [2, 0, 1]))
            assert run.returncode == 0, run.stderr
            printed = [line for line in run.stderr.splitlines() if "tagging" in line]
            host = socket.gethostname()
            tagged = [f"[modalapp {host}] tagging {x}" for x in (2, 0, 1)]
            assert printed == ([] if model == "native" else tagged)
            run_id = json.loads(run.stdout)["run"]["run_id"]
            results = [json.loads(line)["result"] for line in cli(aws_env, "runs", "results", run_id).stdout.split()]
            assert results == ["2:two", "0:zero", "1:one"]
        finally:
            worker.terminate()
            worker.wait(30)
    assert os.listdir(empty) == []


def test_include_refusals(local_env, tmp_path, monkeypatch):
    """An include over INCLUDE_MAX_BYTES, or one that does not exist, is refused in one line before anything is
    written; the snapshot of the same files is byte-identical (a re-created pool keeps its digest)."""
    import calque
    (tmp_path / "h.py").write_text(TAGGER)
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(calque_core.INCLUDE_MAX_BYTES + 1)
    for include, words in (("big.bin", "MiB a pool snapshots"), ("nope.txt", "not found")):
        out = cli(local_env, "pool", "create", "--model", "m", "--handler", "h.py:Tagger", "--workers", "0",
                  "--include", include, cwd=str(tmp_path))
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
    assert "m" not in cli(local_env, "pool", "list", "--json").stdout
    (tmp_path / "small.txt").write_text("x")
    first = calque_core.include_snapshot([[str(tmp_path / "small.txt"), "small.txt"]])
    os.utime(tmp_path / "small.txt", (1, 1))
    assert calque_core.include_snapshot([[str(tmp_path / "small.txt"), "small.txt"]]) == first


SLEEPY = '''
import time
import modal

app = modal.App()


@app.function(volumes={{{mount!r}: modal.Volume.from_name("notes", create_if_missing=True)}})
def greet(name: str = "you", times: int = 1):
    for _ in range(times):
        print(f"hi {{name}}")
    with open({mount!r} + "/greeted.txt", "a") as f:
        f.write(name)


@app.function()
def nap(x):
    time.sleep(60)
'''


def test_modal_run_of_a_function_and_sigterm(local_env, tmp_path):
    """`modal run app.py::fn --opt v` calls the function once with its options, as Modal's CLI (its print on our
    stderr); its create_if_missing volume is the store's folder of it, or the one --volume names, linked at its
    mount while the run lasts; a file of several functions and no entrypoint names them in one line; SIGTERM of
    `modal run` deletes its ephemeral pool and stops its workers."""
    path = tmp_path / "sleepy.py"
    path.write_text(SLEEPY.format(mount=str(tmp_path / "mnt")))
    out = cli(local_env, "modal", "run", f"{path}::greet", "--name", "calque", "--times", "2")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("[greet w0] hi calque") == 2
    assert (tmp_path / "store" / "volumes" / "notes" / "greeted.txt").read_text() == "calque"
    assert not os.path.lexists(tmp_path / "mnt")   # the link its worker made is gone with the run
    (tmp_path / "mine").mkdir()
    out = cli(local_env, "modal", "run", f"{path}::greet", "--volume", f"notes={tmp_path / 'mine'}")
    assert out.returncode == 0 and (tmp_path / "mine" / "greeted.txt").read_text() == "you", out.stderr
    out = cli(local_env, "modal", "run", str(path))
    assert out.returncode == 2 and "0 local entrypoints and 2 functions (greet, nap)" in out.stderr
    local_env = dict(local_env, CALQUE_GRACE="1")   # the napping worker is stopped without a 5 s wait
    proc = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "modal", "run", f"{path}::nap", "--x", "1"],
                            env=local_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "modal-sleepy-nap" in cli(local_env, "runs", "list").stdout, 60, "the run of the nap")
    model = json.loads(cli(local_env, "pool", "list", "--json").stdout)[0]["model"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert "modal-sleepy" not in cli(local_env, "pool", "list").stdout
    wait_for(lambda: not running(model), 30, "the pool's supervisor and worker to exit")


PATH_KEYED = '''
import pathlib
import modal

app = modal.App()
MOUNT = pathlib.PurePosixPath({mount!r})   # Modal takes a path as a volumes= key, as a str


@app.function(volumes={{MOUNT: modal.Volume.from_name("notes", create_if_missing=True)}})
def note(text: str = "hi"):
    pathlib.Path(MOUNT, "note.txt").write_text(text)
'''


def test_volume_keyed_by_a_path_and_a_pool_that_fails_to_be_made(local_env, tmp_path):
    """volumes={PurePosixPath: Volume} mounts as a str key does (it was a traceback in pool create,
    and in modal run hidden behind "no pool ... nothing to delete"); an ephemeral pool that cannot
    be made (CALQUE_STATE is a file) says why in one line, not that there is nothing to delete."""
    path = tmp_path / "keyed.py"
    path.write_text(PATH_KEYED.format(mount=str(tmp_path / "mnt")))
    out = cli(local_env, "modal", "run", f"{path}::note", "--text", "kept")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "store" / "volumes" / "notes" / "note.txt").read_text() == "kept"   # the store's
    (tmp_path / "plain-file").write_text("")
    env = dict(local_env, CALQUE_STATE=str(tmp_path / "plain-file"))
    out = modal_run(env, f"{path}::note", "--volume", f"notes={tmp_path / 'mine'}", installed=True)
    assert out.returncode != 0 and "no pool for model" not in out.stderr, out.stderr
    assert "plain-file/pools: Not a directory" in out.stderr.splitlines()[-1], out.stderr


SECRETS = '''
import json
import os
import modal

app = modal.App(secrets=[modal.Secret.from_dict({"FROM_DICT": "d"})])


@app.function(secrets=[modal.Secret.from_name("api", required_keys=["API_KEY"])])
def getenv(name):
    return os.environ.get(name)


@app.local_entrypoint()
def main():
    print(json.dumps({name: getenv.remote(name) for name in ("API_KEY", "FROM_DICT", "UNSET")}))
'''


def test_secrets_from_a_file_from_the_source_and_their_required_keys(local_env, tmp_path):
    """`--secret N=FILE` and `Secret.from_dict` reach the function's environment; a file lacking one of
    `required_keys`, or no file at all, is refused in one line before any pool is made; with no --secret,
    the note names the keys the workers' environment must hold."""
    path = tmp_path / "secrets_app.py"
    path.write_text(SECRETS)
    (tmp_path / "good.env").write_text("export API_KEY=k1\nOTHER=o\n")
    (tmp_path / "bad.env").write_text("OTHER=o\n")
    out = modal_run(local_env, str(path), "--secret", f"api={tmp_path / 'good.env'}")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"API_KEY": "k1", "FROM_DICT": "d", "UNSET": None}
    out = modal_run(local_env, str(path), "--secret", f"api={tmp_path / 'bad.env'}", installed=True)
    assert (out.returncode, out.stderr.splitlines()[-1]) == (2, (
        f"calque: error: secret api: {tmp_path / 'bad.env'} lacks API_KEY (its required_keys: API_KEY) ---> HINT: "
        f"add a KEY=value line for each"))
    out = cli(local_env, "pool", "create", "--model", "secret-app", "--handler", f"{path}:getenv", "--workers", "0",
              "--secret", "api=nowhere.env")
    assert (out.returncode, out.stderr.splitlines()[-1]) == (2, (
        f"calque: error: --secret api={ROOT}/nowhere.env: no such file ---> HINT: name a file of KEY=value lines"))
    out = modal_run(local_env, str(path))
    assert out.returncode == 0 and json.loads(out.stdout)["API_KEY"] is None, out.stderr
    assert "secret api: no --secret api=FILE: its variables (API_KEY) must be in the workers' environment" \
        in out.stderr
    assert "secret-app" not in cli(local_env, "pool", "list").stdout


NUMPY = importlib.metadata.version("numpy")


def test_errors_in_a_users_file_are_one_line(local_env, tmp_path):
    """A syntax error, a top-level import this Python lacks, an image pip package not installed or
    not at the version pinned, a decorator without its parentheses, a web endpoint as the target (of
    pool create, and of modal run, named or alone in its file), `App.lookup`, a class's constructor arguments, an
    exception in the entrypoint: each one line naming the file (and line) and the next step."""
    cases = {
        "syntax.py": ("import modal\napp = modal.App()\n@app.function()\ndef f(x):\n    return x +\n",
                      "f", "syntax error on line 5"),
        "missing.py": ("import modal\nimport no_such_module_xyz\napp = modal.App()\n@app.function()\ndef f(x):\n"
                       "    return x\n", "f", "missing.py:2: module 'no_such_module_xyz' is not installed"),
        "image.py": ("import modal\napp = modal.App(image=modal.Image.debian_slim().pip_install('no-such-dist==1.0'))"
                     "\n@app.function()\ndef f(x):\n    return x\n", "f", "-m pip install no-such-dist==1.0"),
        "pinned.py": ("import modal\napp = modal.App(image=modal.Image.debian_slim()"
                      ".pip_install('numpy==1.0', 'boto3>=1.0'))\n@app.function()\n"
                      "def f(x):\n    return x\n", "f",
                      f"pip_install numpy==1.0 ({NUMPY} installed) in the workers' Python"),
        "bare.py": ("import modal\napp = modal.App()\n@app.function\ndef f(x):\n    return x\n", "f",
                    "bare.py:3: @app.function without parentheses ---> HINT: write @app.function()"),
        "web.py": ("import modal\napp = modal.App()\n@app.function()\n@modal.asgi_app()\ndef f():\n    return None\n",
                   "f", "f is a @modal.asgi_app web endpoint"),
        "lookup.py": ("import modal\napp = modal.App.lookup('box', create_if_missing=True)\n", "f",
                      "lookup.py:2: modal.App.lookup (a deployed app, as Sandboxes use) is not supported"),
    }
    for name, (source, target, words) in cases.items():
        (tmp_path / name).write_text(source)
        out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{tmp_path / name}:{target}",
                  "--workers", "0")
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, (name, out.stderr)
        assert "boto3" not in out.stderr
    web = tmp_path / "web.py"
    for target, installed in ((str(web), False), (f"{web}::f", True)):
        out = modal_run(local_env, target, installed=installed)   # not "has no function f"
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "web.py:f: f is a @modal.asgi_app web endpoint" in out.stderr
    (tmp_path / "raw.py").write_text("import modal\napp = modal.App()\n@app.function()\n"
                                     "def f(data: bytes):\n    return len(data)\n")
    out = cli(local_env, "modal", "run", str(tmp_path / "raw.py"))   # Modal's CLI: no bytes option
    assert out.returncode == 2, out.stderr
    assert "parameter data is a bytes: Modal's CLI" in out.stderr
    (tmp_path / "ctor.py").write_text(   # Modal's deprecated constructor arguments
        "import modal\napp = modal.App()\n@app.cls()\nclass C:\n    def __init__(self, p):\n"
        "        self.p = p\n    @modal.method()\n    def f(self):\n        return self.p\n"
        "@app.local_entrypoint()\ndef main():\n    C('x').f.remote()\n")
    out = modal_run(local_env, str(tmp_path / "ctor.py"), installed=True)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "ctor.py:12: C(*args), an __init__'s arguments, is not supported" in out.stderr
    (tmp_path / "entry.py").write_text("import modal\napp = modal.App()\n@app.local_entrypoint()\ndef main():\n"
                                       "    raise RuntimeError('first\\nsecond')\n")
    out = cli(local_env, "modal", "run", str(tmp_path / "entry.py"))
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "entrypoint main failed: " in out.stderr and "entry.py:5: RuntimeError: first second" in out.stderr


def test_pip_versions_with_and_without_packaging(monkeypatch):
    """The image's pins are checked by packaging's rules, and by the ==/>= fallback where packaging
    is absent."""
    import calque
    assert calque_fleet.pip_unmet("numpy<2") == f"{NUMPY} installed"
    assert calque_fleet.pip_unmet("numpy~=2.0") is None
    for packaging in (True, False):
        if not packaging:
            monkeypatch.setitem(sys.modules, "packaging.requirements", None)
        assert calque_fleet.pip_unmet(f"numpy=={NUMPY}") is None
        assert calque_fleet.pip_unmet("numpy[dev]>=1.0") is None
        assert calque_fleet.pip_unmet("numpy>=999") == f"{NUMPY} installed"
        assert calque_fleet.pip_unmet("numpy==1.0") == f"{NUMPY} installed"
        assert calque_fleet.pip_unmet("no-such-dist-xyz>=1") == "not installed"


def test_image_imports_and_bootstrap(tmp_path):
    """`with image.imports():` skips a missing module outside a worker, as Modal does locally, and raises it in a
    worker; an EC2 pool's bootstrap installs the image's apt and pip packages as written."""
    import calque
    import calque_ec2 as ec2
    app = tmp_path / "imports.py"
    app.write_text("import modal\nimage = modal.Image.debian_slim()\napp = modal.App(image=image)\n"
                   "with image.imports():\n    import no_such_module_xyz\n@app.function()\ndef f(x):\n    return x\n")
    calque_core.import_modal_app(str(app), "f")
    with pytest.raises(calque.UserError, match="imports.py:5: module 'no_such_module_xyz' is not installed"):
        calque_core.import_modal_app(str(app), "f", container=True)
    script = ec2.user_data_pool("m", "s3://b/p", "us-east-1", "kit.tgz", "0" * 64,
                                image={"apt": ["libgomp1"], "pip": ["scikit-learn~=1.5.0", "numpy"]})
    assert "apt-get -o DPkg::Lock::Timeout=600 install -y -q libgomp1" in script
    assert "install -q --no-cache-dir 'scikit-learn~=1.5.0' numpy" in script


def test_submit_follow_logs(local_env, tmp_path):
    """submit --follow-logs on a native pool: what the handler prints reaches submit's stderr, prefixed."""
    (tmp_path / "loud.py").write_text("import calque\n\n\nclass Loud:\n    @calque.enter\n    def load(self):\n"
                                      "        pass\n\n    @calque.batch\n    def run(self, items):\n"
                                      "        print('batch of', len(items))\n        return items\n")
    assert cli(local_env, "pool", "create", "--model", "loud", "--handler", f"{tmp_path / 'loud.py'}:Loud",
               "--workers", "1").returncode == 0
    out = cli(local_env, "submit", "--pool", "loud", "--follow-logs", write_items(tmp_path / "i.jsonl", [1, 2, 3]))
    assert out.returncode == 0, out.stderr
    assert "[loud w0] batch of 3" in out.stderr
    assert cli(local_env, "pool", "delete", "--model", "loud", "--yes").returncode == 0


def test_function_call_get_timeout_and_gather(tmp_path):
    """FunctionCall.get(timeout=0) of a call not done raises TimeoutError, as Modal's; once its result lands,
    get() and gather() give it, and a failed call raises its original builtin type."""
    import threading
    import calque
    app = tmp_path / "calls.py"
    app.write_text("import modal\napp = modal.App()\n@app.function()\ndef f(x):\n    return x\n")
    shim, target, _ = calque_core.import_modal_app(str(app), "f")
    landed, outcomes = threading.Event(), iter([{"ok": True, "result": 7}, {"ok": False, "error": "KeyError: 3"}])

    def results(target, params, items):
        landed.wait()
        yield next(outcomes)
    shim.runner = results
    try:
        call = target.spawn(1)
        with pytest.raises(TimeoutError):
            call.get(timeout=0)
        landed.set()
        assert call.get() == 7 and shim.FunctionCall.gather(shim.FunctionCall.from_id(call.object_id)) == [7]
        with pytest.raises(KeyError):
            target.spawn(2).get()
    finally:
        shim.runner = None


CALQUE = os.path.join(os.path.dirname(PY), "calque")   # the installed command (the venv's console script)


def modal_run(env, *args, installed=False, **popen):
    """`python calque.py modal run ARGS`, or the installed `calque modal run ARGS`: as a finished
    process, or with `popen` a running one."""
    argv = [CALQUE] if installed else [PY, os.path.join(ROOT, "calque.py")]
    if popen:
        return subprocess.Popen([*argv, "modal", "run", *args], env=env, cwd=ROOT, **popen)
    return subprocess.run([*argv, "modal", "run", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def running(model):
    """Pids of the live processes whose command line names `model` (its supervisor and workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += [pid] if model.encode() in f.read() else []
        except OSError:
            pass
    return found


GLOSSARY = '''
import asyncio
import json
import os
import modal

app = modal.App("glossary")
LOG = {log!r}


@app.cls(timeout=30, cpu=2.0, memory=2048, max_inputs=500)
class Glossary:
    @modal.enter()
    async def load(self):
        await asyncio.sleep(0)
        self.loop = asyncio.get_running_loop()
        self.terms = {{"gpu": "accelerator", "warm": "loaded"}}

    @modal.method()
    async def define(self, word: str):
        return [self.terms.get(word, "?"), asyncio.get_running_loop() is self.loop]

    @modal.exit()
    async def save(self):
        await asyncio.sleep(0)
        with open(LOG, "a") as f:
            f.write(f"saved {{asyncio.get_running_loop() is self.loop}}\\n")


@app.function(timeout=600, retries=1, env={{"GREETING": "hej"}}, region="eu-west-1",
              schedule=modal.Period(days=1))
def greet(name: str):
    return f"{{os.environ['GREETING']}} {{name}}"


@app.local_entrypoint()
async def main():
    words = [w async for w in Glossary().define.map.aio(["gpu", "warm", "cold"])]
    print(json.dumps({{"words": words, "greet": await greet.remote.aio("ada")}}))
'''


@pytest.mark.parametrize("installed", [False, True])
def test_async_hooks_and_function_options_under_modal_run(local_env, tmp_path, installed):
    """An async @modal.enter is awaited on the loop the async methods run on (what it set is there), an
    async @modal.exit on the same loop at the pool's deletion; @app.function(timeout=, env=, region=,
    schedule=) runs, each option the kit has no use for named in one note."""
    path, log = write_app(tmp_path, GLOSSARY)
    out = modal_run(local_env, path, installed=installed)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"words": [["accelerator", True], ["loaded", True], ["?", True]],
                                      "greet": "hej ada"}
    assert "never awaited" not in out.stderr
    for note in ("greet: region=: ignored", "greet: schedule=: ignored", "Glossary.define: cpu=: ignored",
                 "Glossary.define: max_inputs=: ignored"):
        assert note in out.stderr, out.stderr
    assert log.read_text() == "saved True\n"
    assert "modal-" not in cli(local_env, "pool", "list").stdout


def test_timeout_and_options_of_a_function_as_of_a_class_at_pool_create(local_env, tmp_path):
    """timeout= is the batch watchdog of a function's pool as of a method's (per item: x batch size);
    env= reaches the worker; every App.function / App.cls option of Modal 1.x is accepted on both."""
    import calque
    path, _ = write_app(tmp_path, GLOSSARY)
    for target, timeout, note in (("greet", 600 * 4, "region=: ignored (workers run where the pool is"),
                                  ("Glossary.define", 30 * 4, "memory=: ignored (a worker has its machine's")):
        out = cli(local_env, "pool", "create", "--model", target, "--handler", f"{path}:{target}",
                  "--workers", "0", "--batch-size", "4")
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert f"pool {target}: {note}" in out.stdout
        assert calque_core.load_pool(backend_for(local_env), target)["batch_timeout"] == timeout
    record = calque_core.load_pool(backend_for(local_env), "greet")
    assert record["modal"]["image"]["env"] == {"GREETING": "hej"} and record["max_deliveries"] == 2
    shim = calque_core.load_modal_shim()
    modal_1x = ("image env secrets gpu serialized network_file_systems volumes cpu memory ephemeral_disk "
                "min_containers max_containers buffer_containers scaledown_window proxy retries timeout "
                "startup_timeout cloud region routing_region nonpreemptible enable_memory_snapshot block_network "
                "restrict_modal_access single_use_containers i6pn include_source experimental_options "
                "max_inputs").split()   # App.cls's; App.function's adds schedule, name, is_generator
    values = {"image": shim.Image.debian_slim(), "env": {"A": "1"}, "secrets": [], "volumes": {},
              "network_file_systems": {"/cache": "nfs"}, "gpu": "T4", "schedule": shim.Cron("0 * * * *")}
    for option in modal_1x + ["schedule", "name", "is_generator"]:
        for decorate, obj in ((shim.App().function, lambda x: x), (shim.App().cls, type("C", (), {}))):
            made = decorate(**{option: values.get(option, 1)})(obj)
            noted = [note for note in shim.ignored(made.options) if note.startswith(f"{option}=")]
            assert noted == ([f"{option}=: ignored ({shim.OPTIONS[option]})"] if shim.OPTIONS[option] else [])
    with pytest.raises(shim.Unsupported, match=r"@app.cls\(timout=...\) .* did you mean timeout=\?"):
        shim.App().cls(timout=1)
    with pytest.raises(shim.Unsupported, match="remove the option"):
        shim.App().function(banana=3)


def test_with_options_and_from_name_of_a_function_as_of_a_class():
    """Both: .with_options checks its options and is the same pool; .from_name (a deployed app) is
    refused in one line naming which and what to write instead."""
    shim = calque_core.load_modal_shim()
    for made, what in ((shim.App().function()(lambda x: x), "function"),
                       (shim.App().cls()(type("C", (), {})), "class")):
        assert made.with_options(gpu="T4", cpu=2) is made
        with pytest.raises(shim.Unsupported, match=r"with_options\(gpux=...\) .* mean gpu=\?"):
            made.with_options(gpux=1)
        refused = (rf"^modal.{type(made).__name__}.from_name \(a deployed app\) .* HINT: "
                   rf"import the app file and call its {what}$")
        with pytest.raises(shim.Unsupported, match=refused):
            type(made).from_name("app", "name")


def test_a_bug_in_the_kit_is_named_as_the_kits(local_env, tmp_path):
    """An exception raised in the kit's own code while `modal run` serves the app is the kit's: its
    traceback with a note naming the kit's line, not one line blaming the app's; an app's own error,
    or a wrong call of the stand-in, still names the app's line."""
    path, _ = write_app(tmp_path, GLOSSARY)
    broken = (f"import sys; sys.path.insert(0, {ROOT!r}); import calque, calque_fleet; "
              "calque_fleet.modal_gpu = lambda gpu: {}['card']; "   # a kit function that fails, as a bug would
              f"sys.exit(calque.main(['modal', 'run', {path!r}]))")
    out = subprocess.run([PY, "-c", broken], env=local_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)   # from the app's folder, as a user runs it
    assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr
    assert "calque: a bug in calque (calque_fleet.py:" in out.stderr and "in modal_options), not in " in out.stderr
    assert "entrypoint main failed" not in out.stderr
    broken = (f"import sys; sys.path.insert(0, {ROOT!r}); import calque, calque_core; "
              "calque_core.load_modal_shim()._check_options = lambda where, options: {}['x']; "   # at import
              f"sys.exit(calque.main(['pool', 'create', '--model', 'g', '--handler', {path + ':greet'!r}]))")
    out = subprocess.run([PY, "-c", broken], env=local_env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "calque: a bug in calque (modal.py:" in out.stderr, out.stderr
    assert "in _register), not in " in out.stderr and "is not supported" not in out.stderr
    (tmp_path / "wrong.py").write_text("import modal\napp = modal.App()\n@app.cls()\nclass C:\n"
                                       "    @modal.method()\n    def m(self, x):\n        return x\n"
                                       "@app.local_entrypoint()\ndef main():\n    C().n.remote(1)\n")
    out = modal_run(local_env, str(tmp_path / "wrong.py"))
    assert out.returncode == 1 and "wrong.py:10: AttributeError: C has no @modal.method n" in out.stderr
    assert "Traceback" not in out.stderr


HANG = '''
import time
import modal

app = modal.App("hang")
LOG = {log!r}


@app.function()
def crunch(n: int):
    with open(LOG, "a") as f:
        f.write("started\\n")
    time.sleep(3600)   # a call far longer than anyone waits for
    return n


@app.local_entrypoint()
async def main():
    print(await crunch.remote.aio(1))
'''


def start_hang(env, tmp_path, installed=False):
    """`modal run` of HANG once its call runs in its ephemeral pool's worker: (process, pool name)."""
    path, log = write_app(tmp_path, HANG, "hang.py")
    proc = modal_run(env, path, installed=installed, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: log.exists() and "started" in log.read_text(), 60, "the remote call to start")
    model = json.loads(cli(env, "pool", "list", "--json").stdout)[0]["model"]
    assert running(model)
    return proc, model


@pytest.mark.parametrize("sig,installed", [(signal.SIGTERM, False), (signal.SIGINT, True),
                                           (signal.SIGTERM, True)])
def test_one_signal_ends_modal_run_awaiting_an_aio_call(local_env, tmp_path, sig, installed):
    """The first SIGTERM or Ctrl-C (SIGINT) ends `modal run` while its async entrypoint awaits a
    .remote.aio call, and its ephemeral pool is deleted: no supervisor or worker left."""
    proc, model = start_hang(local_env, tmp_path, installed)
    try:
        proc.send_signal(sig)
        proc.wait(60)   # before: hung until a second signal
    finally:
        proc.kill()
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), proc.stderr.read()
    assert not running(model)
    assert "modal-hang" not in cli(local_env, "pool", "list").stdout
    worker_log = next((tmp_path / "state" / "pools").glob("modal-hang-crunch-*/worker-0.log")).read_text()
    assert "(signal, no grace); visible again in 0s" in worker_log   # the call let go at once, not killed


def test_modal_run_killed_leaves_no_pool_running(local_env, tmp_path):
    """kill -9 of `modal run`: nothing of it can act, so its ephemeral pool's supervisor, which
    watches the modal run's pid, stops the worker and deletes the pool and its folder."""
    proc, model = start_hang(local_env, tmp_path)
    proc.kill()
    proc.wait()
    wait_for(lambda: not running(model), 60, "the pool's supervisor and worker to exit")
    wait_for(lambda: "modal-hang" not in cli(local_env, "pool", "list").stdout, 30, "the pool's deletion")
    wait_for(lambda: not (tmp_path / "state" / "pools" / calque_core.slug(model)).exists(), 30, "its folder removed")
