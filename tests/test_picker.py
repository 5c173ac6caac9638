"""The endpoint picker's protocol and route headers, in process: the ext_proc replies GAIE's
endpoint-picker protocol requires (order, destination header and metadata, body back, immediate
responses), with a stand-in `Picker` (the routing itself is exercised end to end in
tests/test_picker_e2e.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from dynamo_ppd.apis import CHAT
from dynamo_ppd.picker.extproc import DESTINATION_HEADER, ExtProcService
from dynamo_ppd.picker.picker import Pick, Refusal
from dynamo_ppd.picker.route import (
    AGENT_SESSION_HEADERS,
    CLIENT_ROUTING_HEADERS,
    PREFILL_PIN,
    ROUTE_HEADER,
    SESSION_HEADER,
    route_headers,
    without_client_pins,
)
from dynamo_ppd.policy.decision import Route

pytestmark = pytest.mark.unit

Mode = processing_mode_pb2.ProcessingMode


class FakePicker:
    def __init__(self, result: Pick | Refusal):
        self.result = result
        self.seen: list[tuple[dict, bytes, str]] = []
        self.subsets: list[list[str] | None] = []
        self.statuses: list[int | None] = []

    def frontend(self, subset=None) -> str:
        self.subsets.append(subset)
        return subset[0] if subset else "127.0.0.1:8001"

    def answered(self, pick, status) -> None:
        self.statuses.append(status)

    def watch(self, pick, status, content_type, picked_at, every_body=False) -> None:
        return None  # never watches an answer (tests/test_picker_outcomes.py does)

    async def pick(self, headers, body, path, subset=None, clock=None):
        self.seen.append((dict(headers), body, path))
        self.subsets.append(subset)
        if isinstance(self.result, Refusal):
            raise self.result
        return self.result


class FakeMetrics:
    def __init__(self):
        self.outcomes: list[str] = []

    def observe(self, outcome: str, seconds: float, cpu_s: float = 0.0, stages=None) -> None:
        self.outcomes.append(outcome)


def _messages(body: bytes, mode=Mode.FULL_DUPLEX_STREAMED, chunks: int = 2) -> list[pb.ProcessingRequest]:
    headers = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key="X-Dynamo-Session-Id", raw_value=b"abc"),
    ])
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=False),
                                 protocol_config=pb.ProtocolConfiguration(request_body_mode=mode))
    size = -(-len(body) // chunks)
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    last = len(parts) - 1
    return [first, *(pb.ProcessingRequest(request_body=pb.HttpBody(body=part, end_of_stream=i == last))
                     for i, part in enumerate(parts))]


def _process(picker, messages) -> tuple[list[pb.ProcessingResponse], FakeMetrics]:
    metrics = FakeMetrics()
    service = ExtProcService(picker, metrics)  # type: ignore[arg-type]

    async def stream():
        for m in messages:
            yield m

    async def run():
        return [r async for r in service.Process(stream(), None)]

    return asyncio.run(run()), metrics


def _set_headers(reply: pb.ProcessingResponse) -> dict[str, str]:
    options = reply.request_headers.response.header_mutation.set_headers
    return {o.header.key: o.header.raw_value.decode() for o in options}


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_full_duplex_replies_headers_then_the_body_only_after_the_whole_body():
    route = route_headers(Route.VIA_PREFILL, 42)
    picker = FakePicker(Pick("127.0.0.1:8001", route.set, route.remove, None))
    replies, metrics = _process(picker, _messages(BODY, chunks=3))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    headers, seen_body, path = picker.seen[0]
    assert seen_body == BODY and path == "/v1/chat/completions"
    assert headers["x-dynamo-session-id"] == "abc"  # names lower-cased, as Envoy sends them
    sets = _set_headers(replies[0])
    assert sets[DESTINATION_HEADER] == "127.0.0.1:8001"
    assert sets[PREFILL_PIN] == "42" and sets[ROUTE_HEADER] == "via_prefill"
    assert replies[0].request_headers.response.clear_route_cache
    options = replies[0].request_headers.response.header_mutation.set_headers
    assert all(o.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for o in options)
    lb = replies[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == "127.0.0.1:8001"  # the same value as the header
    streamed = replies[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == BODY and streamed.end_of_stream
    assert metrics.outcomes == ["routed"]


def _body_set_headers(reply: pb.ProcessingResponse) -> dict[str, str]:
    options = reply.request_body.response.header_mutation.set_headers
    return {o.header.key: o.header.raw_value.decode() for o in options}


def test_buffered_mode_answers_the_headers_at_once_and_routes_on_the_body_answer():
    # Envoy sends a buffered body only once the headers are answered: routing on the headers'
    # answer would wait for a body that never comes.
    route = route_headers(Route.VIA_PREFILL, 5)
    replies, _ = _process(FakePicker(Pick("h:1", route.set, route.remove, None)),
                          _messages(BODY, Mode.BUFFERED, chunks=1))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert not replies[0].request_headers.response.HasField("header_mutation")
    body = replies[1].request_body.response
    assert not body.HasField("body_mutation")  # unchanged body: no mutation, no new length
    sets = _body_set_headers(replies[1])
    assert sets[DESTINATION_HEADER] == "h:1" and sets[PREFILL_PIN] == "5" and "content-length" not in sets
    lb = replies[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == "h:1"
    replies, _ = _process(FakePicker(Pick("h:1", route.set, route.remove, b"{}")),
                          _messages(BODY, Mode.BUFFERED, chunks=1))
    assert replies[1].request_body.response.body_mutation.body == b"{}"
    assert _body_set_headers(replies[1])["content-length"] == "2"


def test_a_refusal_is_an_immediate_response_with_the_frontends_error_body():
    replies, metrics = _process(FakePicker(Refusal(503, "no workers", "no_workers", CHAT)), _messages(BODY))
    assert [r.WhichOneof("response") for r in replies] == ["immediate_response"]
    immediate = replies[0].immediate_response
    assert immediate.status.code == 503
    assert json.loads(immediate.body) == {"message": "no workers", "type": "Service Unavailable", "code": 503}
    assert metrics.outcomes == ["refused_503"]


def test_a_request_without_a_body_goes_to_a_frontend_unrouted():
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")])
    picker = FakePicker(Refusal(500, "never called", "x"))
    replies, _ = _process(picker, [pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))])
    assert _set_headers(replies[0]) == {DESTINATION_HEADER: "127.0.0.1:8001"}
    assert picker.seen == []


def _with_subset(message: pb.ProcessingRequest, value) -> pb.ProcessingRequest:
    from dynamo_ppd.picker.extproc import SUBSET_KEY, SUBSET_NAMESPACE

    message.metadata_context.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: value})
    return message


def test_the_gateways_endpoint_subset_reaches_the_picker():
    route = route_headers(Route.DECODE_LOCAL, None)
    picker = FakePicker(Pick("10.0.0.8:8000", route.set, route.remove, None))
    messages = _messages(BODY)
    _with_subset(messages[0], ["10.0.0.8:8000", "10.0.0.9:8000"])
    _process(picker, messages)
    assert picker.subsets == [["10.0.0.8:8000", "10.0.0.9:8000"]]
    picker = FakePicker(Pick("h:1", route.set, route.remove, None))
    _process(picker, _messages(BODY))
    assert picker.subsets == [None]  # no hint (Istio): the picker's own frontends
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")])
    get = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))
    _with_subset(get, ["10.0.0.9:8000"])
    replies, _ = _process(picker, [get])
    assert _set_headers(replies[0]) == {DESTINATION_HEADER: "10.0.0.9:8000"}


def test_response_messages_pass_through_unchanged():
    route = route_headers(Route.DECODE_LOCAL, None)
    response = [pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=True))]
    # GAIE's gateways stream the response body in full duplex: each chunk is streamed back.
    messages = _messages(BODY)
    messages[0].protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    replies, _ = _process(FakePicker(Pick("h:1", route.set, route.remove, None)), [*messages, *response])
    assert [r.WhichOneof("response") for r in replies][2:] == ["response_headers", "response_body"]
    streamed = replies[3].response_body.response.body_mutation.streamed_response
    assert streamed.body == b"data: x\n\n" and streamed.end_of_stream
    # Any other response body mode (STREAMED, after a mode override): CONTINUE, no mutation.
    picker = FakePicker(Pick("h:1", route.set, route.remove, None))
    replies, _ = _process(picker, [*_messages(BODY), *response])
    assert [r.WhichOneof("response") for r in replies][2:] == ["response_headers", "response_body"]
    common = replies[3].response_body.response
    assert not common.HasField("body_mutation") and common.status == pb.CommonResponse.CONTINUE


def test_an_event_stream_echoed_in_full_duplex_loses_its_events_without_data():
    # Dynamo 1.6.1 opens a decode-local follow-up's stream with its bypass annotation: a GAIE
    # gateway streams the body through the picker, whose echo leaves it out (split or not).
    route = route_headers(Route.DECODE_LOCAL, None)
    sse = base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")])
    pieces = [b"event: x-bypass-rem", b"ote-prefill\n: true\n\ndata: {\"a\": 1}\n\n", b"data: [DONE]\n\n"]
    response = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=sse)),
                *(pb.ProcessingRequest(response_body=pb.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
                  for i, p in enumerate(pieces))]
    messages = _messages(BODY)
    messages[0].protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    replies, _ = _process(FakePicker(Pick("h:1", route.set, route.remove, None)), [*messages, *response])
    echoed = [r.response_body.response.body_mutation.streamed_response for r in replies[3:]]
    assert b"".join(e.body for e in echoed) == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert [e.end_of_stream for e in echoed] == [False, False, True]


def _response_headers(status: bytes) -> pb.ProcessingRequest:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status),
                                          base_pb2.HeaderValue(key="content-type", raw_value=b"text/plain")])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers), observability_mode=True)


def test_the_response_status_of_a_routed_stream_reaches_the_picker():
    route = route_headers(Route.VIA_PREFILL, 42)
    picker = FakePicker(Pick("h:1", route.set, route.remove, None))
    replies, _ = _process(picker, [*_messages(BODY), _response_headers(b"503")])
    assert picker.statuses == [503]
    # Sent in observability mode: no answer (Envoy reads none); otherwise answered, unchanged.
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    answered = _response_headers(b"200")
    answered.observability_mode = False
    replies, _ = _process(picker, [*_messages(BODY), answered])
    assert picker.statuses == [503, 200]
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "response_headers"]
    # Nothing routed on the stream (a refusal, a request without a body): nothing to report.
    refused = FakePicker(Refusal(400, "too long", "too_large"))
    _process(refused, [*_messages(BODY), _response_headers(b"400")])
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")])
    unrouted = FakePicker(Pick("h:1", route.set, route.remove, None))
    get = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers, end_of_stream=True))
    _process(unrouted, [get, _response_headers(b"500")])
    assert refused.statuses == [] and unrouted.statuses == []


def test_routes_become_a_prefill_pin_or_no_pin_and_client_pins_are_dropped():
    via = route_headers(Route.VIA_PREFILL, 7)
    assert via.set == {ROUTE_HEADER: "via_prefill", PREFILL_PIN: "7"}
    named = route_headers(Route.DECODE_LOCAL, None, "conv-1#fork")
    assert named.set == {ROUTE_HEADER: "decode_local", SESSION_HEADER: "conv-1#fork"}  # keys the affinity
    assert SESSION_HEADER not in named.remove
    assert PREFILL_PIN not in via.remove and "x-dynamo-worker-instance-id" in via.remove
    local = route_headers(Route.DECODE_LOCAL, None)
    assert local.set == {ROUTE_HEADER: "decode_local"}  # the frontend's KV router picks the holder
    # No session: the turn is unnamed on purpose, so the client's own session headers go too.
    assert set(local.remove) == set(CLIENT_ROUTING_HEADERS) | set(AGENT_SESSION_HEADERS)
    with pytest.raises(ValueError):
        route_headers(Route.VIA_PREFILL, None)


def test_client_pins_in_nvext_are_dropped():
    body = {"nvext": {"backend_instance_id": 3, "prefill_worker_id": 4, "ignore_eos": True}}
    assert without_client_pins(body)
    assert body == {"nvext": {"ignore_eos": True}}
    assert not without_client_pins({"nvext": {"ignore_eos": True}})
    assert not without_client_pins({"messages": []})


class _Routing:
    """The routing state's surface `Picker.pick` uses; planning raises what the test says."""

    def __init__(self, raises: Exception):
        from dynamo_ppd.policy.qps import SlidingWindowRate
        from dynamo_ppd.routing.limits import RequestLimits
        from dynamo_ppd.routing.metrics import RoutingMetrics

        self.metrics, self.rate = RoutingMetrics(), SlidingWindowRate()
        self.limits = RequestLimits(context_window=100)
        self.raises = raises
        self.decode_chosen_downstream = False
        self.config = SimpleNamespace(block_size=16)

    async def plan_turn(self, request, tokens, forced=None, lap=None, known_hashes=None):
        raise self.raises


