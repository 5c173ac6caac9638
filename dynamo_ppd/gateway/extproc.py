"""The gateway's ext_proc client: it plays Envoy's ext_proc HTTP filter
(envoy.filters.http.ext_proc, source/extensions/filters/http/ext_proc/ext_proc.cc) toward an
endpoint picker, configured as the Gateway API Inference Extension configures it on the request
path: processing mode request_header_mode SEND, request_body_mode FULL_DUPLEX_STREAMED (or
BUFFERED), request_trailer_mode SEND; on the response path response_header_mode SEND in
observability mode (``observability_mode: true``: sent, never waited for) and response_body_mode
NONE. With ``--no-response-headers`` response_header_mode is SKIP.

Per request, one `Process` stream:

1. ``request_headers``: HttpHeaders with the header map (values in ``raw_value``, pseudo-headers
   included) and ``end_of_stream`` true only when no body follows; the first message carries
   ``protocol_config`` (the body modes), as `Filter::encodeProtocolConfig` does.
2. The body as ``request_body`` HttpBody messages, ``end_of_stream`` on the last. FULL_DUPLEX:
   sent right behind the headers without waiting (Envoy streams it as it arrives; here in 64 KiB
   chunks). BUFFERED: one message, sent only once the headers were answered, because Envoy holds
   the body while "header processing still in progress" (`Filter::onData`). A request without
   trailers sends no ``request_trailers`` message, as with Envoy over HTTP/1.1.
3. The answers: a ``request_headers`` HeadersResponse (header mutation; ``clear_route_cache``
   means nothing here: there is no route cache) and ``request_body`` BodyResponses. In full
   duplex GAIE's EPP answers only after the whole body (`pkg/epp/handlers/server.go`:
   headers response, then a streamed body response), the body coming back as
   ``streamed_response`` pieces up to ``end_of_stream``; in buffered mode a ``body`` replacement,
   ``clear_body``, or no mutation (the body stays). ``dynamic_metadata`` on any answer is merged.
   An ``immediate_response`` at any point ends the exchange: it is the client's answer.
4. The response phase (`ResponsePhase`): the stream stays open while the request is forwarded.
   When the upstream's status line and headers arrive, before any of the body goes to the
   client, one ``response_headers`` HttpHeaders goes out: ``:status`` first, then the response's
   headers minus this hop's connection fields, ``end_of_stream`` when no body follows, and
   ``observability_mode`` set. When the gateway answers itself because the upstream failed
   (502), that status goes out the same way. Why: the picker learns at once that a turn failed
   (Dynamo's frontend answers 5xx to a turn pinned to a prefill worker that is gone), which
   Dynamo's discovery tells it only some 20 s later; meanwhile it would pin more turns there.
   The message is written in the background, as Envoy does in observability mode: the client's
   response waits for nothing; the picker's answer, if any, is read and discarded. Then the
   stream is half-closed and closed once the picker ends it, or cancelled after
   `CLOSE_GRACE_S` (Envoy's ``deferred_close_timeout``, 5 s by default). A failure there is
   logged at debug and changes nothing for the client. GAIE's gateways (kgateway, Istio) send
   response headers too, but wait for the answer (no observability mode) and stream the
   response body through the picker as well (deploy/README.md).
5. With ``--allow-mode-override`` (Envoy's ``allow_mode_override: true``) the response headers go
   out in the ordinary mode instead (``observability_mode`` false) and the response waits for the
   picker's answer (`ResponsePhase.ask`), because that answer may carry a ``mode_override``: the
   processing mode for the rest of this request. Honoured as Envoy's filter honours it
   (`Filter::onReceiveMessage`, ext_proc.cc): only in the answer to headers, never in
   observability mode, never one naming FULL_DUPLEX_STREAMED; header modes left DEFAULT keep the
   configured ones, body modes are taken as given. What this gateway acts on is the response
   body mode: STREAMED sends each body piece to the picker as Envoy's STREAMED mode does, one
   ``response_body`` HttpBody per piece (``end_of_stream`` on the last; an empty last one when the
   body's end carries no data), each held from the client until the picker answers it (Envoy
   sends the next piece before that answer is in; here it waits its turn, which is the same
   while the picker answers faster than the pieces come); its
   answer's mutations are not applied (the picker makes none), an immediate response there is
   ignored. NONE, or no override, sends no body. BUFFERED and the other modes are not played:
   no body is sent (logged once). Envoy's newest filter also ignores every override while its
   configured request or response body mode is FULL_DUPLEX_STREAMED, which is this gateway's
   request body mode by default; this gateway does not, so that the picker can observe answers
   here (on GAIE's gateways it gets every response body anyway, FULL_DUPLEX_STREAMED). A picker
   that does not answer within ``--picker-timeout-ms``, or fails, is left alone for the rest of
   the request and the response goes on (fail open).

Each awaited answer has ``--picker-timeout-ms`` (Envoy's ``message_timeout``). A gRPC error, a
timeout, or a stream that ends early raise `PickerError`; `PickerPool` then tries the next
replica and in the end fails open (GAIE's ``failureMode: FailOpen``). Note that Envoy itself does
not fail open in FULL_DUPLEX_STREAMED once body data went out (`Filter::failureModeAllow`); this
gateway does, as the Inference Extension's FailOpen setting promises.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from .headers import apply_header_mutation, merge_metadata, to_header_map
from .http import HOP_BY_HOP, Headers
from .upstream import BodyTap

log = logging.getLogger("dynamo_ppd.gateway")

Mode = processing_mode_pb2.ProcessingMode
BODY_MODES = {"full-duplex": Mode.FULL_DUPLEX_STREAMED, "buffered": Mode.BUFFERED}
BODY_CHUNK = 64 << 10
# A restarted picker must be reachable again within a second, not after gRPC's default
# reconnect backoff (up to two minutes).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
# How long a finished stream may take to close before it is cancelled (Envoy's
# deferred_close_timeout for observability mode, 5 s by default).
CLOSE_GRACE_S = 5.0


class PickerError(Exception):
    """The picker did not answer usably (unreachable, gRPC error, timeout, stream ended)."""


@dataclass
class Immediate:
    """A picker's ImmediateResponse: the client's answer, nothing is forwarded."""

    status: int
    headers: Headers
    body: bytes
    details: str = ""


@dataclass
class CalloutResult:
    headers: Headers  # after the picker's mutations
    body: bytes  # after the picker's body mutation (the original when it made none)
    metadata: dict[str, Any] = field(default_factory=dict)  # dynamic metadata, by namespace
    immediate: Immediate | None = None
    seconds: float = 0.0  # first message sent -> last answer needed before forwarding
    picker: str = ""
    # The stream, kept open for the response's status (module doc, step 4); None when the
    # response phase is off. Its owner reports the status once or closes it: one of the two.
    response: ResponsePhase | None = None


def processing_mode(body_mode: str, response_headers: bool = True) -> processing_mode_pb2.ProcessingMode:
    """The filter's ProcessingMode this gateway plays (for reference and tests; the stream itself
    only carries the body modes, in protocol_config): the request path as the Inference Extension
    sets it, response headers SEND (in observability mode) unless ``response_headers`` is off."""
    return Mode(request_header_mode=Mode.SEND,
                response_header_mode=Mode.SEND if response_headers else Mode.SKIP,
                request_body_mode=BODY_MODES[body_mode], response_body_mode=Mode.NONE,
                request_trailer_mode=Mode.SEND, response_trailer_mode=Mode.SKIP)


def request_messages(headers: Headers, body: bytes, body_mode: str,
                     chunk: int = BODY_CHUNK) -> list[pb.ProcessingRequest]:
    """What Envoy's filter sends for this request, in order (see the module doc)."""
    mode = BODY_MODES[body_mode]
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=to_header_map(headers), end_of_stream=not body),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=Mode.NONE))
    if not body:
        return [first]
    size = chunk if mode == Mode.FULL_DUPLEX_STREAMED else len(body)
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    last = len(pieces) - 1
    return [first, *(pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == last))
                     for i, p in enumerate(pieces))]


