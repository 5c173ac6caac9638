"""The benchmark client against a tiny local OpenAI stub with known timings, and `bench compare`
end to end on the simulated cluster."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dynamo_ppd.bench.client import run_manifest
from dynamo_ppd.bench.manifest import Manifest, ManifestConversation, ManifestTurn
from dynamo_ppd.bench.results import summarize

FIRST_TOKEN_S = 0.080
GAP_S = 0.020


class Stub(BaseHTTPRequestHandler):
    """Answers /v1/models and streams max_tokens tokens: the first after FIRST_TOKEN_S, then one
    every GAP_S. Remembers every request body and session header."""

    seen: list[tuple[dict, str | None]] = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Stub.seen.append((request, self.headers.get("x-dynamo-session-id")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        time.sleep(FIRST_TOKEN_S)
        for i in range(request["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub():
    Stub.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_client_measures_known_timings_and_sends_real_history(stub):
    manifest = Manifest(header=None, conversations=[
        ManifestConversation("c1", 0.0, [ManifestTurn(max_tokens=6, user_text="hello"),
                                         ManifestTurn(max_tokens=4, user_tokens=5, think_time_s=0.1)]),
        ManifestConversation("c2", 0.05, [ManifestTurn(max_tokens=3, user_text="hi")]),
    ])
    results = asyncio.run(run_manifest(stub, manifest))
    assert sorted((r.conversation_id, r.turn) for r in results) == [("c1", 1), ("c1", 2), ("c2", 1)]
    for r in results:
        assert r.ok and r.ttft_s == pytest.approx(FIRST_TOKEN_S, abs=0.03)
        assert r.tpot_s == pytest.approx(GAP_S, abs=0.008)
        assert r.lag_s < 0.02  # the client kept to its schedule
    c1 = sorted((r for r in results if r.conversation_id == "c1"), key=lambda r: r.turn)
    assert c1[1].sent_s - (c1[0].sent_s + c1[0].e2e_s) == pytest.approx(0.1, abs=0.03)  # think time
    # The second turn carried the first turn's real reply; one session id per conversation.
    bodies = [(b, s) for b, s in Stub.seen if b["messages"][0]["content"] == "hello"]
    second = next(b for b, _ in bodies if len(b["messages"]) == 3)
    assert second["messages"][1]["role"] == "assistant"
    assert second["messages"][1]["content"].strip() == "t0 t1 t2 t3 t4 t5"
    assert len({s for _, s in bodies}) == 1 and all(b["ignore_eos"] and b["stream"] for b, _ in Stub.seen)
    point = summarize("stub", "test", 1.0, results, duration_s=1.0)
    o = point.outcome
    assert o.success_rate == 100.0 and o.total_requests == 3 and o.timeout_s == 30.0
    assert o.turn2.count == 1 and o.turn1.count == 2
    assert o.turn1.avg_ttft_s == pytest.approx(FIRST_TOKEN_S, abs=0.03)
    assert o.all_turns.avg_tpot_s == pytest.approx(GAP_S, abs=0.008)  # (e2e - TTFT) / (tokens - 1)


def test_client_reports_failures():
    manifest = Manifest(header=None, conversations=[
        ManifestConversation("bad", 0.0, [ManifestTurn(max_tokens=2, user_text="x")])])
    results = asyncio.run(run_manifest("http://127.0.0.1:1", manifest, model="m"))  # nothing listens
    assert len(results) == 1 and not results[0].ok and results[0].error


def test_bench_compare_two_systems_end_to_end(model_dir, tmp_path):
    """`bench compare` brings up pd and ppd on the simulated cluster, plays the same manifest,
    and writes results.json, results.md and a plot."""
    from dynamo_ppd.bench import results as res
    from dynamo_ppd.bench.compare import compare

    out = tmp_path / "out"
    results = compare(["pd", "ppd"], "turns-4", None, [1.0], duration_s=4, config="1P2D", out_dir=out)
    assert {p.system for p in results.points} == {"pd", "ppd"}
    for point in results.points:
        o = point.outcome
        assert o.total_requests > 0 and o.success_rate == 100.0
        assert o.turn2.count > 0 and o.all_turns.p50_tpot_s is not None and o.all_turns.p50_tpot_s > 0
        assert point.client_lag_ms.p99 < 50  # the client kept up
    assert res.load(out / "results.json") == results
    old = out / "old.json"
    old.write_text('{"version": 1, "config": "1P2D", "points": []}')
    with pytest.raises(res.ResultsError, match="results version 1, this dynamo-ppd reads version 2"):
        res.load(old)
    table = (out / "results.md").read_text()
    assert "| ppd | turns-4 | 1 |" in table and "x)" in table  # ratios to pd
    assert (out / "turns-4.png").stat().st_size > 10_000
