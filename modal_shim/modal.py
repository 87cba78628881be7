"""calque's stand-in `modal`: lets an unedited Modal app file import and declare itself on a calque pool.

calque loads this module as `modal` before it imports a Modal app file (a pool handler, or `calque modal run`),
even where the real `modal` package is installed: the real one's decorators turn a class into a client of
Modal's servers, whose internal metadata API changes between releases, while everything calque needs is what
the decorators declare. So this file only records: the options of @app.cls / @app.function, the roles of
@modal.enter / exit / method / batched / concurrent, modal.parameter() fields. calque.ModalHandler runs them
on a worker; calque's `modal run` routes .map / .remote / .spawn to a pool through `runner` below.

A construct it does not implement raises Unsupported at import, naming it and what to do: never a no-op.
docs/modal.md has the compatibility table.
"""
import functools
import inspect

runner = None   # set by `calque modal run`: call(target, params, items) -> an iterator of result dicts


class Unsupported(Exception):
    """A Modal construct calque cannot honour: one line, the construct and what to do."""


class RemoteError(Exception):
    """An item's error as the worker reported it (its type and message; the traceback is in the result's trace)."""


def _unsupported(construct, hint):
    raise Unsupported(f"{construct} is not supported on a calque pool ---> HINT: {hint}")


# ---- options of @app.cls / @app.function ----------------------------------------------------------------------
# mapped: calque reads them (docs/modal.md says to what); recorded: kept and reported, no calque meaning;
# anything else is refused at import
MAPPED_OPTIONS = {"gpu", "retries", "timeout", "secrets", "volumes", "image"}
RECORDED_OPTIONS = {"cpu", "memory", "min_containers", "max_containers", "buffer_containers", "scaledown_window",
                    "keep_warm", "container_idle_timeout", "concurrency_limit", "allow_concurrent_inputs",
                    "enable_memory_snapshot", "serialized", "name", "include_source", "startup_timeout",
                    "single_use_containers", "max_inputs"}


def _check_options(where, options):
    for key in options:
        if key not in MAPPED_OPTIONS | RECORDED_OPTIONS:
            _unsupported(f"{where}({key}=...)", "remove the option, or run this function on Modal")


class Retries:
    def __init__(self, max_retries, backoff_coefficient=2.0, initial_delay=1.0, max_delay=60.0):
        self.max_retries = max_retries


class Secret:
    def __init__(self, name=None, values=None):
        self.name, self.values = name, values or {}

    @classmethod
    def from_name(cls, name, **_):
        return cls(name=name)

    @classmethod
    def from_dict(cls, values):
        return cls(values={k: str(v) for k, v in values.items()})

    @classmethod
    def from_dotenv(cls, *args, **kwargs):
        _unsupported("modal.Secret.from_dotenv", "use modal.Secret.from_name(N) with pool create --secret N=file.env")


class Volume:
    def __init__(self, name):
        self.name = name

    @classmethod
    def from_name(cls, name, **_):
        return cls(name)

    def commit(self):
        """A local folder or a mounted prefix has nothing to commit."""

    def reload(self):
        """Nothing to reload: the folder is read directly."""


class Image:
    """Recorded and reported, never built: on a calque pool the worker's environment is yours."""

    def __init__(self, steps=()):
        self.steps = list(steps)

    def __getattr__(self, step):
        if step.startswith("_"):
            raise AttributeError(step)
        return lambda *args, **kwargs: Image(self.steps + [step])

    @classmethod
    def _base(cls, name):
        return classmethod(lambda c, *args, **kwargs: cls([name]))


for _base in ("debian_slim", "micromamba", "from_registry", "from_dockerfile", "from_aws_ecr",
              "from_gcp_artifact_registry", "from_id"):
    setattr(Image, _base, Image._base(_base))


# ---- roles of methods and classes -----------------------------------------------------------------------------
def _role(fn, **role):
    fn._modal_role = {**getattr(fn, "_modal_role", {}), **role}
    return fn


def enter(*, snap=False):
    """Runs once per worker before its first claim; snap=True ones first (memory snapshots are Modal's)."""
    return lambda fn: _role(fn, kind="enter", snap=snap)


def exit():
    return lambda fn: _role(fn, kind="exit")


def method(*, is_generator=None, keep_warm=None):
    return lambda fn: _role(fn, kind="method", is_generator=is_generator)


