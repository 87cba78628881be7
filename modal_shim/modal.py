"""calque's stand-in `modal`: lets an unedited Modal app file import and declare itself on a calque pool.

calque loads this module as `modal` before it imports a Modal app file (a pool handler, or `calque modal run`),
even where the real `modal` package is installed: the real one's decorators turn a class into a client of
Modal's servers, whose internal metadata API changes between releases, while everything calque needs is what
the decorators declare. So this file only records: the options of @app.cls / @app.function, the roles of
@modal.enter / exit / method / batched / concurrent, modal.parameter() fields. calque.ModalHandler runs them
on a worker; calque's `modal run`, and a worker for its function's calls, route .map / .remote /
.spawn to a pool through `runner` below.

A construct it does not implement raises Unsupported at import, naming it and what to do: never a no-op.
docs/modal.md has the compatibility table.
"""
import asyncio
import builtins
import contextlib
import dataclasses
import difflib
import enum
import functools
import inspect
import os
import pathlib
import threading
import uuid
from concurrent.futures import Future, wait   # its TimeoutError is the builtin one (3.11)

import calque_values

runner = None      # set by `calque modal run` and a worker (calque_runs.Calls):
                   # call(target, params, items) -> an iterator of result dicts
container = False  # True in a worker: Image.imports() blocks import for real there
volume = None      # set by calque (a worker, `modal run`): NAME -> where Volume NAME lives


class Unsupported(Exception):
    """A Modal construct calque cannot honour: one line, the construct and what to do."""
    app_error = True


def app_error(error):
    """`error`, marked as the app's doing (a wrong argument, a timeout it asked for): `modal run`
    names the app's line for it; any other error raised in the kit's code is the kit's (a bug)."""
    error.app_error = True
    return error


class RemoteError(Exception):
    """An item's error as the worker reported it (its type and message; the traceback is in the result's trace)."""


def _unsupported(construct, hint):
    raise Unsupported(f"{construct} is not supported on a calque pool ---> HINT: {hint}")


# ---- options of @app.cls / @app.function ----------------------------------------------------------------------
# Modal's App.function / App.cls options (1.x, and older names still seen): None where calque
# honours it (docs/modal.md says as what), else why it has no effect on a calque pool, the note
# `pool create` and `modal run` print. Accepted alike on both (schedule= is a function's only on
# Modal); any other is refused.
SIZE = "a pool's size is pool create's --workers / --min-workers / --max-workers"
MACHINE = "a worker has its machine's cores, memory and disk"
PLACE = "workers run where the pool is: this machine, or the --instances of an EC2 pool"
NO_EFFECT = "it only changes what Modal's servers do"
OPTIONS = {
    **dict.fromkeys(("image", "env", "secrets", "volumes", "gpu", "retries", "timeout",
                     "is_generator", "allow_concurrent_inputs")),
    **dict.fromkeys(("cpu", "memory", "ephemeral_disk"), MACHINE),
    **dict.fromkeys(("min_containers", "max_containers", "buffer_containers", "scaledown_window",
                     "keep_warm", "container_idle_timeout", "concurrency_limit"), SIZE),
    **dict.fromkeys(("cloud", "region", "routing_region", "proxy", "i6pn"), PLACE),
    **dict.fromkeys(("serialized", "name", "include_source", "block_network",
                     "restrict_modal_access", "experimental_options",
                     "_experimental_restrict_output"), NO_EFFECT),
    "network_file_systems": "modal.NetworkFileSystem is refused: use volumes= (in the store)",
    "nonpreemptible": "an EC2 pool is on-demand unless --spot; local workers are not preempted",
    "enable_memory_snapshot": "no snapshot is taken: each worker runs @modal.enter once",
    "startup_timeout": "@modal.enter runs as long as it takes (pool create waits until it is done)",
    "single_use_containers": "a worker serves claim after claim (sticky)",
    "max_inputs": "a worker serves claim after claim (sticky); it is not restarted after N inputs",
    "schedule": "nothing is scheduled: run calque modal run app.py::FUNCTION from cron",
}


def _check_options(where, options):
    for key in options:
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, 1)
            _unsupported(f"{where}({key}=...)", f"did you mean {close[0]}=?" if close else
                         "remove the option, or run this function on Modal")


def ignored(options):
    """One note per option given that has no effect on a calque pool: "cpu=: ignored (why)"."""
    return [f"{key}=: ignored ({OPTIONS[key]})" for key, value in options.items()
            if OPTIONS.get(key) and value not in (None, False, {}, [], ())]


def Cron(*args, **kwargs):
    """modal.Cron(...) / modal.Period(...), a schedule= value: recorded (OPTIONS: no effect here)."""
    return [args, kwargs]