def response_headers_message(status: int, headers: Headers, end_of_stream: bool) -> pb.ProcessingRequest:
    """What Envoy's filter sends when the upstream's response headers arrive: ``:status`` first,
    then the response's headers lower-cased minus this hop's connection fields (Envoy's HTTP/1
    codec keeps none of them in the header map), flagged as sent in observability mode (the
    picker need not answer)."""
    fields = [(":status", str(status)), *((k.lower(), v) for k, v in headers if k.lower() not in HOP_BY_HOP)]
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=to_header_map(fields), end_of_stream=end_of_stream),
        observability_mode=True)


def immediate_from(response: pb.ImmediateResponse) -> Immediate:
    """An ImmediateResponse as the client's answer. Envoy answers 200 when no status is set and
    500 for a code below 200 (`MutationUtils::isValidHttpStatus`)."""
    code = response.status.code if response.HasField("status") else 200
    if not 200 <= code <= 599:
        code = 500
    headers = apply_header_mutation([], response.headers)
    return Immediate(code, headers, bytes(response.body), response.details)


class _Exchange:
    """The answers of one stream, applied as they come (see the module doc, step 3)."""

    def __init__(self, headers: Headers, body: bytes):
        self.result = CalloutResult(headers=list(headers), body=body)
        self.streamed: list[bytes] | None = None
        self.headers_done = False
        self.body_done = False

    def _mutate_body(self, mutation: pb.BodyMutation) -> bool:
        """Apply a body mutation; True once the body is final."""
        kind = mutation.WhichOneof("mutation")
        if kind == "streamed_response":
            self.streamed = (self.streamed or []) + [mutation.streamed_response.body]
            if not mutation.streamed_response.end_of_stream:
                return False
            self.result.body = b"".join(self.streamed)
        elif kind == "body":
            self.result.body = mutation.body
        elif kind == "clear_body" and mutation.clear_body:
            self.result.body = b""
        return True

    def take(self, response: pb.ProcessingResponse) -> None:
        if response.HasField("dynamic_metadata"):
            merge_metadata(self.result.metadata, response.dynamic_metadata)
        kind = response.WhichOneof("response")
        if kind == "immediate_response":
            self.result.immediate = immediate_from(response.immediate_response)
        elif kind in ("request_headers", "request_body"):
            common = getattr(response, kind).response
            if common.HasField("header_mutation"):
                self.result.headers = apply_header_mutation(self.result.headers, common.header_mutation)
            if kind == "request_headers":
                self.headers_done = True
                if common.status == pb.CommonResponse.CONTINUE_AND_REPLACE:
                    # The headers answer replaces the body; no body answer follows.
                    self.body_done = self._mutate_body(common.body_mutation)
            elif common.HasField("body_mutation"):
                self.body_done = self._mutate_body(common.body_mutation)
            else:
                self.body_done = True  # no mutation: the original body goes on
        # request_trailers answers and response-path answers change nothing here.


