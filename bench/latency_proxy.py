"""A loopback HTTP forwarder that adds a fixed delay before each request it forwards: moto_server with the
per-request latency of real SQS and S3 calls in a region (10-20 ms), so that what pipelining saves shows.

    moto_server -H 127.0.0.1 -p 5000 &
    python bench/latency_proxy.py --upstream http://127.0.0.1:5000 --delay-ms 15 --port 5015 &
    AWS_ENDPOINT_URL=http://127.0.0.1:5015 CALQUE_STORE=s3://bench/run python calque.py submit --pool demo items.jsonl

or, in-process: `url, stop = start_proxy("http://127.0.0.1:5000", 15)`, then stop() when done.

Each client connection has its own thread (keep-alive, as botocore's connection pool uses them) and its own
upstream connection, so requests in flight are delayed side by side, not queued behind each other. A long
poll (ReceiveMessage with WaitTimeSeconds) holds its thread for as long as moto_server holds it.
"""
import argparse
import http.client
import http.server
import socket
import sys
import threading
import time
import urllib.parse

HOP_HEADERS = ("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "expect")


def handler_class(upstream, delay):
    """The request handler: wait `delay` s, forward the request to `upstream`, relay the answer."""
    target = urllib.parse.urlsplit(upstream)

    class Forward(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"     # keep-alive, and the 100-continue botocore asks for on a PUT
        disable_nagle_algorithm = True    # else the body, sent after the headers, waits ~40 ms on a delayed ACK

        def forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(delay)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
            try:
                reply = self.ask_upstream(body, headers)
            except (http.client.HTTPException, OSError):    # moto_server closed a kept connection: once more
                self.upstream = None
                reply = self.ask_upstream(body, headers)
            data = reply.read()
            self.send_response(reply.status)
            for key, value in reply.getheaders():
                if key.lower() not in HOP_HEADERS:
                    self.send_header(key, value)
            # a HEAD's answer carries the object's length, with no body
            self.send_header("Content-Length", reply.getheader("Content-Length", "0") if self.command == "HEAD"
                             else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def ask_upstream(self, body, headers):
            """The upstream's reply, on this client connection's own upstream connection (opened when needed)."""
            if getattr(self, "upstream", None) is None:
                self.upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                self.upstream.connect()
                self.upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.upstream.request(self.command, self.path, body, headers)
            return self.upstream.getresponse()

        def handle_one_request(self):
            try:
                super().handle_one_request()
            except (BrokenPipeError, ConnectionResetError):     # the client went away first (it exited)
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        def log_message(self, *args):
            pass

    return Forward


def start_proxy(upstream, delay_ms, port=0):
    """A proxy to `upstream` adding `delay_ms` ms per request, served on 127.0.0.1:`port` (0: any free port) by a
    daemon thread: (its URL, a function that stops it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler_class(upstream, delay_ms / 1000.0))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="latency-proxy", daemon=True).start()

    def stop():
        server.shutdown()
        server.server_close()
    return f"http://127.0.0.1:{server.server_port}", stop


def main(argv=None):
    parser = argparse.ArgumentParser(description="Forward HTTP requests to an upstream after a fixed delay.")
    parser.add_argument("--upstream", required=True, help="where requests go, e.g. http://127.0.0.1:5000")
    parser.add_argument("--delay-ms", type=float, required=True, help="milliseconds added before each request")
    parser.add_argument("--port", type=int, required=True, help="port to listen on, on 127.0.0.1")
    args = parser.parse_args(argv)
    if not args.upstream.startswith("http://127.0.0.1:") or args.delay_ms < 0:
        print("latency_proxy: error: --upstream must be http://127.0.0.1:PORT and --delay-ms 0 or more ---> HINT: "
              "point it at a local moto_server", file=sys.stderr)
        return 2
    try:
        url, _ = start_proxy(args.upstream, args.delay_ms, args.port)
    except OSError as e:
        print(f"latency_proxy: error: cannot listen on 127.0.0.1:{args.port} ({e.strerror}) ---> HINT: pick a free "
              f"--port", file=sys.stderr)
        return 2
    print(f"latency_proxy: {url} -> {args.upstream}, +{args.delay_ms:g} ms per request", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:       # Ctrl-C: the way to stop it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
