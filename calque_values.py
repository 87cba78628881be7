"""Python values JSON cannot say, carried without pickle: the kit's typed encoding, in which a
Modal app's arguments, results and exceptions travel (docs/contract.md#typed-values).

A plain JSON value (dicts with text keys, lists, str, int, float, bool, None) travels as it is,
untagged; its envelope says whether anything in it is tagged, so a plain one is never walked on
the way back. Anything else is a one-key dict {"$py": [tag, payload]}. A class travels as its name,
"module:qualname", and is rebuilt only from a module `allowed` admits (the app's own, the standard
library): never pickle, never another import.
"""
import base64
import contextlib
import dataclasses
import datetime
import decimal
import enum
import importlib
import importlib.util
import os
import pathlib
import sys
import uuid

TAG = "$py"
TRAVELS = ("what travels: JSON values, bytes, tuples, sets, dates and times, Decimal, UUID, paths, "
           "and Enum members, dataclasses, NamedTuples, pydantic models and exceptions of the "
           "app's own modules or the standard library")
LEAVES = frozenset((str, int, float, bool, type(None)))   # JSON's scalars, exactly these types
TIMES = {cls.__name__: cls for cls in (datetime.datetime, datetime.date, datetime.time)}


class Refused(TypeError):
    """A value the encoding does not carry, or a class it does not rebuild: one line."""


def plain(value):
    """Whether JSON carries `value` exactly: no tuple, no key that is not text, nothing tagged.
    (Leaves are checked inline: a call a leaf made it twice as slow.)"""
    kind = type(value)
    if kind is dict:
        if TAG in value:
            return False
        for k, v in value.items():
            if type(k) is not str or type(v) not in LEAVES and not plain(v):
                return False
        return True
    if kind is list:
        for v in value:
            if type(v) not in LEAVES and not plain(v):
                return False
        return True
    return kind in LEAVES


with contextlib.suppress(ImportError):   # the same walk in C (fastbatch/plain.c), 7x faster,
    from calque_plain import plain        # where it was built: this walk was the encoding's cost


def app_modules(folder):
    """allowed(module) of an app file's folder: the standard library, and modules whose top-level
    file or package lies in that folder (its siblings, its add_local_python_source modules on a
    worker). A module is located, never imported, to decide."""
    folder = os.path.join(os.path.realpath(folder), "")

    def allowed(module):
        top = module.partition(".")[0]
        if top in sys.stdlib_module_names:
            return True
        try:
            loaded = getattr(sys.modules.get(top), "__file__", None)
            origin = loaded or importlib.util.find_spec(top).origin
        except (ImportError, ValueError, AttributeError):   # no such module
            return False
        return bool(origin) and os.path.realpath(origin).startswith(folder)
    return allowed


class Encoder:
    """encode(value): the value in the typed encoding, `tagged` saying whether anything in it is.
    `tag_bytes`: bytes as base64 text (a result's); else kept as bytes, which the transport carries
    (an argument's: staged beside the manifest, contract.md's bytes form)."""

    def __init__(self, allowed, tag_bytes):
        self.allowed, self.tag_bytes, self.tagged = allowed, tag_bytes, False

    def encode(self, value):
        kind = type(value)
        if kind in LEAVES:
            return value
        if kind is list:
            return [self.encode(v) for v in value]
        if kind is dict:
            if TAG in value or any(type(k) is not str for k in value):
                pairs = [[self.encode(k), self.encode(v)] for k, v in value.items()]
                return self._tag("dict", pairs)
            return {k: self.encode(v) for k, v in value.items()}
        if isinstance(value, (bytes, bytearray)):
            return self._tag("bytes", base64.b64encode(value).decode()) if self.tag_bytes else value
        if hasattr(value, "tolist") and not isinstance(value, enum.Enum):   # numpy, torch: theirs
            return value
        return self._tag(*self._other(value))

    def _tag(self, tag, payload):
        self.tagged = True
        return {TAG: [tag, payload]}

    def _other(self, value):
        kind = type(value)
        if kind in (tuple, set, frozenset):
            return kind.__name__, [self.encode(v) for v in value]
        if kind in TIMES.values():
            return kind.__name__, value.isoformat()
        if kind is datetime.timedelta:
            return "timedelta", [value.days, value.seconds, value.microseconds]
        if kind in (decimal.Decimal, uuid.UUID):
            return kind.__name__.lower(), str(value)
        if isinstance(value, pathlib.PurePath):
            return "path", [kind.__name__, str(value)]
        name = self.name(kind)
        if isinstance(value, enum.Enum):
            return "enum", [name, value.name]
        if isinstance(value, BaseException):
            return "exception", [name, [self.encode(v) for v in exception_args(value)]]
        if isinstance(value, tuple) and hasattr(kind, "_fields"):
            return "namedtuple", [name, [self.encode(v) for v in value]]
        if dataclasses.is_dataclass(value):
            fields = [f.name for f in dataclasses.fields(value)]
        elif hasattr(kind, "model_fields"):   # a pydantic model
            fields = list(kind.model_fields)
        else:
            raise Refused(f"a {kind.__module__}.{kind.__qualname__} does not travel ({TRAVELS})")
        return "object", [name, {f: self.encode(getattr(value, f)) for f in fields}]

    def name(self, kind):
        """A class's "module:qualname", refused where it could not be found again by name."""
        if "<locals>" in kind.__qualname__ or not self.allowed(kind.__module__):
            raise Refused(f"a {kind.__module__}.{kind.__qualname__} does not travel: its class is "
                          f"not at the top of the app's own modules or the standard library "
                          f"({TRAVELS})")
        return f"{kind.__module__}:{kind.__qualname__}"


