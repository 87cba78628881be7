"""calque dashboard and `runs report --html`: the JSON API's figures, escaping of every store string, the token
and loopback rules, read-only answers, the reads of a refresh, and a real headless Chromium over a live pool
while a run drains."""
import html
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

import calque
import calque_ec2 as ec2
import calque_dashboard as dashboard
import calque_core
import calque_cost
from bench_dashboard import finish_claims, synth_run
from cdp import Browser, chromium_path
from conftest import HANDLERS, PY, ROOT, cli, wait_for, write_items
from test_ec2 import HANDLER as EC2_HANDLER, MODEL as EC2_MODEL, aws, options as ec2_options  # noqa: F401
from test_ec2 import record as ec2_record

MODEL = "<script>alert(1)</script>"                       # a pool name that is HTML
ERROR = '<img src=x onerror=alert(2)><b>bold</b> & "q"'   # an item error that is HTML


@pytest.fixture
def serve_dashboard(local_env):
    """Start `calque dashboard --port 0 ARGS` on the fixture's store; its base URL (read from its first line)."""
    procs = []

    def start(*args, env=local_env):
        proc = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "dashboard", "--port", "0", *args], env=env,
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("calque dashboard on http://127.0.0.1:"), line + proc.stderr.read()
        return line.split()[3].split("?")[0].rstrip("/")

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def get(url, headers=None, method="GET"):
    """(status, headers, body) of one request."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}, method=method),
                                    timeout=60) as answer:
            return answer.status, answer.headers, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read().decode()


def html_pool(env, tmp_path, workers, items):
    """The pool MODEL (the Spin handler) with `workers` local workers, and the items file; returns its path."""
    done = cli(env, "pool", "create", "--model", MODEL, "--handler", f"{HANDLERS}:Spin", "--workers", str(workers))
    assert done.returncode == 0, done.stderr
    return write_items(tmp_path / "items.jsonl", items)


def test_api_figures_escaping_token_and_report(local_env, tmp_path, serve_dashboard):
    """The API's figures add up, store strings are escaped everywhere, the token and Host rules hold, only GET."""
    items = html_pool(local_env, tmp_path, 1, [dict({"x": i}, **({"error": ERROR} if i % 20 == 3 else {}))
                                               for i in range(60)])
    done = cli(local_env, "submit", "--pool", MODEL, items, "--claim-size", "10", "--json")
    run_id = json.loads(done.stdout)["run"]["run_id"]
    # a worker writes its stats once it runs out of claims, a moment after the run's last summary
    backend = calque_core.open_backend(local_env["CALQUE_STORE"])
    wait_for(lambda: sum(w.get("claims", 0) for w in calque_core.read_worker_stats(backend, MODEL)) == 6,
             what="the worker's stats to count its six claims")
    base = serve_dashboard()

    pools = json.loads(get(f"{base}/api/pools")[2])["pools"]
    assert [p["model"] for p in pools] == [MODEL] and pools[0]["warm_hit_rate"] == 1.0
    assert json.loads(get(f"{base}/api/runs")[2])["runs"][0]["run_id"] == run_id
    run = json.loads(get(f"{base}/api/runs/{run_id}")[2])
    assert run["items"] == {"ok": 57, "failed": 3, "pending": 0, "dead_lettered": 0, "cancelled": 0}
    assert run["complete"] and run["done_fraction"] == 1.0 and run["eta_seconds"] is None
    group = run["failures"]["groups"][0]
    assert ERROR in group["message"] and group["count"] == 3 and group["first_items"] == [3, 23, 43]
    [row] = run["timeline"]["rows"]
    assert row["enters"] == 1 and row["claims"] == 6   # the worker's one @enter, then its six claims
    assert 0 < run["cost"]["so_far_usd"] < run["cost"]["cold_usd"]
    pool = json.loads(get(f"{base}/api/pools/{urllib.parse.quote(MODEL, safe='')}")[2])
    assert pool["model"] == MODEL and pool["workers"][0]["state"] == "running" and pool["workers"][0]["warm"]

    pages = [get(base + path)[2] for path in ("/", f"/pools/{urllib.parse.quote(MODEL, safe='')}",
                                              f"/runs/{run_id}")]
    for page in pages:
        assert MODEL not in page and page.count("<script") == 1   # the page's own script, and no other
        assert html.escape(MODEL) in page
    assert ERROR not in pages[2] and html.escape(ERROR) in pages[2]

    status, headers, body = get(f"{base}/pools/{urllib.parse.quote('<b>nope</b>', safe='')}")
    assert status == 404 and headers["Content-Type"].startswith("text/plain") and "nope" in body
    assert get(f"{base}/runs/no-such-run")[0] == 404
    assert get(f"{base}/api/runs/{run_id}", method="POST")[0] == 405
    assert get(f"{base}/api/runs/{run_id}", method="DELETE")[0] == 405
    assert get(f"{base}/", {"Host": "rebound.example:8265"})[0] == 403   # DNS rebinding: another site's name

    refused = cli(local_env, "dashboard", "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2 and "---> HINT:" in refused.stderr and len(refused.stderr.splitlines()) == 1
    guarded = serve_dashboard("--token", "s3cret-token")
    assert get(f"{guarded}/api/pools")[0] == 401
    assert get(f"{guarded}/api/pools", {"Authorization": "Bearer wrong"})[0] == 401
    assert get(f"{guarded}/api/pools", {"Authorization": "Bearer s3cret-token"})[0] == 200
    status, headers, _ = get(f"{guarded}/?token=s3cret-token")
    assert status == 200 and "HttpOnly" in headers["Set-Cookie"]
    assert get(f"{guarded}/", {"Cookie": headers["Set-Cookie"].split(";")[0]})[0] == 200

    report = tmp_path / "report.html"
    done = cli(local_env, "runs", "report", run_id, "--html", str(report))
    assert done.returncode == 0, done.stderr
    text = report.read_text()
    assert run_id in text and "<svg" in text and "<script" not in text and "<img" not in text
    assert "http://" not in text and "https://" not in text and html.escape(ERROR) in text
    missing = cli(local_env, "runs", "report", "nope-run", "--html", str(report))
    assert missing.returncode == 2 and "runs list" in missing.stderr


def test_refresh_reads_only_new_summaries(tmp_path, monkeypatch):
    """A refresh of a live run GETs its record, the new summaries and the manifests of claims holding failed items
    newly shown, once; a complete run is not read again."""
    monkeypatch.setattr(dashboard, "POOL_TTL", 3600.0)   # the pool's status read once, however slow the test
    backend = calque_core.open_backend(str(tmp_path / "store"))
    board = dashboard.Dashboard({"CALQUE_STATE": str(tmp_path / "state")}, backend, calque_cost.pricing())
    run, t0, reads = synth_run(backend, 200), 1_700_000_000.0, []
    for start, stop in ((0, 50), (50, 80), (80, 80), (80, 200), (200, 200)):
        finish_claims(backend, run, start, stop, t0=t0)
        before = backend.requests["store_gets"]
        view = board.run_view(run["run_id"])
        reads.append(backend.requests["store_gets"] - before)
        assert view["items"]["ok"] + view["items"]["failed"] == stop * 10 and view["items"]["pending"] == (
            200 - stop) * 10
    pool_record = 1   # the pool's status, for its workers' @enter: a GET of its record (missing here)
    named = 1         # the manifest of a claim holding a failed item first shown (its name), read once
    assert reads == [1 + 50 + pool_record + named, 1 + 30 + named, 1, 1 + 120 + 2 * named, 0]


def test_worker_rows_join_slots_by_pid_and_show_a_slot_still_loading():
    """A worker's row takes its local slot (found by pid, on this host only) for warm, GPUs, restarts and last exit;
    an alive slot whose worker has written no stats yet is a row of its own, "loading"; a dead one is none."""
    import socket
    host = socket.gethostname()
    died = {"reason": "killed by SIGKILL", "at": 1.0}
    slots = [{"slot": 0, "pid": 11, "alive": True, "warm": True, "gpus": ["0"], "restarts": 1, "last_exit": None},
             {"slot": 1, "pid": 12, "alive": True, "warm": False, "gpus": ["1"], "restarts": 2, "last_exit": died},
             {"slot": 2, "pid": 13, "alive": False, "warm": False, "restarts": 0}]
    stats = [{"worker_id": "w-11", "pid": 11, "host": host, "state": "running", "enter_count": 1, "claims": 3,
              "warm_hits": 2, "items": 30, "updated_at": "b"},
             {"worker_id": "w-12", "pid": 12, "host": "elsewhere", "state": "running", "enter_count": 0, "claims": 1,
              "warm_hits": 0, "items": 5, "updated_at": "b"}]
    rows = dashboard.pool_workers({"local_workers": slots, "workers": stats},
                                  {"w-11": {"gpu_utilisation": {"value": 0.5}}})
    assert [(r["worker_id"], r["state"], r["warm"], r["gpus"], r["restarts"]) for r in rows] == [
        ("w-11", "running", True, ["0"], 1),
        ("w-12", "running", False, None, None),          # the same pid on another host: not slot 1's
        ("slot 1 (pid 12)", "loading", False, ["1"], 2)]
    assert rows[0]["gpu_utilisation"] == 0.5 and rows[2]["last_exit"] == died
    assert (rows[2]["claims"], rows[2]["items"], rows[2]["gpu_utilisation"]) == (0, 0, None)


def test_browser_sees_a_run_drain(local_env, tmp_path, serve_dashboard):
    """Chromium on the run page while it drains: progress advances without a reload, a timeline row per worker
    with its one @enter, the HTML error listed as text, no console error, no dialog; screenshots saved."""
    binary, why = chromium_path()
    if binary is None:
        pytest.skip(f"no headless Chromium: {why}")
    gate = tmp_path / "gate"   # one claim waits for it: the run is still draining when the page first loads
    gate.mkdir()
    local_env["GATE_DIR"] = str(gate)
    items = html_pool(local_env, tmp_path, 2, [dict({"x": i, "spin": 3000}, **({"error": ERROR} if i % 40 == 7
                                                                              else {}), hold=i == 100)
                                               for i in range(160)])
    done = cli(local_env, "submit", "--pool", MODEL, items, "--claim-size", "8", "--no-wait")
    run_id = done.stdout.strip()
    base, shots = serve_dashboard(), tmp_path / "screenshots"
    shots.mkdir()
    browser = Browser(binary)
    try:
        browser.open(f"{base}/runs/{run_id}")
        browser.value("window.stayed = true")   # gone if the page reloads
        first = float(browser.value("document.getElementById('progress').dataset.done"))
        assert first < 1
        browser.wait("Number(document.getElementById('progress').dataset.done) >= 0.9 && "
                     "Number(document.getElementById('main').dataset.updates) > 0")
        browser.screenshot(shots / "run-draining.png")
        (gate / "open").touch()
        browser.wait("document.getElementById('progress').dataset.done === '1.000000'")
        browser.screenshot(shots / "run.png")
        assert browser.value("window.stayed") is True
        rows = browser.value("[...document.querySelectorAll('#timeline g.worker')].map(g => [g.dataset.enters, "
                             "Number(g.dataset.claims)])")
        assert len(rows) == 2 and all(enters == "1" and claims >= 1 for enters, claims in rows), rows
        failures = browser.value("document.getElementById('failures').textContent")
        assert ERROR in failures and browser.value("document.querySelectorAll('#failures img, #failures b')"
                                                   ".length") == 0
        browser.open(base + "/")
        assert browser.value("[...document.querySelectorAll('h1')].map(h => h.textContent)") == [
            "pools", f"pool {MODEL}"]
        assert browser.value("document.scripts.length") == 1
        browser.screenshot(shots / "home.png")
        assert browser.problems == []
    finally:
        (gate / "open").touch()
        browser.close()
    if os.environ.get("CALQUE_SCREENSHOTS"):   # where to keep them (docs/dashboard.png is one)
        shutil.copytree(shots, os.environ["CALQUE_SCREENSHOTS"], dirs_exist_ok=True)


def test_browser_draws_failed_and_cancelled_runs_as_they_are(local_env, tmp_path, serve_dashboard):
    """A run whose 50 items all failed and a cancelled run, in Chromium: the runs list says `failed`
    and `cancelled` (not done), each run's bar is red or grey by its items' outcomes (not a full bar
    of progress), /api/runs carries state and counts, and the failed run's page says `failed`."""
    binary, why = chromium_path()
    if binary is None:
        pytest.skip(f"no headless Chromium: {why}")
    for model, workers in (("m", "1"), ("idle", "0")):
        out = cli(local_env, "pool", "create", "--model", model, "--handler", f"{HANDLERS}:Echo",
                  "--workers", workers)
        assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [{"x": i, "fail": 1} for i in range(50)])
    failed = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "20").stdout.split()[1]
    cancelled = cli(local_env, "submit", "--pool", "idle", items, "--no-wait").stdout.strip()
    assert cli(local_env, "runs", "cancel", cancelled).returncode == 0
    base, shots = serve_dashboard(), tmp_path / "screenshots"
    shots.mkdir()
    api = {r["run_id"]: r for r in json.loads(get(f"{base}/api/runs")[2])["runs"]}
    assert [(api[r]["state"], api[r]["ok"], api[r]["failed"]) for r in (failed, cancelled)] == [
        ("failed", 0, 50), ("cancelled", 0, 0)]
    browser = Browser(binary)
    try:
        browser.open(f"{base}/runs")
        rows = browser.value(   # {run: [state, [[colour, width] of each span of its bar]]}
            "Object.fromEntries([...document.querySelectorAll('tr')].slice(1).map(tr => ["
            "tr.cells[0].textContent, [tr.cells[7].textContent, [...tr.cells[4]"
            ".querySelectorAll('span')].map(s => [getComputedStyle(s).backgroundColor, "
            "s.style.width])]]))")
        assert rows == {failed: ["failed", [["rgb(220, 38, 38)", "100%"]]],
                        cancelled: ["cancelled", [["rgb(168, 162, 158)", "100%"]]]}, rows
        browser.screenshot(shots / "runs-failed.png")
        browser.open(f"{base}/runs/{failed}")
        assert browser.value("document.querySelector('h1 [data-state]').textContent") == "failed"
        browser.screenshot(shots / "run-failed.png")
        assert browser.problems == []
    finally:
        browser.close()
    if os.environ.get("CALQUE_SCREENSHOTS"):
        shutil.copytree(shots, os.environ["CALQUE_SCREENSHOTS"], dirs_exist_ok=True)


