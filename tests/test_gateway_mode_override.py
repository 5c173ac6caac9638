"""The local gateway honouring a picker's ``mode_override`` as Envoy does with
``allow_mode_override`` (`dynamo_ppd.gateway.extproc`, step 5): the response headers are answered
before the response goes on, and a response body mode STREAMED in the answer sends that response's
body through the picker piece by piece; without --allow-mode-override, with NONE, with a mode
Envoy refuses, or from a picker that does not answer, no body reaches the picker and the client
gets its answer all the same. Fakes from tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from test_gateway import DEST, FakeEpp, FakeUpstream, _gateway

from dynamo_ppd.gateway import GatewayConfig
from dynamo_ppd.gateway.args import parse_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

Mode = processing_mode_pb2.ProcessingMode


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


def _bodies(epp: FakeEpp, stream: int = -1) -> list[tuple[bytes, bool]]:
    return [(m.response_body.body, m.response_body.end_of_stream) for m in epp.streams[stream]
            if m.HasField("response_body")]


def _response_headers(epp: FakeEpp, stream: int = -1) -> pb.ProcessingRequest:
    (message,) = [m for m in epp.streams[stream] if m.HasField("response_headers")]
    return message


async def _sse(gw, upstream: FakeUpstream) -> bytes:
    """A streamed answer through the gateway (the fake upstream's ``/sse``), released at once."""
    upstream.release.set()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/sse", json={"model": "m", "stream": True})
    assert r.status_code == 200
    return r.content


SSE = b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"


async def test_a_streamed_override_sends_the_answers_body_through_the_picker(upstream, epp):
    epp.set_headers = {DEST: upstream.address}
    epp.mode_override = Mode(response_body_mode=Mode.STREAMED)
    async with await _gateway(upstream, epp.address, allow_mode_override=True) as gw:
        assert await _sse(gw, upstream) == SSE  # unchanged for the client
        await epp.wait_ended()
        assert gw.metrics.value("ppd_gateway_picker_response_bodies_total") == 1
        assert "mode override allowed" in gw.describe()
    assert not _response_headers(epp).observability_mode  # answered, and waited for
    # Each chunk's data without its framing, in order; the end of the chunked body as an empty
    # last piece, as Envoy sends an end of stream that carries no data.
    assert _bodies(epp) == [(b"data: one\n\n", False), (b"data: two\n\n", False),
                            (b"data: [DONE]\n\n", False), (b"", True)]
    # A body framed by its length: its last piece carries the end of stream.
    async with await _gateway(upstream, epp.address, allow_mode_override=True) as gw, \
            httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/chat/completions", json={"model": "m"})
        await epp.wait_ended(2)
    pieces = _bodies(epp)
    assert b"".join(p for p, _ in pieces) == r.content and pieces[-1][1]


async def test_each_body_piece_waits_for_the_pickers_answer(upstream):
    class SlowBodies(FakeEpp):
        async def Process(self, request_iterator, context):  # noqa: N802
            async def slowed():
                async for message in request_iterator:
                    if message.HasField("response_body"):
                        await asyncio.sleep(0.3)  # the answer to this piece is late
                    yield message
            async for answer in super().Process(slowed(), context):
                yield answer

    epp = await SlowBodies(set_headers={DEST: upstream.address},
                           mode_override=Mode(response_body_mode=Mode.STREAMED)).start()
    try:
        async with await _gateway(upstream, epp.address, allow_mode_override=True) as gw:
            started = time.monotonic()
            assert await _sse(gw, upstream) == SSE
            took = time.monotonic() - started
        assert took >= 4 * 0.3  # four pieces, each held until answered (Envoy's STREAMED)
    finally:
        await epp.stop()


@pytest.mark.parametrize("setting", ["not allowed", "none", "full duplex"])
async def test_no_body_reaches_the_picker_unless_allowed_and_asked(upstream, epp, setting):
    epp.set_headers = {DEST: upstream.address}
    epp.mode_override = Mode(response_body_mode={"none": Mode.NONE, "full duplex": Mode.FULL_DUPLEX_STREAMED}
                             .get(setting, Mode.STREAMED))
    async with await _gateway(upstream, epp.address, allow_mode_override=setting != "not allowed") as gw:
        assert await _sse(gw, upstream) == SSE
        await epp.wait_ended()
        assert gw.metrics.value("ppd_gateway_picker_response_bodies_total") == 0
    assert _bodies(epp) == []
    # Without allow_mode_override the response headers go in observability mode, never waited for.
    assert _response_headers(epp).observability_mode == (setting == "not allowed")


async def test_a_picker_that_does_not_answer_the_response_headers_is_left_alone(upstream, epp):
    epp.set_headers = {DEST: upstream.address}
    epp.mode_override = Mode(response_body_mode=Mode.STREAMED)
    epp.response_answer_after_s = 2.0  # past the gateway's --picker-timeout-ms 300
    async with await _gateway(upstream, epp.address, allow_mode_override=True, picker_timeout_ms=300) as gw:
        started = time.monotonic()
        assert await _sse(gw, upstream) == SSE  # fail open, after one timeout
        assert 0.3 <= time.monotonic() - started < 1.5
        assert gw.metrics.value("ppd_gateway_picker_response_bodies_total") == 0
    assert _bodies(epp) == []


def test_the_flag_needs_the_response_header_phase():
    assert parse_args(["--allow-mode-override", "--picker", "127.0.0.1:9002"]).allow_mode_override
    assert not parse_args([]).allow_mode_override  # Envoy's default
    with pytest.raises(ValueError, match="--no-response-headers"):
        GatewayConfig(pickers=("127.0.0.1:9002",), allow_mode_override=True,
                      response_headers=False).validate()
