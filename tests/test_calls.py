"""Calls from inside a worker: a Modal app's function fanning out to another target of its app
(.map, .spawn, .remote, their .aio) on real warmd processes: under `calque modal run` from a
folder outside the checkout on both backends, on named pools (`pool create --call`), the one-line
refusals (a cycle, the caller's own pool, no pool), the calls cancelled with their calling claim,
and the EC2 worker role's grants for exactly the pools it calls."""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import PY, ROOT, backend_for, cli, pool_pids, start_worker, wait_for, write_items
from test_modal import CALQUE
import calque_core
import calque_ec2

FANOUT = '''
import asyncio
import json
import os
import re
import modal

app = modal.App("fanout")
GATE = {gate!r}
if modal.is_local():   # counted: once in `modal run`, as Modal's CLI imports it
    with open(__file__ + ".imports", "a") as f:
        f.write("1")


@app.cls(gpu="A10G")
class Embedder:
    @modal.enter()
    def load(self):
        self.weights = {{c: ord(c) for c in "abcdefghijklmnopqrstuvwxyz"}}

    @modal.method()
    def embed(self, text):
        while GATE and not os.path.exists(GATE):   # a test holds the call here until it opens
            pass
        return [sum(self.weights.get(c, 0) for c in text), len(text)]


@app.function()
def orchestrate(texts):
    """A CPU orchestrator, as in Modal's examples: .map, .spawn, .remote and .aio to the GPU class."""
    vectors = list(Embedder().embed.map(texts))
    spawned = [Embedder().embed.spawn(t) for t in texts[:2]]
    first = Embedder().embed.remote(texts[0])

    async def both():
        return await asyncio.gather(Embedder().embed.remote.aio("ab"),
                                    Embedder().embed.remote.aio("abc"))
    return {{"vectors": vectors, "spawned": [c.get() for c in spawned], "first": first,
            "aio": asyncio.run(both())}}


@app.function()
def ping(n):
    return pong.remote(n)


@app.function()
def pong(n):
    return ping.remote(n) if n else "pong"


@app.function()
def itself(n):
    return itself.remote(n)


@app.local_entrypoint()
def main(count: int = 4, which: str = "orchestrate"):
    if which != "orchestrate":
        print({{"ping": ping, "itself": itself}}[which].remote(1))
        return
    print(json.dumps(orchestrate.remote([f"w{{i}}" + "ab" * i for i in range(count)])))
'''


def embed(text):
    return [sum(ord(c) for c in text if c.isalpha() and c.islower()), len(text)]


def expected(count):
    texts = [f"w{i}" + "ab" * i for i in range(count)]
    return {"vectors": [embed(t) for t in texts], "spawned": [embed(t) for t in texts[:2]],
            "first": embed(texts[0]), "aio": [embed("ab"), embed("abc")]}


def write_fanout(tmp_path, gate=""):
    folder = tmp_path / "app"   # outside the checkout, as a user's
    folder.mkdir(exist_ok=True)
    (folder / "fanout.py").write_text(FANOUT.format(gate=gate))
    return folder