class _Tokens:
    def tokens(self, body, path, lap=None):
        return [1] * len(body["messages"][0]["content"].split())


def _pick(routing, body: bytes, headers: dict | None = None, path: str = "/v1/chat/completions",
          subset: list[str] | None = None) -> Refusal:
    from dynamo_ppd.picker.picker import Picker

    # (no prompt memo: the stand-in tokenizer has only `tokens`)
    picker = Picker(routing, _Tokens(), ["127.0.0.1:8001"], prompt_memo_mb=0)  # type: ignore[arg-type]
    with pytest.raises(Refusal) as refused:
        asyncio.run(picker.pick(headers or {}, body, path, subset))
    return refused.value


def _unplaced(routing) -> dict[str, float]:
    return {s.labels["reason"]: s.value for s in routing.metrics.unplaced.collect()[0].samples
            if s.name.endswith("_total")}


def test_only_nowhere_to_send_a_request_is_refused_and_counted_by_kind():
    from dynamo_ppd.routing.planner import NoWorkers

    routing = _Routing(NoWorkers("no decode worker is available"))
    ok_body = json.dumps({"messages": [{"role": "user", "content": "a b c"}]}).encode()
    assert _pick(routing, ok_body).status == 503  # no worker of a needed kind
    assert _pick(routing, ok_body, subset=[]).status == 503  # no frontend
    errors = {s.labels["kind"]: s.value for s in routing.metrics.errors.collect()[0].samples
              if s.name.endswith("_total")}
    assert errors == {"no_workers": 1.0, "no_frontends": 1.0}