async def _answers(call: Any, exchange: _Exchange, until: Callable[[], bool], timeout_s: float) -> None:
    while exchange.result.immediate is None and not until():
        try:
            response = await asyncio.wait_for(call.read(), timeout_s)
        except asyncio.TimeoutError:
            raise PickerError(f"no answer within {timeout_s * 1000:g} ms") from None
        if response is grpc.aio.EOF:
            raise PickerError("the picker closed the stream before answering")
        exchange.take(response)


async def _write_all(call: Any, messages: Sequence[pb.ProcessingRequest]) -> None:
    for message in messages:
        await call.write(message)


async def process(stub: external_processor_pb2_grpc.ExternalProcessorStub, headers: Headers, body: bytes,
                  body_mode: str, timeout_s: float, closing: set[asyncio.Task] | None = None,
                  keep_open: bool = False) -> CalloutResult:
    """One ext_proc exchange for one request (module doc); raises PickerError. ``closing``: where
    the tasks that close finished streams are kept (without it a finished stream is cancelled at
    once); ``keep_open``: a routed request's stream stays open for the response phase
    (`CalloutResult.response`)."""
    messages = request_messages(headers, body, body_mode)
    exchange = _Exchange(headers, body)
    call = stub.Process()
    writer: asyncio.Task | None = None
    done = False
    started = time.perf_counter()
    try:
        if BODY_MODES[body_mode] == Mode.FULL_DUPLEX_STREAMED or not body:
            # The writer runs beside the reader: an immediate answer may come before the body is out.
            writer = asyncio.ensure_future(_write_all(call, messages))
            await _answers(call, exchange, lambda: exchange.headers_done and (exchange.body_done or not body),
                           timeout_s)
        else:
            await call.write(messages[0])
            await _answers(call, exchange, lambda: exchange.headers_done, timeout_s)
            if exchange.result.immediate is None and not exchange.body_done:
                await call.write(messages[1])
                await _answers(call, exchange, lambda: exchange.body_done, timeout_s)
        exchange.result.seconds = time.perf_counter() - started
        done = exchange.result.immediate is None and (writer is None or writer.done())
        return exchange.result
    except grpc.aio.AioRpcError as exc:
        raise PickerError(f"gRPC {exc.code().name}: {exc.details()}") from None
    except (grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
        raise PickerError(f"stream error: {exc}") from None
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
        if writer is not None:
            await asyncio.gather(writer, return_exceptions=True)
        if done and closing is not None and keep_open:
            exchange.result.response = ResponsePhase(call, closing, timeout_s)
        elif done and closing is not None:
            # Half-close as Envoy does when processing is over, and let the picker end the
            # stream in its own time; cancel it if it does not.
            _in_background(_finish(call), closing)
        else:
            call.cancel()


def _in_background(coro: Coroutine[Any, Any, None], closing: set[asyncio.Task]) -> None:
    """Run ``coro`` as a task kept in ``closing`` until it is done (`PickerPool.close` cancels it)."""
    task = asyncio.ensure_future(coro)
    closing.add(task)
    task.add_done_callback(closing.discard)


async def _finish(call: Any, last: pb.ProcessingRequest | None = None) -> None:
    """Write ``last`` (if any), half-close, read and discard whatever the picker still answers
    until it ends the stream; cancel the stream when that takes over `CLOSE_GRACE_S` or fails.
    Never raises: the client's request is over or goes on without this."""

    async def steps() -> None:
        if last is not None:
            await call.write(last)
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass  # an answer to the response phase: observability mode ignores it
        await call.code()

    try:
        await asyncio.wait_for(steps(), CLOSE_GRACE_S)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError,
            asyncio.InvalidStateError) as exc:
        log.debug("ext_proc stream closed uncleanly: %s", str(exc) or type(exc).__name__)
    finally:
        call.cancel()


