"""Every view says what failed (issue 42): `runs list` (text and --json), `runs show` and the
dashboard's /api/runs give each run its state and its items ok and failed; failed items are grouped
by their exact message and named by their --id-field or file path, never by a BytesIO's address.
Real CLI processes, both spellings."""
import json
import os
import subprocess
import urllib.request

from conftest import HANDLERS, PY, ROOT, cli, write_items
from test_media_in import jpeg

INSTALLED = os.path.join(os.path.dirname(PY), "calque")
HEADER = ["run", "mode", "model", "items", "claims", "ok", "failed", "state", "created"]


def both(env, *args, cwd=ROOT):
    """The command as `python calque.py ARGS` and as the installed `calque ARGS`: one answer."""
    outs = [cli(env, *args, cwd=cwd), subprocess.run([INSTALLED, *args], env=env, cwd=cwd,
                                                     capture_output=True, text=True, timeout=120)]
    assert outs[0].returncode == outs[1].returncode, outs
    assert outs[0].stdout.replace("python calque.py", "calque") == outs[1].stdout, outs
    return outs[0]


def create_pool(env, model, handler, *extra):
    out = cli(env, "pool", "create", "--model", model, "--handler", handler, *extra)
    assert out.returncode == 0, out.stderr


def listed(env):
    """{run_id: (ok, failed, state)} of `runs list` as text, and its --json records by run id."""
    header, *lines = both(env, "runs", "list").stdout.splitlines()
    assert header.split() == HEADER
    text = {}
    for line in lines:
        run_id, *_, ok, failed = line.split()[:7]
        text[run_id] = (int(ok), int(failed), " ".join(line.split()[7:-1]))
    return text, {r["run_id"]: r for r in json.loads(both(env, "runs", "list", "--json").stdout)}


def api_runs(env):
    """/api/runs of a `calque dashboard` process on the store: {run_id: run}."""
    proc = subprocess.Popen([INSTALLED, "dashboard", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = proc.stdout.readline().split()[3].split("?")[0].rstrip("/")
        with urllib.request.urlopen(f"{base}/api/runs", timeout=60) as answer:
            return {r["run_id"]: r for r in json.loads(answer.read())["runs"]}
    finally:
        proc.terminate()
        proc.wait(10)


def test_every_view_gives_each_run_its_state_and_counts(local_env, tmp_path):
    """A run whose 50 items all fail is `failed` with 0 ok and 50 failed, a cancelled run is
    `cancelled`, one with some failures `done with failures`, a clean one `done`: in runs list
    (text, --json), runs show (text, --json) and /api/runs alike."""
    create_pool(local_env, "m", f"{HANDLERS}:Echo", "--workers", "1")
    runs = {}
    for state, fails in (("failed", range(50)), ("done with failures", (3, 7)), ("done", ())):
        items = write_items(tmp_path / "items.jsonl",
                            [dict({"x": i}, fail=i in fails) for i in range(50)])
        out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "20")
        assert out.returncode == (0 if state == "done" else 1), out.stderr
        runs[out.stdout.split()[1]] = (state, 50 - len(fails), len(fails))
    create_pool(local_env, "idle", f"{HANDLERS}:Echo", "--workers", "0")
    cancelled = cli(local_env, "submit", "--pool", "idle", items, "--no-wait").stdout.strip()
    assert cli(local_env, "runs", "cancel", cancelled).returncode == 0
    runs[cancelled] = ("cancelled", 0, 0)

    text, records = listed(local_env)
    api = api_runs(local_env)
    for run_id, (state, ok, failed) in runs.items():
        assert text[run_id] == (ok, failed, state), (run_id, text)
        for view in (records[run_id], api[run_id]):
            assert (view["state"], view["ok"], view["failed"]) == (state, ok, failed), view
        show = both(local_env, "runs", "show", run_id)
        assert show.returncode == (0 if state == "done" else 1)
        assert show.stdout.splitlines()[0].endswith(f"(of 50 items); state: {state}"), show.stdout
        show = both(local_env, "runs", "show", run_id, "--json")
        assert json.loads(show.stdout)["state"] == state


def test_failures_keep_each_message_with_its_exact_count(local_env, tmp_path):
    """A batch of 32 returning 31 results and one of 18 returning 17: two messages, 32 and 18
    items, each with its own items; not `50 x handler returned 31 results for a batch of 32`."""
    create_pool(local_env, "short", f"{HANDLERS}:WrongCount", "--workers", "1")
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(50)])
    out = cli(local_env, "submit", "--pool", "short", items, "--claim-size", "50")
    assert out.returncode == 1, out.stderr
    show = both(local_env, "runs", "show", out.stdout.split()[1]).stdout
    for count, first in ((32, "0, 1, 2, 3, 4"), (18, "32, 33, 34, 35, 36")):
        assert (f"        {count} x handler returned {count - 1} results for a batch of {count} "
                f"items  (items {first}, ...)") in show, show


def test_failed_items_are_named_by_id_field_and_by_file_path(local_env, tmp_path):
    """An --id-field run names its failed items by their ids; a folder of files names them by path,
    and a decoder's `<_io.BytesIO object at 0x...>` is not what the report or result line shows."""
    create_pool(local_env, "m", f"{HANDLERS}:Echo", "--workers", "1")
    items = write_items(tmp_path / "items.jsonl",
                        [{"x": i, "id": f"doc-{i}", "fail": i % 10 == 4} for i in range(30)])
    out = cli(local_env, "submit", "--pool", "m", items, "--id-field", "id", "--claim-size", "8")
    assert out.returncode == 1, out.stderr
    show = both(local_env, "runs", "show", out.stdout.split()[1]).stdout
    for i in (4, 14, 24):
        assert f"         1 x ValueError: item {i} asked to fail  (items doc-{i})" in show, show

    photos = tmp_path / "work" / "photos"
    (photos / "b").mkdir(parents=True)
    for name, data in {"a.jpg": jpeg(8, 8), "b/bad.jpg": b"not an image", "c.jpg": b"nor"}.items():
        (photos / name).write_bytes(data)
    create_pool(local_env, "decode", os.path.join(ROOT, "tests", "media_handlers.py") + ":Decode",
                "--workers", "1")
    out = cli(local_env, "submit", "--pool", "decode", "photos/", cwd=photos.parent)
    assert out.returncode == 1, out.stderr
    run_id = out.stdout.split()[1]
    show = both(local_env, "runs", "show", run_id, cwd=photos.parent).stdout
    assert "BytesIO object at" not in show, show
    assert ("         2 x UnidentifiedImageError: cannot identify image file <the item's bytes>  "
            "(items b/bad.jpg, c.jpg)") in show, show
    failed = cli(local_env, "runs", "results", run_id, "--failed", cwd=photos.parent)
    assert [(r["i"], r["error"]) for r in map(json.loads, failed.stdout.splitlines())] == [
        (1, "UnidentifiedImageError: cannot identify image file 'b/bad.jpg'"),
        (2, "UnidentifiedImageError: cannot identify image file 'c.jpg'")]
