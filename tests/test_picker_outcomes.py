"""The endpoint picker learning from the answers it routed, in process: a watched follow-up's
response stream (headers, then body chunks arriving over time) gives the policy its TTFT and TPOT
(`picker.outcomes.AnswerWatch`, `Routing.observe_outcome`) and the metrics count it; the picker
asks the gateway for an answer's body (``mode_override`` STREAMED) only for the follow-ups it
samples. The routing state's side of it, shared with the relay router: tests/test_router_outcomes.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from test_picker import BODY, FakeMetrics, _messages
from test_router_dispatch import FakeClient

from dynamo_ppd.picker.extproc import ExtProcService
from dynamo_ppd.picker.outcomes import AnswerWatch, completion_tokens
from dynamo_ppd.picker.picker import Pick, Picker
from dynamo_ppd.policy.decision import Decision, Route
from dynamo_ppd.policy.score import Prediction
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.routing.state import Routing, Turn

pytestmark = pytest.mark.unit

Mode = processing_mode_pb2.ProcessingMode
PREDICTED = Prediction(ttft_s=0.050, tpot_s=0.010)
BUCKET = "ctx2-app1-load0"


def _picker(share: float = 1.0, rng: random.Random | None = None) -> tuple[Picker, list[tuple]]:
    """A picker over an unstarted routing state in ppd mode; the list gets what its policy observes."""
    config = parse_args(["--mode", "ppd"])
    routing = Routing(None, config, build_policy(config), RoutingMetrics(),
                      clients={"prefill": FakeClient([1], "prefill"), "decode": FakeClient([11], "decode")})
    seen: list[tuple] = []
    learn = routing.policy.observe

    def observe(decision, ttft_s, tpot_s):
        seen.append((decision, ttft_s, tpot_s))
        return learn(decision, ttft_s, tpot_s)

    routing.policy.observe = observe  # type: ignore[method-assign]
    return Picker(routing, tokenizer=None, frontends=["127.0.0.1:8001"],  # type: ignore[arg-type]
                  observe_share=share, rng=rng), seen


def _pick(turn: int = 2, route: Route = Route.DECODE_LOCAL, reason: str = "ppd_table") -> Pick:
    decision = Decision(route, reason, 0.3, local=PREDICTED, via_prefill=Prediction(0.08, 0.009),
                        raw=PREDICTED, bucket=BUCKET)
    plan = Turn("s", turn, 2000, [], None, decision=decision, decode=11)
    return Pick("127.0.0.1:8001", {}, (), None, plan)


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _delta(content: str, role: str | None = None) -> bytes:
    delta = {"content": content, **({"role": role} if role else {})}
    return _event({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


USAGE = _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 2000, "completion_tokens": 7,
                                                    "total_tokens": 2007}})
DONE = b"data: [DONE]\n\n"


def _response_headers(status: bytes = b"200", content_type: bytes = b"text/event-stream",
                      observability: bool = False) -> pb.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status),
                                          base_pb2.HeaderValue(key="content-type", raw_value=content_type)])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers),
                                observability_mode=observability)


def _body(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def _run(picker: Picker, pick: Pick, response: list[tuple[float, pb.ProcessingRequest]],
         response_body_mode: int = Mode.NONE) -> list[pb.ProcessingResponse]:
    """One ext_proc stream through the picker's service: the request (routed to ``pick``), then
    each response message after its delay in seconds; ``response_body_mode``: the gateway's, as
    its protocol_config says."""
    async def routed(*_args, **_kw):
        return pick

    picker.pick = routed  # type: ignore[method-assign]
    service = ExtProcService(picker, FakeMetrics())  # type: ignore[arg-type]

    request = _messages(BODY)
    request[0].protocol_config.response_body_mode = response_body_mode

    async def stream():
        for message in request:
            yield message
        for delay, message in response:
            await asyncio.sleep(delay)
            yield message

    async def run():
        return [r async for r in service.Process(stream(), None)]

    return asyncio.run(run())


def _sample(metrics: RoutingMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_watched_streamed_answer_gives_the_policy_its_ttft_and_tpot():
    picker, seen = _picker()
    replies = _run(picker, _pick(), [
        (0.01, _response_headers()),
        (0.0, _body(_delta("", role="assistant"))),  # the role alone: no token yet
        (0.15, _body(_delta("Hel"))),  # the first token, 0.16 s after the route went out
        (0.05, _body(_delta("lo th"))),
        (0.05, _body(_delta("ere, ") + _delta("frie"))),  # two events in one chunk
        (0.05, _body(_delta("nd."))),  # the last token, 0.15 s after the first
        (0.0, _body(USAGE)),
        (0.0, _body(DONE, end=True)),
    ])
    assert replies[2].HasField("response_headers")
    assert replies[2].mode_override.response_body_mode == Mode.STREAMED  # the gateway sends the body
    assert all(r.HasField("response_body") for r in replies[3:]) and len(replies) == 3 + 7
    [(decision, ttft_s, tpot_s)] = seen
    assert decision.bucket == BUCKET
    assert 0.155 <= ttft_s < 0.30, ttft_s
    # 7 completion tokens (the usage, not the 5 events): 6 gaps over the ~0.15 s from first to last.
    assert 0.148 / 6 <= tpot_s < 0.30 / 6, tpot_s
    metrics = picker.routing.metrics
    assert _sample(metrics, "ppd_outcomes_observed_total", route="decode_local") == 1
    assert _sample(metrics, "ppd_ttft_prediction_ratio_count", route="decode_local", bucket=BUCKET) == 1
    # Observed over predicted (the calibrated prediction): ~0.16 s against 0.05 s.
    ratio = _sample(metrics, "ppd_ttft_prediction_ratio_sum", route="decode_local", bucket=BUCKET)
    assert ratio == pytest.approx(ttft_s / PREDICTED.ttft_s)
    assert _sample(metrics, "ppd_tpot_prediction_ratio_count", route="decode_local", bucket=BUCKET) == 1
    assert picker.routing.last_observed is not None and picker.routing.last_observed.ttft_error > 1


def test_the_watch_counts_tokens_from_the_usage_else_the_events():
    clock = iter([0.20, 0.25, 0.30, 0.40]).__next__
    routing = _picker()[0].routing
    watch = AnswerWatch(routing, _pick().turn, picked_at=0.0, clock=clock)  # type: ignore[arg-type]
    chunks = (_delta("", role="assistant"), _delta("a"), _delta("b"), _delta("c") + _delta("d"), _delta("e"))
    for chunk in chunks:
        watch.chunk(chunk, False)
    watch.chunk(DONE, True)  # no usage: the 5 events that carried tokens are the tokens
    last = routing.last_observed
    assert last is not None
    assert last.ttft_error == pytest.approx(0.20 / PREDICTED.ttft_s - 1)
    assert last.tpot_error == pytest.approx((0.40 - 0.20) / 4 / PREDICTED.tpot_s - 1)
    assert completion_tokens(USAGE) == 7 and completion_tokens(_delta("x")) is None
    assert completion_tokens(b'data: {"usage":{"completion_tokens":"many"}}\n\n') is None
    # An answer cut before its end of stream, or with no token, teaches nothing.
    routing.last_observed = None
    cut = AnswerWatch(routing, _pick().turn, picked_at=0.0)  # type: ignore[arg-type]
    cut.chunk(_delta("a"), False)
    empty = AnswerWatch(routing, _pick().turn, picked_at=0.0)  # type: ignore[arg-type]
    empty.chunk(_delta(""), False)
    empty.chunk(DONE, True)
    assert routing.last_observed is None
    assert _sample(routing.metrics, "ppd_outcomes_observed_total", route="decode_local") == 1


def _sse(kind: str, data: dict) -> bytes:
    compact = json.dumps(data, separators=(",", ":"))  # as serde writes it
    return f"event: {kind}\ndata: {compact}\n\n".encode()


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_the_watch_reads_the_agent_apis_event_streams(api):
    """Anthropic's content_block_delta and the Responses API's output_text.delta carry the tokens;
    their usage gives output_tokens (the Responses API's inside its response object)."""
    clock = iter([0.20, 0.25, 0.30, 0.40, 0.41, 0.42, 0.43]).__next__
    routing = _picker()[0].routing
    watch = AnswerWatch(routing, _pick().turn, picked_at=0.0, clock=clock)  # type: ignore[arg-type]
    if api == "messages":
        head = [_sse("message_start", {"type": "message_start", "message": {
                    "content": [], "usage": {"input_tokens": 900, "output_tokens": 1}}}),
                _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})]
        tokens = [_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": t}}) for t in "abcd"]
        tail = [_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                         "usage": {"output_tokens": 4}}),
                _sse("message_stop", {"type": "message_stop"})]
    else:
        head = [_sse("response.created", {"type": "response.created", "response": {
                    "text": {"format": {"type": "text"}}, "output": [], "usage": None}})]
        tokens = [_sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": t})
                  for t in "abcd"]
        tail = [_sse("response.completed", {"type": "response.completed", "response": {
                    "usage": {"input_tokens": 900, "output_tokens": 4, "total_tokens": 904}}})]
    for chunk in head + tokens + tail:
        watch.chunk(chunk, False)
    watch.chunk(b"", True)
    last = routing.last_observed
    assert last is not None
    assert last.ttft_error == pytest.approx(0.20 / PREDICTED.ttft_s - 1)  # the first delta, not a header
    assert last.tpot_error == pytest.approx((0.40 - 0.20) / 3 / PREDICTED.tpot_s - 1)  # 4 tokens, usage's


