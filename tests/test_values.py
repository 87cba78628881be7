"""Python values without pickle (calque_values): a Modal app's dataclass, date and other arguments,
its tuple, bytes and path results, and its own exceptions, through real pools on the embedded store
and on moto_server, under both command spellings; the encoding's round trip and refusals in process;
gpu="any" and GPU lists priced; App.registered_functions."""
import dataclasses
import datetime
import decimal
import enum
import collections
import importlib.util
import json
import pathlib
import sys
import typing
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cli
from test_modal import modal_run, write_app
import calque_cost
import calque_fleet
import calque_values

APP = '''
import dataclasses
import datetime
import decimal
import enum
import json
import pathlib
import typing
import uuid

import modal

app = modal.App("values")


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    day: datetime.date
    tags: tuple = ()


class Size(enum.Enum):
    SMALL = "s"
    LARGE = "l"


class Span(typing.NamedTuple):
    start: int
    stop: int


class Unlucky(Exception):
    """The app's own error, with an __init__ of its own."""

    def __init__(self, job, why):
        super().__init__(job, why)
        self.job = job


@app.function(gpu="any")
def plan(job: Job, when: datetime.date, size: Size = Size.SMALL):
    if job.name == "bad":
        raise Unlucky(job, f"due {{when}}")
    path = pathlib.Path("out") / job.name
    return (job.name, (when - job.day).days, size, path, [job.name.encode(), b"\\0"])


@app.function(gpu=["H100", "A100-80GB:2"])
def odd(x):
    if x == "json":
        return json.loads("{{")   # fails inside the standard library: the app's line is named
    if x == "file":
        return open("nothing-here.txt")   # an OSError's file name is not in its args
    at = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc)
    return {{"span": Span(1, 2), "set": {{3}}, "money": decimal.Decimal("1.10"), "at": at,
            "id": uuid.UUID(int=7), 1: "int key", "t": (1, (2,))}}


class Opaque:   # neither a dataclass nor a model: no class to rebuild it by
    pass


@app.function()
def opaque():
    return Opaque()


@app.function()
def pairs(n: int):
    for k in range(n):
        yield (k, datetime.date(2024, 1, 1 + k))


@app.local_entrypoint()
def main(fail: str = ""):
    jobs = [Job("a", datetime.date(2024, 1, 1), ("x",)), Job("bad", datetime.date(2024, 1, 2))]
    out = list(plan.map(jobs, [datetime.date(2024, 1, 5)] * 2, return_exceptions=True))
    first = out[0] + ("!",)   # a tuple, as Modal gives it back
    error = out[1]
    try:
        odd.remote("file")
    except FileNotFoundError as e:
        missing = [e.filename, str(e)]
    print(json.dumps({{
        "first": [first[0], first[1], first[2].name, str(first[3]), [b.decode() for b in first[4]],
                  first[5]],
        "path": type(first[3]).__name__,
        "error": [type(error).__name__, isinstance(error, Unlucky),
                  isinstance(error, modal.RemoteError), error.job.name, str(error)],
        "odd": repr(odd.remote("x")), "functions": sorted(app.registered_functions),
        "pairs": [repr(p) for p in pairs.remote_gen(3)], "missing": missing}}))
    if fail == "local":
        class Point:   # a class no worker can find again by name
            pass
        plan.remote(Point(), datetime.date(2024, 1, 5))
    if fail == "json":
        odd.remote("json")
    if fail == "result":
        opaque.remote()
    if fail == "deep":
        deep = []
        for _ in range(5000):
            deep = [deep]
        odd.remote(deep)
'''