Period = Cron


class Retries:
    """retries=: kept as given; pool create checks it (calque_core.retry_policy) and the workers
    retry an item that raises with its backoff."""
    def __init__(self, max_retries, backoff_coefficient=2.0, initial_delay=1.0, max_delay=60.0):
        self.policy = dict(max_retries=max_retries, backoff_coefficient=backoff_coefficient,
                           initial_delay=initial_delay, max_delay=max_delay)


class Secret:
    def __init__(self, name=None, values=None, required_keys=()):
        self.name, self.values, self.required_keys = name, values or {}, list(required_keys)

    @classmethod
    def from_name(cls, name, required_keys=(), **_):
        return cls(name=name, required_keys=required_keys)

    @classmethod
    def from_dict(cls, values):
        return cls(values={k: str(v) for k, v in values.items()})

    @classmethod
    def from_dotenv(cls, *args, **kwargs):
        _unsupported("modal.Secret.from_dotenv", "use modal.Secret.from_name(N) with pool create --secret N=file.env")


class FileEntryType(enum.IntEnum):
    UNSPECIFIED, FILE, DIRECTORY, SYMLINK = range(4)


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file or folder of a Volume, as Modal's listdir gives it (path: from the volume's root)."""
    path: str
    type: FileEntryType
    mtime: int
    size: int


class _WithAio:
    """A method with Modal's .aio twin (`await vol.commit.aio()`, `async for e in vol.iterdir.aio(p)`)."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, owner):
        return _CallForm(self.fn.__get__(obj), inspect.isgeneratorfunction(self.fn)) if obj is not None else self


class Volume:
    """A Volume is the store's prefix volumes/NAME/ (or the folder `--volume NAME=PATH` names): a
    worker mounts it before the app is imported (on s3://, the machine's copy: commit() uploads
    it, reload() brings others' commits); the methods below work on the store from anywhere, and
    each but batch_upload has its .aio form."""

    def __init__(self, name, create_if_missing=False):
        self.name, self.create_if_missing = name, create_if_missing

    @classmethod
    def from_name(cls, name, create_if_missing=False, **_):
        return cls(name, create_if_missing)

    def _call(self, method, *args):
        """What the volume's calque side (calque_core.StoredVolume) answers; its OSError (a file
        missing, a folder where a file was meant) is the app's doing."""
        if volume is None:
            _unsupported(f"Volume {self.name}'s methods outside `calque modal run` and a worker",
                         "call them from the app's local entrypoint or its functions")
        try:
            return getattr(volume(self.name), method)(*args)
        except OSError as e:
            raise app_error(e) from None

    @_WithAio
    def commit(self):
        self._call("commit")

    @_WithAio
    def reload(self):
        self._call("sync")

    @_WithAio
    def iterdir(self, path, *, recursive=True):
        for name, folder, mtime, size in self._call("entries", path, recursive):
            kind = FileEntryType.DIRECTORY if folder else FileEntryType.FILE
            yield FileEntry(name, kind, mtime, size)

    @_WithAio
    def listdir(self, path, *, recursive=False):
        return list(self.iterdir(path, recursive=recursive))

    @_WithAio
    def read_file(self, path):
        yield self._call("read", path)

    @_WithAio
    def remove_file(self, path, recursive=False):
        self._call("remove", path, recursive)

    @_WithAio
    def copy_files(self, src_paths, dst_path, recursive=False):
        self._call("copy", list(src_paths), dst_path, recursive)

    @contextlib.contextmanager
    def batch_upload(self, force=False):
        """put_file / put_directory inside the block; the files are written when it ends."""
        batch = _Upload()
        yield batch
        self._call("upload", batch.files, force)


class _Upload:
    def __init__(self):
        self.files = {}

    def put_file(self, local_file, remote_path, mode=None):
        readable = hasattr(local_file, "read")
        self.files[str(remote_path)] = local_file if readable else str(local_file)

    def put_directory(self, local_path, remote_path, recursive=True):
        local = pathlib.Path(local_path)
        for path in local.rglob("*") if recursive else local.glob("*"):
            if path.is_file():
                self.files[f"{remote_path}/{path.relative_to(local).as_posix()}"] = str(path)


