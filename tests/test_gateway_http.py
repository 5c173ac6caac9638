"""The local gateway's pure parts, in process: HTTP/1.1 framing on in-memory streams, Envoy's
header map and mutation rules, the ext_proc messages it sends and how it reads the answers, the
picker rotation, and the command line's one-line errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from dynamo_ppd.gateway import args, extproc, headers, http

pytestmark = pytest.mark.unit

Mode = processing_mode_pb2.ProcessingMode
Option = base_pb2.HeaderValueOption


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class _Sink:
    """A StreamWriter stand-in that records what is written and each flush."""

    def __init__(self) -> None:
        self.flushes: list[bytes] = []
        self._pending = b""

    def write(self, data: bytes) -> None:
        self._pending += data

    async def drain(self) -> None:
        self.flushes.append(self._pending)
        self._pending = b""


# -- framing ------------------------------------------------------------------------------------

async def test_reads_two_pipelined_requests_with_length_and_chunked_bodies():
    reader = _reader(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n"
                     b"X-Mixed-Case: A\r\n\r\nhello"
                     b"POST /x HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer-Field: t\r\n\r\n")
    head = await http.read_request_head(reader)
    assert (head.method, head.target, head.content_length, head.keep_alive) == (
        "POST", "/v1/chat/completions", 5, True)
    assert ("x-mixed-case", "A") in head.headers  # names lower-cased, values kept
    assert await http.read_body(reader, head, 100) == b"hello"
    head2 = await http.read_request_head(reader)
    assert head2.chunked and await http.read_body(reader, head2, 100) == b"abcde"
    assert await http.read_request_head(reader) is None  # clean close between requests


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n folded: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\n", 400),  # closed inside the head
])
async def test_malformed_requests_are_refused_with_a_status(raw, status):
    with pytest.raises(http.HttpError) as info:
        await http.read_request_head(_reader(raw))
    assert info.value.status == status


async def test_a_body_over_the_limit_is_413():
    head = await http.read_request_head(_reader(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n"))
    with pytest.raises(http.HttpError) as info:
        await http.read_body(_reader(b"x" * 10), head, 5)
    assert info.value.status == 413


async def test_keep_alive_rules_and_expect_continue():
    h10 = await http.read_request_head(_reader(b"GET / HTTP/1.0\r\n\r\n"))
    close = await http.read_request_head(_reader(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n"))
    expect = await http.read_request_head(_reader(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n"
                                                  b"Content-Length: 3\r\n\r\n"))
    assert not h10.keep_alive and not close.keep_alive and expect.expects_continue


def test_the_upstream_request_has_a_fresh_length_and_no_hop_by_hop_fields():
    raw = http.encode_request("POST", "/v1/x", [("host", "gw"), ("transfer-encoding", "chunked"),
                                                 ("content-length", "99"), ("connection", "close"),
                                                 ("x-a", "1")], b"abc")
    assert raw == b"POST /v1/x HTTP/1.1\r\nhost: gw\r\nx-a: 1\r\ncontent-length: 3\r\n\r\nabc"
    assert b"content-length" not in http.encode_request("GET", "/", [("host", "gw")], b"")


async def test_a_chunked_response_is_relayed_chunk_by_chunk_as_is():
    body = b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    reader = _reader(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + body)
    head = await http.read_response_head(reader)
    assert head.body_framing("POST") == "chunked"
    relayed = http.client_response_head(head, close=False)
    assert relayed.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in relayed
    sink = _Sink()
    await http.relay_body("chunked", head, reader, sink)  # type: ignore[arg-type]
    assert sink.flushes == [b"b\r\ndata: one\n\n\r\n", b"b\r\ndata: two\n\n\r\n", b"0\r\n\r\n"]


async def test_response_framing_length_close_and_none():
    reader = _reader(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbody")
    head = await http.read_response_head(reader)  # the interim 100 is skipped
    sink = _Sink()
    await http.relay_body(head.body_framing("POST"), head, reader, sink)  # type: ignore[arg-type]
    assert b"".join(sink.flushes) == b"body"
    close = await http.read_response_head(_reader(b"HTTP/1.0 200 OK\r\n\r\n"))
    assert close.body_framing("GET") == "close" and close.close
    assert close.body_framing("HEAD") == "none"
    with pytest.raises(ConnectionError):
        await http.read_response_head(_reader(b""))


# -- Envoy's header map and mutations -----------------------------------------------------------

def _set(key: str, value: str, append: bool | None = None, action: int = 0,
         raw: bool = True) -> base_pb2.HeaderValueOption:
    header = base_pb2.HeaderValue(key=key, raw_value=value.encode()) if raw else \
        base_pb2.HeaderValue(key=key, value=value)
    option = Option(header=header, append_action=action)  # type: ignore[arg-type]
    if append is not None:
        option.append.CopyFrom(wrappers_pb2.BoolValue(value=append))
    return option


async def test_envoy_headers_have_pseudo_headers_first_and_no_host():
    head = await http.read_request_head(_reader(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw:8000\r\nContent-Type: application/json\r\n"
        b"Connection: keep-alive\r\nContent-Length: 2\r\n\r\n"))
    got = headers.envoy_headers(head, "rid-1")
    assert got[:4] == [(":authority", "gw:8000"), (":path", "/v1/chat/completions"), (":method", "POST"),
                       (":scheme", "http")]
    names = [k for k, _ in got]
    assert "host" not in names and "connection" not in names
    assert ("x-request-id", "rid-1") in got and ("x-forwarded-proto", "http") in got
    proto = headers.to_header_map(got)
    assert proto.headers[0].raw_value == b"gw:8000" and proto.headers[0].value == ""


def test_set_headers_overwrite_unless_appending():
    start = [("x-dynamo-worker-instance-id", "7"), ("x-dynamo-worker-instance-id", "8"), ("x-keep", "k")]
    mutation = pb.HeaderMutation(set_headers=[_set("X-Dynamo-Worker-Instance-Id", "9"),
                                              _set("x-keep", "more", append=True),
                                              _set("x-new", "n", raw=False)])
    got = headers.apply_header_mutation(start, mutation)
    assert [v for k, v in got if k == "x-dynamo-worker-instance-id"] == ["9"]
    assert [v for k, v in got if k == "x-keep"] == ["k", "more"]
    assert ("x-new", "n") in got


def test_append_actions_and_removals():
    start = [("a", "1"), ("b", "1"), ("gone", "x"), (":path", "/p")]
    mutation = pb.HeaderMutation(remove_headers=["Gone", ":path"], set_headers=[
        _set("a", "2", action=Option.ADD_IF_ABSENT), _set("c", "3", action=Option.ADD_IF_ABSENT),
        _set("b", "4", action=Option.OVERWRITE_IF_EXISTS), _set("d", "5", action=Option.OVERWRITE_IF_EXISTS),
        _set("e", "6", action=Option.OVERWRITE_IF_EXISTS_OR_ADD),
        _set("a", "7", append=True, action=Option.APPEND_IF_EXISTS_OR_ADD)])
    got = headers.apply_header_mutation(start, mutation)
    assert got == [("a", "1"), ("b", "4"), (":path", "/p"), ("c", "3"), ("e", "6"), ("a", "7")]


def test_envoy_refuses_to_change_system_headers_and_bad_values():
    start = [(":authority", "gw"), (":method", "POST"), (":path", "/a")]
    mutation = pb.HeaderMutation(set_headers=[_set(":authority", "evil"), _set("host", "evil"),
                                              _set(":method", "GET"), _set("x-envoy-foo", "1"),
                                              _set("x-bad", "a\r\nb: c"), _set(":path", "/b")])
    assert headers.apply_header_mutation(start, mutation) == [(":authority", "gw"), (":method", "POST"),
                                                              (":path", "/b")]


def test_destination_comes_from_the_header_then_the_metadata():
    struct = struct_pb2.Struct()
    struct.update({"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.2:8000"}})
    metadata: dict = {}
    headers.merge_metadata(metadata, struct)
    assert headers.destination([], metadata) == "10.0.0.2:8000"
    assert headers.destination([("x-gateway-destination-endpoint", "10.0.0.1:8000,10.0.0.3:8000")],
                               metadata) == "10.0.0.1:8000"
    assert headers.destination([], {}) is None
    assert headers.upstream_request_parts([(":method", "POST"), (":path", "/v"), (":authority", "gw"),
                                           (":scheme", "http"), ("x", "1")]) == (
        "POST", "/v", [("host", "gw"), ("x", "1")])


# -- ext_proc messages and answers --------------------------------------------------------------

def test_full_duplex_messages_are_headers_then_64k_body_chunks():
    body = b"x" * (64 * 1024 + 10)
    messages = extproc.request_messages([(":method", "POST")], body, "full-duplex")
    assert [m.WhichOneof("request") for m in messages] == ["request_headers", "request_body", "request_body"]
    first = messages[0]
    assert not first.request_headers.end_of_stream
    assert first.protocol_config.request_body_mode == Mode.FULL_DUPLEX_STREAMED
    assert first.protocol_config.response_body_mode == Mode.NONE
    assert not messages[1].HasField("protocol_config")
    assert [m.request_body.end_of_stream for m in messages[1:]] == [False, True]
    assert b"".join(m.request_body.body for m in messages[1:]) == body
    buffered = extproc.request_messages([], body, "buffered")
    assert len(buffered) == 2 and buffered[1].request_body.end_of_stream
    assert buffered[0].protocol_config.request_body_mode == Mode.BUFFERED
    no_body = extproc.request_messages([], b"", "full-duplex")
    assert len(no_body) == 1 and no_body[0].request_headers.end_of_stream
    mode = extproc.processing_mode("full-duplex")
    assert (mode.request_trailer_mode, mode.response_header_mode) == (Mode.SEND, Mode.SEND)
    assert (mode.response_body_mode, mode.response_trailer_mode) == (Mode.NONE, Mode.SKIP)
    assert extproc.processing_mode("full-duplex", response_headers=False).response_header_mode == Mode.SKIP


def test_response_headers_carry_the_status_first_and_no_hop_fields():
    message = extproc.response_headers_message(
        503, [("Content-Type", "application/json"), ("transfer-encoding", "chunked"),
              ("connection", "keep-alive"), ("x-request-id", "r1")], end_of_stream=False)
    assert message.WhichOneof("request") == "response_headers" and message.observability_mode
    sent = [(h.key, h.raw_value) for h in message.response_headers.headers.headers]
    assert sent == [(":status", b"503"), ("content-type", b"application/json"), ("x-request-id", b"r1")]
    assert not message.response_headers.end_of_stream
    assert extproc.response_headers_message(204, [], end_of_stream=True).response_headers.end_of_stream


class _Call:
    """A grpc.aio stream-stream call stand-in: records what the gateway does with it; its answers
    come from ``answers`` (EOF after them), or never when ``hang``."""

    def __init__(self, answers=(), hang: bool = False):
        self.written: list[pb.ProcessingRequest] = []
        self.half_closed = self.cancelled = False
        self.answers = list(answers)
        self.hang = hang

    async def write(self, message) -> None:
        self.written.append(message)

    async def done_writing(self) -> None:
        self.half_closed = True

    async def read(self):
        if self.hang:
            await asyncio.Event().wait()
        if self.answers:
            return self.answers.pop(0)
        return grpc.aio.EOF

    async def code(self):
        return None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_the_response_phase_reports_once_then_closes_and_never_waits(monkeypatch):
    async def run():
        closing: set[asyncio.Task] = set()
        answered = _Call([pb.ProcessingResponse(response_headers=pb.HeadersResponse())])
        phase = extproc.ResponsePhase(answered, closing)
        phase.report(500, [("content-type", "application/json")], end_of_stream=False)
        phase.report(200, [], end_of_stream=False)  # only the first status goes out
        phase.close()
        assert len(closing) == 1 and answered.written == []  # nothing done before the caller yields
        await asyncio.gather(*closing)
        assert [m.WhichOneof("request") for m in answered.written] == ["response_headers"]
        assert answered.half_closed and answered.answers == [] and answered.cancelled
        quiet = _Call()
        extproc.ResponsePhase(quiet, closing).close()  # no status (cancelled): closed all the same
        await asyncio.gather(*closing)
        assert quiet.written == [] and quiet.half_closed and quiet.cancelled
        monkeypatch.setattr(extproc, "CLOSE_GRACE_S", 0.05)
        stuck = _Call(hang=True)  # a picker that never ends the stream: cancelled after the grace
        extproc.ResponsePhase(stuck, closing).report(502, [], end_of_stream=False)
        await asyncio.wait_for(asyncio.gather(*closing), 1.0)
        assert stuck.cancelled and len(stuck.written) == 1 and not closing

    asyncio.run(run())


def test_answers_in_gaie_order_build_the_forwarded_request():
    exchange = extproc._Exchange([("x-a", "1")], b"original")
    metadata = struct_pb2.Struct()
    metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": "1.2.3.4:5"}})
    exchange.take(pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            clear_route_cache=True, header_mutation=pb.HeaderMutation(set_headers=[_set("x-a", "2")]))),
        dynamic_metadata=metadata))
    assert exchange.headers_done and not exchange.body_done
    for piece, end in ((b"new ", False), (b"body", True)):
        exchange.take(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=piece,
                                                                                     end_of_stream=end))))))
    result = exchange.result
    assert exchange.body_done and result.body == b"new body" and result.headers == [("x-a", "2")]
    assert result.metadata == {"envoy.lb": {"x-gateway-destination-endpoint": "1.2.3.4:5"}}
    unchanged = extproc._Exchange([], b"keep")
    unchanged.take(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse())))
    assert unchanged.body_done and unchanged.result.body == b"keep"


def test_immediate_response_status_headers_and_body():
    reply = extproc.immediate_from(pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=400),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
        body=b'{"error": 1}', details="why"))
    assert (reply.status, reply.headers, reply.body) == (400, [("content-type", "application/json")],
                                                         b'{"error": 1}')
    assert extproc.immediate_from(pb.ImmediateResponse()).status == 200


def test_pickers_rotate_and_a_failed_one_sits_out_for_a_while():
    now = [0.0]
    pool = extproc.PickerPool(["a:1", "b:1", "c:1"], "full-duplex", 1.0, retry_after_s=5.0,
                              clock=lambda: now[0])
    assert [pool.order()[0] for _ in range(4)] == ["a:1", "b:1", "c:1", "a:1"]
    pool._down_until["b:1"] = 5.0
    assert pool.order() == ["c:1", "a:1"]
    now[0] = 5.0
    assert pool.order() == ["c:1", "a:1", "b:1"]


# -- command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--port", "x"], "--port"),
    (["--upstream", "nohost"], "HOST:PORT"),
    (["--picker", "1.2.3.4:99999"], "1-65535"),
    (["--picker", "a:1,a:1"], "twice"),
    (["--picker-timeout-ms", "-1"], "positive"),
    (["--body-mode", "streamed"], "full-duplex"),
    (["--bogus"], "--bogus"),
])
def test_a_bad_flag_exits_2_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        args.parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and words in err and "error:" in err


def test_defaults_and_flags_give_a_valid_config():
    assert args.parse_args([]) == args.GatewayConfig().validate()
    assert args.parse_args([]).response_headers
    assert not args.parse_args(["--no-response-headers"]).response_headers
    assert "--no-response-headers" in args.build_parser().format_help()
    config = args.parse_args(["--port", "0", "--picker", "127.0.0.1:9002, 127.0.0.1:9003", "--body-mode",
                              "buffered", "--picker-timeout-ms", "250", "--metrics-port", "9100"])
    assert config.pickers == ("127.0.0.1:9002", "127.0.0.1:9003") and config.picker_timeout_s == 0.25
    assert (config.body_mode, config.metrics_port) == ("buffered", 9100)