@pytest.mark.parametrize("backend,installed", [("local", False), ("aws", True)])
def test_values_of_modal_idioms_travel(backend, installed, request, tmp_path):
    """Dataclass, date and Enum arguments; a tuple result (concatenated, as Modal's), bytes in a
    list, a Path; the app's own exception through return_exceptions=True, as its own class; a
    NamedTuple, set, Decimal, datetime, UUID and an int key; a generator's tuples streamed by
    .remote_gen; on a real pool, both spellings."""
    env = request.getfixturevalue(f"{backend}_env")
    path, _ = write_app(tmp_path, APP)
    out = modal_run(env, path, installed=installed)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["first"] == ["a", 4, "SMALL", "out/a", ["a", "\0"], "!"]
    assert got["path"] == "PosixPath"
    job = "Job(name='bad', day=datetime.date(2024, 1, 2), tags=())"
    assert got["error"] == ["Unlucky", True, True, "bad", f"({job}, 'due 2024-01-05')"]
    assert got["missing"] == [
        "nothing-here.txt", "[Errno 2] No such file or directory: 'nothing-here.txt'"]
    assert got["odd"] == (
        "{'span': Span(start=1, stop=2), 'set': {3}, 'money': Decimal('1.10'), "
        "'at': datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc), "
        "'id': UUID('00000000-0000-0000-0000-000000000007'), 1: 'int key', 't': (1, (2,))}")
    assert got["functions"] == ["odd", "opaque", "pairs", "plan"]
    # streamed as yielded
    assert got["pairs"] == [f"({k}, datetime.date(2024, 1, {1 + k}))" for k in range(3)]
    # gpu="any" and a list of fallbacks are priced: the cheapest instance with a card they accept
    assert "gpu='any': EC2 instance type for --instances: g4dn.xlarge ($0.526/h" in out.stderr
    # each worker gets one GPU here: of the list, H100 only fits
    assert "gpu=['H100', 'A100-80GB:2']: EC2 instance type for --instances: p5.48xlarge" \
        in out.stderr


def test_refusals_and_the_apps_frame(local_env, tmp_path):
    """An argument of a class no worker can find by name is refused at the call in one line naming
    it and what travels, and so is one nested past the recursion limit (the installed `calque`); an
    uncaught item error raised inside the standard library names the app's line, not the kit's or
    json's; a result of a class the encoding does not carry fails its item in one line."""
    path, _ = write_app(tmp_path, APP)
    lines = APP.splitlines()
    call, loads, deep = (next(n for n, line in enumerate(lines, 1) if text in line)
                         for text in ("plan.remote(Point()", "json.loads(", "odd.remote(deep)"))
    out = modal_run(local_env, path, "--fail", "local")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"calque: error: entrypoint main failed: {path}:{call}: TypeError: plan's arguments: a "
        "calque_modal_app_app.main.<locals>.Point does not travel: its class is not at the top of "
        f"the app's own modules or the standard library ({calque_values.TRAVELS})")
    out = modal_run(local_env, path, "--fail", "deep", installed=True)   # either walk's RecursionError
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"calque: error: entrypoint main failed: {path}:{deep}: TypeError: odd's arguments: nested "
        f"deeper than Python's recursion limit ({sys.getrecursionlimit()}): flatten them")
    out = modal_run(local_env, path, "--fail", "json")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "calque: error: entrypoint main: an item failed: JSONDecodeError: Expecting property name "
        f"enclosed in double quotes: line 1 column 2 (char 1) (at app.py:{loads} in odd)")
    out = modal_run(local_env, path, "--fail", "result")   # a result no class rebuilds fails its item
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "calque: error: entrypoint main: an item failed: TypeError: its result: a "
        f"calque_modal_app_app.Opaque does not travel ({calque_values.TRAVELS}) ---> HINT: ")


class Colour(enum.IntEnum):
    RED = 1


class Pair(typing.NamedTuple):
    a: int
    b: bytes


@dataclasses.dataclass
class Late:
    x: int
    y: int = dataclasses.field(init=False, default=0)