class Image:
    """Recorded, never built: on a calque pool the worker's environment is yours. `steps` is the builder chain as
    written ([name, args, kwargs] each); `pool create` checks its pip packages, snapshots its add_local_* files into
    the store and passes its env to the workers (calque.image_plan)."""

    def __init__(self, steps=()):
        self.steps = list(steps)

    def __getattr__(self, step):
        if step.startswith("_"):
            raise AttributeError(step)
        return lambda *args, **kwargs: Image(self.steps + [[step, list(args), kwargs]])

    @classmethod
    def _base(cls, name):
        return classmethod(lambda c, *args, **kwargs: cls([[name, list(args), kwargs]]))

    @contextlib.contextmanager
    def imports(self):
        """Modal runs the block in the image's containers and ignores its ImportError elsewhere: here, a worker
        (container=True) imports for real; `modal run` and `pool create` skip a missing module, as Modal does."""
        try:
            yield
        except ImportError:
            if container:
                raise


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
        _check_options(where, options)
        merged = {"image": self.image, **options}
        merged["secrets"] = self.secrets + list(options.get("secrets", ()))
        merged["volumes"] = {os.fspath(mount): vol for mount, vol in   # a str or a Path
                             {**self.volumes, **options.get("volumes", {})}.items()}

        def wrap(obj):
            self.registered[obj.__name__] = kind(self, obj, merged)
            return self.registered[obj.__name__]
        return wrap

    def cls(self, _warn_parentheses_missing=None, **options):
        _parentheses(_warn_parentheses_missing, "@app.cls")
        return self._register("@app.cls", Cls, options)

    def function(self, _warn_parentheses_missing=None, **options):
        _parentheses(_warn_parentheses_missing, "@app.function")
        return self._register("@app.function", Function, options)

    def local_entrypoint(self, _warn_parentheses_missing=None, *, name=None):
        _parentheses(_warn_parentheses_missing, "@app.local_entrypoint")

        def wrap(fn):
            self.entrypoints[name or fn.__name__] = fn
            return fn
        return wrap

    @property
    def registered_functions(self):
        """{name: Function} of the app's @app.function functions, as Modal's."""
        return {k: v for k, v in self.registered.items() if isinstance(v, Function)}

    @property
    def registered_classes(self):
        return {k: v for k, v in self.registered.items() if isinstance(v, Cls)}

    def include(self, other):
        self.registered.update(other.registered)
        return self

    def run(self, *args, **kwargs):
        _unsupported("app.run()", "run it as calque modal run app.py (the entrypoint runs locally, calls go to a pool)")

    @classmethod
    def lookup(cls, name, **_):
        _unsupported("modal.App.lookup (a deployed app, as Sandboxes use)",
                     "declare modal.App(name) in the file and run it with calque modal run")


def _parentheses(given, decorator):
    if given is not None:   # Modal refuses it too (InvalidError)
        raise Unsupported(f"{decorator} without parentheses ---> HINT: write {decorator}()")


class _Declared:
    """What @app.cls and @app.function make alike: their variants and deployed twins."""

    def with_options(self, **options):
        """Modal scales the variant apart; here its calls go to the same pool (options checked)."""
        _check_options(f"{self.__name__}.with_options", options)
        return self

    @classmethod
    def from_name(cls, app_name, name, **_):
        _unsupported(f"modal.{cls.__name__}.from_name (a deployed app)",
                     f"import the app file and call its {cls.declares}")


class Cls(_Declared):
    """What @app.cls makes of a class: Batcher(**params).method.map(...) on a pool; .user_cls for the worker."""
    declares = "class"

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

    def __call__(self, *args, **params):
        if args:   # Modal runs them through the class's own __init__ (deprecated since 0.73)
            _unsupported(f"{self.__name__}(*args), an __init__'s arguments,",
                         "declare them as modal.parameter() fields and pass them by name")
        unknown = set(params) - set(self.parameters())
        if unknown:
            raise app_error(TypeError(f"{self.__name__}() got parameters it does not declare: "
                                      f"{', '.join(sorted(unknown))}"))
        return Obj(self, params)

    def __getattr__(self, name):   # Modal 1.0 style: Cls.method without parameters
        if name in vars(self).get("user_cls", object).__dict__:
            return getattr(Obj(self, {}), name)
        raise AttributeError(name)


class Obj:
    def __init__(self, cls, params):
        self._cls, self._params = cls, params

    def __getattr__(self, name):
        if name not in self._cls.methods():
            raise app_error(AttributeError(f"{self._cls.__name__} has no @modal.method {name}"))
        return Handle(f"{self._cls.__name__}.{name}", self._params, getattr(self._cls.user_cls, name),
                      lambda: self._local_instance())

    def _local_instance(self):
        instance = self._cls.user_cls()
        for key, value in {**self._cls.parameters(), **self._params}.items():
            setattr(instance, key, value)
        return instance