_warned_modes: set[int] = set()


def override_body_mode(answer: pb.ProcessingResponse) -> int | None:
    """The response body mode the ``mode_override`` of an answer to headers sets, with
    ``allow_mode_override``, as Envoy would honour it (module doc, step 5): None when it has none
    or it is ignored."""
    if not answer.HasField("mode_override"):
        return None
    mode = answer.mode_override
    if Mode.FULL_DUPLEX_STREAMED in (mode.request_body_mode, mode.response_body_mode):
        return None  # Envoy: "mode override from response is FULL_DUPLEX_STREAMED" is refused
    return mode.response_body_mode


class ResponsePhase:
    """A routed request's ext_proc stream after the request phase (module doc, steps 4 and 5):
    `report` sends the response's status in observability mode and closes the stream, `ask`
    sends it in the ordinary mode and waits for the answer (and returns the body's tap when the
    picker asked for the body), `close` closes it without a status; the first of the three does
    it, later ones do nothing. Closing never waits: the work runs in a task of the pool's
    ``closing`` set, which `PickerPool.close` cancels."""

    def __init__(self, call: Any, closing: set[asyncio.Task], timeout_s: float = 1.0):
        self._call = call
        self._closing = closing
        self._timeout_s = timeout_s  # per awaited answer (`ask`, the body's pieces)
        self.finished = False

    def report(self, status: int, headers: Headers, end_of_stream: bool) -> None:
        if self.finished:
            return
        self.finished = True
        _in_background(_finish(self._call, response_headers_message(status, headers, end_of_stream)),
                       self._closing)

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        _in_background(_finish(self._call), self._closing)

    async def ask(self, status: int, headers: Headers, end_of_stream: bool) -> BodyTap | None:
        """Send the response's status and headers and wait for the picker's answer (module doc,
        step 5); the tap for the body when its mode override asks for a STREAMED body, else
        None (the stream is then closed). Never raises: a failing picker is left alone."""
        if self.finished:
            return None
        message = response_headers_message(status, headers, end_of_stream)
        message.observability_mode = False
        try:
            await self._call.write(message)
            answer = await self._answer("response_headers")
        except PickerError as exc:
            log.debug("response headers not answered (%s): going on without the picker", exc)
            self._abandon()
            return None
        mode = override_body_mode(answer)
        if mode == Mode.STREAMED and not end_of_stream:
            return self._body
        if mode not in (None, Mode.NONE, Mode.STREAMED) and mode not in _warned_modes:
            _warned_modes.add(mode)
            log.info("the picker asked for response body mode %s, which this gateway does not play: "
                     "no body sent", Mode.BodySendMode.Name(mode))
        self.close()
        return None

    async def _body(self, data: bytes, end_of_stream: bool) -> None:
        """One piece of the response body to the picker, held until answered (the tap `ask`
        returns); the stream is closed after the last piece."""
        if self.finished:
            return
        try:
            await self._call.write(pb.ProcessingRequest(
                response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream)))
            await self._answer("response_body")
        except PickerError as exc:
            log.debug("response body not answered (%s): going on without the picker", exc)
            self._abandon()
            return
        if end_of_stream:
            self.close()

    async def _answer(self, kind: str) -> pb.ProcessingResponse:
        """The picker's next answer; PickerError when it fails, is late or answers out of turn."""
        try:
            answer = await asyncio.wait_for(self._call.read(), self._timeout_s)
        except asyncio.TimeoutError:
            raise PickerError(f"no answer within {self._timeout_s * 1000:g} ms") from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            raise PickerError(str(exc) or type(exc).__name__) from None
        if answer is grpc.aio.EOF:
            raise PickerError("the picker closed the stream")
        if answer.WhichOneof("response") != kind:
            # An immediate response once the answer has started is not played here (module doc).
            raise PickerError(f"answered {answer.WhichOneof('response')} to {kind}")
        return answer

    def _abandon(self) -> None:
        """The picker failed on this stream: cancel it, the response goes on without it."""
        self.finished = True
        self._call.cancel()


