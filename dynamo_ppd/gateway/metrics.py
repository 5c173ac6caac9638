"""The gateway's Prometheus metrics (one registry per gateway, served on --metrics-port).

- ``ppd_gateway_requests_total{outcome}``: requests answered, by how: ``routed`` (forwarded
  where the picker said), ``passthrough`` (no --picker), ``fail_open`` (no picker answered:
  forwarded to --upstream), ``immediate`` (the picker answered the client itself),
  ``bad_gateway`` (the upstream failed: 502 or a cut response), ``bad_request`` (refused by the
  gateway's HTTP parser), ``client_gone`` (the client left before the answer was out).
- ``ppd_gateway_picker_callout_seconds``: first ext_proc message sent -> last answer needed
  before forwarding (what the callout adds to a request's latency).
- ``ppd_gateway_picker_fail_open_total``: requests sent to --upstream because no picker answered.
- ``ppd_gateway_immediate_responses_total{code}``: the picker's immediate responses, by status.
- ``ppd_gateway_upstream_errors_total``: upstreams unreachable, or failing before or while
  answering.
- ``ppd_gateway_picker_response_bodies_total``: responses whose body went through the picker
  (it asked for it with a mode override, --allow-mode-override).
- ``ppd_gateway_picker_failures_total``: ext_proc callouts that failed (a timeout, an error).
- ``ppd_gateway_picker_ejections_total``: pickers left out after --picker-eject-after failures in a row.
- ``ppd_gateway_sse_events_dropped_total``: events without data taken out of event streams
  (Dynamo's ``x-bypass-remote-prefill`` annotation, `sse`).
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

OUTCOMES = ("routed", "passthrough", "fail_open", "immediate", "bad_gateway", "bad_request", "client_gone")
# The callout is sub-millisecond on loopback and up to the timeout when a picker hangs.
CALLOUT_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ppd_gateway_requests", "Requests answered, by outcome", ["outcome"],
                                registry=self.registry)
        self.picker_callout_seconds = Histogram(
            "ppd_gateway_picker_callout_seconds",
            "First ext_proc message sent to the last picker answer needed before forwarding",
            buckets=CALLOUT_BUCKETS, registry=self.registry)
        self.fail_open = Counter("ppd_gateway_picker_fail_open",
                                 "Requests forwarded to --upstream because no picker answered",
                                 registry=self.registry)
        self.immediate_responses = Counter("ppd_gateway_immediate_responses",
                                           "Immediate responses from the picker, by HTTP status", ["code"],
                                           registry=self.registry)
        self.upstream_errors = Counter("ppd_gateway_upstream_errors",
                                       "Upstreams unreachable or failing before or while answering",
                                       registry=self.registry)
        self.response_bodies = Counter("ppd_gateway_picker_response_bodies",
                                       "Responses whose body went through the picker (its mode override)",
                                       registry=self.registry)
        self.picker_failures = Counter("ppd_gateway_picker_failures",
                                       "ext_proc callouts that failed (a timeout or an error)",
                                       registry=self.registry)
        self.picker_ejections = Counter("ppd_gateway_picker_ejections",
                                        "Pickers left out after --picker-eject-after failures in a row",
                                        registry=self.registry)
        self.sse_events_dropped = Counter("ppd_gateway_sse_events_dropped",
                                          "Events without data taken out of event streams",
                                          registry=self.registry)
        self._server: WSGIServer | None = None

    def serve(self, port: int, host: str) -> int:
        """Serve /metrics in a background thread; the port it listens on (``port`` 0: any)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent): e.g. ``value("ppd_gateway_picker_fail_open_total")``."""
        return self.registry.get_sample_value(name, labels) or 0.0