class Function(_Declared):
    declares = "function"

    def __init__(self, app, fn, options):
        self.app, self.raw_f, self.options = app, fn, options
        self._handle = Handle(fn.__name__, {}, fn, None)
        functools.update_wrapper(self, fn)

    def __getattr__(self, name):
        if name in CALL_FORMS + ("local",):
            return getattr(vars(self)["_handle"], name)
        raise AttributeError(name)

    def __call__(self, *args, **kwargs):
        return self.raw_f(*args, **kwargs)


def _call_item(args, kwargs, *stream):
    """A call as one JSON item the worker unpacks into fn(*args, **kwargs) (calque.ModalHandler);
    `stream`: the id of a .remote_gen call, whose items the worker writes as they come
    (calque.Streamed)."""
    return {CALL_KEY: [list(args), dict(kwargs), *stream]}


CALL_KEY = "__modal_call__"
CALL_FORMS = ("remote", "remote_gen", "map", "starmap", "for_each", "spawn", "spawn_map")


def _on_thread(fn, *args, **kwargs):
    """A Future of fn's value, computed on a daemon thread: a pool's (asyncio.to_thread's) would be
    waited for at exit, so a signal could not end `modal run` while a call waits on its pool."""
    outcome = Future()

    def work():
        if outcome.set_running_or_notify_cancel():
            try:
                outcome.set_result(fn(*args, **kwargs))
            except BaseException as e:
                outcome.set_exception(e)
    threading.Thread(target=work, daemon=True).start()
    return outcome


async def _in_thread(fn, *args, **kwargs):
    return await asyncio.wrap_future(_on_thread(fn, *args, **kwargs))


async def _async_iter(results):
    done, results = object(), iter(results)
    while (value := await _in_thread(next, results, done)) is not done:
        yield value


class _CallForm:
    """One of .remote / .map / ... with its .aio twin: Modal's async interface, run on a thread."""

    def __init__(self, fn, iterates):
        self.fn, self.iterates = fn, iterates

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def aio(self, *args, **kwargs):
        if self.iterates:
            return _async_iter(self.fn(*args, **kwargs))
        return _in_thread(self.fn, *args, **kwargs)


def _remote_exception(result):
    """A failed item's error as Modal raises it: the exception the app raised, rebuilt where its
    class is the app's own or the standard library's (calque.ModalRun), made also a RemoteError; a
    line without it (the worker's own error) by its builtin type's name; else RemoteError("Type:
    message"). `where`: the app's innermost frame in it."""
    error, raised = RemoteError(result["error"]), result.get("exception")
    name, _, message = result["error"].partition(": ")
    if name == "RemoteError":   # a call's failed call (a worker's): said once
        error = RemoteError(message)
    base = getattr(builtins, name, None)
    if raised is None and isinstance(base, type) and issubclass(base, Exception):
        with contextlib.suppress(TypeError):
            raised = base(message)
    if raised is not None:
        kind = type(raised)
        with contextlib.suppress(TypeError):   # a class that cannot be mixed with RemoteError
            mixed = type(kind.__name__, (kind, RemoteError), {"__module__": kind.__module__,
                                                               "__qualname__": kind.__qualname__})
            error = mixed.__new__(mixed, *calque_values.exception_args(raised))
            error.args, error.__dict__ = raised.args, vars(raised)
    error.where = (result.get("raised") or {}).get("where")
    return error