def batched(*, max_batch_size, wait_ms):
    """One call per batch of up to max_batch_size items; wait_ms is moot: a claim arrives as a batch already."""
    return lambda fn: _role(fn, kind="batched", max_batch_size=max_batch_size, wait_ms=wait_ms)


def concurrent(*, max_inputs, target_inputs=None):
    """Up to max_inputs item calls at once (threads; async methods on one event loop)."""
    def mark(obj):
        obj._modal_concurrent = max_inputs
        return obj
    return mark


def build(*args, **kwargs):
    _unsupported("@modal.build", "do the download in @modal.enter (it runs once per worker)")


class _Parameter:
    def __init__(self, default=inspect.Parameter.empty, init=True):
        self.default = default


def parameter(*, default=inspect.Parameter.empty, init=True):
    return _Parameter(default, init)


# ---- the app and its objects ----------------------------------------------------------------------------------
class App:
    def __init__(self, name=None, *, image=None, secrets=(), volumes=None, **options):
        self.name, self.image, self.secrets, self.volumes = name, image, list(secrets), dict(volumes or {})
        self.registered, self.entrypoints = {}, {}

    def _register(self, where, kind, options):
        """The decorator of @app.cls / @app.function: options checked and merged with the app's, the object made."""
        if "schedule" in options:
            _unsupported(f"{where}(schedule=...)", "run the entrypoint from cron: calque modal run app.py")
        _check_options(where, options)
        merged = {"image": self.image, **options}
        merged["secrets"] = self.secrets + list(options.get("secrets", ()))
        merged["volumes"] = {**self.volumes, **options.get("volumes", {})}

        def wrap(obj):
            self.registered[obj.__name__] = kind(self, obj, merged)
            return self.registered[obj.__name__]
        return wrap

    def cls(self, **options):
        return self._register("@app.cls", Cls, options)

    def function(self, **options):
        return self._register("@app.function", Function, options)

    def local_entrypoint(self, _warn_parentheses_missing=None, *, name=None):
        def wrap(fn):
            self.entrypoints[name or fn.__name__] = fn
            return fn
        return wrap

    def include(self, other):
        self.registered.update(other.registered)
        return self

    def run(self, *args, **kwargs):
        _unsupported("app.run()", "run it as calque modal run app.py (the entrypoint runs locally, calls go to a pool)")


class Cls:
    """What @app.cls makes of a class: Batcher(**params).method.map(...) on a pool; .user_cls for the worker."""

    def __init__(self, app, user_cls, options):
        self.app, self.user_cls, self.options = app, user_cls, options
        self.__name__ = user_cls.__name__

    def parameters(self):
        """{name: default or inspect.Parameter.empty} of the class's modal.parameter() fields."""
        return {k: v.default for k, v in vars(self.user_cls).items() if isinstance(v, _Parameter)}

    def methods(self):
        """{name: role} of the @modal.method / @modal.batched methods."""
        return {k: v._modal_role for k, v in vars(self.user_cls).items()
                if getattr(v, "_modal_role", {}).get("kind") in ("method", "batched")}

    def __call__(self, **params):
        unknown = set(params) - set(self.parameters())
        if unknown:
            raise TypeError(f"{self.__name__}() got parameters it does not declare: {', '.join(sorted(unknown))}")
        return Obj(self, params)

    def with_options(self, **options):
        _unsupported(f"{self.__name__}.with_options", "pass the options to @app.cls, or create another pool")

    def __getattr__(self, name):   # Modal 1.0 style: Cls.method without parameters
        if name in vars(self).get("user_cls", object).__dict__:
            return getattr(Obj(self, {}), name)
        raise AttributeError(name)


class Obj:
    def __init__(self, cls, params):
        self._cls, self._params = cls, params

    def __getattr__(self, name):
        if name not in self._cls.methods():
            raise AttributeError(f"{self._cls.__name__} has no @modal.method {name}")
        return Handle(f"{self._cls.__name__}.{name}", self._params, getattr(self._cls.user_cls, name),
                      lambda: self._local_instance())

    def _local_instance(self):
        instance = self._cls.user_cls()
        for key, value in {**self._cls.parameters(), **self._params}.items():
            setattr(instance, key, value)
        return instance


