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
        # The per-request work proper: the event loop thread's CPU inside `Picker.pick` (parse,
        # tokenize, plan, record). The rest of the process's CPU (process_cpu_seconds_total) is
        # gRPC's and the subscriptions' (KV events, load reports), which follow the workers'
        # activity rather than the requests.
        self.pick_cpu = Counter("ppd_picker_pick_cpu_seconds",
                                "Event-loop thread CPU spent picking routes", registry=registry)
        ProcessCollector(registry=registry)

    def observe(self, outcome: str, seconds: float, cpu_s: float = 0.0) -> None:
        self.requests.labels(outcome).inc()
        self.pick_seconds.observe(seconds)
        self.pick_cpu.inc(cpu_s)
