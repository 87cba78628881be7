"""The contract's pure parts: names, the message, store keys."""
import collections
import pytest

import calque
import calque_core


@pytest.mark.parametrize("model, queue", [
    ("Qwen/Qwen2.5-1.5B-Instruct", "calque-pool-qwen-qwen2-5-1-5b-instruct"),
    ("llama-3-8b", "calque-pool-llama-3-8b"),
    ("  Foo__Bar  ", "calque-pool-foo__bar"),
    ("a" * 200, "calque-pool-" + "a" * 68),
    ("x" * 67 + "/y", "calque-pool-" + "x" * 67),
])
def test_slug_vectors(model, queue):
    """The contract's test vectors for pool queue names."""
    assert calque_core.pool_queue_name(model) == queue
    assert len(queue) <= 80


def test_slug_empty_is_an_error():
    """A model name with nothing queue-safe in it is refused."""
    with pytest.raises(calque.UserError, match="no letters or digits"):
        calque_core.slug("//--//")


def test_dlq_name_fits():
    """The dead-letter queue name is cut to its own prefix's budget."""
    name = calque_core.dlq_name("b" * 200)
    assert name == "calque-dlq-" + "b" * 69 and len(name) == 80


def test_message_round_trip_and_unknown_fields():
    """A message carries run_id, model, manifest_uri; unknown fields are ignored."""
    body = calque_core.make_message("r1", "m", "file:///x/runs/r1/manifests/c00000.json", "c00000")
    msg = calque_core.parse_message(body)
    assert (msg["run_id"], msg["model"]) == ("r1", "m")
    assert calque_core.parse_message('{"run_id":"r","model":"m","manifest_uri":"u","extra":1}')["run_id"] == "r"


@pytest.mark.parametrize("body, problem", [
    ("not json", "not JSON"), ("[1]", "not a JSON object"), ('{"run_id":"r","model":"m"}', "manifest_uri"),
    ('{"run_id":5,"model":"m","manifest_uri":"u"}', "run_id"),
])
def test_malformed_messages(body, problem):
    """Malformed bodies raise ValueError naming the problem."""
    with pytest.raises(ValueError, match=problem):
        calque_core.parse_message(body)


def test_local_uri_must_stay_inside_the_store(tmp_path):
    """A manifest_uri outside the store root (or escaping it with ..) resolves to None."""
    store = calque_core.LocalStore(str(tmp_path / "s"), collections.Counter())
    key = "runs/r/manifests/c00000.json"
    assert store.key_for_uri(store.uri(key)) == key
    assert store.key_for_uri("file:///etc/passwd") is None
    assert store.key_for_uri(store.uri("../outside.json")) is None
    assert store.key_for_uri("s3://bucket/runs/r/manifests/c00000.json") is None
    assert calque_core.MANIFEST_KEY.match("runs/r/results/c00000.jsonl") is None


def test_s3_uri_must_stay_inside_the_store():
    """On S3 the URI must be under s3://bucket/prefix/ and may not climb out of it."""
    store = calque_core.S3Store(None, "b", "p", collections.Counter())
    assert store.key_for_uri("s3://b/p/runs/r/manifests/c00000.json") == "runs/r/manifests/c00000.json"
    assert store.key_for_uri("s3://b/other/runs/r/manifests/c00000.json") is None
    assert store.key_for_uri("s3://b/p/../x/runs/r/manifests/c.json") is None
    assert store.key_for_uri("s3://evil/p/runs/r/manifests/c00000.json") is None


def test_results_are_made_jsonable():
    """numpy and torch values in results become plain JSON."""
    import numpy as np
    import torch
    assert calque_core.dumps({"a": np.float32(1.5), "b": np.arange(3), "c": torch.tensor([1.0, 2.0])}) == \
        '{"a":1.5,"b":[0,1,2],"c":[1.0,2.0]}'
    with pytest.raises(TypeError):
        calque_core.dumps({"x": object()})


def test_public_names():
    """`from calque import *` gives the handler API, the Python API and the errors, nothing else."""
    assert {"enter", "batch", "Pool", "submit", "Run", "UserError"} <= set(calque.__all__)
    assert len(calque.__all__) <= 40 and all(hasattr(calque, name) for name in calque.__all__)
    namespace = {}
    exec("from calque import *", namespace)
    assert "enter" in namespace and "os" not in namespace and "slug" not in namespace


def test_handler_decorators_mark_the_methods(tmp_path):
    """@calque.enter and @calque.batch mark the methods load_handler returns."""
    path = tmp_path / "h.py"
    path.write_text("import calque\nclass M:\n    @calque.enter\n    def load(self): self.k = 2\n"
                    "    @calque.batch\n    def run(self, xs): return [self.k * x for x in xs]\n")
    _, enter, batch, collate = calque_core.load_handler(str(path), "M")
    enter()
    assert batch([1, 2]) == [2, 4] and collate is None


def test_handler_source_check():
    """pool create reads the handler without running it: class and both decorators must be there."""
    good = "import calque\nclass M:\n    @calque.enter\n    def a(self): pass\n    @calque.batch\n    def b(self, x): return x\n"
    calque_core.check_handler_source(good, "M", "h.py")
    with pytest.raises(calque.UserError, match="no class N"):
        calque_core.check_handler_source(good, "N", "h.py")
    with pytest.raises(calque.UserError, match="lacks @calque.batch"):
        calque_core.check_handler_source("class M:\n    @enter\n    def a(self): pass\n", "M", "h.py")
    with pytest.raises(calque.UserError, match="syntax error"):
        calque_core.check_handler_source("class M(:\n", "M", "h.py")


def test_settings_precedence(tmp_path, monkeypatch):
    """pool.env overrides the defaults and the environment overrides pool.env; a bad line is named."""
    env_file = tmp_path / "pool.env"
    env_file.write_text("# comment\nCALQUE_BATCH_SIZE=7\nCALQUE_GRACE=9\n")
    monkeypatch.setenv("CALQUE_ENV", str(env_file))
    monkeypatch.setenv("CALQUE_GRACE", "3")
    conf = calque_core.settings()
    assert conf["CALQUE_BATCH_SIZE"] == "7" and conf["CALQUE_GRACE"] == "3"
    env_file.write_text("CALQUE_BATCH_SIZE 7\n")
    with pytest.raises(calque.UserError, match="pool.env:1"):
        calque_core.settings()