def test_bad_input_goes_to_the_frontend_unrouted_as_the_client_sent_it():
    # The frontend answers it in its own words (status, shape, message): no plan, no record.
    from dynamo_ppd.picker.picker import Picker

    routing = _Routing(AssertionError("bad input is never planned"))
    picker = Picker(routing, _Tokens(), ["127.0.0.1:8001"], prompt_memo_mb=0)  # type: ignore[arg-type]
    bodies = [b"{nope", b"[1, 2]", b"[" * 100_000 + b"]" * 100_000,  # (deeper than Python's stack)
              json.dumps({"messages": [{"role": "user", "content": "w " * 150}]}).encode(),  # over context
              json.dumps({"max_tokens": -3, "messages": [{"role": "user", "content": "a"}]}).encode(),
              json.dumps({"max_tokens": True, "messages": [{"role": "user", "content": "a"}]}).encode(),
              json.dumps({"stream": "yes", "messages": [{"role": "user", "content": "a"}]}).encode(),
              json.dumps({"temperature": "hot", "messages": [{"role": "user", "content": "a"}]}).encode()]
    for body in bodies:
        picked = asyncio.run(picker.pick({}, body, "/v1/chat/completions"))
        assert (picked.endpoint, picked.set_headers, picked.body, picked.unplaced) == \
            ("127.0.0.1:8001", {}, None, "invalid")
    long_id = {"x-dynamo-session-id": "s" * 300}
    ok_body = json.dumps({"messages": [{"role": "user", "content": "a"}]}).encode()
    assert asyncio.run(picker.pick(long_id, ok_body, "/v1/chat/completions")).unplaced == "invalid"
    assert _unplaced(routing) == {"invalid": 9.0}


