#!/usr/bin/env python3
"""Serve the PPD router's Prometheus metrics on the pod's address.

The router binds its metrics server (`--metrics-port`) to 127.0.0.1, which Prometheus cannot
scrape from outside the pod. The Helm chart runs this proxy as a sidecar in the router's pod (same
network namespace): GET /metrics on --listen is answered with GET --upstream. Standard library
only; it ships in the router image as /opt/dynamo-ppd/metrics_proxy.py.

    python metrics_proxy.py --listen 0.0.0.0:9464 --upstream http://127.0.0.1:28808/metrics
"""

from __future__ import annotations

import argparse
import signal
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(upstream: str, timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                return self._reply(200, b"ok\n", "text/plain")
            if path != "/metrics":
                return self._reply(404, b"only /metrics and /healthz\n", "text/plain")
            try:
                with urllib.request.urlopen(upstream, timeout=timeout_s) as response:
                    body = response.read()
                    ctype = response.headers.get("Content-Type", "text/plain; version=0.0.4")
            except (urllib.error.URLError, OSError) as exc:
                return self._reply(502, f"router metrics unavailable: {exc}\n".encode(), "text/plain")
            self._reply(200, body, ctype)

        def _reply(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 (scrapes every 15 s: stay quiet)
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Serve the PPD router's 127.0.0.1 metrics on the pod address.")
    p.add_argument("--listen", default="0.0.0.0:9464", help="HOST:PORT to serve on (default: %(default)s)")
    p.add_argument("--upstream", default="http://127.0.0.1:28808/metrics",
                   help="the router's metrics URL (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="upstream timeout in seconds")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), make_handler(args.upstream, args.timeout))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"metrics proxy: http://{args.listen}/metrics -> {args.upstream}", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
