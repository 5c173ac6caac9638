"""The picker's own metrics, beside the routing metrics it shares with the relay router
(`routing.metrics.RoutingMetrics`, one registry, served on --metrics-port)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Counter, Histogram, ProcessCollector

from ..routing.metrics import RoutingMetrics


class PickerMetrics:
    def __init__(self, routing: RoutingMetrics):
        registry = routing.registry
        self.requests = Counter("ppd_picker_requests", "Requests the picker answered, by outcome",
                                ["outcome"], registry=registry)
        self.pick_seconds = Histogram(
            "ppd_picker_pick_seconds",
            "The picker's own time per request: from its first ext_proc message in to the route "
            "out (body, parse, template, tokenize, hashes, plan, record, answer)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 1.5e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 1.0),
            registry=registry)
        self.stage_seconds = Counter("ppd_picker_stage_seconds",
                                     "The picker's own time per request, summed by stage",
                                     ["stage"], registry=registry)
        # The per-request work proper: the event loop thread's CPU inside `Picker.pick` (parse,
        # tokenize, plan, record). The rest of the process's CPU (process_cpu_seconds_total) is
        # gRPC's and the subscriptions' (KV events, load reports), which follow the workers'
        # activity rather than the requests.
        self.pick_cpu = Counter("ppd_picker_pick_cpu_seconds",
                                "Event-loop thread CPU spent picking routes", registry=registry)
        ProcessCollector(registry=registry)

    def observe(self, outcome: str, seconds: float, cpu_s: float = 0.0,
                stages: Mapping[str, float] | None = None) -> None:
        self.requests.labels(outcome).inc()
        self.pick_seconds.observe(seconds)
        self.pick_cpu.inc(cpu_s)
        for stage, stage_s in (stages or {}).items():
            self.stage_seconds.labels(stage).inc(stage_s)
