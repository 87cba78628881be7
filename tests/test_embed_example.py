"""examples/embed_model.py end to end, as a user runs it: the model built locally (examples/make_embed_model.py),
texts in a Parquet file, a pool of 2 workers on default settings, the [B, 256] tensors read back with
Run.to_numpy() and `runs results --format npy`, equal to a plain loop over the same texts."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import PY, ROOT

pytest.importorskip("transformers", reason="the example's packages are not installed: .venv/bin/pip install -r "
                                           "examples/requirements-embed.txt")
pytest.importorskip("tokenizers", reason="the example's packages are not installed: .venv/bin/pip install -r "
                                         "examples/requirements-embed.txt")
sys.path.insert(0, os.path.join(ROOT, "examples"))
import make_embed_model  # noqa: E402


def test_embedding_example_end_to_end(local_env, tmp_path):
    model_dir, texts = tmp_path / "embed-model", tmp_path / "texts.parquet"
    make_embed_model.build(str(model_dir))
    make_embed_model.write_texts(str(texts), 70)
    env = dict(local_env, EMBED_MODEL_DIR=str(model_dir), HF_HUB_OFFLINE="1")   # a local folder: no hub, ever
    handler = os.path.join(ROOT, "examples", "embed_model.py")

    def calque(*args):   # from the user's folder, not the checkout
        out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout

    calque("pool", "create", "--model", "embed", "--handler", f"{handler}:EmbedModel", "--workers", "2")
    run_id = calque("submit", "--pool", "embed", str(texts), "--columns", "text", "--claim-size", "20").split()[1]
    calque("runs", "results", run_id, "--format", "npy", "--output", str(tmp_path / "emb.npy"))
    calque("pool", "delete", "--model", "embed", "--yes")
    got = np.load(tmp_path / "emb.npy")
    from embed_model import EmbedModel
    model = EmbedModel()
    os.environ.update(EMBED_MODEL_DIR=str(model_dir), HF_HUB_OFFLINE="1")
    try:
        model.load()
    finally:
        del os.environ["EMBED_MODEL_DIR"], os.environ["HF_HUB_OFFLINE"]
    import pyarrow.parquet as pq
    rows = [{"text": t} for t in pq.read_table(texts).column("text").to_pylist()]
    want = np.concatenate([model.embed(rows[i:i + 32]).numpy() for i in range(0, len(rows), 32)])
    assert got.shape == (70, 256) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert np.abs(got - want).max() < 1e-5   # other batches pad differently: equal but for float rounding