class Handle:
    """A method or function as the entrypoint calls it: every call goes to the pool that serves `target`."""

    def __init__(self, target, params, fn, instance):
        self.target, self.params, self.fn, self.instance = target, params, fn, instance
        for name in CALL_FORMS:
            setattr(self, name, _CallForm(getattr(self, "_" + name), name in ("remote_gen", "map", "starmap")))

    def _results(self, items):
        if runner is None:
            _unsupported(f"{self.target}.remote/.map outside `calque modal run`",
                         "call it from the app's local entrypoint, run with calque modal run app.py")
        if getattr(self.fn, "_modal_role", {}).get("kind") == "web":
            _unsupported(f"calling web endpoint {self.target}", "call a plain @app.function or @modal.method")
        return runner(self.target, self.params, items)

    def _map(self, *iterables, kwargs=None, order_outputs=True, return_exceptions=False,
             wrap_returned_exceptions=True):
        """Results in input order as claims finish (order_outputs=False accepted: input order is one of the
        orders it allows). The first failed item raises unless return_exceptions."""
        return self._starmap(zip(*iterables), kwargs, return_exceptions=return_exceptions)

    def _starmap(self, iterable, kwargs=None, order_outputs=True, return_exceptions=False, **_):
        return self._values([_call_item(args, kwargs or {}) for args in iterable], return_exceptions)

    def _for_each(self, *iterables, kwargs=None, ignore_exceptions=False):
        for _ in self._map(*iterables, kwargs=kwargs, return_exceptions=ignore_exceptions):
            pass

    def _remote(self, *args, **kwargs):
        return next(iter(self._values([_call_item(args, kwargs)], False)))

    def _remote_gen(self, *args, **kwargs):
        """A generator's items as the worker produces them (read from the store in chunks,
        calque.Streamed); the call's result, the whole list, gives the rest and raises its error."""
        stream = uuid.uuid4().hex
        call, after, read = FunctionCall(self._results([_call_item(args, kwargs, stream)])), None, 0
        try:
            while True:
                done = call._outcome.done()
                for after, chunk in runner.streamed(self.target, self.params, stream, after):
                    if chunk["start"] > read:   # a redelivery's, timed otherwise: the result has it
                        continue
                    for value in chunk["values"][read - chunk["start"]:]:
                        read += 1
                        yield value
                if done or wait([call._outcome], timeout=0.1).done:
                    break
            yield from call.get()[read:]
        finally:
            runner.streamed(self.target, self.params, stream, done=True)

    def _spawn(self, *args, **kwargs):
        return FunctionCall(self._results([_call_item(args, kwargs)]))

    def _spawn_map(self, *iterables, kwargs=None):
        """Fire and forget, as Modal's: `modal run` waits for these calls before it deletes the pool."""
        self._results([_call_item(x, kwargs or {}) for x in zip(*iterables)])

    def local(self, *args, **kwargs):
        if self.instance is None:
            return self.fn(*args, **kwargs)
        return self.fn(self.instance(), *args, **kwargs)

    def _values(self, items, return_exceptions):
        for result in self._results(items):
            if result["ok"]:
                yield result["result"]
            elif return_exceptions:
                yield _remote_exception(result)
            else:
                raise _remote_exception(result)


class FunctionCall:
    """A spawned call: .get(), .object_id, FunctionCall.from_id (calls of this `modal run`), .gather."""
    _spawned = {}

    def __init__(self, results):
        # the call's result, or why the run cannot finish (ResultsIncomplete...): get() raises it
        self._outcome = _on_thread(next, iter(results))
        self.object_id = f"fc-{uuid.uuid4().hex}"
        FunctionCall._spawned[self.object_id] = self
        self.get = _CallForm(self._get, False)

    def _get(self, timeout=None):
        """The call's value; TimeoutError when it is not done within `timeout` s (0: done already), as Modal's."""
        try:
            outcome = self._outcome.result(timeout)
        except TimeoutError:
            error = TimeoutError(f"call {self.object_id} not done within {timeout} s")
            raise app_error(error) from None
        if not outcome["ok"]:
            raise _remote_exception(outcome)
        return outcome["result"]

    @classmethod
    def from_id(cls, function_call_id):
        if function_call_id not in cls._spawned:
            _unsupported(f"FunctionCall.from_id({function_call_id!r}) of another process",
                         "keep the FunctionCall of .spawn() in the entrypoint that made it")
        return cls._spawned[function_call_id]

    @staticmethod
    def gather(*calls):
        """Every call's value, in order; the first failed call raises, as Modal's."""
        return [call.get() for call in calls]


def is_local():
    return not container


def enable_output(*args, **kwargs):
    """calque prints its pools and the workers' output already."""
    return contextlib.nullcontext()


def _web(decorator):
    """A web endpoint is kept, marked: the file imports; serving it or calling it is refused (calque.py)."""
    return lambda *args, **kwargs: lambda fn: _role(fn, kind="web", web=decorator)


for _decorator in ("asgi_app", "wsgi_app", "web_endpoint", "fastapi_endpoint", "web_server"):
    globals()[_decorator] = _web(_decorator)


# ---- everything else: refused by name -------------------------------------------------------------------------
_REFUSED = {
    "Dict": "keep shared state in your own store (a file, Redis, S3)",
    "Queue": "submit items to the pool (calque.submit) instead of a Modal queue",
    "Sandbox": "run the command in the handler, or on Modal",
    "NetworkFileSystem": "use modal.Volume.from_name(N) with pool create --volume N=PATH",
    "CloudBucketMount": "use modal.Volume.from_name(N): on an s3:// store, its prefix volumes/N/",
    "Stub": "rename modal.Stub to modal.App (Modal did in 0.64)",
    "gpu": "write gpu=\"A100:2\" (a string), as Modal 1.0 does",
}


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    _unsupported(f"modal.{name}", _REFUSED.get(name, "remove it, or run this part on Modal"))
