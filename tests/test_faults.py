"""Faults that used to end in a traceback or in state that lies: each is one line naming what failed and the
next step, with the right exit code (2 bad input, 1 a failed run or store), and nothing lost or left behind.
Real processes, real SQLite, real signals and sockets; moto_server for SQS + S3."""
import json
import math
import os
import re
import resource
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import HANDLERS, PY, ROOT, backend_for, cli, wait_for, write_items
import calque_core
import calque_supervisor


def error_line(out, code):
    """The one line a failed command printed (after checking its exit code, and that nothing else was printed)."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def create_pool(env, model="m", *extra):
    # no local worker unless asked (pool create starts 1 by default)
    extra = extra if "--workers" in extra else (*extra, "--workers", "0")
    out = cli(env, "pool", "create", "--model", model, "--handler", f"{HANDLERS}:Echo", *extra)
    assert out.returncode == 0, out.stderr
    return out


def nothing_staged(env, queue="calque-pool-m"):
    """No run in the store and the pool queue as it was: empty."""
    assert json.loads(cli(env, "runs", "list", "--json").stdout) == []
    assert backend_for(env).queues.open_queue(queue).counts() == {"visible": 0, "in_flight": 0}


def live_worker(env, model="m", other_than=None):
    """Wait until the pool's local worker (not `other_than`) is alive and has reported itself running; its pid.
    Read from the supervisor's status file and the store directly: a CLI call per poll would cost 0.5 s."""
    import calque
    backend = backend_for(env)
    status_file = os.path.join(env["CALQUE_STATE"], "pools", calque_core.slug(model), "supervisor.json")

    def running():
        try:
            with open(status_file) as f:
                pids = [w["pid"] for w in json.load(f)["workers"] if w["pid"] not in (None, other_than)]
        except (OSError, ValueError):
            return None
        reported = {w["pid"] for w in calque_core.read_worker_stats(backend, model) if w["state"] == "running"}
        return next((pid for pid in pids if pid in reported and calque_supervisor.pid_alive(pid)), None)
    return wait_for(running, 60, "a live worker reporting running")


