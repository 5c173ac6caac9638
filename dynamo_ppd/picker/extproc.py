"""The picker's Envoy ext_proc service, as the Gateway API Inference Extension's endpoint picker
protocol (v1.0, `docs/proposals/004-endpoint-picker-protocol` of
kubernetes-sigs/gateway-api-inference-extension) defines it and its EPP implements it
(`pkg/epp/handlers/server.go`, `request.go`).

Per HTTP request the gateway opens one `Process` stream and sends the request headers, then the
body (FULL_DUPLEX_STREAMED: in chunks, the last with end_of_stream; BUFFERED: one message). The
picker answers only once the whole body is in, in the order the protocol requires: first the
headers response (the header mutation carrying the route, ``x-gateway-destination-endpoint``
naming the frontend, ``Content-Length`` when the body changed, and the same endpoint in the
``envoy.lb`` dynamic metadata), then the body (a streamed body response in full-duplex mode, as
GAIE's EPP sends it; a body mutation, or none, in buffered mode). The frontend named is one of
the endpoints the gateway allows when it says which (the subset hint in the request's metadata).
A request that cannot be
forwarded gets an ImmediateResponse (503) with the error body of the request's API (`apis`). A
request with no body (a GET) goes to a frontend unrouted.

Response headers and bodies, if the gateway sends them, pass unchanged, but for the events without
data an event stream loses on the way (`sse`: Dynamo 1.6.1's ``x-bypass-remote-prefill``
annotation, which no conforming client dispatches and openai-python fails on): a GAIE gateway
streams every response body through the picker (FULL_DUPLEX_STREAMED), so the picker's echo is
where a Kubernetes deployment drops them, at no cost beyond the echo it makes anyway. The response
headers of a routed request tell the picker its status (`Picker.answered`) and whether to watch
the answer for its TTFT and TPOT (`Picker.watch`, `outcomes`: a share of the follow-ups, or every
one where the gateway streams every response body through the picker anyway, FULL_DUPLEX_STREAMED,
so that watching costs nothing more than reading chunks it echoes already); unless sent in
observability mode they are answered with a ``mode_override`` whose ``response_body_mode`` is
STREAMED for a watched answer and NONE for any other, so a gateway that allows overrides
(``allow_mode_override``) sends only the watched answers' bodies. Each response body chunk is
answered as the gateway's response body mode requires
(`ProtocolConfiguration.response_body_mode`): a streamed body response echoing it in
FULL_DUPLEX_STREAMED, an empty CONTINUE otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ..sse import DatalessEventFilter
from .metrics import PickerMetrics
from .outcomes import AnswerWatch
from .picker import Pick, Picker, Refusal
from .stages import StageClock

log = logging.getLogger("dynamo_ppd.picker")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
# The endpoints a gateway allows for a request (protocol: "the EPP MUST pick from" them), in the
# ext_proc request's metadata_context; kgateway sends them, Istio does not.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
TIMING_NAMESPACE = "ppd.picker"  # the picker's own time per request (`timing_metadata`)


def endpoint_subset(message: pb.ProcessingRequest) -> list[str] | None:
    """The subset hint of a request's metadata, or None when the gateway sent none."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.WhichOneof("kind") != "list_value":
        return []  # not a list: nothing the picker may pick from (a 503, as for an empty one)
    return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]


def _header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header set with overwrite semantics (``append`` false: every existing value is replaced)."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def headers_response(endpoint: str, set_headers: dict[str, str], remove: tuple[str, ...] = (),
                     body_length: int | None = None) -> pb.ProcessingResponse:
    """The request-headers reply: the route's headers and the destination, header and metadata."""
    options = [_set(DESTINATION_HEADER, endpoint), *(_set(k, v) for k, v in set_headers.items())]
    if body_length is not None:  # the body changed: Envoy needs its new length (GAIE does this)
        options.append(_set("content-length", str(body_length)))
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            clear_route_cache=True,
            header_mutation=pb.HeaderMutation(set_headers=options, remove_headers=list(remove)))),
        dynamic_metadata=metadata)


