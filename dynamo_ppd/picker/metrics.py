"""The picker's own metrics, beside the routing metrics it shares with the relay router
(`router.metrics.RouterMetrics`, one registry, served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, ProcessCollector

from ..router.metrics import RouterMetrics


class PickerMetrics:
    def __init__(self, routing: RouterMetrics):
        registry = routing.registry
        self.requests = Counter("ppd_picker_requests", "Requests the picker answered, by outcome",
                                ["outcome"], registry=registry)
        self.pick_seconds = Histogram(
            "ppd_picker_pick_seconds",
            "From the request's whole body in to the route out (parse, tokenize, plan)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0), registry=registry)
        # process_cpu_seconds_total: the picker's CPU, which per request is what the benchmarks
        # compare with the relay router's per token.
        ProcessCollector(registry=registry)

    def observe(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome).inc()
        self.pick_seconds.observe(seconds)