class _Unplaceable:
    def tokens(self, body, path, lap=None):
        from dynamo_ppd.picker.chat_template import Unplaceable

        raise Unplaceable("unknown_api", f"no prompt in {path}")


def test_a_request_the_picker_cannot_place_goes_to_the_frontend_unrouted_and_is_counted():
    from dynamo_ppd.picker.picker import Picker

    routing = _Routing(AssertionError("an unplaced request is never planned"))
    picker = Picker(routing, _Unplaceable(), ["127.0.0.1:8001"])  # type: ignore[arg-type]
    body = json.dumps({"input": "hi"}).encode()
    picked = asyncio.run(picker.pick({}, body, "/v1/embeddings"))
    assert (picked.endpoint, picked.set_headers, picked.body, picked.turn) == \
        ("127.0.0.1:8001", {}, None, None)
    assert "x-dynamo-prefill-instance-id" in picked.remove_headers  # a client's own pins go
    with_pin = json.dumps({"input": "hi", "nvext": {"backend_instance_id": 3}}).encode()
    pinned = asyncio.run(picker.pick({}, with_pin, "/v1/embeddings"))
    assert json.loads(pinned.body) == {"input": "hi", "nvext": {}}
    assert _unplaced(routing) == {"unknown_api": 2.0}


def test_a_refused_messages_request_gets_anthropics_error_shape():
    routing = _Routing(AssertionError("refused before planning"))
    ok_body = json.dumps({"messages": [{"role": "user", "content": "a"}]}).encode()
    refused = _pick(routing, ok_body, path="/v1/messages", subset=[])
    assert refused.status == 503
    assert json.loads(refused.body()) == {"type": "error", "error": {
        "type": "overloaded_error", "message": str(refused)}}
    assert json.loads(_pick(routing, ok_body, subset=[]).body())["code"] == 503  # OpenAI's elsewhere


