"""Claims sized to the work: the sizing rule (ClaimSizes, claim_sizing), progress within claims, whole-claim
handlers (failure isolation, the watchdog, a death mid-call), and the supervisor releasing a dead worker's claims.
Real warmd.py processes under the real pool supervisor on the embedded backend."""
import json
import os
import signal
import time

import pytest

import calque
import warmd
import calque_core
import calque_runs
import calque_sources
import calque_fleet
from conftest import HANDLERS, backend_for, cli, pool_pids, start_worker, wait_for, write_items
from test_chaos import delete_pool, finished, logs, results, start_pool, submit
from test_dashboard import get, serve_dashboard  # noqa: F401 (a fixture)


def sizes_of(total, workers, lo=10, hi=1000):
    return calque_runs.ClaimSizes(workers=workers, lo=lo, hi=hi).plan(total)


@pytest.mark.parametrize("total,workers", [(300, 2), (1200, 2), (6000, 2), (6000, 8), (1_000_000, 4), (7, 3)])
def test_claims_shrink_to_the_end_in_stages_of_a_claim_a_worker(total, workers):
    """Factoring: each stage is `workers` claims of ceil(rest / 2 workers), within [lo, hi]; the sizes add up to
    the run and never grow; the last stage splits the rest evenly, in claims of lo/2 at least, none left alone."""
    sizes = sizes_of(total, workers)
    assert sum(sizes) == total and sizes == sorted(sizes, reverse=True)
    assert sizes[0] == min(1000, total, max(10, -(-total // (2 * workers))))
    for start in range(0, len(sizes) - workers, workers):   # one size a stage, until the rest runs out
        assert len(set(sizes[start:start + workers])) == 1
    last = sizes[-(len(sizes) % workers or workers):]
    assert max(last) - min(last) <= 1 and min(last) >= min(5, total) and max(sizes) <= 1000
    assert all(size >= 10 for size in sizes[:-len(last)])


@pytest.mark.parametrize("total", [300, 1200, 6000, 100, 7])
def test_claims_hold_whole_batches(total):
    """In batches of 32, every claim but the run's last holds whole batches: the run pays no more handler calls
    than its items need (ceil(total / 32)), where claims of 75 paid three calls for 75 items; a claim of no more
    than hi holds fewer than a batch, and then the items count alone."""
    sizes = calque_runs.ClaimSizes(workers=2, lo=10, hi=1000, unit=32).plan(total)
    assert sum(sizes) == total and all(size % 32 == 0 for size in sizes[:-1]) and max(sizes) <= 992
    assert sum(-(-size // 32) for size in sizes) == -(-total // 32)
    assert calque_runs.ClaimSizes(workers=2, lo=1, hi=20, unit=32).plan(total) == sizes_of(total, 2, lo=1, hi=20)


def test_the_issue_runs_keep_two_workers_busy():
    """The runs of issue 35 on a 2-worker pool in batches of 32: 300 prompts were one claim, 1,200 were 1000 + 200;
    now the first claims split the run evenly, and each worker makes as many generate calls as a loop over half."""
    def shown(total):
        sizes = calque_runs.ClaimSizes(workers=2, lo=10, hi=1000, unit=32).plan(total)
        return calque_core.format_sizes(calque_core.claim_sizes({"claims": sizes, "claim_counts": sizes}))
    assert shown(300) == "2x96, 3x32, 1x12"                       # 5 batches a worker, as in each half's loop
    assert shown(1200) == "2x320, 2x160, 2x64, 3x32, 1x16"        # 19 a worker


def test_a_stream_read_ahead_is_cut_as_the_counted_run():
    """A stream (a JSONL file, a listing) is read 2 x workers x hi items ahead: it is cut exactly as the same
    items counted first, and no more than that is held."""
    sizes = calque_runs.ClaimSizes(workers=2, lo=3, hi=20)
    stream = calque_sources.Lookahead(iter(range(500)), sizes.ahead())
    cut = [stop - start for start, stop, _, _ in calque_sources.Items(stream).claims(sizes)]
    assert cut == calque_runs.ClaimSizes(workers=2, lo=3, hi=20).plan(500)
    assert sizes.ahead() == 80 and len(stream.held) == 0


@pytest.mark.parametrize("total", [64, 300, 10_000])
def test_every_kind_of_input_is_cut_as_the_plan(tmp_path, total):
    """A list, a stream, an array file, a table in memory and a Parquet file (copied, and by reference) are cut in the
    plan's sizes, whether the run's last claim ends a stage (64: 32 + 32) or not; the cut of a table asked a size once
    more after its last claim, and a size of 0 there failed the run in pyarrow."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    def sizes():
        return calque_runs.ClaimSizes(workers=2, lo=10, hi=1000, unit=32)

    table = pa.table({"x": list(range(total))})
    pq.write_table(table, tmp_path / "items.parquet")
    np.save(tmp_path / "items.npy", np.arange(total, dtype=np.float32))
    parquet = calque_sources.TableItems.open(str(tmp_path / "items.parquet"))
    inputs = {"list": calque_sources.Items([{"x": i} for i in range(total)]),
              "stream": calque_sources.Items({"x": i} for i in range(total)),
              "array": calque.as_items(str(tmp_path / "items.npy")), "table": calque_sources.TableItems.open(table),
              "parquet": parquet}
    for name, items in inputs.items():
        cut = [stop - start for start, stop, _, _ in items.claims(sizes())]
        assert cut == sizes().plan(total), name
    parquet.by_reference = True
    assert [stop - start for start, stop, _, _ in parquet.claims(sizes())] == sizes().plan(total)


def measured_pool(tmp_path, per_item, fixed, sizes, gap=0.0):
    """A local store holding pool `m`'s worker stats after claims of `sizes`, each fixed + n x per_item s, and as
    many gaps of `gap` s between them (warmd keeps these sums: claim_fit, claim_gaps)."""
    backend = calque_core.open_backend(str(tmp_path / "store"))
    fit = [len(sizes), sum(sizes), sum(fixed + n * per_item for n in sizes), sum(n * n for n in sizes),
           sum(n * (fixed + n * per_item) for n in sizes)]
    calque_core.write_json(backend, calque_core.worker_stats_prefix("m") + "w-1.json",
                      {"worker_id": "w-1", "claim_fit": fit, "claim_gaps": [len(sizes) - 1, gap * (len(sizes) - 1)]})
    return backend


def test_measured_claims_bound_the_sizes(tmp_path, monkeypatch):
    """Once the pool has claims, per item and per claim seconds are fitted from them: the ceiling is what
    CALQUE_CLAIM_SECONDS allows, the floor keeps the fixed cost and the gap at 10% of a claim; --claim-size and a set
    CALQUE_CLAIM_SIZE win over both."""
    backend = measured_pool(tmp_path, per_item=0.02, fixed=0.08, sizes=[10, 40, 80, 160], gap=0.02)
    record = {"model": "m"}
    monkeypatch.setattr(calque_fleet, "pool_ceiling", lambda *_: (1, 2, "workers", 2))
    conf = dict(calque_core.DEFAULTS, CALQUE_CLAIM_SECONDS="2")
    sizes = calque_fleet.claim_sizing(conf, backend, record, None)
    assert (sizes.workers, sizes.lo, sizes.hi) == (2, 50, 100)      # (0.08 + 0.02) s / 10% / 0.02 s; 2 s / 0.02 s
    assert "20 ms an item and 100 ms a claim measured" in sizes.why
    assert calque_fleet.claim_sizing(conf, backend, record, 7).plan(20) == [7, 7, 6]
    assert calque_fleet.claim_sizing(dict(conf, CALQUE_CLAIM_SIZE="9"), backend, record, None).plan(20) == [9, 9, 2]
    fresh = calque_core.open_backend(str(tmp_path / "fresh"))
    assert calque_fleet.claim_sizing(conf, fresh, record, None).lo == calque_core.CLAIM_SIZE_FLOOR   # unmeasured


def test_a_pool_run_without_options_uses_both_workers_and_runs_show_says_why(local_env, tmp_path):
    """300 items on a 2-worker pool, no options: claims of three batches of 32 down to one, both workers serve
    some, results in item order; `runs show` prints the sizes and the reason; --claim-size and CALQUE_CLAIM_SIZE still win."""
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Faulty", "--workers", "2")
    assert out.returncode == 0, out.stderr
    # a few ms of real work an item: a claim lasts long enough for the other worker to take the next one
    items = write_items(tmp_path / "items.jsonl", [{"x": i, "spin": 4000} for i in range(300)])
    out = cli(local_env, "submit", "--pool", "m", items, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    run_id, summaries = report["run"]["run_id"], report["summaries"]
    assert [s["items"] for s in summaries] == [96, 96, 32, 32, 32, 12]
    assert len({s["worker_id"] for s in summaries}) == 2
    lines = [json.loads(line) for line in cli(local_env, "runs", "results", run_id).stdout.splitlines()]
    assert [line["result"]["y"] for line in lines] == [2 * i for i in range(300)]
    shown = cli(local_env, "runs", "show", run_id).stdout
    assert ("claim sizes: 2x96, 3x32, 1x12 (sized to the run: 2 worker(s), claims of 10 to 992 items in whole "
            "batches of 32 (the pool has no measured claim yet)") in shown
    out = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "100", "--json")
    assert [s["items"] for s in json.loads(out.stdout)["summaries"]] == [100] * 3
    assert "claim sizes: 3x100 (--claim-size)" in cli(local_env, "runs", "show", "latest").stdout
    out = cli(dict(local_env, CALQUE_CLAIM_SIZE="120"), "submit", "--pool", "m", items, "--json")
    assert [s["items"] for s in json.loads(out.stdout)["summaries"]] == [120, 120, 60]
    out = cli(local_env, "submit", "--pool", "m", items, "--json")   # now measured: a reason with figures
    assert "ms an item" in json.loads(out.stdout)["run"]["sizing"]
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_a_parquet_run_without_options_is_cut_as_the_same_rows_in_jsonl(local_env, tmp_path):
    """The same 300 rows as a Parquet file on a fresh 2-worker pool: the same claims, every row ok (its last claim
    ends a stage, where the table's cut used to fail in pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"x": list(range(300))}), tmp_path / "items.parquet")
    out = cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "2")
    assert out.returncode == 0, out.stderr
    out = cli(local_env, "submit", "--pool", "m", str(tmp_path / "items.parquet"), "--json")
    assert out.returncode == 0, out.stderr
    summaries = json.loads(out.stdout)["summaries"]
    assert [s["items"] for s in summaries] == [96, 96, 32, 32, 32, 12] and sum(s["ok"] for s in summaries) == 300
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_a_long_claim_reports_the_items_it_has_done(local_env, tmp_path, serve_dashboard):  # noqa: F811
    """A claim running past PROGRESS_SECONDS writes its items done after each batch: `runs show` and the
    dashboard count them before the claim's summary exists."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Steps", "--workers", "1",
              "--batch-size", "2")
    assert out.returncode == 0, out.stderr
    items = [{"x": i} for i in range(6)]
    items[0]["step"], items[2]["step"] = "a", "b"
    out = cli(env, "submit", "--pool", "m", write_items(tmp_path / "items.jsonl", items), "--claim-size", "6",
              "--no-wait")
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    wait_for((gate / "at-a").exists, 30, "the first batch")
    time.sleep(warmd.PROGRESS_SECONDS)         # the claim is now long: its next batch reports
    (gate / "a").touch()
    wait_for((gate / "at-b").exists, 30, "the second batch")
    backend = backend_for(env)
    wait_for(lambda: calque_core.claims_progress(backend, run_id, ["c00000"]) == {"c00000": 2}, 30, "the report")
    assert "0 items ok, 0 failed, 6 pending (2 of them done in running claims)" in cli(
        env, "runs", "show", run_id).stdout
    base = serve_dashboard(env=env)
    view = json.loads(get(f"{base}/api/runs/{run_id}")[2])
    assert view["items_running_done"] == 2 and view["done_fraction"] == pytest.approx(2 / 6)
    (gate / "b").touch()
    finished(backend, {run_id: 1}, 30)
    assert "6 items ok" in cli(env, "runs", "show", run_id).stdout
    assert cli(env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def whole_claim_pool(local_env, tmp_path, **env):
    sizes_file = tmp_path / "sizes"
    env = dict(local_env, SIZES_FILE=str(sizes_file), **env)
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:WholeClaim", "--visibility-timeout",
              "2", "--workers", "1", "--batch-size", "4")
    assert out.returncode == 0, out.stderr
    return env, backend_for(env), lambda: [int(n) for n in sizes_file.read_text().split()]


def test_a_whole_claim_handler_gets_the_claim_in_one_call_and_a_failing_item_fails_alone(local_env, tmp_path):
    """@calque.batch(whole_claim=True): a claim of 10 on a pool of batch size 4 is one call of 10; a call that
    raises is retried item by item, so only the failing item fails."""
    env, backend, calls = whole_claim_pool(local_env, tmp_path)
    run_id = submit(backend, [{"x": i} for i in range(10)], claim_size=10)
    assert finished(backend, {run_id: 1}, 60)[run_id][0]["ok"] == 10 and calls() == [10]
    items = [{"x": i} for i in range(10)]
    items[3]["fail"] = True
    failing = submit(backend, items, claim_size=10)
    summary = finished(backend, {failing: 1}, 60)[failing][0]
    assert summary["failed"] == [3] and summary["ok"] == 9 and calls() == [10, 10] + [1] * 10
    assert [line["ok"] for line in results(backend, failing, [summary])] == [True] * 3 + [False] + [True] * 6
    delete_pool(env)


def test_the_watchdog_times_out_one_long_whole_claim_call(local_env, tmp_path):
    """--batch-timeout applies to the one call: a hung item makes the worker commit, release and exit; the
    redelivery runs the claim's items alone, so the hung one alone is quarantined and the rest complete."""
    env, backend, calls = whole_claim_pool(local_env, tmp_path, CALQUE_BATCH_TIMEOUT="1")
    items = [{"x": i} for i in range(8)]
    items[5]["hang"] = True
    hung = submit(backend, items, claim_size=8)
    summary = finished(backend, {hung: 1}, 90)[hung][0]
    assert summary["failed"] == [5] and summary["ok"] == 7
    assert summary["errors"]["5"].startswith("timed out after 1 s (the pool's batch_timeout)")
    assert calls()[0] == 8 and set(calls()[1:]) == {1}
    assert [line["result"] for line in results(backend, hung, [summary]) if line["ok"]] == [
        {"y": 2 * i} for i in range(8) if i != 5]
    delete_pool(env)


def test_a_death_inside_a_whole_claim_call_quarantines_only_its_item(local_env, tmp_path):
    """A worker killed inside the one call: the redelivery runs the items alone (the claim was one batch), the
    item that kills its worker is quarantined as poison, every other item's result is written once, in order."""
    env, backend, calls = whole_claim_pool(local_env, tmp_path)
    items = [{"x": i} for i in range(6)]
    items[2]["die"] = "kill"
    run_id = submit(backend, items, claim_size=6)
    summary = finished(backend, {run_id: 1}, 90)[run_id][0]
    assert summary["failed"] == [2] and summary["ok"] == 5 and "poison" in summary["errors"]["2"]
    assert calls()[0] == 6 and set(calls()[1:]) == {1}
    assert [line["ok"] for line in results(backend, run_id, [summary])] == [True, True, False, True, True, True]
    delete_pool(env)


def gated_claim(local_env, tmp_path, workers):
    """A pool of `workers` (visibility timeout 300 s) and a run of one claim whose items hold until gate/open
    exists: (env, gate, backend, run id)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(local_env, GATE_DIR=str(gate))
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Faulty", "--visibility-timeout",
              "300", "--workers", str(workers))
    assert out.returncode == 0, out.stderr
    backend = backend_for(env)
    return env, gate, backend, submit(backend, [{"x": i, "hold": True} for i in range(4)], claim_size=4)


def test_the_supervisor_releases_the_claim_its_dead_worker_held(local_env, tmp_path):
    """A worker killed -9 mid-claim, on a pool whose visibility timeout is 300 s: its receipts file names the
    claim, the supervisor makes it visible again at once, and its second delivery starts long before the
    timeout would have let it (the ordering of two timestamps, not a wall-clock limit on the test)."""
    env, gate, backend, run_id = gated_claim(local_env, tmp_path, 1)
    wait_for(lambda: list(gate.glob("started-*")), 30, "the claim to start")
    receipts = os.path.join(env["CALQUE_STATE"], "pools", "m", "worker-0.claims")
    assert len(json.load(open(receipts))) == 1
    os.kill(pool_pids(env)[1][0], signal.SIGKILL)
    killed_at = time.time()
    (gate / "open").touch()
    summary = finished(backend, {run_id: 1}, 120)[run_id][0]
    assert summary["receive_count"] == 2 and summary["ok"] == 4
    started = calque_core._parse_time(summary["started_at"], "started_at").timestamp()
    assert killed_at < started < killed_at + 300
    assert "died holding a claim: visible again now" in logs(env, "supervisor")
    assert cli(env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_the_next_worker_to_start_releases_the_claim_a_dead_unsupervised_worker_held(local_env, tmp_path):
    """No supervisor (workers started by hand, or by systemd as on an EC2 instance), visibility timeout 300 s: a
    worker that starts while the claim's holder lives leaves its claim alone (the holder's receipts file is locked);
    the holder killed -9, the next worker to start makes the claim visible at once, and it runs again long before
    the timeout would have let it (the ordering of two timestamps, not a wall-clock limit on the test)."""
    env, gate, backend, run_id = gated_claim(local_env, tmp_path, 0)
    holder = start_worker(env, "--model", "m")
    wait_for(lambda: list(gate.glob("started-*")), 30, "the claim to start")
    receipts = os.path.join(env["CALQUE_STATE"], "pools", "m", f"worker-pid{holder.pid}.claims")
    held = json.load(open(receipts))
    assert len(held) == 1

    def started(name):
        log = open(tmp_path / f"{name}.log", "w")
        worker = start_worker(env, "--model", "m", log=log)
        wait_for(lambda: "@enter done" in (tmp_path / f"{name}.log").read_text(), 30, f"the {name} worker's start")
        return worker, (tmp_path / f"{name}.log").read_text()

    alongside, said = started("alongside")
    assert "visible again now" not in said and json.load(open(receipts)) == held
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    killed_at = time.time()
    successor, said = started("successor")
    assert f"a claim held by a dead worker (worker-pid{holder.pid}.claims) is visible again now" in said
    assert not os.path.exists(receipts)
    (gate / "open").touch()
    summary = finished(backend, {run_id: 1}, 120)[run_id][0]
    assert summary["receive_count"] == 2 and summary["ok"] == 4
    assert killed_at < calque_core._parse_time(summary["started_at"], "started_at").timestamp() < killed_at + 300
    for worker in (alongside, successor):
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    assert cli(env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_submits_bar_counts_the_items_a_running_claim_reported(tmp_path, capsys):
    """wait_for_run's bar (submit's) adds a running claim's reported items to the finished claims' once no summary
    has landed for a second: a claim's progress record, as warmd writes it, moves the bar before its summary."""
    backend = calque_core.open_backend(str(tmp_path / "store"))
    queue = backend.queues.create_queue("calque-pool-m", 60)
    run = calque_runs.stage_run(backend, {"model": "m"}, [{"x": i} for i in range(6)], 6, queue, "pool")
    backend.store.put(calque_core.progress_key(run["run_id"], "c00000"), json.dumps({"done": 2, "worker_id": "w-1"}))
    summaries, timed_out = calque_runs.wait_for_run(backend, run, timeout=1.5, progress=True)
    assert timed_out and summaries == [] and "2/6" in capsys.readouterr().err
