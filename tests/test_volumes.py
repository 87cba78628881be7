"""Modal Volumes that live in the store (the prefix volumes/<slug>/), in Modal's idioms: a volume
written and committed by one function, read after reload by another and listed and read from the
entrypoint; a volume under a `Path` key that the app's module-level code sees (the folder an import
made at its mount gives way); the one-line refusal of a mount that holds files; the links an
ephemeral pool made removed when it ends; two machines' copies kept apart and brought together by
commit and reload; a 2-worker machine fetching a volume once. On the embedded store and on
moto_server, through `calque modal run` and `pool create` (both spellings) from a folder outside the
checkout."""
import json
import os
import subprocess

from conftest import PY, ROOT, FaultProxy, backend_for, wait_for, write_items
import calque_core

CALQUE = os.path.join(os.path.dirname(PY), "calque")   # the installed command

VOLS = '''
import asyncio
import io
import json
import os
import pathlib

import modal

app = modal.App("vols")
notes = modal.Volume.from_name("notes", create_if_missing=True)
cache = modal.Volume.from_name("hf-cache", create_if_missing=True)
DATA = {data!r}
HUB = pathlib.Path({hub!r})
os.environ["HF_HUB_CACHE"] = str(HUB / "hub")
os.makedirs(os.environ["HF_HUB_CACHE"], exist_ok=True)   # as `import diffusers` does, at the mount
AT_IMPORT = sorted(os.listdir(HUB))


@app.function(volumes={{DATA: notes}})
def write(text):
    with open(f"{{DATA}}/greeting.txt", "w") as f:
        f.write(text)
    os.makedirs(f"{{DATA}}/sub", exist_ok=True)
    with open(f"{{DATA}}/sub/x.bin", "wb") as f:
        f.write(bytes(10))
    notes.commit()
    return "written"


@app.function(volumes={{DATA: notes}})
async def read():
    await notes.reload.aio()
    with open(f"{{DATA}}/greeting.txt") as f:
        return f.read()


@app.function(volumes={{HUB: cache}})
def seen():
    return AT_IMPORT


def refused(call):
    try:
        call()
    except (FileNotFoundError, FileExistsError, IsADirectoryError) as e:
        return type(e).__name__


async def aio_forms():
    return ([e.path async for e in notes.iterdir.aio("/", recursive=False)], len(await notes.listdir.aio("/")),
            b"".join([chunk async for chunk in notes.read_file.aio("greeting.txt")]).decode())


@app.local_entrypoint()
def main(tokenizer: str):
    with cache.batch_upload() as batch:
        batch.put_file(io.BytesIO(b"weights"), "model.safetensors")
        batch.put_directory(tokenizer, "/tok")

    def again():
        with cache.batch_upload() as batch:
            batch.put_file(io.BytesIO(b"other"), "/model.safetensors")
    out = {{"write": write.remote("hello"), "read": read.remote(), "seen": seen.remote(),
           "tree": [[e.path, e.type.name, e.size] for e in notes.listdir("/", recursive=True)],
           "top": [e.path for e in notes.iterdir("/", recursive=False)],
           "file": b"".join(notes.read_file("/greeting.txt")).decode(),
           "tok": [e.path for e in cache.listdir("tok", recursive=True)], "aio": asyncio.run(aio_forms()),
           "refused": [refused(again), refused(lambda: notes.remove_file("sub")),
                       refused(lambda: list(notes.read_file("nope.txt"))),
                       refused(lambda: notes.copy_files(["sub"], "sub2"))]}}
    notes.copy_files(["greeting.txt", "sub"], "copies", recursive=True)
    notes.copy_files(["greeting.txt"], "renamed.txt")
    out["copied"] = [e.path for e in notes.listdir("/", recursive=True) if e.type.name == "FILE"]
    notes.remove_file("copies", recursive=True)
    notes.remove_file("renamed.txt")
    out["after"] = [e.path for e in notes.listdir("/")]
    print(json.dumps(out))
'''


