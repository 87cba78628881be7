"""examples/generate_model.py end to end, as a user runs it: the model built locally (examples/make_generate_model.py),
prompts in a JSONL file, a pool of 2 workers with no options: both workers serve claims, and the texts equal a plain
loop's greedy output; the whole-claim variant (one generate call a claim) gives the same texts."""
import json
import os
import subprocess
import sys

import pytest

from conftest import PY, ROOT

pytest.importorskip("transformers", reason="the example's packages are not installed: .venv/bin/pip install -r "
                                           "examples/requirements-embed.txt")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import make_generate_model  # noqa: E402

PROMPTS = 60   # claims of 32 and 28 on two workers: one generate call each


def test_generation_example_on_two_workers_with_no_options(local_env, tmp_path):
    model_dir, prompts = tmp_path / "generate-model", tmp_path / "prompts.jsonl"
    make_generate_model.build(str(model_dir))
    make_generate_model.write_prompts(str(prompts), PROMPTS)
    env = dict(local_env, GENERATE_MODEL_DIR=str(model_dir), HF_HUB_OFFLINE="1")   # a local folder: no hub, ever
    handler = os.path.join(ROOT, "examples", "generate_model.py")

    def calque(*args):   # from the user's folder, not the checkout
        out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def texts(handler_class):
        calque("pool", "create", "--model", "gen", "--handler", f"{handler}:{handler_class}", "--workers", "2")
        report = json.loads(calque("submit", "--pool", "gen", str(prompts), "--json"))
        lines = calque("runs", "results", report["run"]["run_id"]).splitlines()
        calque("pool", "delete", "--model", "gen", "--yes")
        return report["summaries"], [json.loads(line)["result"] for line in lines]

    summaries, got = texts("GenerateModel")
    assert [s["items"] for s in summaries] == [32, 28]
    assert len({s["worker_id"] for s in summaries}) == 2, "both workers served claims"
    from generate_model import GenerateModel
    model = GenerateModel()
    os.environ.update(GENERATE_MODEL_DIR=str(model_dir), HF_HUB_OFFLINE="1")
    try:
        model.load()
    finally:
        del os.environ["GENERATE_MODEL_DIR"], os.environ["HF_HUB_OFFLINE"]
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    want = [text for i in range(0, len(rows), 32) for text in model.generate(rows[i:i + 32])]
    assert got == want and len(set(want)) > 1
    assert texts("GenerateWholeClaim")[1] == want