def test_fan_out_from_a_worker_under_modal_run(any_env, tmp_path):
    """`modal run` makes the orchestrator's pool warm and the class's from zero, each record
    naming the other; the orchestrator's calls run on the class's pool; all pools gone after."""
    folder = write_fanout(tmp_path)
    installed = any_env["CALQUE_STORE"].startswith("s3://")   # both spellings, one a backend
    out = modal_run_in(any_env, folder, installed, "fanout.py", "--count", "6", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected(6)
    assert "for Embedder.embed: 0 to 2 local worker(s), on its calls" in out.stderr
    assert "for orchestrate: 2 local worker(s)" in out.stderr
    assert (folder / "fanout.py.imports").read_text() == "1"   # not once a pool as well
    backend = backend_for(any_env)
    assert not backend.store.list("pools/")   # every pool deleted at close
    runs = [calque_core.read_json(backend, key + "/run.json") for key in backend.store.list("runs/")]
    called = [r for r in runs if   # .map, 2 .spawn, .remote, 2 .remote.aio
               r["model"].startswith("modal-fanout-Embedder-embed-")]
    assert len(called) == 6 and all(r["options"]["chain"] == ["orchestrate"] for r in called)


def modal_run_in(env, folder, installed, *args):
    """`calque modal run ARGS` (installed) or `python calque.py modal run ARGS`, in `folder`."""
    argv = [CALQUE] if installed else [PY, os.path.join(ROOT, "calque.py")]
    return subprocess.run([*argv, "modal", "run", *args], env=env, cwd=str(folder),
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("which, line", [
    ("ping", "pong calls ping, which waits on this call (ping -> pong -> ping): it could wait on "
             "itself ---> HINT: call the code as a plain function, or call ping from the local "
             "entrypoint"),
    ("itself", "itself calls itself, its own pool, whose workers could all be waiting")])
def test_a_call_that_could_wait_on_itself_fails_in_one_line(local_env, tmp_path, which, line):
    folder = write_fanout(tmp_path)
    out = modal_run_in(local_env, folder, which == "itself", "fanout.py", "--which", which)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("calque: error: entrypoint main: an item failed: RemoteError: "
                           "Unsupported: ") and line in last and "Traceback" not in out.stderr


def test_named_pools_and_their_calls(local_env, tmp_path):
    """pool create fills `calls` from the pools of the same app file, --call names or overrides
    one (a wrong one refused in one line); a pool with none fails the calling item in one line."""
    folder = write_fanout(tmp_path)
    handler = str(folder / "fanout.py")

    def create(model, target, *more):
        out = cli(local_env, "pool", "create", "--model", model, "--handler", f"{handler}:{target}",
                  "--workers", "1", *more, cwd=str(folder))
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "calls go to: none; no pool for ping, pong, itself, Embedder.embed (--call TARGET=POOL)" in (
        create("lonely", "orchestrate"))
    create("emb-a", "Embedder.embed")
    assert "its calls go to: Embedder.embed -> emb-a" in create("orch", "orchestrate")
    for bad, said in ((["--call", "Embedder.embed=nope"], "no pool for model 'nope'"),
                      (["--call", "Nope=emb-a"], "--call Nope=emb-a: "),
                      (["--call", "Embedder.embed=lonely"], "pool lonely serves fanout.py:"
                                                            "orchestrate, not Embedder.embed")):
        out = cli(local_env, "pool", "create", "--model", "orch-x", "--handler",
                  f"{handler}:orchestrate", "--workers", "0", *bad, cwd=str(folder))
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.splitlines()) == 1
    items = write_items(tmp_path / "items.jsonl", [["ab", "abc"]])
    run = cli(local_env, "submit", "--pool", "orch", items, "--json", cwd=str(folder))
    assert run.returncode == 0, run.stderr
    got = cli(local_env, "runs", "results", json.loads(run.stdout)["run"]["run_id"]).stdout
    assert json.loads(got)["result"]["vectors"] == [embed("ab"), embed("abc")]
    run = cli(local_env, "submit", "--pool", "lonely", items, "--json", cwd=str(folder))
    assert run.returncode == 1
    error = json.loads(cli(local_env, "runs", "results", json.loads(run.stdout)["run"]["run_id"]).stdout)
    assert error["error"].startswith("Unsupported: orchestrate calls Embedder.embed: no pool serves it "
                                     "for pool lonely ---> HINT: pool create --call Embedder.embed=POOL")


def test_cancelling_the_calling_run_cancels_its_calls(local_env, tmp_path):
    """The orchestrator's claim waits on its .map (one Embedder worker held at a gate); cancelling
    the orchestrator's run cancels the .map's run too: its claims not started never run."""
    gate = tmp_path / "gate"
    folder = write_fanout(tmp_path, str(gate))
    local_env = dict(local_env, CALQUE_CLAIM_SIZE="1")   # the .map's 6 calls: 6 claims
    handler = str(folder / "fanout.py")
    for model, target in (("slow-emb", "Embedder.embed"), ("orch", "orchestrate")):
        out = cli(local_env, "pool", "create", "--model", model, "--handler", f"{handler}:{target}",
                  "--workers", "1", cwd=str(folder))
        assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [[f"t{i}" for i in range(6)]])
    run = cli(local_env, "submit", "--pool", "orch", items, "--no-wait", cwd=str(folder))
    assert run.returncode == 0, run.stderr
    run_id = run.stdout.strip()
    backend = backend_for(local_env)

    def child():
        keys = [k for k in backend.store.list("runs/") if "/slow-emb." in "/" + k]
        return keys and calque_core.read_json(backend, keys[0] + "/run.json")
    call = wait_for(child, 60, "the orchestrator's .map run")
    assert cli(local_env, "runs", "cancel", run_id).returncode == 0
    cancelled_unrun(backend, call)   # marked before the gate opens: none is taken meanwhile
    gate.write_text("open")
    summaries = wait_for(lambda: len(calque_core.read_summaries(backend, call["run_id"])) == len(
        call["claims"]) and calque_core.read_summaries(backend, call["run_id"]), 60, "every claim ended")
    states = sorted(s["status"] for s in summaries)
    assert len(call["claims"]) == 6 and states.count("cancelled") >= 5   # all but the one held
    record = calque_core.read_json(backend, calque_core.run_key(call["run_id"]))
    assert record["cancelled"]["reason"].startswith(f"the calling claim {run_id}/c00000 ended: "
                                                    "its run was cancelled")