def write_vols(tmp_path):
    (tmp_path / "tokenizer" / "inner").mkdir(parents=True)
    (tmp_path / "tokenizer" / "vocab.txt").write_text("a b")
    (tmp_path / "tokenizer" / "inner" / "merges.txt").write_text("ab")
    path = tmp_path / "vols.py"
    path.write_text(VOLS.format(data=str(tmp_path / "data"), hub=str(tmp_path / "hub")))
    return path


def calque_cli(env, folder, *args, installed=False):
    """`python calque.py ARGS`, or the installed `calque ARGS`, run in `folder`."""
    argv = [CALQUE] if installed else [PY, os.path.join(ROOT, "calque.py")]
    return subprocess.run([*argv, *args], env=env, cwd=str(folder), capture_output=True, text=True,
                          timeout=300)


def test_a_volume_in_the_store_through_modal_run(any_env, tmp_path):
    """The fixture app on either store: what one function commits another reads, the entrypoint
    lists, reads, uploads, copies and removes it in the store; the Path-keyed volume is in place
    when the app is imported (its module-level listing sees the uploaded weights); the links made
    are gone after the run, the folder the import made is back; Modal's exceptions for an existing
    file, a folder removed or copied without recursive=True and a missing file; the .aio forms. Run from a folder
    outside the checkout; python calque.py on the local store, the installed command on
    moto_server."""
    path, s3 = write_vols(tmp_path), any_env["CALQUE_STORE"].startswith("s3://")
    out = calque_cli(any_env, tmp_path, "modal", "run", str(path), "--tokenizer",
                     str(tmp_path / "tokenizer"), installed=s3)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["write"] == "written" and got["read"] == "hello" and got["file"] == "hello"
    assert got["seen"] == ["hub", "model.safetensors", "tok"]   # the volume, at import
    assert got["tree"] == [["greeting.txt", "FILE", 5], ["sub", "DIRECTORY", 0],
                           ["sub/x.bin", "FILE", 10]]
    assert got["top"] == ["greeting.txt", "sub"] and got["aio"] == [["greeting.txt", "sub"], 2, "hello"]
    assert got["tok"] == ["tok/inner", "tok/inner/merges.txt", "tok/vocab.txt"]
    assert got["refused"] == ["FileExistsError", "IsADirectoryError", "FileNotFoundError",
                              "IsADirectoryError"]
    assert got["copied"] == ["copies/greeting.txt", "copies/sub/x.bin", "greeting.txt",
                             "renamed.txt", "sub/x.bin"]
    assert got["after"] == ["greeting.txt", "sub"]
    store = backend_for(any_env).store
    assert store.get("volumes/notes/greeting.txt") == b"hello"
    assert store.get("volumes/hf-cache/model.safetensors") == b"weights"
    assert not os.path.lexists(tmp_path / "data")   # no folder was there
    hub = tmp_path / "hub"
    assert os.path.isdir(hub) and not os.path.islink(hub)   # the folder the import made
    assert ("fetched into" in out.stderr) == s3   # a machine's copy on s3:// only


def test_a_mount_that_holds_files_is_refused_in_one_line(local_env, tmp_path):
    """pool create of a function whose mount holds a file: one line naming the volume's own name in
    the flag that makes that folder the volume (both spellings); with that flag the pool starts, the
    folder untouched."""
    path = write_vols(tmp_path)
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "keep.txt").write_text("mine")
    for installed in (False, True):
        out = calque_cli(local_env, tmp_path, "pool", "create", "--model", "v", "--handler",
                         f"{path}:seen", "--workers", "1", installed=installed)
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert (f"volume hf-cache: its mount {tmp_path / 'hub'} exists and holds files ---> HINT: "
                f"move it away, or make it the volume: --volume hf-cache={tmp_path / 'hub'}"
                ) in out.stderr
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "data")   # left by someone: not replaced
    out = calque_cli(local_env, tmp_path, "pool", "create", "--model", "v", "--handler",
                     f"{path}:read", "--workers", "1")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert (f"its mount {tmp_path / 'data'} exists and is a link to {tmp_path / 'elsewhere'}"
            in out.stderr)
    out = calque_cli(local_env, tmp_path, "pool", "create", "--model", "v", "--handler",
                     f"{path}:seen", "--workers", "1", "--volume", f"hf-cache={tmp_path / 'hub'}",
                     installed=True)
    assert out.returncode == 0, out.stderr   # its worker warm: the app imported, the folder used
    assert (tmp_path / "hub" / "keep.txt").read_text() == "mine"
    assert not os.path.islink(tmp_path / "hub")
    out = calque_cli(local_env, tmp_path, "pool", "delete", "--model", "v", "--yes", "--force")
    assert out.returncode == 0, out.stderr


