"""The Python API end to end, in this process as a notebook would use it, on both backends: Pool.create waits for
warm workers, calque.submit returns a Run whose results() yields each claim's results before the run completes."""
import os

import numpy as np
import pytest

import calque
from conftest import wait_for

HANDLER = '''
import os
import time
import calque


class Held:
    """Item {"hold": true} waits until the file "open" exists in the working directory."""

    @calque.enter
    def load(self):
        pass

    @calque.batch
    def run(self, items):
        if isinstance(items, dict):   # numeric items, collated: {"input": tensor}
            return [{"y": 2 * int(v)} for v in items["input"]]
        out = []
        for item in items:
            while item.get("hold") and not os.path.exists("open"):
                time.sleep(0.01)
            out.append({"y": 2 * int(item["x"] if "x" in item else item["input"])})   # a JSON item, or a row
        return out
'''


@pytest.mark.parametrize("backend", ["local", "aws"])
def test_api_end_to_end(backend, request, tmp_path, monkeypatch):
    """Pool.create (warm), submit (JSON items and a numpy array), results() yielding claim 0 while claim 1 is held,
    status, failures, cost, cancel, delete."""
    env = request.getfixturevalue("local_env" if backend == "local" else "aws_env")
    for key in ("CALQUE_STORE", "CALQUE_STATE", "CALQUE_POLL_WAIT", "CALQUE_GRACE", "CALQUE_ENV", "AWS_ENDPOINT_URL"):
        if key in env:
            monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(tmp_path)   # the user's folder: the handler and the file it waits for live here
    (tmp_path / "held.py").write_text(HANDLER)
    pool = calque.Pool("api")
    record = pool.create(handler="held.py:Held", workers=1)
    assert record["workdir"] == str(tmp_path)
    assert [w["warm"] for w in pool.status()["local_workers"]] == [True]

    run = calque.submit(({"x": i, "hold": i == 1} for i in range(2)), pool="api", claim_size=1)
    results = run.results()
    assert next(results) == {"i": 0, "ok": True, "result": {"y": 0}}
    assert run.status()["complete"] is False          # claim 1 is held: the first result came before the end
    (tmp_path / "open").touch()
    assert [r["result"]["y"] for r in results] == [2]
    assert run.wait(60) and run.failures() == [] and run.cost()[0]["items"] == 2

    arrays = calque.submit(np.arange(3), pool="api")
    assert [r["result"]["y"] for r in arrays.results()] == [0, 2, 4]

    pool.scale(0)
    queued = calque.submit([{"x": 5}], pool="api", wait_for_workers=True)
    assert queued.cancel() == ["c00000"]
    with pytest.raises(calque.ResultsIncomplete, match="cancelled"):
        list(queued.results())
    with pytest.raises(calque.UserError, match="has no live worker"):
        calque.submit([{"x": 5}], pool="api")
    pool.delete(force=True)   # the cancelled claim is still in the queue
    wait_for(lambda: not os.path.exists(tmp_path / "state" / "pools" / "api" / "supervisor.json"), 10, "no supervisor")
