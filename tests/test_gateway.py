"""The local gateway end to end on loopback: a fake endpoint picker (a grpc.aio ext_proc server
that records what it got and answers as GAIE's EPP does), fake upstreams (h11: an echo of the
request as JSON, and an SSE stream that waits for the test), the gateway in process, and once as
a process for SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import h11
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2

from dynamo_ppd.gateway import Gateway, GatewayConfig
from dynamo_ppd.launch.process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

DEST = "x-gateway-destination-endpoint"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


@dataclass
class FakeEpp(external_processor_pb2_grpc.ExternalProcessorServicer):
    """Answers like GAIE's EPP: full duplex, the headers answer then the body (streamed back) once
    the whole body is in; buffered, the headers answer at once and the body after it."""

    set_headers: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)
    endpoint_metadata: str | None = None
    new_body: bytes | None = None
    immediate: pb.ImmediateResponse | None = None
    hang: bool = False
    # How long it takes to answer a response_headers message (the gateway sends it in
    # observability mode and reads no answer it waits for); None: no answer at all.
    response_answer_after_s: float | None = 0.0
    # The mode_override in that answer (tests/test_gateway_mode_override.py); response bodies
    # are answered CONTINUE, unchanged.
    mode_override: processing_mode_pb2.ProcessingMode | None = None
    streams: list[list[pb.ProcessingRequest]] = field(default_factory=list)
    ended: int = 0  # streams the gateway closed (their request iterator ran out)
    server: grpc.aio.Server | None = None
    port: int = 0

    def _headers_answer(self, body_len: int | None) -> pb.ProcessingResponse:
        options = [_set(k, v) for k, v in self.set_headers.items()]
        if body_len is not None:
            options.append(_set("Content-Length", str(body_len)))  # as GAIE sends it
        response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            clear_route_cache=True, header_mutation=pb.HeaderMutation(set_headers=options,
                                                                      remove_headers=self.remove))))
        if self.endpoint_metadata:
            response.dynamic_metadata.update({"envoy.lb": {DEST: self.endpoint_metadata}})
        return response

    async def Process(self, request_iterator, context):  # noqa: N802
        got: list[pb.ProcessingRequest] = []
        self.streams.append(got)
        body, full_duplex = b"", True
        async for message in request_iterator:
            got.append(message)
            if message.HasField("protocol_config"):
                full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
            if self.hang:
                continue
            if self.immediate is not None:
                yield pb.ProcessingResponse(immediate_response=self.immediate)
                return
            kind = message.WhichOneof("request")
            if kind == "response_headers":
                if self.response_answer_after_s is not None:
                    await asyncio.sleep(self.response_answer_after_s)
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(),
                                                mode_override=self.mode_override)
                continue
            if kind == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))
                continue
            if kind == "request_headers" and (message.request_headers.end_of_stream or not full_duplex):
                yield self._headers_answer(None)
            elif kind == "request_body":
                body += message.request_body.body
                if not message.request_body.end_of_stream:
                    continue
                new = self.new_body if self.new_body is not None else body
                if full_duplex:
                    yield self._headers_answer(len(new))
                    half = len(new) // 2  # two streamed pieces, as a long body may come back
                    for piece, end in ((new[:half], False), (new[half:], True)):
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                                body=piece, end_of_stream=end)))))
                else:
                    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=self.new_body)) \
                        if self.new_body is not None else pb.CommonResponse()
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        self.ended += 1

    async def start(self, port: int = 0) -> FakeEpp:
        self.server = grpc.aio.server()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def headers_seen(self, stream: int = -1) -> list[tuple[str, bytes]]:
        return [(h.key, h.raw_value) for h in self.streams[stream][0].request_headers.headers.headers]

    def kinds(self, stream: int = -1) -> list[str | None]:
        return [m.WhichOneof("request") for m in self.streams[stream]]

    async def wait_ended(self, streams: int = 1, timeout_s: float = 5.0) -> None:
        """Until the gateway closed this many streams (the response phase runs after the client
        has its answer, so a test that reads a whole stream waits for its end)."""
        deadline = time.monotonic() + timeout_s
        while self.ended < streams:
            assert time.monotonic() < deadline, f"{self.ended} of {streams} ext_proc streams ended"
            await asyncio.sleep(0.01)


class FakeUpstream:
    """HTTP/1.1 on h11 (a parser independent of the gateway's): ``/sse`` streams two events with
    the second held until ``release`` is set; anything else echoes the request as JSON."""

    def __init__(self, close_after_response: bool = False) -> None:
        self.close_after_response = close_after_response  # as an idle timeout would, unannounced
        self.requests: list[dict] = []
        self.release = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.connections = 0

    async def start(self) -> FakeUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            return event

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = await self._next_event(conn, reader)
                if not isinstance(event, h11.Request):
                    return
                body = b""
                while isinstance(part := await self._next_event(conn, reader), h11.Data):
                    body += part.data
                record = {"method": event.method.decode(), "target": event.target.decode(),
                          "headers": [[k.decode(), v.decode()] for k, v in event.headers],
                          "body": body.decode("latin-1")}
                self.requests.append(record)
                if event.target == b"/sse":
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])))
                    writer.write(conn.send(h11.Data(data=b"data: one\n\n")))
                    await writer.drain()
                    await asyncio.wait_for(self.release.wait(), 10)
                    writer.write(conn.send(h11.Data(data=b"data: two\n\n")))
                    writer.write(conn.send(h11.Data(data=b"data: [DONE]\n\n")))
                else:
                    data = json.dumps(record).encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("content-type", "application/json"), ("content-length", str(len(data)))])))
                    writer.write(conn.send(h11.Data(data=data)))
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if self.close_after_response:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()


def _values(record: dict, name: str) -> list[str]:
    return [v for k, v in record["headers"] if k.lower() == name]


@pytest.fixture
async def upstream():
    up = await FakeUpstream().start()
    yield up
    await up.stop()


@pytest.fixture
async def epp():
    fake = await FakeEpp().start()
    yield fake
    await fake.stop()


async def _gateway(up: FakeUpstream, *pickers: str, **kw) -> Gateway:
    gateway = Gateway(GatewayConfig(port=0, upstream=up.address, pickers=tuple(pickers), **kw))
    await gateway.start()
    return gateway


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "pad": "x" * 70_000}


async def test_full_duplex_sends_what_envoy_sends_and_forwards_the_mutated_request(upstream, epp):
    epp.set_headers = {"x-dynamo-worker-instance-id": "9", DEST: upstream.address}
    epp.remove = ["x-remove-me"]
    epp.new_body = b'{"model": "m", "routed": true}'
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json=BODY, headers={
            "x-dynamo-worker-instance-id": "7", "x-remove-me": "1", "X-Custom": "Kept"})
        await epp.wait_ended()
    assert r.status_code == 200
    stream = epp.streams[0]
    assert epp.kinds() == ["request_headers", "request_body", "request_body", "response_headers"]
    assert stream[0].protocol_config.request_body_mode == FULL_DUPLEX
    assert not stream[0].request_headers.end_of_stream and stream[2].request_body.end_of_stream
    seen = dict(epp.headers_seen())
    assert seen[":method"] == b"POST" and seen[":path"] == b"/v1/chat/completions"
    assert seen[":authority"] == f"127.0.0.1:{gw.port}".encode() and seen[":scheme"] == b"http"
    assert seen["x-custom"] == b"Kept" and all(k == k.lower() for k in seen)
    assert json.loads(b"".join(m.request_body.body for m in stream[1:3])) == BODY
    got = upstream.requests[0]
    assert _values(got, "x-dynamo-worker-instance-id") == ["9"]  # overwritten, not appended
    assert _values(got, "x-remove-me") == [] and _values(got, "x-custom") == ["Kept"]
    assert got["body"] == epp.new_body.decode()
    assert _values(got, "content-length") == [str(len(epp.new_body))]
    assert _values(got, "transfer-encoding") == []
    assert _values(got, "host") == [f"127.0.0.1:{gw.port}"]
    assert gw.metrics.value("ppd_gateway_requests_total", outcome="routed") == 1
    assert gw.metrics.value("ppd_gateway_picker_callout_seconds_count") == 1


async def test_buffered_mode_sends_the_body_after_the_headers_answer(upstream, epp):
    epp.set_headers = {"x-routed": "yes"}

    async def chunked():  # a chunked client body: the gateway decodes it
        yield b'{"model": '
        yield b'"m"}'

    async with await _gateway(upstream, epp.address, body_mode="buffered") as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/completions", content=chunked())
        await epp.wait_ended()
    assert r.status_code == 200
    stream = epp.streams[0]
    assert epp.kinds() == ["request_headers", "request_body", "response_headers"]
    assert stream[0].protocol_config.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    assert stream[1].request_body.body == b'{"model": "m"}' and stream[1].request_body.end_of_stream
    got = upstream.requests[0]
    assert got["body"] == '{"model": "m"}' and _values(got, "x-routed") == ["yes"]
    assert _values(got, "content-length") == ["14"] and _values(got, "transfer-encoding") == []


async def test_destination_from_the_header_and_from_envoy_lb_metadata(upstream, epp):
    other = await FakeUpstream().start()
    try:
        async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
            epp.set_headers = {DEST: other.address}
            assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
            epp.set_headers, epp.endpoint_metadata = {}, other.address
            assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
            epp.endpoint_metadata = None  # neither: the default upstream
            assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert len(other.requests) == 2 and len(upstream.requests) == 1
        assert _values(other.requests[0], DEST) == [other.address]
    finally:
        await other.stop()


async def test_an_immediate_response_reaches_the_client_and_nothing_is_forwarded(upstream, epp):
    epp.immediate = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=400),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
        body=b'{"error": {"message": "no model"}}', details="refused")
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"messages": []})
        r2 = await client.post("/v1/chat/completions", json={"messages": []})  # same connection
    assert (r.status_code, r.json(), r.headers["content-type"]) == (
        400, {"error": {"message": "no model"}}, "application/json")
    assert r2.status_code == 400 and upstream.requests == [] and gw.accepted == 1
    assert gw.metrics.value("ppd_gateway_immediate_responses_total", code="400") == 2


async def test_fail_open_when_the_picker_port_is_closed(upstream):
    async with await _gateway(upstream, f"127.0.0.1:{free_port()}") as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"}, headers={"x-worker": "7"})
    assert r.status_code == 200 and r.json()["body"] == '{"model":"m"}'
    assert _values(upstream.requests[0], "x-worker") == ["7"]
    assert gw.metrics.value("ppd_gateway_picker_fail_open_total") == 1
    assert gw.metrics.value("ppd_gateway_requests_total", outcome="fail_open") == 1


async def test_fail_open_when_the_picker_hangs_past_the_timeout(upstream, epp):
    epp.hang, epp.set_headers = True, {"x-routed": "yes"}
    async with await _gateway(upstream, epp.address, picker_timeout_ms=200) as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        started = time.monotonic()
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        took = time.monotonic() - started
    assert r.status_code == 200 and 0.2 <= took < 2.0
    assert _values(upstream.requests[0], "x-routed") == []
    assert gw.metrics.value("ppd_gateway_picker_fail_open_total") == 1


async def test_one_slow_request_does_not_eject_the_picker_but_failures_in_a_row_do(upstream, epp):
    # Envoy's outlier detection, not a one-strike rule: a request the picker does not answer in
    # time goes on unrouted, and the next request is the picker's again; --picker-eject-after
    # failures in a row leave it out for the retry period.
    epp.set_headers = {"x-routed": "yes"}
    async with await _gateway(upstream, epp.address, picker_timeout_ms=200, picker_eject_after=3,
                              picker_retry_after_s=30) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        epp.hang = True
        assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        epp.hang = False
        assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert _values(upstream.requests[-1], "x-routed") == ["yes"]  # still asked, and it answered
        assert gw.metrics.value("ppd_gateway_picker_failures_total") == 1
        assert gw.metrics.value("ppd_gateway_picker_ejections_total") == 0
        epp.hang = True
        for _ in range(3):
            await client.post("/v1/chat/completions", json={"model": "m"})
        assert gw.metrics.value("ppd_gateway_picker_ejections_total") == 1
        epp.hang = False
        asked = len(epp.streams)
        started = time.monotonic()
        assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert len(epp.streams) == asked and time.monotonic() - started < 0.2  # left out: not asked
        assert _values(upstream.requests[-1], "x-routed") == []


async def test_pickers_take_turns_and_a_restarted_one_is_used_again(upstream, epp):
    second = await FakeEpp().start()
    epp.set_headers = second.set_headers = {"x-routed": "yes"}
    async with await _gateway(upstream, epp.address, second.address, picker_retry_after_s=0.3) as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert (len(epp.streams), len(second.streams)) == (2, 2)
        await second.stop()  # both requests go to the first picker: the second is skipped once failed
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert len(epp.streams) == 5 and gw.metrics.value("ppd_gateway_picker_fail_open_total") == 0
        restarted = await FakeEpp(set_headers={"x-routed": "again"}).start(second.port)
        try:
            await asyncio.sleep(0.4)
            for _ in range(4):
                await client.post("/v1/chat/completions", json={"model": "m"})
            assert len(restarted.streams) >= 1
        finally:
            await restarted.stop()
    assert all(_values(r, "x-routed") for r in upstream.requests)


async def test_pass_through_makes_no_callout_and_keeps_the_connection(upstream):
    async with await _gateway(upstream) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r1 = await client.post("/v1/chat/completions", json={"model": "m"}, headers={"x-a": "1"})
        r2 = await client.get("/v1/models")
    assert r1.status_code == r2.status_code == 200
    assert [r["target"] for r in upstream.requests] == ["/v1/chat/completions", "/v1/models"]
    assert _values(upstream.requests[0], "x-a") == ["1"]
    assert gw.accepted == 1 and upstream.connections == 1  # one client connection, one pooled upstream
    assert gw.metrics.value("ppd_gateway_requests_total", outcome="passthrough") == 2


async def test_a_request_without_body_is_routed_on_its_headers(upstream, epp):
    epp.set_headers = {"x-routed": "yes"}
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.get("/v1/models")).status_code == 200
        await epp.wait_ended()
    assert epp.kinds() == ["request_headers", "response_headers"]
    assert epp.streams[0][0].request_headers.end_of_stream
    assert _values(upstream.requests[0], "x-routed") == ["yes"]
    assert _values(upstream.requests[0], "content-length") == []


def _response_headers(epp: FakeEpp, stream: int = -1) -> pb.HttpHeaders:
    (message,) = [m for m in epp.streams[stream] if m.HasField("response_headers")]
    assert message.observability_mode  # sent, not waited for
    return message.response_headers


def _header_dict(headers: pb.HttpHeaders) -> dict[str, bytes]:
    return {h.key: h.raw_value for h in headers.headers.headers}


async def test_the_upstreams_status_goes_to_the_picker_on_the_same_stream_after_the_request(upstream, epp):
    epp.set_headers = {DEST: upstream.address}
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        await epp.wait_ended()  # the gateway half-closed it and the picker ended it
    assert r.status_code == 200
    assert epp.kinds() == ["request_headers", "request_body", "response_headers"]
    sent = _response_headers(epp)
    fields = [h.key for h in sent.headers.headers]
    assert fields[0] == ":status" and _header_dict(sent)[":status"] == b"200"
    assert _header_dict(sent)["content-type"] == b"application/json"
    assert "connection" not in fields and "transfer-encoding" not in fields  # this hop's, not Envoy's
    assert not sent.end_of_stream  # a body follows
    assert len(epp.streams) == 1 and len(upstream.requests) == 1


async def test_the_client_does_not_wait_for_the_pickers_answer_to_the_response_headers(upstream, epp):
    epp.set_headers = {DEST: upstream.address}
    epp.response_answer_after_s = 2.0
    gw = await _gateway(upstream, epp.address)
    try:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            started = time.monotonic()
            r = await client.post("/v1/chat/completions", json={"model": "m"})
            took = time.monotonic() - started
            assert r.status_code == 200 and took < 1.0, f"the client waited {took:.2f} s"
            deadline = time.monotonic() + 5
            while not any(m.HasField("response_headers") for m in epp.streams[0]):
                assert time.monotonic() < deadline, "no response_headers reached the picker"
                await asyncio.sleep(0.01)
            assert epp.ended == 0  # the picker is still sitting on its answer
    finally:
        started = time.monotonic()
        await gw.stop()  # the stream waiting on the picker's late answer is cancelled, not awaited
        assert time.monotonic() - started < 1.0
    assert _header_dict(_response_headers(epp))[":status"] == b"200"


async def test_the_gateways_own_502_goes_to_the_picker_as_the_status(upstream, epp):
    epp.set_headers = {DEST: f"127.0.0.1:{free_port()}"}  # routed to an endpoint nobody listens on
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        await epp.wait_ended()
    assert r.status_code == 502 and upstream.requests == []
    assert _header_dict(_response_headers(epp))[":status"] == b"502"


async def test_no_response_headers_with_the_response_phase_off(upstream, epp):
    epp.set_headers = {DEST: upstream.address}
    async with await _gateway(upstream, epp.address, response_headers=False) as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        assert (await client.get("/v1/models")).status_code == 200
        await epp.wait_ended(2)
    assert r.status_code == 200
    assert [epp.kinds(0), epp.kinds(1)] == [["request_headers", "request_body"], ["request_headers"]]
    assert "response headers" not in gw.describe()


async def test_a_pooled_connection_the_upstream_closed_is_replaced():
    up = await FakeUpstream(close_after_response=True).start()
    try:
        async with await _gateway(up) as gw, httpx.AsyncClient(base_url=gw.url) as client:
            for _ in range(3):
                # No pause: the gateway may reuse the connection before it sees the close.
                assert (await client.post("/v1/chat/completions", json={"model": "m"})).status_code == 200
        assert up.connections == 3 and gw.metrics.value("ppd_gateway_upstream_errors_total") == 0
    finally:
        await up.stop()


async def test_the_first_sse_event_arrives_before_the_upstream_finishes(upstream, epp):
    async with await _gateway(upstream, epp.address) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        async with client.stream("POST", "/sse", json={"model": "m", "stream": True}) as r:
            chunks = r.aiter_bytes()
            first = await asyncio.wait_for(chunks.__anext__(), 5)
            assert first == b"data: one\n\n" and not upstream.release.is_set()
            upstream.release.set()
            rest = b"".join([c async for c in chunks])
    assert rest == b"data: two\n\ndata: [DONE]\n\n"
    assert r.headers["content-type"] == "text/event-stream"


async def test_upstream_down_is_a_502_with_a_json_error():
    config = GatewayConfig(port=0, upstream=f"127.0.0.1:{free_port()}")
    async with Gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        again = await client.post("/v1/messages", json={"model": "m"})
    assert r.status_code == 502 and again.status_code == 502
    error = r.json()  # the frontend's error shape on OpenAI's paths, Anthropic's on /v1/messages
    assert (error["type"], error["code"]) == ("Bad Gateway", 502) and "unreachable" in error["message"]
    assert again.json()["type"] == "error" and again.json()["error"]["type"] == "api_error"
    assert gw.metrics.value("ppd_gateway_upstream_errors_total") == 2


async def test_metrics_are_served_on_the_metrics_port(upstream):
    async with await _gateway(upstream, metrics_port=0) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        await client.get("/v1/models")
        page = (await client.get(f"http://127.0.0.1:{gw.metrics_port}/metrics")).text
    assert 'ppd_gateway_requests_total{outcome="passthrough"} 1.0' in page


def test_the_command_line_gateway_stops_cleanly_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_ppd.gateway", "--port", "0", "--upstream",
                             f"127.0.0.1:{free_port()}", "--picker", f"127.0.0.1:{free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "gateway on http://127.0.0.1:" in line and "-> upstream" in line and "mode full-duplex" in line
        port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m"}, timeout=10)
        assert r.status_code == 502  # picker and upstream both down: fail open, then bad gateway
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err