def test_newcomer_mistakes_with_volumes_are_one_line(local_env, tmp_path):
    """--volume naming a volume the app does not declare (a typo) or no folder, a mount path that
    is not absolute (Modal refuses it too): one line each, exit 2, nothing created (modal run: no
    line per target); a folder the workers cannot make: one line; the entrypoint reading a file
    the volume lacks: one line naming the app's line, not a kit traceback."""
    path = write_vols(tmp_path)
    out = calque_cli(local_env, tmp_path, "pool", "create", "--model", "v", "--handler",
                     f"{path}:seen", "--workers", "0", "--volume", "hf_cache=weights",
                     installed=True)
    assert out.returncode == 2 and out.stderr == (
        "calque: error: --volume hf_cache=weights: the app has no volume hf_cache (it has: "
        "hf-cache, notes)\n"), out.stderr
    for flag, said in (("hf_cache=weights", "the app has no volume hf_cache (it has: "),
                       ("notes=", "--volume notes=: not a local folder ---> HINT: ")):
        out = calque_cli(local_env, tmp_path, "modal", "run", str(path), "--tokenizer",
                         str(tmp_path / "tokenizer"), "--volume", flag)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr   # no pool
        assert said in out.stderr, out.stderr
    (tmp_path / "afile").write_text("")   # a --volume folder no worker can make: one line
    out = calque_cli(local_env, tmp_path, "modal", "run", f"{path}::write", "--text", "hi",
                     "--volume", f"notes={tmp_path}/afile/notes", installed=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (f"volume notes: cannot make its folder {tmp_path}/afile/notes (Not a directory) ---> "
            "HINT: --volume notes=PATH naming a folder the workers can write"
            ) in out.stderr.splitlines()[-1], out.stderr
    path.write_text(path.read_text().replace("volumes={HUB: cache}", 'volumes={"hub": cache}'))
    out = calque_cli(local_env, tmp_path, "modal", "run", f"{path}::seen")
    assert out.returncode == 2 and out.stderr.endswith(
        'calque: error: volume hf-cache: its mount hub is not an absolute path ---> HINT: '
        'volumes={"/hub": ...}\n'), out.stderr
    assert "vols" not in calque_cli(local_env, tmp_path, "pool", "list").stdout
    (tmp_path / "miss.py").write_text("import modal\napp = modal.App()\n"
                                      "vol = modal.Volume.from_name('notes')\n"
                                      "@app.local_entrypoint()\ndef main():\n"
                                      "    print(b''.join(vol.read_file('nope.txt')))\n")
    out = calque_cli(local_env, tmp_path, "modal", "run", "miss.py", installed=True)
    assert out.returncode == 1 and out.stderr == (
        "calque: error: entrypoint main failed: miss.py:6: FileNotFoundError: volume notes: no "
        "file nope.txt\n"), out.stderr


def test_two_machines_copies_meet_through_commit_and_reload(aws_env, tmp_path):
    """Two machines' copies of one volume (two CALQUE_STATE folders) on moto_server: a file
    committed on one is fetched by the other's reload, once; a file changed on a machine and not
    committed stays through a reload; a file removed and committed goes from the other's copy; a
    reload with nothing new fetches nothing."""
    store = backend_for(aws_env).store
    a, b = (calque_core.open_volume({"CALQUE_STATE": str(tmp_path / m)}, store, "Weights v1")
            for m in "ab")
    assert a.folder != b.folder and a.sync() == b.sync() == 0
    os.makedirs(os.path.join(a.folder, "sub"))
    for name, data in (("w.bin", b"1" * 1000), ("sub/t.txt", b"tok"), ("gone.txt", b"x")):
        with open(os.path.join(a.folder, name), "wb") as f:
            f.write(data)
    a.commit()
    assert [k for k, *_ in store.walk("volumes/weights-v1/")] == ["gone.txt", "sub/t.txt", "w.bin"]
    assert b.sync() == 1004 and b.sync() == 0
    with open(os.path.join(b.folder, "sub", "t.txt"), "wb") as f:
        f.write(b"b's own")                              # not committed
    with open(os.path.join(a.folder, "sub", "t.txt"), "wb") as f:
        f.write(b"a's")
    os.remove(os.path.join(a.folder, "gone.txt"))
    a.commit()
    assert b.sync() == 0                                  # b's change is kept; nothing else is new
    assert open(os.path.join(b.folder, "sub", "t.txt"), "rb").read() == b"b's own"
    assert not os.path.exists(os.path.join(b.folder, "gone.txt"))
    assert store.get("volumes/weights-v1/sub/t.txt") == b"a's"
    b.commit()                                            # last writer wins, as on Modal
    assert store.get("volumes/weights-v1/sub/t.txt") == b"b's own"
    assert a.sync() == 7 and open(os.path.join(a.folder, "sub", "t.txt"), "rb").read() == b"b's own"


WEIGHTS = '''
import os
import pathlib

import modal

app = modal.App("weights")
MOUNT = pathlib.Path({mount!r})
# at import, as a loader does, in the container only (modal.is_local(): pool create's import)
SIZES = {{}} if modal.is_local() else {{n: os.path.getsize(MOUNT / n) for n in os.listdir(MOUNT)}}


@app.cls(volumes={{MOUNT: modal.Volume.from_name("weights")}})
class Model:
    @modal.method()
    def sizes(self, x):
        return SIZES
'''


def test_a_two_worker_machine_fetches_a_volume_once(aws_env, tmp_path):
    """pool create --workers 2 of a class whose weights are in a volume (a Path key), on moto_server
    behind a recording proxy: each of the volume's objects is fetched once for the machine, and both
    workers' imports see the files; a volume that does not exist (without create_if_missing) is
    refused in one line."""
    app = tmp_path / "weights.py"
    app.write_text(WEIGHTS.format(mount=str(tmp_path / "weights")))
    out = calque_cli(aws_env, tmp_path, "pool", "create", "--model", "w", "--handler",
                     f"{app}:Model", "--workers", "0", installed=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "volume weights (mounted at" in out.stderr and "create_if_missing=True" in out.stderr
    store = backend_for(aws_env).store
    files = {f"part-{n}.safetensors": os.urandom(100_000 + n) for n in range(3)}
    for name, data in files.items():
        store.put(f"volumes/weights/{name}", data)
    proxy = FaultProxy(aws_env["AWS_ENDPOINT_URL"])
    env = dict(aws_env, AWS_ENDPOINT_URL=proxy.url)
    try:
        out = calque_cli(env, tmp_path, "pool", "create", "--model", "w", "--handler",
                         f"{app}:Model", "--workers", "2")
        assert out.returncode == 0, out.stderr
        fetched = sorted(e["path"] for e in proxy.seen
                         if e["method"] == "GET" and "/volumes/weights/" in e["path"])
        assert fetched == sorted(f"/{store.bucket}/root/volumes/weights/{n}" for n in files)
        items = write_items(tmp_path / "i.jsonl", list(range(8)))
        out = calque_cli(env, tmp_path, "submit", "--pool", "w", items, "--claim-size", "1",
                         "--json", installed=True)
        assert out.returncode == 0, out.stderr
        assert len({s["worker_id"] for s in json.loads(out.stdout)["summaries"]}) == 2
        out = calque_cli(env, tmp_path, "runs", "results", "latest")
        sizes = {n: len(d) for n, d in files.items()}
        assert [json.loads(line)["result"] for line in out.stdout.splitlines()] == [sizes] * 8
    finally:
        calque_cli(env, tmp_path, "pool", "delete", "--model", "w", "--yes", "--force")
        proxy.close()


SYNC = """import sys, calque_core
store = calque_core.open_backend(sys.argv[1]).store
calque_core.open_volume({"CALQUE_STATE": sys.argv[2]}, store, "slow").sync()
"""


def test_a_fetch_killed_9_leaves_nothing_half_and_the_next_one_finishes(aws_env, tmp_path):
    """A worker's fetch of a volume killed -9 after its first files (moto_server behind a 0.2 s
    delay per request), its index saved each second meanwhile: the copy holds whole files only, no
    partial one inside it; the next fetch completes the copy, fetching only what the index saved
    does not record."""
    from latency_proxy import start_proxy
    store = backend_for(aws_env).store
    files = {f"f{n:02d}.bin": os.urandom(1000 + n) for n in range(20)}
    for name, data in files.items():
        store.put(f"volumes/slow/{name}", data)
    url, stop = start_proxy(aws_env["AWS_ENDPOINT_URL"], 200)
    try:
        proc = subprocess.Popen([PY, "-c", SYNC, aws_env["CALQUE_STORE"], str(tmp_path / "state")],
                                env=dict(aws_env, AWS_ENDPOINT_URL=url, PYTHONPATH=ROOT))
        volume = calque_core.open_volume({"CALQUE_STATE": str(tmp_path / "state")}, store, "slow")
        wait_for(lambda: os.path.isdir(volume.folder) and len(os.listdir(volume.folder)) >= 8, 60,
                 "8 files fetched (1.6 s or more: past an index save)")
        proc.kill()
        proc.wait()
    finally:
        stop()
    def copy():
        return {n: open(os.path.join(volume.folder, n), "rb").read()
                for n in os.listdir(volume.folder)}
    had = copy()
    assert 8 <= len(had) < 20 and all(files[n] == data for n, data in had.items())
    indexed = json.load(open(volume.folder + ".json"))
    assert indexed and set(indexed) <= set(had)
    assert volume.sync() == sum(len(d) for n, d in files.items() if n not in indexed)
    assert copy() == files
    assert volume.sync() == 0


NAP = '''
import time
import modal

app = modal.App()
vol = modal.Volume.from_name("naps", create_if_missing=True)


@app.function(volumes={{{mount!r}: vol}})
def nap(x: int = 1):
    open({mount!r} + "/started", "w").write("yes")
    time.sleep(60)
'''


def test_modal_run_killed_9_its_pools_supervisor_removes_the_links(local_env, tmp_path):
    """`modal run` killed -9 while its function naps in a volume: the ephemeral pool's supervisor,
    which deletes the pool, also removes the link its worker made at the mount (the folder the link
    replaced made again); the volume's files stay in the store."""
    path, mount = tmp_path / "nap.py", tmp_path / "naps"
    path.write_text(NAP.format(mount=str(mount)))
    mount.mkdir()   # an empty folder: the link replaces it
    proc = subprocess.Popen([CALQUE, "modal", "run", str(path)], cwd=str(tmp_path),
                            env=dict(local_env, CALQUE_GRACE="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (mount / "started").exists(), 60, "the function started, in the volume")
        assert os.path.islink(mount)
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not os.path.islink(mount), 60, "the supervisor to remove the link")
    assert os.path.isdir(mount) and os.listdir(mount) == []
    assert (tmp_path / "store" / "volumes" / "naps" / "started").read_text() == "yes"
    wait_for(lambda: "modal-nap" not in calque_cli(local_env, tmp_path, "pool", "list").stdout, 60,
             "the pool deleted")
