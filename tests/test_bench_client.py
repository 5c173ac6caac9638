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
from dynamo_ppd.bench.results import summarize
from dynamo_ppd.workloads.manifest import Manifest, ManifestConversation, ManifestTurn

pytestmark = pytest.mark.e2e

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
        anthropic = self.path == "/v1/messages"  # the Messages API's events, as Dynamo streams them
        if anthropic:
            self._event("message_start", {"type": "message_start", "message": {
                "content": [], "usage": {"input_tokens": 11, "output_tokens": 0}}})
        time.sleep(FIRST_TOKEN_S)
        for i in range(request["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            if anthropic:
                self._event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": f" t{i}"}})
                continue
            chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        if anthropic:
            self._event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                          "usage": {"output_tokens": request["max_tokens"]}})
            self._event("message_stop", {"type": "message_stop"})
            return
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, kind: str, data: dict) -> None:
        self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


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


def test_an_agent_workloads_shared_system_prompt_opens_every_conversation(stub):
    from dynamo_ppd.workloads.manifest import ManifestHeader

    manifest = Manifest(header=ManifestHeader(workload="agents", shared_prefix_tokens=40), conversations=[
        ManifestConversation(f"a{i}", 0.01 * i, [ManifestTurn(max_tokens=2, user_text=f"task {i}"),
                                                 ManifestTurn(max_tokens=2, user_tokens=3)])
        for i in range(3)])
    Stub.seen.clear()
    results = asyncio.run(run_manifest(stub, manifest))
    assert len(results) == 6 and all(r.ok for r in results)
    systems = {b["messages"][0]["content"] for b, _ in Stub.seen}
    assert len(systems) == 1 and len(next(iter(systems)).split()) > 10  # one prompt, shared by all
    assert all(b["messages"][0]["role"] == "system" for b, _ in Stub.seen)
    assert {b["messages"][1]["content"] for b, _ in Stub.seen if len(b["messages"]) == 2} == \
        {"task 0", "task 1", "task 2"}


def test_the_client_speaks_the_anthropic_messages_api(stub):
    from dynamo_ppd.workloads.manifest import ManifestHeader

    manifest = Manifest(header=ManifestHeader(workload="agents", shared_prefix_tokens=20), conversations=[
        ManifestConversation("m1", 0.0, [ManifestTurn(max_tokens=5, user_text="hello"),
                                         ManifestTurn(max_tokens=3, user_tokens=4, think_time_s=0.05)])])
    Stub.seen.clear()
    results = sorted(asyncio.run(run_manifest(stub, manifest, api="messages")), key=lambda r: r.turn)
    assert [r.ok for r in results] == [True, True] and [r.output_tokens for r in results] == [5, 3]
    assert results[0].ttft_s == pytest.approx(FIRST_TOKEN_S, abs=0.03)
    assert results[0].tpot_s == pytest.approx(GAP_S, abs=0.008)
    first, second = (body for body, _ in Stub.seen)
    assert set(first) == {"model", "max_tokens", "stream", "messages", "system"}  # no chat-only fields
    assert first["system"] == second["system"] and first["messages"] == [{"role": "user", "content": "hello"}]
    assert second["messages"][1] == {"role": "assistant", "content": " t0 t1 t2 t3 t4"}
    with pytest.raises(ValueError, match="unknown api"):
        asyncio.run(run_manifest(stub, manifest, api="grpc"))


def test_client_reports_failures():
    manifest = Manifest(header=None, conversations=[
        ManifestConversation("bad", 0.0, [ManifestTurn(max_tokens=2, user_text="x")])])
    results = asyncio.run(run_manifest("http://127.0.0.1:1", manifest, model="m"))  # nothing listens
    assert len(results) == 1 and not results[0].ok and results[0].error


def test_dilated_client_stretches_the_schedule_and_reports_model_time(stub):
    """At dilation 2 the stub's 80 ms first token and 20 ms gaps are 40 ms and 10 ms of model
    time; the think time and the arrivals are stretched on the wall clock."""
    manifest = Manifest(header=None, conversations=[
        ManifestConversation("c1", 0.05, [ManifestTurn(max_tokens=4, user_text="hello"),
                                          ManifestTurn(max_tokens=4, user_tokens=3, think_time_s=0.1)])])
    results = sorted(asyncio.run(run_manifest(stub, manifest, dilation=2.0)), key=lambda r: r.turn)
    assert [r.ok for r in results] == [True, True]
    for r in results:
        assert r.ttft_s == pytest.approx(FIRST_TOKEN_S / 2, abs=0.015)
        assert r.tpot_s == pytest.approx(GAP_S / 2, abs=0.005)
    assert results[0].sent_s == pytest.approx(0.05, abs=0.01)  # model seconds from the start
    gap = results[1].sent_s - (results[0].sent_s + results[0].e2e_s)
    assert gap == pytest.approx(0.1, abs=0.015)  # the think time, in model seconds (0.2 s of wall)