def body_response(body: bytes | None, full_duplex: bool) -> pb.ProcessingResponse:
    """The request-body reply: the body streamed back (full duplex), or mutated (buffered)."""
    if full_duplex:
        mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body or b"",
                                                                               end_of_stream=True))
        return pb.ProcessingResponse(request_body=pb.BodyResponse(
            response=pb.CommonResponse(body_mutation=mutation)))
    common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=body)) if body is not None else \
        pb.CommonResponse()
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def immediate_response(refusal: Refusal) -> pb.ProcessingResponse:
    content_type = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[content_type]),
        body=refusal.body(), details=f"ppd_picker_{refusal.kind}"))


def response_status(headers: pb.HttpHeaders) -> int | None:
    """The ``:status`` of a response-headers message (None when absent or not a number)."""
    for header in headers.headers.headers:
        if header.key == ":status":
            value = _header_value(header)
            return int(value) if value.isdigit() else None
    return None


def content_type(headers: pb.HttpHeaders) -> str:
    """The ``content-type`` of a response-headers message ("" when absent)."""
    for header in headers.headers.headers:
        if header.key == "content-type":
            return _header_value(header)
    return ""


# The answers to response headers: the answer's body streamed to the picker (a watched answer)
# or not sent at all (`Picker.watch`); made once, they are the same for every request.
WATCH_BODY = pb.ProcessingResponse(response_headers=pb.HeadersResponse(),
                                   mode_override=Mode(response_body_mode=Mode.STREAMED))
SKIP_BODY = pb.ProcessingResponse(response_headers=pb.HeadersResponse(),
                                  mode_override=Mode(response_body_mode=Mode.NONE))
BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))


def timing_metadata(reply: pb.ProcessingResponse, clock: StageClock) -> None:
    """Add the picker's own time for this request to the reply's dynamic metadata, namespace
    `TIMING_NAMESPACE`: microseconds from the first ext_proc message in to the route out
    (``path_us``) and per stage (`stages.STAGES`), for the request-path benchmark and for a
    gateway's access log (Envoy merges dynamic metadata into the request's)."""
    fields = {"path_us": round(clock.total * 1e6, 1)}
    fields.update({f"{stage}_us": round(seconds * 1e6, 1) for stage, seconds in clock.stages.items()})
    reply.dynamic_metadata.fields[TIMING_NAMESPACE].struct_value.update(fields)


