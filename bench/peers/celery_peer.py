"""The Celery peer of calque's moto_server benchmark: the same workload on Celery 5.x, for bench/peers/compare.py.

    PY=.venv-peers/bin/python
    $PY bench/peers/celery_peer.py workers --endpoint http://127.0.0.1:5000 --workers 2   # prints {"pids": [...]}
    $PY bench/peers/celery_peer.py client --endpoint http://127.0.0.1:5000 --items items.jsonl --task-size 100

What runs, and what it stands for on calque's side:
- broker: kombu's SQS transport at --endpoint (moto_server, or the latency proxy in front of it), queue
  peer-$PEER_QUEUE (peer-calque-peer); long polls of 20 s (calque's CALQUE_POLL_WAIT), no extra wait between polls;
- task_acks_late and worker_prefetch_multiplier 1: a worker holds one message at a time and deletes it only after
  its task ran and its result was stored (calque: results, summary, then the ack);
- result backend: Celery's own S3 backend (s3_endpoint_url = --endpoint), bucket --bucket: one PUT per task,
  and the client's AsyncResult.get is a HEAD then a GET per result (404 HEADs while it is not there yet);
- --workers processes, each `celery worker --pool solo` (one process that polls the queue and runs the model,
  as one warmd.py does), without gossip, mingle, heartbeats or remote control (SQS has no broadcast);
- the model: examples/demo_model.py's DemoModel, loaded once per worker before it says it is ready; a task
  carries its items in its message (JSON, Celery's way) and returns DemoModel.predict's outputs.
The client reads the JSONL items file, sends one task per --task-size items (SendMessage each: Celery has no
batch send), then joins the results in order (ResultSet.join, Celery's default interval of 0.5 s) and prints
{"items", "tasks", "failed"} as JSON. compare.py times the client process whole, as it times calque's submit.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from urllib.parse import quote, urlsplit

from celery import Celery, signals
from celery.result import ResultSet

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# ------------------------------------------------------------------------------------------------
ENDPOINT = os.environ.get("PEER_ENDPOINT", "http://127.0.0.1:5000")   # moto_server, or a proxy in front of it
BUCKET = os.environ.get("PEER_BUCKET", "peers")    # the S3 result backend's bucket (compare.py creates it)
QUEUE = os.environ.get("PEER_QUEUE", "calque-peer")   # the task queue (SQS name: peer-QUEUE); one a run
POLL_WAIT = 20                                      # s of one SQS long poll (calque's CALQUE_POLL_WAIT)
VISIBILITY = 60                                     # s a received task stays invisible (calque's default)
READY_WAIT = 120                                    # s the workers may take to load the model and start polling
RESULTS_WAIT = 3600                                 # s the client waits for every result
LOG_LEVEL = os.environ.get("PEER_LOG_LEVEL", "WARNING")   # the workers' (INFO logs each task; in their log files)


def configure(celery, endpoint, bucket):
    """Point the app at `endpoint`: SQS broker, S3 results, acks late, prefetch 1 (see the docstring)."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID", "testing"), os.environ.get("AWS_SECRET_ACCESS_KEY", "testing")
    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    celery.conf.update(
        broker_url=f"sqs://{quote(key, safe='')}:{quote(secret, safe='')}@{urlsplit(endpoint).netloc}//",
        broker_transport_options={"region": region, "is_secure": False, "queue_name_prefix": "peer-",
                                  "wait_time_seconds": POLL_WAIT, "polling_interval": 0,
                                  "visibility_timeout": VISIBILITY},
        broker_connection_retry_on_startup=True,
        result_backend="s3", s3_bucket=bucket, s3_base_path="results/", s3_endpoint_url=endpoint,
        s3_access_key_id=key, s3_secret_access_key=secret, s3_region=region,
        task_acks_late=True, worker_prefetch_multiplier=1, task_default_queue=QUEUE,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        worker_enable_remote_control=False, worker_send_task_events=False, worker_hijack_root_logger=False)


app = Celery("celery_peer")
configure(app, ENDPOINT, BUCKET)   # a worker process is configured by its environment (run_workers sets it)
_model = []   # the worker's DemoModel, loaded once


def model():
    if not _model:
        sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
        from demo_model import DemoModel
        demo = DemoModel()
        demo.load()
        _model.append(demo)
    return _model[0]


@app.task(name="predict")
def predict(items):
    return model().predict(items)


@signals.worker_ready.connect
def loaded(**_):
    """Load the model before saying ready (a file the `workers` command waits for): tasks find it warm."""
    model()
    ready = os.environ.get("PEER_READY_FILE")
    if ready:
        open(ready, "w").close()


def run_workers(args):
    """Start args.workers `celery worker --pool solo` processes, print {"pids": [...]} once all are ready, and stop
    them (SIGTERM: warm shutdown) when stdin closes."""
    state = tempfile.mkdtemp(prefix="celery-peer-")
    procs, ready = [], []
    for n in range(args.workers):
        ready.append(os.path.join(state, f"ready-{n}"))
        env = dict(os.environ, PEER_ENDPOINT=args.endpoint, PEER_BUCKET=args.bucket, PEER_READY_FILE=ready[-1])
        log = open(os.path.join(state, f"worker-{n}.log"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_peer", "worker", "--pool", "solo", "--concurrency", "1",
             "-Q", QUEUE, "-n", f"peer{n}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", LOG_LEVEL], cwd=HERE, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
    deadline = time.monotonic() + READY_WAIT
    while not all(os.path.exists(r) for r in ready):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            sys.exit(f"celery_peer: workers not ready (exited: {[p.args[-1] for p in dead]}); logs in {state}")
        time.sleep(0.1)
    print(json.dumps({"pids": [p.pid for p in procs], "logs": state}), flush=True)
    sys.stdin.read()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait()


def chunks(path, size):
    """The JSONL file's items, a list of `size` at a time (the last one the rest)."""
    chunk = []
    with open(path) as f:
        for line in f:
            if line.strip():
                chunk.append(json.loads(line))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def run_client(args):
    """Send the items as tasks of args.task_size, join every result, print what came back."""
    configure(app, args.endpoint, args.bucket)
    sent = [predict.apply_async((chunk,), queue=QUEUE) for chunk in chunks(args.items, args.task_size)]
    outputs = ResultSet(sent).join(timeout=RESULTS_WAIT)
    print(json.dumps({"items": sum(len(o) for o in outputs), "tasks": len(sent),
                      "failed": sum(not isinstance(o, list) for o in outputs)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("workers", "client"):
        p = sub.add_parser(name)
        p.add_argument("--endpoint", default=ENDPOINT, help="S3 + SQS endpoint URL (moto_server, or a proxy)")
        p.add_argument("--bucket", default=BUCKET, help="the result backend's bucket (must exist)")
        if name == "workers":
            p.add_argument("--workers", type=int, default=2, help="celery worker processes (--pool solo each)")
        else:
            p.add_argument("--items", required=True, help="JSONL items file")
            p.add_argument("--task-size", type=int, default=100, help="items per task")
    args = parser.parse_args()
    (run_workers if args.command == "workers" else run_client)(args)


if __name__ == "__main__":
    main()
