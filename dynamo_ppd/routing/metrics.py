"""The router's Prometheus metrics (served on --metrics-port) and its per-decision debug line."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from ..policy.decision import Observed

log = logging.getLogger("dynamo_ppd.routing.decisions")

# A prediction's error as observed/predicted (`Observed`'s error + 1): 1 is exact, 0.5 twice as fast
# as predicted, 2 twice as slow. As a ratio, always positive, the histogram keeps its _sum (the
# Prometheus client drops it once a bucket is negative): the mean error is sum/count - 1.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
# Calibration buckets are a small fixed set of names ("ctx2-app1-load0"); past this many distinct
# ones, the rest are counted as "other", so a policy that names too many cannot blow up the series.
MAX_BUCKET_LABELS = 64


class RoutingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter("ppd_decisions", "Routing decisions", ["route", "turn", "reason"],
                                 registry=self.registry)
        self.decision_seconds = Histogram(
            "ppd_decision_seconds", "Time to decide a route (lookup, residency, policy)",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2, 0.1), registry=self.registry)
        self.sessions_active = Gauge("ppd_sessions_active", "Sessions in the local table",
                                     registry=self.registry)
        self.residency_misses = Counter(
            "ppd_residency_misses", "Follow-ups whose decode worker no longer held the history",
            registry=self.registry)
        self.rehomes = Counter("ppd_rehomes", "Turns moved to another decode worker (theirs was gone)",
                               registry=self.registry)
        self.migrations = Counter(
            "ppd_migrations", "Answers continued on another worker after theirs failed mid-answer",
            registry=self.registry)
        self.session_moves = Counter(
            "ppd_session_moves", "Via-prefill turns moved off a hot decode worker to a cooler one",
            registry=self.registry)
        self.sessions_evicted = Counter(
            "ppd_sessions_evicted", "Sessions dropped past --max-sessions (least recently used first)",
            registry=self.registry)
        self.frontend_refusals = Counter(
            "ppd_frontend_refusals", "Routed requests the frontend then refused (HTTP 4xx), by status: "
            "decisions made for turns that did not happen", ["status"], registry=self.registry)
        self.decode_divergence = Counter(
            "ppd_decode_divergence",
            "Follow-ups whose history was on another decode worker than the planner had chosen for "
            "the turn before (behind the endpoint picker: only after a decode-local turn, the one "
            "route whose worker the frontend is expected to keep)", registry=self.registry)
        self.session_forks = Counter(
            "ppd_session_forks", "Turns under a session id whose prompt did not continue its history",
            registry=self.registry)
        self.request_rate = Gauge("ppd_request_rate", "Requests/s of all router replicas (the policy's QPS)",
                                  registry=self.registry)
        self.request_rate_local = Gauge("ppd_request_rate_local", "Requests/s this router replica sees",
                                        registry=self.registry)
        self.etcd_up = Gauge("ppd_etcd_up", "1 while etcd answers", registry=self.registry)
        self.nats_up = Gauge("ppd_nats_up", "1 while the KV event subscription is connected",
                             registry=self.registry)
        self.kv_events = Counter("ppd_kv_events", "KV events applied to the residency index",
                                 registry=self.registry)
        self.residency_resyncs = Counter(
            "ppd_residency_resyncs", "Worker views rebuilt from the worker-local indexer, by why",
            ["reason"], registry=self.registry)
        self.residency_orphans = Counter(
            "ppd_residency_orphans", "Stored KV events whose parent block the router had not seen",
            registry=self.registry)
        self.residency_gaps = Counter(
            "ppd_residency_gaps", "Jumps (or steps back) in a worker's KV event ids",
            registry=self.registry)
        self.residency_unknown = Gauge(
            "ppd_residency_unknown_workers", "Workers whose view could not be rebuilt (orphans left)",
            registry=self.registry)
        self.kv_silent_workers = Gauge(
            "ppd_kv_silent_workers", "Decode workers that served turns but never published a KV event",
            registry=self.registry)
        self.relayed_tokens = Counter("ppd_relayed_tokens", "Answer tokens relayed to the frontend",
                                      registry=self.registry)
        self.relayed_chunks = Counter(
            "ppd_relayed_chunks", "Answer chunks relayed to the frontend (fewer than tokens: coalesced)",
            registry=self.registry)
        self.errors = Counter("ppd_request_errors", "Requests that ended in an error", ["kind"],
                              registry=self.registry)
        self.unplaced = Counter(
            "ppd_requests_unplaced", "Requests the endpoint picker sent to the frontend unrouted (Dynamo's "
            "own routing placed them): an API it does not read, or a prompt it does not mirror",
            ["reason"], registry=self.registry)
        self.prompt_memo = Counter(
            "ppd_prompt_memo", "Requests the endpoint picker tokenized, by what an earlier request's "
            "work saved: session (its session's last request), shared_head (a request with the same "
            "head, e.g. a system prompt and tools), none (nothing kept), head_changed (bytes differ "
            "before the first message), tail_unparsed, other_api (completions)", ["outcome"],
            registry=self.registry)
        # What the policy learned from outcomes (`Routing.observe_outcome`): follow-ups whose TTFT
        # and TPOT it observed, and how far its prediction was off, by route and calibration bucket.
        self.outcomes = Counter("ppd_outcomes_observed",
                                "Follow-up outcomes (TTFT, TPOT) the policy learned from", ["route"],
                                registry=self.registry)
        self.ttft_ratio = Histogram(
            "ppd_ttft_prediction_ratio",
            "Observed over predicted TTFT of the follow-ups observed (1: exact; the error is this - 1)",
            ["route", "bucket"], buckets=RATIO_BUCKETS, registry=self.registry)
        self.tpot_ratio = Histogram(
            "ppd_tpot_prediction_ratio",
            "Observed over predicted TPOT of the follow-ups observed (1: exact; the error is this - 1)",
            ["route", "bucket"], buckets=RATIO_BUCKETS, registry=self.registry)

        # The live P:D configuration and what decides its turns (`Routing._select_table`): 1 for the
        # current one, 0 for those before it, so a change shows as a step on a dashboard.
        self.configuration = Gauge(
            "ppd_pd_configuration", "The live P:D configuration (1: current) and what decides its turns: "
            "a table's file name, profile (the engine profile's predictions) or none (a fixed rule)",
            ["configuration", "basis"], registry=self.registry)
        self._configurations: set[tuple[str, str]] = set()

        self._decision_children: dict[tuple[str, str, str], object] = {}
        self._buckets: set[str] = set()

    def count_decision(self, route: str, turn: str, reason: str) -> None:
        """`decisions.labels(...).inc()`, with the labelled child looked up once (hot path)."""
        key = (route, turn, reason)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(route, turn, reason)
        child.inc()  # type: ignore[attr-defined]

    def count_outcome(self, route: str, observed: Observed | None) -> None:
        """One outcome the policy learned from (a follow-up's TTFT and TPOT), and, when it had a
        prediction for it (``observed``), that prediction's errors by route and bucket."""
        self.outcomes.labels(route).inc()
        if observed is None:
            return
        bucket = self.bucket_label(observed.bucket)
        self.ttft_ratio.labels(observed.route.value, bucket).observe(observed.ttft_error + 1)
        if observed.tpot_error is not None:
            self.tpot_ratio.labels(observed.route.value, bucket).observe(observed.tpot_error + 1)

    def bucket_label(self, bucket: str) -> str:
        """A calibration bucket as a label: "all" for none, "other" past `MAX_BUCKET_LABELS`."""
        label = bucket or "all"
        if label not in self._buckets:
            if len(self._buckets) >= MAX_BUCKET_LABELS:
                return "other"
            self._buckets.add(label)
        return label

    def set_configuration(self, configuration: str, basis: str) -> None:
        for seen in self._configurations:
            self.configuration.labels(*seen).set(0)
        self._configurations.add((configuration, basis))
        self.configuration.labels(configuration, basis).set(1)

    def set_rates(self, local: float, shared: float) -> None:
        self.request_rate_local.set(local)
        self.request_rate.set(shared)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)


def debug_line(**fields) -> None:
    """One JSON line per decision (inputs, score, route) at debug level."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(json.dumps(fields, default=str, separators=(",", ":")))