def test_the_session_comes_from_dynamos_agent_headers_in_its_order():
    from dynamo_ppd.picker.route import session_from_headers

    claude = {"x-claude-code-session-id": "sess", "x-claude-code-agent-id": "sub"}
    assert session_from_headers({"x-claude-code-session-id": "sess"}) == "sess"
    assert session_from_headers(claude) == "sub"  # a subagent has its own context
    assert session_from_headers({**claude, "x-dynamo-session-id": "dyn"}) == "dyn"
    assert session_from_headers({"thread-id": "th", "x-session-id": "oc"}) == "th"
    assert session_from_headers({"x-session-id": "oc", "session_id": "codex-old"}) == "oc"
    assert session_from_headers({"session_id": "codex-old"}) is None  # Dynamo does not read it
    assert session_from_headers({"session_id": "codex-old"}, ["session_id"]) == "codex-old"
    assert session_from_headers({"x-dynamo-session-id": ""}) is None


class _Prompts:
    """`PromptTokenizer.tokenized_text` alone (what `Picker._body_to_send` asks of it)."""

    from dynamo_ppd.picker.prompt import PromptTokenizer as _Real

    tokenized_text = staticmethod(_Real.tokenized_text)


@pytest.mark.parametrize(("body", "path", "expected"), [
    # No nvext: spliced in before the closing brace, the client's bytes otherwise as they were.
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}  ', "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "nvext": {"token_data": [5, 6]}}),
    # The client's own nvext keeps its other fields; an explicit null becomes the ids' object.
    (b'{"messages": [], "nvext": {"ignore_eos": true}}', "/v1/chat/completions",
     {"messages": [], "nvext": {"ignore_eos": True, "token_data": [5, 6]}}),
    (b'{"messages": [], "nvext": null}', "/v1/chat/completions",
     {"messages": [], "nvext": {"token_data": [5, 6]}}),
    # A client's routing pins go, whatever else happens.
    (b'{"messages": [], "nvext": {"backend_instance_id": 7}}', "/v1/chat/completions",
     {"messages": [], "nvext": {"token_data": [5, 6]}}),
    # A prompt of ids, or ids the client sent itself: nothing to add.
    (b'{"prompt": [5, 6]}', "/v1/completions", None),
    (b'{"messages": [], "nvext": {"token_data": [5, 6]}}', "/v1/chat/completions", None),
    (b'{"prompt": "hi"}', "/v1/completions", {"prompt": "hi", "nvext": {"token_data": [5, 6]}}),
])
def test_the_forwarded_body_carries_the_token_ids(body, path, expected):
    from dynamo_ppd.picker.picker import Picker

    picker = Picker.__new__(Picker)  # only the body rewrite
    picker.tokenizer, picker.send_token_ids = _Prompts(), True  # type: ignore[assignment]
    forwarded = picker._body_to_send(body, json.loads(body), [5, 6], path)
    assert (json.loads(forwarded) if forwarded is not None else None) == expected
    if expected is not None and b"nvext" not in body:
        assert forwarded.startswith(body.rstrip()[:-1])  # spliced: the client's bytes kept
    picker.send_token_ids = False  # --no-token-ids: the client's body, less its pins
    kept = picker._body_to_send(body, json.loads(body), [5, 6], path)
    assert kept is None or "token_data" not in json.loads(kept).get("nvext", {})
