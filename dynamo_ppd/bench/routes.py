"""The route each answered request took, live and on the virtual clock: a point's decisions beside
its latencies, so that a live run that disagrees with its simulated twin says whether the two
decided differently or timed the same decisions differently.

Live, the simulated workers count the requests they answered to the end by the route their
prompt's KV came by (`worker.handler.SERVED_METRIC`, on each worker's system port: ``via_prefill``,
``decode_local``, ``aggregated``, and ``prefill_leg`` on prefill workers, which is not a route);
`bench compare` reads them off every worker at the end of a point. The simulation's records carry
the same names (`sim.routing.route_name`). Both sides count finished requests only: a request cut
at the horizon is cancelled by the client and counts on neither (one that ends in the moment
between the cut and its cancellation counts live only). The workers cannot tell a turn's number,
so the shares are over every turn, first turns included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..worker.handler import SERVED_METRIC

NOT_A_ROUTE = "prefill_leg"  # a prefill worker's half of a via_prefill request


def parse(text: str) -> dict[str, int]:
    """A worker's served requests by route, from its Prometheus text (none: {}); parsed as
    `chaos.run.router_counters` parses the router's."""
    return {sample.labels["route"]: int(sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == SERVED_METRIC and sample.labels.get("route", NOT_A_ROUTE) != NOT_A_ROUTE}


def add(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for route, n in one.items():
            total[route] = total.get(route, 0) + n
    return dict(sorted(total.items()))


def scrape(system_ports: Iterable[int], timeout_s: float = 5.0) -> dict[str, int]:
    """Served requests by route, summed over the processes on these system ports (on loopback;
    those that publish none, e.g. the frontend, add nothing)."""
    counts = []
    with httpx.Client(timeout=timeout_s) as client:
        for port in system_ports:
            try:
                counts.append(parse(client.get(f"http://127.0.0.1:{port}/metrics").text))
            except httpx.HTTPError:
                continue  # a process without a metrics page: it served nothing we count
    return add(counts)


def local_share(routes: Mapping[str, int] | None) -> float | None:
    """Share of the disaggregated requests that ran decode-local (None: there were none)."""
    if not routes:
        return None
    local, via = routes.get("decode_local", 0), routes.get("via_prefill", 0)
    return local / (local + via) if local + via else None


ROUTING_COUNTERS = ("ppd_decode_divergence_total", "ppd_residency_misses_total", "ppd_rehomes_total")


def routing_counts(metrics_urls: Mapping[str, str], timeout_s: float = 5.0) -> dict[str, float]:
    """The PPD routing processes' (relay routers', endpoint pickers') counts, summed: follow-up
    decisions by route (``follow_up:<route>``) and `ROUTING_COUNTERS`; {} for other systems."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for label, url in metrics_urls.items():
            if not label.startswith(("router", "picker")):
                continue
            try:
                text = client.get(url).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    key = None
                    if sample.name in ROUTING_COUNTERS:
                        key = sample.name
                    elif sample.name == "ppd_decisions_total" and sample.labels.get("turn") == "follow_up":
                        key = f"follow_up:{sample.labels.get('route')}"
                    if key is not None:
                        out[key] = out.get(key, 0.0) + sample.value
    return dict(sorted(out.items()))