def test_worker_policy_grants_exactly_the_pools_it_calls():
    policy = calque_ec2.worker_policy("s3://bkt/root", "orch", "eu-west-1", "111122223333",
                                      calls=["emb-a", "Qwen/Emb"])
    q, obj = "arn:aws:sqs:eu-west-1:111122223333:", "arn:aws:s3:::bkt/root/"
    added = {s["Sid"]: s for s in policy["Statement"]}
    assert added["SendCalls"]["Resource"] == [q + "calque-pool-qwen-emb", q + "calque-pool-emb-a"]
    assert added["SendCalls"]["Action"] == ["sqs:GetQueueAttributes", "sqs:GetQueueUrl", "sqs:SendMessage"]
    assert added["FollowCallsDeadLetters"]["Resource"] == [q + "calque-dlq-qwen-emb", q + "calque-dlq-emb-a"]
    assert added["RunCalls"] == {"Sid": "RunCalls", "Effect": "Allow",
                                 "Action": ["s3:GetObject", "s3:PutObject"],
                                 "Resource": [obj + "runs/emb-a.*/*", obj + "runs/qwen-emb.*/*"]}
    assert added["ReadCalledPools"]["Resource"] == [
        obj + "runs/orch.*/run.json",   # its own runs' chain of calls
        obj + "pools/emb-a/pool.json", obj + "pools/emb-a/streams/*", obj + "pools/emb-a/workers/*",
        obj + "pools/qwen-emb/pool.json", obj + "pools/qwen-emb/streams/*",
        obj + "pools/qwen-emb/workers/*"]
    assert added["ListCalls"]["Condition"]["StringLike"]["s3:prefix"] == [
        "root/runs/emb-a.*", "root/pools/emb-a/streams/*", "root/pools/emb-a/workers/*",
        "root/runs/qwen-emb.*", "root/pools/qwen-emb/streams/*", "root/pools/qwen-emb/workers/*"]
    alone = calque_ec2.worker_policy("s3://bkt/root", "orch", "eu-west-1", "111122223333")
    assert not {"SendCalls", "RunCalls"} & {s["Sid"] for s in alone["Statement"]}