class Function:
    def __init__(self, app, fn, options):
        self.app, self.raw_f, self.options = app, fn, options
        self.__name__ = fn.__name__
        self._handle = Handle(fn.__name__, {}, fn, None)
        functools.update_wrapper(self, fn)

    def __getattr__(self, name):
        if name in ("remote", "map", "starmap", "for_each", "spawn", "local"):
            return getattr(vars(self)["_handle"], name)
        raise AttributeError(name)

    def __call__(self, *args, **kwargs):
        return self.raw_f(*args, **kwargs)


def _as_item(args, kwargs, where):
    """A call's arguments as one JSON item: the one argument, or the list of several (splatted on the worker)."""
    if kwargs:
        raise TypeError(f"{where}: keyword arguments do not travel to a calque pool: pass them positionally")
    return args[0] if len(args) == 1 else list(args)


class Handle:
    """A method or function as the entrypoint calls it: every call goes to the pool that serves `target`."""

    def __init__(self, target, params, fn, instance):
        self.target, self.params, self.fn, self.instance = target, params, fn, instance

    def _results(self, items):
        if runner is None:
            _unsupported(f"{self.target}.remote/.map outside `calque modal run`",
                         "call it from the app's local entrypoint, run with calque modal run app.py")
        return runner(self.target, self.params, items)

    def map(self, *iterables, order_outputs=True, return_exceptions=False, wrap_returned_exceptions=True):
        """Results in input order as claims finish (order_outputs=False accepted: input order is one of the
        orders it allows). The first failed item raises RemoteError unless return_exceptions."""
        items = [x[0] if len(iterables) == 1 else list(x) for x in zip(*iterables)]
        return self._values(items, return_exceptions)

    def starmap(self, iterable, order_outputs=True, return_exceptions=False, kwargs=None):
        return self._values([list(args) for args in iterable], return_exceptions)

    def for_each(self, *iterables, ignore_exceptions=False):
        for _ in self.map(*iterables, return_exceptions=ignore_exceptions):
            pass

    def remote(self, *args, **kwargs):
        return next(iter(self._values([_as_item(args, kwargs, self.target)], False)))

    def spawn(self, *args, **kwargs):
        return FunctionCall(self._results([_as_item(args, kwargs, self.target)]))

    def local(self, *args, **kwargs):
        if self.instance is None:
            return self.fn(*args, **kwargs)
        return self.fn(self.instance(), *args, **kwargs)

    def _values(self, items, return_exceptions):
        for result in self._results(items):
            if result["ok"]:
                yield result["result"]
            elif return_exceptions:
                yield RemoteError(result["error"])
            else:
                raise RemoteError(result["error"])


class FunctionCall:
    def __init__(self, results):
        self._results = results

    def get(self, timeout=None):
        result = next(iter(self._results))
        if not result["ok"]:
            raise RemoteError(result["error"])
        return result["result"]


# ---- everything else: refused by name -------------------------------------------------------------------------
_REFUSED = {
    "Dict": "keep shared state in your own store (a file, Redis, S3)",
    "Queue": "submit items to the pool (calque.submit) instead of a Modal queue",
    "Sandbox": "run the command in the handler, or on Modal",
    "NetworkFileSystem": "use modal.Volume.from_name(N) with pool create --volume N=PATH",
    "CloudBucketMount": "use modal.Volume.from_name(N) with pool create --volume N=s3://bucket/prefix",
    "Cron": "run the entrypoint from cron: calque modal run app.py",
    "Period": "run the entrypoint from cron: calque modal run app.py",
    "asgi_app": "serve web endpoints on Modal or your own server: a calque pool serves batch claims",
    "wsgi_app": "serve web endpoints on Modal or your own server: a calque pool serves batch claims",
    "web_endpoint": "serve web endpoints on Modal or your own server: a calque pool serves batch claims",
    "fastapi_endpoint": "serve web endpoints on Modal or your own server: a calque pool serves batch claims",
    "web_server": "serve web endpoints on Modal or your own server: a calque pool serves batch claims",
    "Stub": "rename modal.Stub to modal.App (Modal did in 0.64)",
    "gpu": "write gpu=\"A100:2\" (a string), as Modal 1.0 does",
}


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    _unsupported(f"modal.{name}", _REFUSED.get(name, "remove it, or run this part on Modal"))