def test_horizon_cuts_running_requests_and_leaves_them_out(stub):
    """A 2 s answer running at a 0.3 s horizon is cut (not a failure); a conversation arriving
    after the horizon never starts; the short one before it counts."""
    manifest = Manifest(header=None, conversations=[
        ManifestConversation("short", 0.0, [ManifestTurn(max_tokens=2, user_text="a")]),
        ManifestConversation("long", 0.0, [ManifestTurn(max_tokens=100, user_text="b")]),
        ManifestConversation("late", 0.5, [ManifestTurn(max_tokens=2, user_text="c")])])
    results = asyncio.run(run_manifest(stub, manifest, horizon_s=0.3))
    by_id = {r.conversation_id: r for r in results}
    assert set(by_id) == {"short", "long"}
    assert by_id["short"].ok and not by_id["short"].cut
    assert by_id["long"].cut and not by_id["long"].ok and by_id["long"].error is None
    point = summarize("stub", "test", 1.0, results, duration_s=0.3)
    assert point.cut == 1 and point.outcome.total_requests == 1 and point.outcome.success_rate == 100.0
    assert [s.conversation_id for s in point.samples] == ["short"]


@pytest.mark.slow
def test_bench_compare_two_systems_end_to_end(model_dir, tmp_path):
    """`bench compare` brings up pd and ppd on the simulated cluster at dilation 2 (workers and
    router at --speedup 0.5), plays the same manifest, simulates it on the virtual clock, and
    writes results.json, results.md and a plot."""
    from dynamo_ppd.bench import results as res
    from dynamo_ppd.bench.compare import compare

    out = tmp_path / "out"
    results = compare(["pd", "ppd"], "turns-4", None, [1.0], config="1P2D", out_dir=out, conversations=3,
                      size=False, dilation=[2.0])
    assert {p.system for p in results.points} == {"pd", "ppd"}
    for point in results.points:
        o = point.outcome
        assert point.dilation == 2.0 and point.conversations == 3 and point.cut == 0
        assert o.total_requests > 0 and o.success_rate == 100.0
        assert o.turn2.count > 0 and o.all_turns.p50_tpot_s is not None and o.all_turns.p50_tpot_s > 0
        assert point.client_lag_ms.p99 < 50  # the client kept up
        assert point.sim_outcome is not None and point.sim_samples
        assert point.cpu_cores.get("frontend", 0) > 0 and "client" in point.cpu_cores
        # Model time: TPOT near the virtual clock's (the workers ran at half speed, the client
        # divided by 2), not twice it.
        assert o.all_turns.p50_tpot_s == pytest.approx(point.sim_outcome.all_turns.p50_tpot_s, rel=0.25)
    # Every system behind the gateway; ppd's routing is the endpoint picker's.
    assert all("gateway" in p.cpu_cores for p in results.points)
    assert "picker" in next(p for p in results.points if p.system == "ppd").cpu_cores
    # The decisions, counted by the live workers and by the simulation: pd never runs a turn
    # decode-local; the ppd router keeps follow-ups on their decode worker.
    by_system = {p.system: p for p in results.points}
    served = by_system["pd"].outcome.total_requests
    assert by_system["pd"].routes == {"via_prefill": served}
    assert by_system["pd"].sim_routes == {"via_prefill": served}
    assert by_system["ppd"].routes.get("decode_local", 0) >= by_system["ppd"].outcome.turn2.count > 0
    assert by_system["ppd"].sim_routes and by_system["ppd"].sim_routes.get("decode_local", 0) > 0
    assert res.load(out / "results.json") == results
    old = out / "old.json"
    old.write_text('{"version": 2, "config": "1P2D", "points": []}')
    with pytest.raises(res.ResultsError, match="results version 2, this dynamo-ppd reads version 3"):
        res.load(old)
    table = (out / "results.md").read_text()
    assert "| ppd | turns-4 | 1 |" in table and "x |" in table and "live/sim" in table
    assert f"| 0% / 0% of {served} |" in table  # pd's decode-local share, live / simulated
    assert (out / "turns-4.png").stat().st_size > 10_000