def at_once(env, *commands):
    """Run `calque.py ARGS` for each ARGS at the same moment (real processes); [(exit code, stdout, stderr)]."""
    procs = [subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in commands]
    outs = [p.communicate(timeout=60) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def processes(state, word):
    """Pids of live processes with `word` in an argument of their command line and CALQUE_STATE=`state`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and any(word.encode() in arg for arg in cmdline) and f"CALQUE_STATE={state}".encode() in environ:
            found.append(int(pid))
    return found


def test_bad_input_is_one_line_and_stages_nothing(local_env, tmp_path):
    """Items that are not UTF-8, nested too deep (RecursionError at ~990 levels) or not numeric arrays, and a
    pool.env that is not UTF-8: exit 2, one line naming file and line, no run staged, the queue unchanged."""
    create_pool(local_env)
    cases = {
        "latin1.jsonl": (b'{"x": 1}\n{"x": "caf\xe9"}\n', "{p}:2: not UTF-8 text (byte 11 of the line) "
                                                          "---> HINT: save the file as UTF-8"),
        "deep.jsonl": (b'{"x": 1}\n' + b"[" * 990 + b"]" * 990 + b"\n", "{p}:2: nested deeper than 512 levels "
                       "---> HINT: flatten the item (calque nests it inside a manifest)"),
        "deeper.jsonl": (b"[" * 5000 + b"]" * 5000 + b"\n", "{p}:1: nested deeper than 512 levels "
                         "---> HINT: flatten the item (calque nests it inside a manifest)"),
        "empty.npy": (b"", "{p}: not a numeric .npy or .npz file (No data left in file) ---> HINT: save plain "
                      "numeric arrays with numpy.save or numpy.savez (object arrays would need pickle)"),
        "broken.npz": (b"PK\x03\x04broken", "{p}: not a numeric .npy or .npz file (File is not a zip file) "
                       "---> HINT: save plain numeric arrays with numpy.save or numpy.savez (object arrays would "
                       "need pickle)"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        out = cli(local_env, "submit", "--pool", "m", str(path), "--timeout", "5")
        assert error_line(out, 2) == "calque: error: " + message.format(p=path)
    env_file = tmp_path / "pool.env"
    env_file.write_bytes(b"CALQUE_GRACE=5\nCALQUE_BATCH_SIZE=\xff\n")
    out = cli(dict(local_env, CALQUE_ENV=str(env_file)), "pool", "list")
    assert error_line(out, 2) == (f"calque: error: {env_file}:2: not UTF-8 text (byte 19 of the line) "
                                  f"---> HINT: save the file as UTF-8")
    nothing_staged(local_env)


def test_full_store_is_one_line_and_stages_nothing(local_env, tmp_path):
    """A store that cannot take a write (a real EFBIG from RLIMIT_FSIZE, as a full disk gives ENOSPC): the
    queue failing to open, or the first object failing to land, is one line and exit 1, nothing left behind."""
    create_pool(local_env)
    store = local_env["CALQUE_STORE"]
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(3)])

    def submit_under_limit():
        return subprocess.run([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "m", items, "--timeout", "5",
                               "--wait-for-workers"],
                              env=local_env, cwd=ROOT, capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)))
    # nobody has the queue open: SQLite must create its 32 KiB shared-memory file, which the limit refuses
    assert error_line(submit_under_limit(), 1) == (f"calque: error: the local queue in {store} failed (disk I/O "
                                                   f"error) ---> HINT: check that the folder is writable and has "
                                                   f"free space, then retry")
    queue = backend_for(local_env).queues.open_queue("calque-pool-m")   # held open: the queue now opens
    assert queue.counts() == {"visible": 0, "in_flight": 0}
    line = error_line(submit_under_limit(), 1)
    assert re.fullmatch(rf"calque: error: store {re.escape(store)}: cannot write runs/m\.\d{{8}}-\d{{6}}-[0-9a-f]{{6}}"
                        rf"/run\.json \(File too large\) ---> HINT: check that the folder is writable and has free "
                        rf"space, then retry", line), line
    nothing_staged(local_env)
    assert os.listdir(os.path.join(store, "runs")) == []   # no partial file, nor the run's folder


def test_corrupt_records_are_named_and_a_corrupt_pool_deletes(local_env, tmp_path):
    """A corrupt summary, run.json or pool.json: every verb that reads it names its key in one line (exit 1),
    and `pool delete --force` deletes a pool whose record is corrupt by the model's names."""
    create_pool(local_env)
    store = local_env["CALQUE_STORE"]
    items = write_items(tmp_path / "i.jsonl", [{"x": 1}])
    run_id = cli(local_env, "submit", "--pool", "m", items, "--no-wait").stdout.strip()
    summary = os.path.join(store, "runs", run_id, "summaries", "c00000.json")
    os.makedirs(os.path.dirname(summary))
    with open(summary, "w") as f:
        f.write('{"claim": "c00000", "items": 1')    # cut short
    assert error_line(cli(local_env, "runs", "show", run_id), 1) == (
        f"calque: error: store record runs/{run_id}/summaries/c00000.json is corrupt (Expecting ',' delimiter: "
        f"line 1 column 31 (char 30)) ---> HINT: repair or delete file://{summary}")
    os.remove(summary)
    run_json = os.path.join(store, "runs", run_id, "run.json")
    with open(run_json, "rb") as f:
        kept = f.read()
    with open(run_json, "wb") as f:
        f.write(b"\x00" * 8)
    expected = (f"calque: error: store record runs/{run_id}/run.json is corrupt (Expecting value: line 1 column 1 "
                f"(char 0)) ---> HINT: repair or delete file://{run_json}")
    assert error_line(cli(local_env, "runs", "show", run_id), 1) == expected
    assert error_line(cli(local_env, "runs", "list"), 1) == expected
    with open(run_json, "wb") as f:
        f.write(kept)
    with open(os.path.join(store, "pools", "m", "pool.json"), "w") as f:
        f.write("[]")
    expected = ("calque: error: store record pools/m/pool.json is corrupt (a JSON list, not an object) ---> HINT: "
                "`python calque.py pool delete --model m --yes --force` deletes the pool by its names, then create "
                "it again")
    for verb in (("pool", "status", "--model", "m"), ("submit", "--pool", "m", items),
                 ("pool", "delete", "--model", "m", "--yes")):
        assert error_line(cli(local_env, *verb), 1) == expected
    assert backend_for(local_env).queues.open_queue("calque-pool-m").counts()["visible"] == 1   # nothing deleted
    out = cli(local_env, "pool", "delete", "--model", "m", "--yes", "--force")
    assert out.returncode == 0 and "deleted queue calque-pool-m" in out.stdout, out.stdout + out.stderr
    import calque
    for queue in ("calque-pool-m", "calque-dlq-m"):
        with pytest.raises(calque.NotFound):
            backend_for(local_env).queues.open_queue(queue)
    assert os.listdir(os.path.join(store, "pools")) == []
    assert json.loads(cli(local_env, "runs", "list", "--json").stdout)[0]["run_id"] == run_id   # runs are kept


def test_queue_file_deleted_under_a_running_worker(local_env, tmp_path):
    """queue.db deleted under a live worker: a submitter gets one line, the worker logs why and moves to the new
    file within seconds (no restart, model kept), and once the pool is re-created the same worker serves it."""
    create_pool(local_env, "m", "--workers", "1")
    pid = live_worker(local_env)
    store = local_env["CALQUE_STORE"]
    os.remove(os.path.join(store, "queue.db"))
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}, {"x": 2}])
    assert error_line(cli(local_env, "submit", "--pool", "m", items), 2) == (
        f"calque: error: queue calque-pool-m not found in {store}: recreate the pool (pool create is idempotent) "
        f"or delete it")
    log = tmp_path / "state" / "pools" / "m" / "worker-0.log"
    wait_for(lambda: f"local queue {store}/queue.db was deleted or replaced under this process" in log.read_text(),
             20, "the worker to notice the deleted queue file")
    create_pool(local_env)
    out = cli(local_env, "submit", "--pool", "m", items, "--json", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    assert [s["worker_id"].rsplit("-", 1)[1] for s in json.loads(out.stdout)["summaries"]] == [str(pid)]
    assert json.loads(cli(local_env, "pool", "status", "--model", "m", "--json").stdout)["supervisor"]["restarts"] == 0
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_a_process_stopped_holding_the_queue_index_locks_delays_a_claim_not_fails_it(local_env, monkeypatch,
                                                                                   capsys):
    """A process stopped (SIGSTOP, starved) while it holds the WAL index's read locks: SQLite gives up on a new read
    after ~10 s with SQLITE_PROTOCOL, before changing anything. The queue tries again and gets its message once the
    locks are let go (CI lost a submit to it once); a command whose tries all fail names the stopped process. Held
    here by a process fcntl-locking the -shm file's five read lock bytes, where SQLite's unix VFS keeps them."""
    import calque
    store = local_env["CALQUE_STORE"]
    for name in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_ENV"):
        monkeypatch.setenv(name, local_env[name])
    queue = calque_core.open_backend(store).queues.create_queue("q", 60)
    queue.send("claim")
    locker = subprocess.Popen([PY, "-c", f"""if True:
        import fcntl, os, time
        fd = os.open({store + "/queue.db-shm"!r}, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 123)
        print("held", flush=True)
        time.sleep(12)   # past SQLite's own ~10 s of tries
        print(time.time(), flush=True)"""], stdout=subprocess.PIPE, text=True)
    assert locker.stdout.readline() == "held\n"
    with monkeypatch.context() as patch:
        patch.setattr(calque_core, "QUEUE_PROTOCOL_TRIES", 1)
        assert calque.main(["pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Faulty", "--workers", "0"]) \
            == calque_core.EXIT_FAILED
    assert capsys.readouterr().err.endswith("failed (locking protocol) ---> HINT: a process using it is stopped "
                                            "(Ctrl-Z, SIGSTOP): resume or end it, then retry\n")
    message = queue.receive(0)
    assert message is not None and message.body == "claim"
    assert time.time() > float(locker.stdout.readline())   # it waited for the locks, and had no other way
    assert locker.wait() == 0


def test_one_supervisor_per_pool(local_env, tmp_path):
    """The same `pool create --workers 1` twice at once leaves one supervisor (both name it); a third started by
    hand exits at once; `pool delete` then leaves no supervisor and no worker."""
    state = local_env["CALQUE_STATE"]
    create = ("pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1")
    outs = at_once(local_env, create, create)
    assert [code for code, _, _ in outs] == [0, 0], outs
    named = {int(re.search(r"under supervisor pid (\d+)", out).group(1)) for _, out, _ in outs}
    assert len(named) == 1, outs
    wait_for(lambda: processes(state, "calque_supervisor.py") == list(named), 20, "exactly the one named supervisor")
    third = subprocess.run([PY, os.path.join(ROOT, "calque_supervisor.py"), "--model", "m"], env=local_env,
                           capture_output=True, text=True, timeout=30)
    assert third.returncode == 0 and re.fullmatch(r"supervisor \d+: pool m already has a supervisor on this "
                                                  r"machine: exit\n", third.stdout), third.stdout
    assert processes(state, "calque_supervisor.py") == list(named)
    live_worker(local_env)
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0
    wait_for(lambda: not processes(state, "calque_supervisor.py") and not processes(state, "warmd.py"), 20,
             "no supervisor and no worker")


@pytest.mark.parametrize("backend", ["local", "moto_server"])
def test_colliding_names_created_at_once(backend, request):
    """Foo/Bar and foo-bar (one slug) created at the same moment: exactly one wins, the other gets one line;
    the winner's re-create is idempotent."""
    env = request.getfixturevalue("local_env" if backend == "local" else "aws_env")
    models = ("Foo/Bar", "foo-bar")
    outs = dict(zip(models, at_once(env, *[("pool", "create", "--model", m, "--handler", f"{HANDLERS}:Echo",
                                             "--workers", "0")
                                            for m in models])))
    winners = [model for model, (code, _, _) in outs.items() if code == 0]
    assert len(winners) == 1, outs
    winner, loser = winners[0], (set(models) - set(winners)).pop()
    code, _, stderr = outs[loser]
    assert code == 2 and stderr.strip() == (
        f"calque: error: model {loser!r} shares its queue name calque-pool-foo-bar with the pool of {winner!r} ---> "
        f"HINT: use that exact name, or one that differs in more than case or punctuation"), stderr
    backend_ = backend_for(env)
    assert backend_.store.list("pools/") == ["pools/foo-bar"]
    import calque
    assert calque_core.read_json(backend_, "pools/foo-bar/pool.json")["model"] == winner
    assert calque_core.read_json(backend_, "pools/foo-bar/name.json") == {"model": winner}
    create_pool(env, winner)
    assert cli(env, "pool", "delete", "--model", winner, "--yes").returncode == 0


def test_status_counts_lost_workers(local_env, tmp_path):
    """A SIGKILLed worker (its stats still say running) and a silent worker elsewhere show as lost; only the
    live one counts as running."""
    create_pool(local_env, "m", "--workers", "1")
    killed = live_worker(local_env)
    os.kill(killed, signal.SIGKILL)
    live_worker(local_env, other_than=killed)
    backend = backend_for(local_env)
    old = time.time() - 600
    import calque
    calque_core.write_json(backend, "pools/m/workers/elsewhere-7.json", {
        "worker_id": "elsewhere-7", "model": "m", "host": "elsewhere", "pid": 7, "state": "running",
        "started_at": calque_core.now_iso(old - 60), "updated_at": calque_core.now_iso(old), "alive_seconds": 60.0,
        "busy_seconds": 0.0, "claims": 0, "warm_hits": 0, "enter_count": 1, "enter_seconds": 0.1, "items": 0})
    out = cli(local_env, "pool", "status", "--model", "m")
    assert "  workers with stats: 3 (1 running, 2 lost)\n" in out.stdout, out.stdout
    status = json.loads(cli(local_env, "pool", "status", "--model", "m", "--json").stdout)
    lost = sorted(w["lost"] for w in status["workers"] if w["state"] == "lost")
    assert lost[0].startswith("no stats for 6") and lost[1] == f"pid {killed} is gone", lost
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


class DroppingProxy:
    """A loopback TCP proxy to `target`; while dropping, it resets every connection, open or new (as an
    endpoint blip does), and counts those it refused. `whole_answers`: how many answers pass whole; each
    after has its headers passed and its connection reset before the body (a drop mid-answer)."""

    def __init__(self, target_port, whole_answers=math.inf):
        self.target, self.dropping, self.refused, self.open = target_port, False, 0, []
        self.whole_answers = whole_answers
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def drop(self, on):
        with self.lock:
            self.dropping = on
            if on:
                for conn in self.open:
                    self._reset(conn)
                self.open = []

    @staticmethod
    def _reset(conn):
        try:   # linger on, timeout 0: a reset, as a dropped connection gives; shutdown wakes its pump's recv
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        except OSError:
            pass   # its pump closed it already

    def _accept(self):
        while True:
            client, _ = self.server.accept()
            with self.lock:
                if self.dropping:
                    self.refused += 1
                    self._reset(client)
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.target))
                self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, a is upstream), daemon=True).start()

    def _pump(self, src, dst, answers):
        try:
            while data := src.recv(65536):
                if answers and b"HTTP/1.1 " in data[:9]:
                    self.whole_answers -= 1
                if self.whole_answers < 0:
                    dst.sendall(data.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
                    self._reset(dst)
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


@pytest.mark.parametrize("installed", [False, True], ids=["script", "installed"])
def test_an_answer_cut_short_is_a_dropped_connection_not_an_empty_answer(aws_env, tmp_path, installed):
    """A connection dropped mid-answer: botocore parses the body it got, none, as an empty answer, and
    `runs list` said "no runs in this store" of a store holding one. Now it is the dropped connection it is:
    retried (CALQUE_ENDPOINT_RETRY), then one line; the store's check at the start says so too."""
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}])
    assert cli(aws_env, "submit", "--model", "cut", items, "--handler", f"{HANDLERS}:Echo").returncode == 0
    port = int(aws_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    argv = [os.path.join(os.path.dirname(PY), "calque")] if installed else [PY, os.path.join(ROOT, "calque.py")]
    for whole, said in ((1, "AWS endpoint {url} unreachable for 1 s (ConnectionClosedError)"),
                        (0, "cannot reach the S3 endpoint (Connection was closed before we received a valid "
                            "response from endpoint URL: \"ListObjectsV2's answer, 0 of its")):
        proxy = DroppingProxy(port, whole_answers=whole)   # 1: the store's check passes, the listing is cut
        env = dict(aws_env, AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="1", CALQUE_ENDPOINT_RETRY="1")
        out = subprocess.run([*argv, "runs", "list"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out
        assert said.format(url=proxy.url) in out.stderr, out.stderr
    assert "cut" in cli(aws_env, "runs", "list").stdout   # as it was, whole


def test_endpoint_blip_while_submit_waits(aws_env, tmp_path):
    """SQS/S3 connections reset for a few seconds while `submit` waits (botocore's own retries off): it rides the
    blip out and reports the run complete; an endpoint that stays away past CALQUE_ENDPOINT_RETRY is one line."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = dict(aws_env, GATE_DIR=str(gate))
    out = cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Gate", "--workers", "1")
    assert out.returncode == 0, out.stderr
    proxy = DroppingProxy(int(aws_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    via_proxy = dict(env, AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="1")
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}])

    def submit(retry):
        return subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "m", items, "--json",
                                 "--timeout", "60"], env=dict(via_proxy, CALQUE_ENDPOINT_RETRY=retry), cwd=ROOT,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def mid_claim():   # the worker holds the claim: the submit is waiting on its summary
        return wait_for(lambda: list(gate.glob("started-*")), 60, "the worker to start the claim")[0]

    waiting = submit("60")
    started = mid_claim()
    proxy.drop(True)
    began = time.monotonic()
    (gate / "open").touch()    # the worker, not behind the proxy, finishes the run during the blip
    wait_for(lambda: proxy.refused >= 3 and time.monotonic() - began >= 2, 30, "a blip of 2 s that refused 3 calls")
    proxy.drop(False)
    stdout, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and "Traceback" not in stderr, stderr
    result = json.loads(stdout)
    assert result["complete"] and [s["ok"] for s in result["summaries"]] == [1]

    (gate / "open").unlink()
    started.unlink()
    given_up = submit("1")
    mid_claim()
    proxy.drop(True)           # and it stays away
    stdout, stderr = given_up.communicate(timeout=60)
    assert given_up.returncode == 1 and "Traceback" not in stderr, stderr
    assert re.fullmatch(rf"calque: error: AWS endpoint {re.escape(proxy.url)} unreachable for 1 s "
                        rf"\((ConnectionClosedError|EndpointConnectionError)\) ---> HINT: check the network and "
                        rf"AWS_ENDPOINT_URL, then retry \(a submitted run goes on: `runs show RUN` reads it\)",
                        stderr.strip().splitlines()[-1]), stderr   # a reset on connect or on a pooled connection
    (gate / "open").touch()
    assert cli(env, "pool", "delete", "--model", "m", "--yes", "--force").returncode == 0
