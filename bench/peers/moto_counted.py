"""moto_server for the benchmarks: the same server as `moto_server -H 127.0.0.1 -p PORT`, which also answers
GET /_bench/counts with {operation: requests served so far}, and whose SQS reads the clock cheaply.

    .venv/bin/python bench/peers/moto_counted.py --port 5000
    .venv/bin/python bench/peers/moto_counted.py --port 5000 --stock-clock    # moto's SQS exactly as shipped

Counting at the server is the one measure that treats calque and a peer alike, whatever client library each uses
(kombu receives through pycurl, which no boto3 hook sees).

The clock: moto 5.2's SQS asks each message it holds whether it is visible and whether it is delayed, through
`unix_time_millis()`, which builds two datetimes, on every send (reading one queue attribute builds them all,
the message counts among them) and every receive: a message sent costs moto ~25 us of CPU for each message
already queued. At 1,000 messages queued a SendMessageBatch cost moto 260 ms of its CPU and a ReceiveMessage 127
ms, so a benchmark on stock moto measured moto's clock, not the clients; real SQS has no such cost. Here moto.sqs.models reads
"now" from time.time() instead: the same value (seconds since the epoch, UTC), 14-18x less of moto's CPU at
those depths. Everything else is moto as shipped.

An operation is "SQS <action>" (the X-Amz-Target of SQS's JSON protocol) or "S3 <LIST|GET|PUT|HEAD|DELETE|POST>"
(LIST: a GET on a bucket, which is a listing).
"""
import argparse
import collections
import json
import os
import threading
import time

import moto.sqs.models
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple

COUNTS_PATH = "/_bench/counts"   # the path that answers the counts (JSON) instead of serving moto


def operation(environ):
    """The request's operation name (see the module docstring)."""
    target = environ.get("HTTP_X_AMZ_TARGET")
    if target:
        return "SQS " + target.rsplit(".", 1)[-1]
    method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/").strip("/")
    if method == "GET" and "/" not in path:   # path-style: /bucket?list-type=2... lists, /bucket/key reads
        return "S3 LIST"
    return "S3 " + method


def counting(app):
    """The WSGI app `app`, counting each request's operation; COUNTS_PATH answers the counts."""
    counts, lock = collections.Counter(), threading.Lock()

    def serve(environ, start_response):
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with lock:
                body = json.dumps(counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        with lock:
            counts[operation(environ)] += 1
        return app(environ, start_response)
    return serve


def cheap_clock():
    """moto's SQS reads "now" from time.time(); a datetime given to its clock functions still goes through moto's."""
    unix_time, unix_time_millis = moto.sqs.models.unix_time, moto.sqs.models.unix_time_millis
    moto.sqs.models.unix_time = lambda dt=None: time.time() if dt is None else unix_time(dt)
    moto.sqs.models.unix_time_millis = lambda dt=None: time.time() * 1000.0 if dt is None else unix_time_millis(dt)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stock-clock", action="store_true", help="moto's SQS clock as shipped (slow, see above)")
    args = parser.parse_args()
    if not args.stock_clock:
        cheap_clock()
    os.environ.setdefault("MOTO_PORT", str(args.port))   # as moto_server does: the URLs moto hands out name it
    run_simple(args.host, args.port, counting(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