# what a named class must be to be rebuilt from its tag: never any other class of a module
KINDS = {"enum": lambda cls: issubclass(cls, enum.Enum),
         "exception": lambda cls: issubclass(cls, BaseException),
         "namedtuple": lambda cls: issubclass(cls, tuple) and hasattr(cls, "_fields"),
         "object": lambda cls: dataclasses.is_dataclass(cls) or hasattr(cls, "model_fields")}


def find_class(name, allowed, tag):
    """The class "module:qualname" names, from a module `allowed` admits, of the kind its tag
    says (a class of another kind, say subprocess.Popen, is never called)."""
    module, _, qualname = name.partition(":")
    if not allowed(module):
        raise Refused(f"{module}.{qualname} is not rebuilt: not of the app's own modules or the "
                      f"standard library")
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        raise Refused(f"{module}.{qualname} is not found here") from None
    if not (isinstance(found, type) and KINDS[tag](found)):
        raise Refused(f"{module}.{qualname} is not rebuilt: no {tag} class")
    return found


def decode(value, allowed):
    """A value of the typed encoding as the Python value it was (classes found where `allowed`)."""
    kind = type(value)
    if kind is list:
        return [decode(v, allowed) for v in value]
    if kind is not dict:
        return value
    if len(value) == 1 and TAG in value:
        tag, payload = value[TAG]
        if tag not in BUILD:
            raise Refused(f"no tag {tag!r} in the typed encoding")
        return BUILD[tag](payload, allowed)
    return {k: decode(v, allowed) for k, v in value.items()}


def _object(payload, allowed):
    """A dataclass (its init fields passed, the others set after) or a pydantic model."""
    cls, fields = find_class(payload[0], allowed, "object"), decode(payload[1], allowed)
    if not dataclasses.is_dataclass(cls):
        return cls(**fields)
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    value = cls(**{k: v for k, v in fields.items() if k in init})
    for k in fields.keys() - init:
        object.__setattr__(value, k, fields[k])
    return value


def exception_args(error):
    """What rebuilds an exception: its args, and an OSError's file names, which its args lack
    (as pickle's OSError.__reduce__ gives them: Modal's `e.filename`, and its message's end)."""
    return error.__reduce__()[1] if isinstance(error, OSError) else error.args


def _exception(payload, allowed):
    """The exception with its args; one whose __init__ takes others gets them set, not passed."""
    cls, args = find_class(payload[0], allowed, "exception"), decode(payload[1], allowed)
    try:
        return cls(*args)
    except Exception:
        error = cls.__new__(cls, *args)
        error.args = tuple(args)
        return error


BUILD = {
    "tuple": lambda p, allowed: tuple(decode(p, allowed)),
    "set": lambda p, allowed: set(decode(p, allowed)),
    "frozenset": lambda p, allowed: frozenset(decode(p, allowed)),
    "dict": lambda p, allowed: {decode(k, allowed): decode(v, allowed) for k, v in p},
    "bytes": lambda p, _: base64.b64decode(p),
    **{name: (lambda cls: lambda p, _: cls.fromisoformat(p))(cls) for name, cls in TIMES.items()},
    "timedelta": lambda p, _: datetime.timedelta(*p),
    "decimal": lambda p, _: decimal.Decimal(p),
    "uuid": lambda p, _: uuid.UUID(p),
    "path": lambda p, _: getattr(pathlib, p[0] if p[0] in pathlib.__all__ else "Path")(p[1]),
    "enum": lambda p, allowed: find_class(p[0], allowed, "enum")[p[1]],
    "exception": _exception,
    "namedtuple": lambda p, ok: find_class(p[0], ok, "namedtuple")(*decode(p[1], ok)),
    "object": _object,
    "typed": decode,   # a result holding tagged values (encode_result)
}


def encode_result(value, allowed):
    """A call's result as it travels: itself where plain JSON (or a typed part: bytes, an array)
    carries it, else {"$py": ["typed", its encoding]}, which decode_result undoes."""
    if plain(value) or isinstance(value, (bytes, bytearray)):
        return value
    encoder = Encoder(allowed, tag_bytes=True)
    encoded = encoder.encode(value)
    return {TAG: ["typed", encoded]} if encoder.tagged else value


def decode_result(value, allowed):
    """A result as the call returned it: a tagged one decoded, a plain one as it is (no walk)."""
    typed = type(value) is dict and len(value) == 1 and TAG in value
    return decode(value, allowed) if typed else value