def test_the_calling_claim_stays_leased_while_its_calls_wait(local_env, tmp_path):
    """An orchestrator whose visibility timeout is 2 s waits on a call held 3 timeouts long: its
    heartbeat keeps the claim, which is delivered once and finishes ok."""
    gate = tmp_path / "gate"
    folder = write_fanout(tmp_path, str(gate))
    handler = str(folder / "fanout.py")
    for model, target, more in (("held-emb", "Embedder.embed", []),
                                ("orch", "orchestrate", ["--visibility-timeout", "2"])):
        out = cli(local_env, "pool", "create", "--model", model, "--handler", f"{handler}:{target}",
                  "--workers", "1", *more, cwd=str(folder))
        assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [["ab"]])
    run_id = cli(local_env, "submit", "--pool", "orch", items, "--no-wait", cwd=str(folder)).stdout.strip()
    backend = backend_for(local_env)
    wait_for(lambda: any("held-emb." in k for k in backend.store.list("runs/")), 60, "the call's run")
    time.sleep(6)   # three of the orchestrator's visibility timeouts pass while its call waits
    gate.write_text("open")
    summary = wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "its summary")[0]
    assert summary["status"] == "ok" and summary["receive_count"] == 1


def test_a_stopping_worker_gives_its_claim_back_and_cancels_its_calls(local_env, tmp_path):
    """`pool scale --workers 0` while the orchestrator's call waits: after its grace the claim is
    given back whole (not failed by the waiting item) and its call's run cancelled; a worker
    started again runs it anew, to the end."""
    gate = tmp_path / "gate"
    folder = write_fanout(tmp_path, str(gate))
    handler = str(folder / "fanout.py")
    local_env = dict(local_env, CALQUE_GRACE="1")
    for model, target in (("gated-emb", "Embedder.embed"), ("orch", "orchestrate")):
        out = cli(local_env, "pool", "create", "--model", model, "--handler", f"{handler}:{target}",
                  "--workers", "1", cwd=str(folder))
        assert out.returncode == 0, out.stderr
    items = write_items(tmp_path / "items.jsonl", [["ab"]])
    run_id = cli(local_env, "submit", "--pool", "orch", items, "--no-wait", cwd=str(folder)).stdout.strip()
    backend = backend_for(local_env)

    def calls():
        return [calque_core.read_json(backend, key + "/run.json")
                for key in backend.store.list("runs/") if "gated-emb." in key]
    first = wait_for(calls, 60, "the call's run")[0]
    out = cli(local_env, "pool", "scale", "--model", "orch", "--workers", "0")
    assert out.returncode == 0, out.stderr
    record = calque_core.read_json(backend, calque_core.run_key(first["run_id"]))
    assert record["cancelled"]["reason"] == (f"the calling claim {run_id}/c00000 ended: the worker "
                                             "let it go")
    assert not calque_core.read_summaries(backend, run_id)   # given back, not written
    gate.write_text("open")
    assert cli(local_env, "pool", "scale", "--model", "orch", "--workers", "1").returncode == 0
    summary = wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "its summary")[0]
    assert summary["status"] == "ok" and summary["receive_count"] == 2


def held_call(env, tmp_path, *orch_args, made=lambda: None):
    """Pools orch (1 worker, `orch_args`) and gated-emb (1 worker, held at a gate), `made()`, and a
    run of one orchestrator claim waiting on its .map (6 claims): (backend, gate, run id, the .map's
    run)."""
    gate = tmp_path / "gate"
    folder = write_fanout(tmp_path, str(gate))
    handler = str(folder / "fanout.py")
    for model, target, more in (("gated-emb", "Embedder.embed", ()), ("orch", "orchestrate", orch_args)):
        out = cli(env, "pool", "create", "--model", model, "--handler", f"{handler}:{target}",
                  "--workers", "1", *more, cwd=str(folder))
        assert out.returncode == 0, out.stderr
    made()
    items = write_items(tmp_path / "items.jsonl", [[f"t{i}" for i in range(6)]])
    run_id = cli(env, "submit", "--pool", "orch", items, "--no-wait", cwd=str(folder)).stdout.strip()
    backend = backend_for(env)
    first = wait_for(lambda: calque_core.list_runs(backend, "gated-emb"), 60, "the call's run")[0]
    assert first["options"]["caller"] == {"run": run_id, "claim": "c00000"}
    return backend, gate, run_id, first


