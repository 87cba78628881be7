"""moto_server that counts what it serves: the same server as `moto_server -H 127.0.0.1 -p PORT`, which also
answers GET /_bench/counts with {operation: requests served so far}. Counting at the server is the one measure
that treats calque and a peer alike, whatever client library each uses (kombu receives through pycurl, which no
boto3 hook sees).

    .venv/bin/python bench/peers/moto_counted.py --port 5000

An operation is "SQS <action>" (the X-Amz-Target of SQS's JSON protocol) or "S3 <LIST|GET|PUT|HEAD|DELETE|POST>"
(LIST: a GET on a bucket, which is a listing).
"""
import argparse
import collections
import json
import os
import threading

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))   # as moto_server does: the URLs moto hands out name it
    run_simple(args.host, args.port, counting(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