def test_encoding_round_trip_and_plain_values_untouched():
    """Every type the encoding names comes back equal and of its type; plain JSON is not tagged
    (the call travels as before) and a result of plain JSON is returned as it is."""
    allowed = calque_values.app_modules(__file__.rsplit("/", 1)[0])
    late = Late(3)
    late.y = 4
    values = [(1, [2, (3,)]), {1: "a", (2, 3): b"\0", "$py": None}, {4, 5}, frozenset({6}), b"\xff",
              datetime.datetime(2024, 1, 2, 3, 4, 5, 6), datetime.date(2024, 1, 2),
              datetime.time(1, 2), datetime.timedelta(days=1, seconds=2, microseconds=3),
              decimal.Decimal("0.1"), uuid.uuid4(), pathlib.PurePosixPath("a/b"), Colour.RED,
              Pair(1, b"x"), late, KeyError("k"), [ValueError("v")],
              FileNotFoundError(2, "No such file or directory", "a.txt"),
              OSError(1, "Operation not permitted", "a", None, "b")]
    for value in values:
        encoder = calque_values.Encoder(allowed, tag_bytes=True)
        back = calque_values.decode(json.loads(json.dumps(encoder.encode(value))), allowed)
        assert encoder.tagged and type(back) is type(value), value
        if isinstance(value, BaseException):
            assert back.args == value.args and str(back) == str(value)   # an OSError's file names
        elif isinstance(value, list):
            assert type(back[0]) is ValueError and back[0].args == ("v",)
        else:
            assert back == value
            assert not hasattr(value, "__dict__") or vars(back) == vars(value)
    plain = {"a": [1, 2.5, None, True, "x"], "b": {"c": []}}
    assert calque_values.encode_result(plain, allowed) is plain
    assert calque_values.decode_result(plain, allowed) is plain
    typed = {"$py": ["typed", {"$py": ["tuple", [1]]}]}
    assert calque_values.decode_result(typed, allowed) == (1,)
    with pytest.raises(calque_values.Refused, match="^a socket.socket does not travel"):
        import socket
        with socket.socket() as s:
            calque_values.Encoder(allowed, tag_bytes=True).encode(s)
    for hostile, why in ((["object", ["subprocess:Popen", {"args": ["true"]}]], "no object class"),
                         (["namedtuple", ["os:system", ["true"]]], "no namedtuple class"),
                         (["enum", ["os:nothing_here", "A"]], "not found here"),
                         (["pickle", "gASVAA=="], "no tag 'pickle'")):
        with pytest.raises(calque_values.Refused, match=why):   # never called, never unpickled
            calque_values.decode({"$py": hostile}, allowed)
    elsewhere = calque_values.app_modules("/nowhere")   # calque_cost is no module of that app's
    with pytest.raises(calque_values.Refused, match="^calque_cost.X is not rebuilt"):
        calque_values.decode({"$py": ["object", ["calque_cost:X", {}]]}, elsewhere)


def python_plain():
    """calque_values.plain as the Python walk (calque_values loaded again, calque_plain hidden)."""
    spec = importlib.util.spec_from_file_location("calque_values_python", calque_values.__file__)
    module = importlib.util.module_from_spec(spec)
    saved = sys.modules.get("calque_plain")
    sys.modules["calque_plain"] = None   # its import raises ImportError
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("calque_plain")
        if saved:
            sys.modules["calque_plain"] = saved
    assert module.plain.__module__ == "calque_values_python"   # the Python function, not C's
    return module.plain


def c_walk():
    """calque_values.plain, which make setup (or pip install) builds in C: without it, a failure, as
    fastbatch's tests fail without its C module."""
    assert calque_values.plain.__module__ == "calque_plain", "calque_plain is not built ---> make setup"
    return calque_values.plain


class Tagged(str):
    """A str subclass: JSON writes it as text, so it comes back a str."""


JSONISH = st.recursive(   # JSON values, with what JSON would change mixed in (tuples, other keys)
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)
    | st.sampled_from([b"x", Tagged("t"), Colour.RED, decimal.Decimal(1)]),
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=4) | st.sampled_from(["$py", "$pz", "é$p"]),
                                     inner, max_size=4)
                   | st.dictionaries(st.integers() | st.sampled_from([Tagged("k"), None, (1,)]),
                                     inner, min_size=1, max_size=2)),
    max_leaves=20)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(JSONISH)