def cancelled_unrun(backend, run):
    """The run's record once cancelled, its 6 claims but those its worker holds at the gate (two
    at most, one received ahead) marked cancelled."""
    def marked():
        states = [s["status"] for s in calque_core.read_summaries(backend, run["run_id"])]
        return len(run["claims"]) == 6 and states.count("cancelled") >= 4
    wait_for(marked, 60, "the call's claims cancelled")
    return calque_core.read_run(backend, run["run_id"])


def test_a_claim_delivered_again_cancels_the_calls_its_killed_worker_made(any_env, tmp_path):
    """The orchestrator's worker killed -9 while its .map waits: the supervisor's new worker takes
    the claim again and, before running it, cancels the .map run the dead one made (its claims
    not run); the claim's calls made anew, it ends ok."""
    env = dict(any_env, CALQUE_CLAIM_SIZE="1")   # the .map's 6 calls: 6 claims
    try:
        backend, gate, run_id, first = held_call(env, tmp_path)
        os.kill(pool_pids(env, "orch")[1][0], signal.SIGKILL)
        record = cancelled_unrun(backend, first)
        assert record["cancelled"]["reason"] == (f"the calling claim {run_id}/c00000 was "
                                                 "delivered again")
        gate.write_text("open")
        summary = wait_for(lambda: calque_core.read_summaries(backend, run_id), 120,
                           "its summary")[0]
        assert summary["status"] == "ok" and summary["receive_count"] == 2
        got = json.loads(cli(env, "runs", "results", run_id).stdout)["result"]
        assert got["vectors"] == [embed(f"t{i}") for i in range(6)]
        again = calque_core.list_runs(backend, "gated-emb")[1:]   # .map, 2 .spawn, .remote, 2 .aio
        assert len(again) == 6 and not any(run.get("cancelled") for run in again)
    finally:   # the session's moto_server is shared: no queue of ours left for the tests after
        for model in ("orch", "gated-emb"):
            out = cli(env, "pool", "delete", "--model", model, "--force", "--yes")
            assert out.returncode == 0, out.stderr


def test_a_claim_dead_lettered_on_its_next_delivery_cancels_the_calls_it_made(local_env, tmp_path):
    """Max deliveries 1: the claim whose worker was killed -9 is dead-lettered, not run, when it
    comes back; what its dead delivery called is cancelled all the same."""
    env = dict(local_env, CALQUE_CLAIM_SIZE="1")
    backend, gate, run_id, first = held_call(env, tmp_path, "--max-deliveries", "1")
    os.kill(pool_pids(env, "orch")[1][0], signal.SIGKILL)
    cancelled_unrun(backend, first)
    summary = wait_for(lambda: calque_core.read_summaries(backend, run_id), 60, "its summary")[0]
    assert summary["status"] == "failed" and "more than the pool's max deliveries 1" in summary[
        "error"], summary
    gate.write_text("open")


def test_a_run_cancelled_while_its_worker_is_dead_cancels_its_calls_on_redelivery(local_env,
                                                                                 tmp_path):
    """No supervisor: the orchestrator's worker killed -9, then `runs cancel` of its run (no live
    worker to pass it on): the next worker to start acks the claim unrun and cancels its call."""
    env = dict(local_env, CALQUE_CLAIM_SIZE="1")
    holder = []
    backend, gate, run_id, first = held_call(env, tmp_path, "--workers", "0", made=lambda: holder.append(
        start_worker(env, "--model", "orch")))
    holder[0].kill()
    holder[0].wait()
    assert cli(env, "runs", "cancel", run_id).returncode == 0
    assert not calque_core.read_run(backend, first["run_id"]).get("cancelled")
    successor = start_worker(env, "--model", "orch")
    record = cancelled_unrun(backend, first)
    assert record["cancelled"]["reason"] == (f"the calling claim {run_id}/c00000 was delivered "
                                             "again")
    gate.write_text("open")
    successor.terminate()
    assert successor.wait(60) == 0


