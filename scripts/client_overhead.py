#!/usr/bin/env python3
"""How much the benchmark client adds to TTFT: play a 20 conv/s manifest against a local stub (its
own process) that answers every request 50 ms after it arrived, then one token every 10 ms. The
stub puts in the first chunk when the request's headers arrived and when that chunk was written
and keeps, per request, the time from the request's arrival to its first chunk; the client's TTFT
minus that server-side span is what the client and loopback HTTP add.

    .venv/bin/python scripts/client_overhead.py [--rate 20] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dynamo_ppd.bench.client import run_manifest
from dynamo_ppd.workloads.generators import make_workload

FIRST_TOKEN_S, GAP_S = 0.050, 0.010


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    spans: dict[str, float] = {}  # "conversation|turn" -> seconds from arrival to first chunk

    def do_GET(self):
        payload = Stub.spans if self.path == "/spans" else {"data": [{"id": "stub"}]}
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        arrived = time.monotonic()  # headers parsed; the body is read next
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(request["max_tokens"]):
            time.sleep(max(0.0, arrived + FIRST_TOKEN_S + i * GAP_S - time.monotonic()))
            data = f"data: {json.dumps({'choices': [{'delta': {'content': ' x'}}]})}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            if i == 0:  # session header: bench-<seed>-<conversation>-<ns>
                conversation = self.headers["x-dynamo-session-id"].split("-")[2]
                turn = (len(request["messages"]) + 1) // 2
                Stub.spans[f"{conversation}|{turn}"] = time.monotonic() - arrived
        end = b"data: [DONE]\n\n"
        self.wfile.write(f"{len(end):x}\r\n".encode() + end + b"\r\n0\r\n\r\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="conversations per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of arrivals")
    args = parser.parse_args()
    # The stub runs in its own process, so the client's measurement is not slowed by it.
    ports: multiprocessing.Queue = multiprocessing.Queue()
    stub = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    stub.start()
    port = ports.get(timeout=10)
    manifest = make_workload("turns-2", args.rate, args.seconds, seed=0)
    url = f"http://127.0.0.1:{port}"
    results = asyncio.run(run_manifest(url, manifest, model="stub"))
    spans = json.loads(urllib.request.urlopen(f"{url}/spans").read())
    extra = sorted((r.ttft_s - spans[f"{r.conversation_id}|{r.turn}"]) * 1e3
                   for r in results if r.ok and r.ttft_s is not None)
    lag = sorted(r.lag_s * 1e3 for r in results)
    print(f"{len(results)} requests at {args.rate:g} conv/s ({sum(r.ok for r in results)} ok)")
    p90, p99 = extra[int(0.9 * (len(extra) - 1))], extra[int(0.99 * (len(extra) - 1))]
    print(f"client TTFT minus the stub's own time to first chunk: p50 {statistics.median(extra):.2f} ms, "
          f"p90 {p90:.2f} ms, p99 {p99:.2f} ms")
    print(f"client lag against the schedule: p50 {statistics.median(lag):.2f} ms, "
          f"p99 {lag[int(0.99 * (len(lag) - 1))]:.2f} ms")
    stub.terminate()


def _serve(ports) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    ports.put(server.server_address[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