def test_the_c_walk_answers_as_the_python_walk(value):
    """calque_plain (fastbatch/plain.c), which calque_values.plain is where it was built, says of
    every value what the Python walk says: generated JSON values with tuples, keys not text,
    "$py" keys, subclasses (a str, a dict, an IntEnum member) and other leaves mixed in."""
    c_plain, walk = c_walk(), python_plain()
    nested = ([value], {"k": value}, collections.OrderedDict(k=value), [[value], (value,)])
    for each in (value, *nested):
        assert c_plain(each) is walk(each), each


def test_the_c_walk_on_edges():
    """The C walk's answers where the Python walk has to be matched by hand: exact types only (a
    bool is a leaf, an IntEnum member or a str subclass not), a "$py" key at any depth, and a value
    nested past the recursion limit (RecursionError, as the Python walk's, not a crash)."""
    c_plain, walk = c_walk(), python_plain()
    cases = {True: [True, {"a": [False, None, 1, 2.5, "é", float("nan")]}, {}, [], {"$p": 1}],
             False: [(1,), [{"a": (1,)}], {1: "a"}, {"a": {"$py": 0}}, [b""], Tagged("x"),
                     {Tagged("k"): 1}, [Colour.RED], Colour.RED, collections.OrderedDict()]}
    for want, values in cases.items():
        for value in values:
            assert c_plain(value) is walk(value) is want, value
    deep = []
    for _ in range(sys.getrecursionlimit() * 3):
        deep = [deep]
    for each in (c_plain, walk):
        with pytest.raises(RecursionError):
            each(deep)


def test_gpu_any_and_lists():
    rates = calque_cost.load_rates()
    assert calque_fleet.modal_gpu("any") == [("T4", 1), ("L4", 1), ("A10G", 1)]
    assert calque_fleet.modal_gpu(["H100:8", "a100"]) == [("H100", 8), ("A100-40GB", 1)]
    assert calque_fleet.suggest_instance(rates, calque_fleet.modal_gpu("any")) == "g4dn.xlarge"
    fallbacks = calque_fleet.modal_gpu(["H100:8", "T4"])
    assert calque_fleet.suggest_instance(rates, fallbacks) == "g4dn.xlarge"
    assert calque_fleet.modal_gpu(None) == [] and calque_fleet.suggest_instance(rates, []) is None


def test_pool_create_prices_a_gpu_list(local_env, tmp_path):
    """With two GPUs a worker both cards of gpu=["H100", "A100-80GB:2"] fit: the cheaper one."""
    path, _ = write_app(tmp_path, APP)
    out = cli(local_env, "pool", "create", "--model", "v", "--handler", f"{path}:odd",
              "--gpus-per-worker", "2", "--workers", "0")
    assert out.returncode == 0, out.stderr
    assert "p4de.24xlarge ($27.4471/h, the cheapest of the cards it accepts)" in out.stdout


def test_a_pydantic_model_round_trip(tmp_path, monkeypatch):
    """A pydantic model (an app's, in its folder) holding another comes back as itself."""
    pytest.importorskip("pydantic")
    (tmp_path / "orders.py").write_text(
        "from pydantic import BaseModel\n\n\nclass Order(BaseModel):\n    sku: str\n    qty: int\n\n\n"
        "class Quote(BaseModel):\n    order: Order\n    total: float\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import orders
    allowed = calque_values.app_modules(str(tmp_path))
    quote = orders.Quote(order=orders.Order(sku="a", qty=2), total=5.0)
    wire = json.loads(json.dumps(calque_values.encode_result(quote, allowed)))
    assert wire["$py"][1]["$py"][1][0] == "orders:Quote"
    assert calque_values.decode_result(wire, allowed) == quote