def test_a_claim_whose_lease_is_lost_cancels_its_calls(local_env, tmp_path):
    """Another receiver takes the orchestrator's claim (its lease lapsed) while its .map waits:
    the worker that lost it cancels the .map's run."""
    env = dict(local_env, CALQUE_CLAIM_SIZE="1")
    backend, gate, run_id, first = held_call(env, tmp_path, "--visibility-timeout", "3")
    queue = backend.queues.open_queue(calque_core.load_pool(backend, "orch")["queue"])

    def steal():   # the lease lapses (as if the heartbeat had stalled), again if a renewal landed
        backend.queues.db().execute("UPDATE messages SET visible_at = 0 WHERE queue = ?",
                                    (queue.name,))
        return queue.receive(0)
    thief = wait_for(steal, 30, "another receiver to take the claim")
    queue.change_visibility(thief, 600)   # the claim stays the thief's
    record = cancelled_unrun(backend, first)
    assert record["cancelled"]["reason"] == (f"the calling claim {run_id}/c00000 ended: its lease "
                                             "was lost")
    gate.write_text("open")


NEEDS = '''
import modal

app = modal.App("needs")


@app.function(image=modal.Image.debian_slim().pip_install("calque-absent-pkg==9.9"))
def heavy(x):
    return x


@app.function()
def light(x):
    return x + 1


@app.function()
def via(x):
    return heavy.remote(x)


@app.local_entrypoint()
def main(through: bool = False):
    print(via.remote(1) if through else light.remote(1))
'''


def test_a_target_whose_pool_cannot_be_made_is_left_out(local_env, tmp_path):
    """`modal run` makes every target's pool up front; one that cannot be (its image's package
    missing) is said in a line and left out, and the entrypoint that never calls it runs; a call to it
    fails saying why."""
    (tmp_path / "needs.py").write_text(NEEDS)
    out = modal_run_in(local_env, tmp_path, False, "needs.py")
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr
    assert "calque: heavy: no pool for its callers: needs.py: the image's pip_install " \
           "calque-absent-pkg==9.9 (not installed)" in out.stderr
    out = modal_run_in(local_env, tmp_path, True, "needs.py", "--through")   # a call to it says why
    assert out.returncode == 1 and "via calls heavy, whose pool could not be made: needs.py: the image's " \
        "pip_install calque-absent-pkg==9.9 (not installed)" in out.stderr.splitlines()[-1], out.stderr


BROKEN = '''
import modal

app = modal.App("broken")


@app.cls()
class Embedder:
    @modal.enter()
    def load(self):
        raise RuntimeError("no weights here")

    @modal.method()
    def embed(self, text):
        return len(text)


@app.function()
def orchestrate(texts):
    return list(Embedder().embed.map(texts))


@app.local_entrypoint()
def main():
    print(orchestrate.remote(["a", "bb"]))
'''


def test_a_call_to_a_pool_whose_workers_die_unwarmed_fails_in_one_line(local_env, tmp_path):
    """The called pool's every worker dies before it is warm (its @enter raises): the waiting
    call fails naming the death, as submit does, its run cancelled; no hang, no pool left."""
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "broken.py").write_text(BROKEN)
    out = modal_run_in(local_env, folder, True, "broken.py")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "died before it was warm" in last and "no weights here" in last, out.stderr
    assert "Traceback" not in out.stderr
    backend = backend_for(local_env)
    assert not backend.store.list("pools/")
    runs = [calque_core.read_json(backend, key + "/run.json") for key in backend.store.list("runs/")]
    called, = [r for r in runs if r["model"].startswith("modal-broken-Embedder-embed-")]
    assert "died before it was warm" in called["cancelled"]["reason"]
    out = modal_run_in(local_env, folder, False, "broken.py::Embedder.embed", "--text", "a")
    last = out.stderr.strip().splitlines()[-1]   # the pool called first, made warm: its hint is
    assert out.returncode == 1 and "no weights here" in last, out.stderr   # this command again,
    assert "modal run broken.py again" in last and "pool deploy" not in last   # not a deploy
    assert "no weights here" in open(re.search(r"\(log (.+?)\)", last).group(1)).read()   # kept: a failed run