def test_ec2_pool_and_a_run_on_s3(aws, tmp_path):
    """An EC2 pool on an s3:// store (mocked AWS, in process): its page reads the fleet through pool_status and
    the pools table marks it EC2; a run's summaries are read from S3 (16 GETs at a time) and add up, and a
    run page says where an EC2 worker's log is."""
    backend = aws.backend
    ec2.pool_create(backend, ec2_record(backend), EC2_HANDLER, ec2_options(), yes_spend_money=True)
    board = dashboard.Dashboard({"CALQUE_STATE": str(tmp_path / "state")}, backend, calque_cost.pricing())
    view = board.pool_view(EC2_MODEL)
    assert view["ec2"] and view["queue"] == {"visible": 0, "in_flight": 0} and view["workers"] == []
    kind, page = dashboard.route(board, f"/pools/{urllib.parse.quote(EC2_MODEL, safe='')}", {})
    assert kind.startswith("text/html") and html.escape(EC2_MODEL) in page
    assert "EC2</span>" in dashboard.route(board, "/pools", {})[1]
    run = synth_run(backend, 40, model=EC2_MODEL)
    finish_claims(backend, run, 0, 25)
    view = board.run_view(run["run_id"])
    assert view["items"]["ok"] + view["items"]["failed"] == 250 and view["items"]["pending"] == 150
    assert len(view["timeline"]["rows"]) == 8 and "journalctl" in view["logs"][""][0]
    finish_claims(backend, run, 25, 40)
    assert board.run_view(run["run_id"])["complete"]
