"""Headless Chromium driven over its DevTools protocol, for the dashboard's browser test: Debian's `chromium`
package (installed by chromium_path() when absent and apt-get can), a fresh profile, and a WebSocket client of
a few lines (stdlib sockets) instead of a browser-automation package."""
import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1000", "--hide-scrollbars"]


def chromium_path():
    """The chromium binary, installed with apt-get when absent; (None, why) when it cannot be had."""
    found = shutil.which("chromium")
    if found:
        return found, None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "no `chromium` on PATH, and no root apt-get to install Debian's chromium package"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            return None, f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return shutil.which("chromium"), None


class WebSocket:
    """A client WebSocket (RFC 6455) over one socket: text frames out (masked), whole messages in."""

    def __init__(self, url):
        host, _, path = url.removeprefix("ws://").partition("/")
        name, port = host.split(":")
        self.sock = socket.create_connection((name, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET /{path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(4096)
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert b" 101 " in head.split(b"\r\n")[0], head

    def send(self, text):
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        length = struct.pack("!B", 0x80 | n) if n < 126 else (struct.pack("!BH", 0x80 | 126, n) if n < 65536 else
                                                               struct.pack("!BQ", 0x80 | 127, n))
        self.sock.sendall(b"\x81" + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _read(self, n):
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def receive(self):
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            n = struct.unpack("!H", self._read(2))[0] if n == 126 else struct.unpack("!Q", self._read(8))[0] \
                if n == 127 else n
            message += self._read(n)
            if first & 0x80:
                return message.decode()


class Browser:
    """One Chromium with one page: navigate, evaluate, screenshot; console errors, uncaught exceptions and
    JavaScript dialogs (an alert() would be one) are collected in `problems`."""

    def __init__(self, binary):
        self.profile = tempfile.mkdtemp(prefix="calque-chromium-")
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port, deadline = None, time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if "DevTools listening on ws://" in line:
                port = int(line.split("ws://")[1].split("/")[0].split(":")[1])
            elif not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30))
        self.ws = WebSocket(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"])
        self.next_id, self.problems = 0, []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.receive())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._event(message)

    def _event(self, message):
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.problems.append(f"console.{params['type']}: {params['args']}")
        elif method == "Runtime.exceptionThrown":
            self.problems.append(f"exception: {params['exceptionDetails']}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.problems.append(f"log: {params['entry']['text']} ({params['entry'].get('url')})")
        elif method == "Page.javascriptDialogOpening":
            self.problems.append(f"dialog: {params['message']}")
            self.call("Page.handleJavaScriptDialog", accept=True)

    def open(self, url):
        """Load `url` and wait for its load event (the old page marked first, so that it is not taken for it)."""
        self.value("window.leaving = true")
        self.call("Page.navigate", url=url)
        self.wait("!window.leaving && document.readyState === 'complete'")

    def value(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.value(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {expression}")

    def screenshot(self, path):
        height = self.value("document.documentElement.scrollHeight")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=min(int(height), 4000),
                  deviceScaleFactor=1, mobile=False)
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        self.call("Emulation.clearDeviceMetricsOverride")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