class PickerPool:
    """The picker replicas: each request starts at the next one in round-robin order and goes on
    to the others when one fails. A replica that failed ``eject_after`` requests in a row is left
    out for ``retry_after_s`` (so one that is down costs a few timeouts per period, and a restarted
    one is used again after it), as Envoy's outlier detection ejects a host after
    ``consecutive_local_origin_failure`` (default 5) failures, not after one: one slow request
    must not take the picker away from everyone. None answering: `callout` returns None and the
    caller fails open."""

    def __init__(self, addresses: Sequence[str], body_mode: str, timeout_s: float, retry_after_s: float,
                 clock: Callable[[], float] = time.monotonic, response_headers: bool = False,
                 eject_after: int = 5, on_failure: Callable[[bool], None] | None = None):
        self.addresses = list(addresses)
        self.body_mode = body_mode
        self.response_headers = response_headers  # keep each routed stream open for its status
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self._next = 0
        self.eject_after = eject_after
        self.on_failure = on_failure  # told of each failure, and whether it ejected the replica
        self._down_until: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # failures in a row, per replica
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, external_processor_pb2_grpc.ExternalProcessorStub] = {}
        self._closing: set[asyncio.Task] = set()

    def _stub(self, address: str) -> external_processor_pb2_grpc.ExternalProcessorStub:
        # Created on first use, inside the running loop (grpc.aio channels belong to one loop).
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            self._stubs[address] = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        return self._stubs[address]

    def order(self) -> list[str]:
        """The replicas to try for the next request: round-robin start, those down left out."""
        start = self._next
        self._next = (start + 1) % len(self.addresses)
        now = self.clock()
        rotated = self.addresses[start:] + self.addresses[:start]
        return [a for a in rotated if self._down_until.get(a, 0.0) <= now]

    async def callout(self, headers: Headers, body: bytes) -> CalloutResult | None:
        for address in self.order():
            try:
                result = await process(self._stub(address), headers, body, self.body_mode, self.timeout_s,
                                       self._closing, keep_open=self.response_headers)
            except PickerError as exc:
                failures = self._failures[address] = self._failures.get(address, 0) + 1
                if self.on_failure is not None:
                    self.on_failure(failures >= self.eject_after)
                if failures >= self.eject_after:
                    log.warning("picker %s failed (%s), %d in a row: left out for %g s", address, exc,
                                failures, self.retry_after_s)
                    self._down_until[address] = self.clock() + self.retry_after_s
                    self._failures[address] = 0
                else:
                    log.warning("picker %s failed (%s), %d in a row", address, exc, failures)
                continue
            self._failures[address] = 0
            result.picker = address
            return result
        return None

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