class ExtProcService(external_processor_pb2_grpc.ExternalProcessorServicer):
    """`Process`: one stream per HTTP request (see the module docstring)."""

    def __init__(self, picker: Picker, metrics: PickerMetrics, timings: bool = False):
        self.picker = picker
        self.metrics = metrics
        self.timings = timings  # each route carries its stage times (`timing_metadata`)

    async def Process(self, request_iterator, context) -> AsyncIterator[pb.ProcessingResponse]:  # noqa: N802
        headers: dict[str, str] = {}
        subset: list[str] | None = None
        body = bytearray()
        # GAIE's gateways stream both bodies; Envoy says which modes in protocol_config.
        full_duplex = response_full_duplex = True
        every_body = False  # the gateway said it streams every response body through (full duplex)
        clock: StageClock | None = None
        picked: list[Pick] = []  # the request's pick, once made (its answer's status is checked)
        watch: AnswerWatch | None = None  # the answer's TTFT and TPOT, when watched
        events: DatalessEventFilter | None = None  # an event stream echoed in full duplex (`sse`)
        picked_at = 0.0
        async for message in request_iterator:
            if clock is None:
                clock = StageClock()
            kind = message.WhichOneof("request")
            if message.HasField("protocol_config"):
                full_duplex = message.protocol_config.request_body_mode == FULL_DUPLEX
                response_full_duplex = every_body = message.protocol_config.response_body_mode == FULL_DUPLEX
            if kind == "request_headers":
                headers = {h.key.lower(): _header_value(h) for h in message.request_headers.headers.headers}
                subset = endpoint_subset(message)
                if message.request_headers.end_of_stream:  # no body: nothing to route by
                    try:
                        yield headers_response(self.picker.frontend(subset), {})
                    except Refusal as refusal:
                        yield immediate_response(refusal)
                elif not full_duplex:  # Envoy sends a buffered body only after this answer
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    clock.lap("body")
                    async for reply in self._route(headers, subset, bytes(body), full_duplex, clock,
                                                   picked):
                        yield reply
                    picked_at = time.monotonic()  # the route is out: the answer's TTFT starts
                    body.clear()
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_headers":
                # The frontend's answer to the routed request: a failure there tells the picker
                # what discovery does not yet (a pinned prefill worker that is gone); a share of
                # the follow-ups' answers are watched for their TTFT and TPOT.
                if picked:
                    response = message.response_headers
                    status = response_status(response)
                    self.picker.answered(picked[0], status)
                    watch = self.picker.watch(picked[0], status, content_type(response), picked_at,
                                              every_body)
                if response_full_duplex and "event-stream" in content_type(message.response_headers):
                    events = DatalessEventFilter()
                if not message.observability_mode:  # in observability mode Envoy reads no answer
                    yield WATCH_BODY if watch is not None else SKIP_BODY
            elif kind == "response_body":  # passed through as GAIE's EPP does, less data-less events
                chunk = message.response_body
                if watch is not None:
                    watch.chunk(chunk.body, chunk.end_of_stream)
                if response_full_duplex:
                    echo = chunk.body
                    if events is not None:  # Dynamo's bypass annotation, which openai-python fails on
                        echo = events.feed(echo) + (events.end() if chunk.end_of_stream else b"")
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=echo, end_of_stream=chunk.end_of_stream)))))
                else:
                    yield BODY_CONTINUE
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    async def _route(self, headers: dict[str, str], subset: list[str] | None, body: bytes,
                     full_duplex: bool, clock: StageClock, picks: list[Pick]
                     ) -> AsyncIterator[pb.ProcessingResponse]:
        cpu = time.thread_time()
        try:
            picked = await self.picker.pick(headers, body, headers.get(":path", "/v1/chat/completions"),
                                            subset, clock)
        except Refusal as refusal:
            log.info("HTTP %d: %s", refusal.status, refusal)
            reply = immediate_response(refusal)
            clock.lap("answer")
            # thread_time: the pick runs on the event loop's thread and rarely awaits (an etcd
            # read of a session another replica wrote), so this is its own CPU.
            self.metrics.observe(f"refused_{refusal.status}", clock.total, time.thread_time() - cpu,
                                 clock.stages)
            yield reply
            return
        picks.append(picked)
        length = len(picked.body) if picked.body is not None else None
        routed = headers_response(picked.endpoint, picked.set_headers, picked.remove_headers, length)
        clock.lap("answer")
        # Unrouted (the frontend's own routing serves it; `ppd_requests_unplaced_total` says why).
        self.metrics.observe("unrouted" if picked.unplaced else "routed", clock.total,
                             time.thread_time() - cpu, clock.stages)
        if self.timings:
            timing_metadata(routed, clock)
        if full_duplex:
            yield routed
            yield body_response(picked.body if picked.body is not None else body, True)
            return
        # Buffered: the headers were answered already, so the route's header mutation and the
        # destination metadata ride on the body's answer (Envoy applies both there).
        reply = body_response(picked.body, False)
        reply.request_body.response.header_mutation.CopyFrom(
            routed.request_headers.response.header_mutation)
        reply.request_body.response.clear_route_cache = True
        reply.dynamic_metadata.CopyFrom(routed.dynamic_metadata)
        yield reply