@pytest.mark.parametrize("case", ["first turn", "not sampled", "5xx", "not streamed", "rehomed", "sampled"])
def test_the_body_is_asked_for_only_for_a_sampled_streamed_follow_up(case):
    picker, seen = _picker(share=0.0 if case == "not sampled" else 1.0)
    pick = _pick(turn=1 if case == "first turn" else 2,
                 reason="rehome_ppd_table" if case == "rehomed" else "ppd_table")
    content_type = b"application/json" if case == "not streamed" else b"text/event-stream"
    headers = _response_headers(status=b"503" if case == "5xx" else b"200", content_type=content_type)
    replies = _run(picker, pick, [(0.0, headers), (0.0, _body(_delta("a"))), (0.0, _body(DONE, end=True))])
    wanted = Mode.STREAMED if case == "sampled" else Mode.NONE
    assert replies[2].mode_override.response_body_mode == wanted
    assert len(seen) == (1 if case == "sampled" else 0)
    # Sent in observability mode, the headers get no answer (the body then never comes).
    replies = _run(picker, pick, [(0.0, _response_headers(observability=True))])
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]


def test_the_share_of_follow_ups_watched_follows_the_flag():
    picker, _ = _picker(share=0.25, rng=random.Random(7))
    watched = sum(picker.watch(_pick(), 200, "text/event-stream", 0.0) is not None for _ in range(2000))
    assert 400 <= watched <= 600
    no_predictor, _ = _picker()
    plan = Turn("s", 2, 10, [], None, decision=Decision(Route.DECODE_LOCAL, "local"))
    unpredicted = Pick("h:1", {}, (), None, plan)
    assert no_predictor.watch(unpredicted, 200, "text/event-stream", 0.0) is None  # nothing to learn


@pytest.mark.parametrize("share", [0.0, 1e-9])
def test_a_gateway_that_streams_every_body_has_every_follow_up_watched_unless_off(share):
    # GAIE's gateways send every answer's body (FULL_DUPLEX_STREAMED) and the picker echoes each
    # chunk anyway: watching adds only the reading, so no draw; --observe-share 0 still turns it off.
    picker, seen = _picker(share=share, rng=random.Random(1))
    answer = [(0.0, _response_headers()), (0.0, _body(_delta("a"))), (0.01, _body(_delta("b"))),
              (0.0, _body(DONE, end=True))]
    replies = _run(picker, _pick(), answer, response_body_mode=Mode.FULL_DUPLEX_STREAMED)
    assert len(seen) == (1 if share else 0)
    echoed = [r.response_body.response.body_mutation.streamed_response.body for r in replies[3:]]
    assert echoed == [_delta("a"), _delta("b"), DONE]  # the body goes on unchanged
    # A gateway whose body mode an override may change: the draw decides (1e-9: not watched).
    _run(picker, _pick(), answer, response_body_mode=Mode.STREAMED)
    assert len(seen) == (1 if share else 0)
