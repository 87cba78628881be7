"""Shared fixtures. Every test talks only to 127.0.0.1: dummy AWS credentials, no EC2 metadata, and a
guard that fails any in-process connection to a non-loopback address."""
import contextlib
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

os.environ.update(AWS_EC2_METADATA_DISABLED="true", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                  AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1")
for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "CALQUE_ENV"):
    os.environ.pop(var, None)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))   # the bench helpers some tests share (latency_proxy, bench_dashboard)
from common import warmd_command  # noqa: E402
import calque_core

PY = sys.executable
HANDLERS = os.path.join(ROOT, "tests", "handlers.py")

_connect = socket.socket.connect


def _loopback_only(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"test tried to reach {address}: only loopback is allowed")
    return _connect(self, address)


socket.socket.connect = _loopback_only


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local_env(tmp_path):
    """Environment for a subprocess on a fresh embedded backend."""
    env = dict(os.environ, CALQUE_STORE=str(tmp_path / "store"), CALQUE_STATE=str(tmp_path / "state"),
               CALQUE_POLL_WAIT="1", CALQUE_GRACE="5", PYTHONUNBUFFERED="1", CALQUE_ENV=str(tmp_path / "none.env"))
    return env


@contextlib.contextmanager
def serving(command):
    """The server that `command(port)` (an argv) starts on a free loopback port: its URL once it accepts
    connections; stopped after."""
    port = free_port()
    proc = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError(f"{command(port)[:2]} did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def moto_endpoint():
    """A moto_server on 127.0.0.1 for multi-process AWS tests (with the deep-learning AMI's public parameter)."""
    with serving(lambda port: [PY, os.path.join(ROOT, "tests", "moto_public.py"), "-H", "127.0.0.1",
                               "-p", str(port)]) as url:
        yield url


@pytest.fixture
def aws_env(tmp_path, moto_endpoint):
    """Environment for a subprocess on SQS + S3 served by moto_server, with a fresh bucket. The endpoint that
    backend_for sets in this process's environment is put back as it was after the test: a later test's
    in-process mock_aws must not send its calls to moto_server, whatever order the tests run in."""
    import boto3
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    bucket = f"calque-test-{os.urandom(4).hex()}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    yield dict(os.environ, AWS_ENDPOINT_URL=moto_endpoint, CALQUE_STORE=f"s3://{bucket}/root",
               CALQUE_STATE=str(tmp_path / "state"), CALQUE_POLL_WAIT="1", CALQUE_GRACE="5", PYTHONUNBUFFERED="1",
               CALQUE_ENV=str(tmp_path / "none.env"))
    if endpoint is None:
        os.environ.pop("AWS_ENDPOINT_URL", None)
    else:
        os.environ["AWS_ENDPOINT_URL"] = endpoint


def cli(env, *args, stdin=None, timeout=120, cwd=ROOT):
    """Run `python calque.py ARGS` as a real process (in the checkout, or `cwd`)."""
    return subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


_workers = []   # every warmd.py a test started: killed after the test if it is still running


def start_worker(env, *args, log=None, constants=None):
    """A warmd.py process; `constants`: warmd's module constants to set in it first ({"AHEAD": True})."""
    proc = subprocess.Popen(warmd_command(*args, constants=constants), env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=log or subprocess.DEVNULL, stderr=log or subprocess.STDOUT, text=True)
    _workers.append(proc)
    return proc


@pytest.fixture(autouse=True)
def no_leftover_processes(tmp_path):
    """A failed test must not leave workers or detached pool supervisors running (they would load the
    machine for every later test): kill what the test started and did not stop."""
    yield
    while _workers:
        proc = _workers.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for status in tmp_path.glob("**/pools/*/supervisor.json"):
        try:
            os.kill(json.loads(status.read_text())["pid"], signal.SIGTERM)   # it stops its own workers
        except (OSError, ValueError, KeyError):
            pass


def wait_for(predicate, timeout=30.0, what="condition"):
    """Poll predicate() until it is truthy; fail the test after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def write_items(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return str(path)


def backend_for(env):
    """An in-process backend on the same store a subprocess with `env` uses."""
    import calque
    if env["CALQUE_STORE"].startswith("s3://"):
        os.environ["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"]
    return calque_core.open_backend(env["CALQUE_STORE"])


@pytest.fixture(params=["local", "moto_server"])
def any_env(request):
    """The environment of local_env, then of aws_env: a test that must hold on both backends."""
    return request.getfixturevalue("local_env" if request.param == "local" else "aws_env")


def pool_pids(env, model="m"):
    """The supervisor's pid and its live workers' pids, from its status file (None, [] when there is none)."""
    try:
        with open(os.path.join(env["CALQUE_STATE"], "pools", model, "supervisor.json")) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return None, []
    return status["pid"], [w["pid"] for w in status["workers"] if w["pid"]]


ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                 b'<Message>Access Denied</Message><RequestId>fault-proxy</RequestId></Error>')


class FaultProxy:
    """A loopback HTTP proxy in front of moto_server: while `failing` is set it answers every PUT (an S3 object
    write) with 403 AccessDenied, as S3 does to a role whose write permission is gone; all else passes through
    (the signature stays valid: Host is passed on). `seen` lists each request as answered: its method, path,
    query, body, X-Amz-Target header and status."""

    def __init__(self, target):
        host, port = target.rsplit("/", 1)[1].split(":")
        proxy, self.failing, self.refused, self.seen = self, threading.Event(), 0, []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"     # keep-alive, and the 100-continue botocore asks for on a PUT

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.command == "PUT" and proxy.failing.is_set():
                    proxy.refused += 1
                    status, headers, data = 403, [("Content-Type", "application/xml")], ACCESS_DENIED
                else:
                    conn = http.client.HTTPConnection(host, int(port), timeout=60)
                    try:
                        conn.request(self.command, self.path, body,
                                     {k: v for k, v in self.headers.items() if k.lower() != "expect"})
                        reply = conn.getresponse()
                        status, headers, data = reply.status, reply.getheaders(), reply.read()
                    except (OSError, http.client.HTTPException):   # moto_server stopping at the end
                        self.close_connection = True
                        return
                    finally:
                        conn.close()
                url = urllib.parse.urlsplit(self.path)
                proxy.seen.append({"method": self.command, "path": urllib.parse.unquote(url.path),
                                   "query": urllib.parse.parse_qs(url.query, keep_blank_values=True),
                                   "target": self.headers.get("X-Amz-Target", ""), "body": body,
                                   "status": status})
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", dict(headers).get("Content-Length", str(len(data)))
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
