"""make bench: a Modal Volume in the store. A 2-worker pool on one machine (local workers, an
s3:// store on moto_server) whose class reads BENCH_VOLUME_MB MB of weights from a volume at
import: the bytes its boot fetched from the store against the volume's size (goal: 1.0x, once for
the machine, not once per worker), and the bytes a second boot of the same machine fetches (goal:
0, its copy is current: one listing).

    .venv/bin/python bench/bench_volume.py          # BENCH_VOLUME_MB=256 for a larger volume

Bytes are counted at a proxy between the workers and moto_server: the objects' GETs under
volumes/ (a listing is counted apart). The machine is shared: read the bytes, not the seconds.
"""
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_pool import start_moto   # noqa: E402  (sets the dummy AWS environment)
import latency_proxy                # noqa: E402
import calque_core                  # noqa: E402

VOLUME_MB = int(os.environ.get("BENCH_VOLUME_MB", "64"))   # the volume's size, in 4 files
APP = '''
import os
import modal

app = modal.App("weights")
MOUNT = {mount!r}
# the weights read at import in the container, as a loader does (not pool create's import)
LOADED = 0 if modal.is_local() else sum(
    len(open(os.path.join(MOUNT, n), "rb").read()) for n in os.listdir(MOUNT))


@app.cls(volumes={{MOUNT: modal.Volume.from_name("weights")}})
class Model:
    @modal.method()
    def loaded(self, x):
        return LOADED
'''


def counting_proxy(upstream):
    """A proxy to moto_server that counts the bytes of each object GET under volumes/ and the
    LISTs there: (its URL, {"bytes", "gets", "lists"})."""
    counts = {"bytes": 0, "gets": 0, "lists": 0}

    class Counting(latency_proxy.handler_class(upstream, 0)):
        def send_header(self, key, value):
            url = urllib.parse.urlsplit(self.path)
            if key == "Content-Length" and self.command == "GET":
                if "/volumes/" in url.path:
                    counts["bytes"] += int(value)
                    counts["gets"] += 1
                elif "volumes%2F" in url.query or "volumes/" in urllib.parse.unquote(url.query):
                    counts["lists"] += 1
            super().send_header(key, value)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", counts


def calque(env, cwd, *args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        sys.exit(f"bench_volume: calque {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def main():
    moto = start_moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, CALQUE_STORE="s3://bench/volume",
                       CALQUE_STATE=os.path.join(tmp, "state"),
                       CALQUE_ENV=os.path.join(tmp, "none.env"))
            store = calque_core.open_backend(env["CALQUE_STORE"]).store
            size = VOLUME_MB * 2**20
            for n in range(4):
                store.put(f"volumes/weights/part-{n}.safetensors", os.urandom(size // 4))
            with open(os.path.join(tmp, "app.py"), "w") as f:
                f.write(APP.format(mount=os.path.join(tmp, "weights")))
            url, counts = counting_proxy(os.environ["AWS_ENDPOINT_URL"])
            env["AWS_ENDPOINT_URL"] = url
            print(f"volume: a 2-worker machine (local workers, moto_server) whose class reads a "
                  f"volume of {VOLUME_MB} MB (4 files) at import")
            boots = (("first boot", "create", "--handler", "app.py:Model"),
                     ("second boot", "scale"))
            for label, verb, *handler in boots:
                if verb == "scale":
                    calque(env, tmp, "pool", "scale", "--model", "w", "--workers", "0")
                before, started = dict(counts), time.monotonic()
                calque(env, tmp, "pool", verb, "--model", "w", *handler, "--workers", "2")
                got = {k: counts[k] - before[k] for k in counts}
                print(f"  {label:<12} fetched {got['bytes'] / 2**20:8.1f} MB = "
                      f"{got['bytes'] / size:.2f}x the volume ({got['gets']} GETs, {got['lists']} "
                      f"LISTs); 2 workers warm in {time.monotonic() - started:.1f} s", flush=True)
            with open(os.path.join(tmp, "items.jsonl"), "w") as f:
                f.write("1\n2\n")
            calque(env, tmp, "submit", "--pool", "w", "items.jsonl", "--claim-size", "1")
            loaded = calque(env, tmp, "runs", "results", "latest").stdout.splitlines()
            if [json.loads(line)["result"] for line in loaded] != [size, size]:
                sys.exit(f"bench_volume: the workers did not read the whole volume: {loaded}")
            calque(env, tmp, "pool", "delete", "--model", "w", "--yes", "--force")
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
