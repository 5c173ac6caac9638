"""Command line of the PPD router (`python -m dynamo_ppd.relay`, `dynamo-ppd router`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from ..argtypes import fraction, positive_float, positive_int
from ..engine.profile import DEFAULT_PROFILE
from ..policy.decision import Mode
from .sessions import DEFAULT_MAX_SESSIONS


@dataclass(frozen=True)
class RoutingConfig:
    mode: Mode
    local_fraction: float
    w_ttft: float
    w_tpot: float
    table: str  # "auto", "none" or a path
    online_correction: bool
    allow_forced_route: bool
    profile: str
    namespace: str
    workers_namespace: str
    prefill_component: str
    decode_component: str
    replica_component: str | None
    model_path: Path | None
    served_model_name: str | None
    block_size: int
    default_max_tokens: int
    session_ttl_s: float
    session_prefix: str
    max_sessions: int
    min_resident_fraction: float
    etcd_url: str
    nats_url: str
    metrics_port: int
    metrics_host: str
    kv_silent_after_s: float = 30.0
    # The two subscriptions that cost a router CPU in proportion to the workers' activity, not to
    # the tokens it relays (`just bench-relay`, docs/bench/relay.md): each can be turned off.
    load_reports: bool = True  # track the workers' forward-pass metrics (every engine iteration)
    residency_recovery: bool = True  # Dynamo's indexers that rebuild residency from the workers
    speedup: float = 1.0  # model seconds per wall second (the workers' --speedup; <1: dilated)
    link_bandwidth_gbps: float | None = None  # the KV link PPD's predictions assume (None: the profile's)


def _weights(text: str) -> tuple[float, float]:
    from ..policy.table import parse_weights

    try:
        weights = parse_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return weights.w_ttft, weights.w_tpot


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynamo_ppd.relay",
        description="PPD router: a Dynamo component behind the OpenAI frontend that sends each "
        "turn of a conversation through a prefill worker or straight to the decode worker holding "
        "its history (an append-prefill there).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.PPD.value,
                   help="pd: every turn via prefill (x=0); local: follow-ups on their decode worker "
                   "(x=1); fraction: a fixed share local; ppd: the score over predicted TTFT/TPOT; "
                   "replica: aggregated workers only")
    p.add_argument("--local-fraction", type=fraction, default=0.5,
                   help="share of follow-ups kept decode-local in fraction mode")
    p.add_argument("--weights", type=_weights, default=(1.0, 1.0),
                   help="W_TTFT,W_TPOT of the ppd score (presets: 1,1 balanced; 2,1; 1,2)")
    p.add_argument("--table", default="none",
                   help="ppd mode: 'none' (default) = the --profile cost model priced as the fleet pays "
                   "it, corrected by observed outcomes (docs/decisions.md); a table JSON path, or "
                   "'auto' = the table shipped for the profile and the live P:D count, the paper's "
                   "measured score plus the online correction (the cost model where none matches)")
    p.add_argument("--allow-forced-route", action="store_true",
                   help="obey a request annotation x-ppd-route:via_prefill|decode_local on follow-ups "
                   "(for `dynamo-ppd table build --backend live`; never in production)")
    p.add_argument("--online-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="ppd mode: correct table decisions with live signals and observed outcomes")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="engine profile for ppd predictions (name or YAML path)")
    p.add_argument("--link-bandwidth-gbps", type=positive_float, metavar="GB/S",
                   help="the prefill workers' KV link bandwidth ppd predictions assume, in GB/s (1e9 "
                   "bytes/s); default: the --profile's")
    p.add_argument("--namespace", default="ppd",
                   help="Dynamo namespace the router serves the public model in")
    p.add_argument("--workers-namespace", default="workers",
                   help="Dynamo namespace of the prefill/decode workers (hidden from the frontend)")
    p.add_argument("--prefill-component", default="prefill", help="prefill workers' component")
    p.add_argument("--decode-component", default="backend", help="decode workers' component")
    p.add_argument("--replica-component", help="aggregated workers' component (replica mode)")
    p.add_argument("--model-path", type=Path, help="local model directory; default: the cache's")
    p.add_argument("--served-model-name", help="public model name; default: the model directory's")
    p.add_argument("--block-size", type=int, default=32, help="KV block size of the workers")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="expected output length when a request sets no max_tokens")
    p.add_argument("--session-ttl", type=float, default=3600.0,
                   help="seconds a session stays after its last turn (an etcd lease)")
    p.add_argument("--session-prefix", default="ppd", help="etcd key prefix of the sessions")
    p.add_argument("--max-sessions", type=positive_int, default=DEFAULT_MAX_SESSIONS,
                   help="sessions kept (locally and in etcd); past it the least recently used go "
                   "(ppd_sessions_evicted_total)")
    p.add_argument("--min-resident-fraction", type=fraction, default=0.5,
                   help="a follow-up is decode-local only if its decode worker still holds this "
                   "share of the history; less means evicted, and the turn goes via prefill")
    p.add_argument("--etcd-url", default=os.environ.get("ETCD_ENDPOINTS", "http://127.0.0.1:2379").split(",")[0],
                   help="etcd for sessions (default: $ETCD_ENDPOINTS)")
    p.add_argument("--nats-url", default=os.environ.get("NATS_SERVER", "nats://127.0.0.1:4222"),
                   help="NATS for the workers' KV events (default: $NATS_SERVER)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on METRICS_HOST:PORT (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics server binds (0.0.0.0 in a pod, for Prometheus to scrape)")
    p.add_argument("--kv-silent-after", type=float, default=30.0,
                   help="seconds a decode worker may serve turns without one KV event before the "
                   "router warns (once) that its follow-ups can never run decode-local "
                   "(ppd_kv_silent_workers)")
    p.add_argument("--load-reports", action=argparse.BooleanOptionalAction, default=True,
                   help="track the workers' forward-pass metrics (one per engine iteration) and "
                   "route by the larger of them and this router's own counts; off: own counts only "
                   "(exact with one router replica, blind to other replicas' traffic), and the "
                   "router no longer decodes every report")
    p.add_argument("--residency-recovery", action=argparse.BooleanOptionalAction, default=True,
                   help="keep Dynamo's indexers (one per worker component) that rebuild the "
                   "residency index from the workers after a restart, a NATS outage or lost events; "
                   "off: residency is only what KV events said since this router started (a "
                   "restarted router sends follow-ups via prefill until their decode workers store "
                   "new blocks), and the router no longer indexes every event twice")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="the simulated workers' --speedup (model time runs this many times faster "
                   "than wall time; `bench --dilation N` runs 1/N): the request rate the policy "
                   "reads and the latencies it learns from are taken on the model's clock")
    return p


def parse_args(argv: list[str] | None = None) -> RoutingConfig:
    parser = build_parser()
    return config_from(parser, parser.parse_args(argv))


def config_from(parser: argparse.ArgumentParser, a: argparse.Namespace) -> RoutingConfig:
    """The routing config of parsed arguments (the relay router's and the endpoint picker's)."""
    if not a.speedup > 0:
        parser.error(f"--speedup must be positive, not {a.speedup}")
    if a.table not in ("auto", "none"):
        from ..policy.table import TableError, load_table

        try:
            load_table(a.table)
        except TableError as exc:
            parser.error(f"--table: {exc}")
    return RoutingConfig(
        mode=Mode(a.mode), local_fraction=a.local_fraction, w_ttft=a.weights[0], w_tpot=a.weights[1],
        table=a.table, online_correction=a.online_correction, allow_forced_route=a.allow_forced_route,
        profile=a.profile, namespace=a.namespace,
        workers_namespace=a.workers_namespace,
        prefill_component=a.prefill_component, decode_component=a.decode_component,
        replica_component=a.replica_component, model_path=a.model_path,
        served_model_name=a.served_model_name, block_size=a.block_size,
        default_max_tokens=a.default_max_tokens, session_ttl_s=a.session_ttl,
        session_prefix=a.session_prefix, max_sessions=a.max_sessions,
        min_resident_fraction=a.min_resident_fraction,
        etcd_url=a.etcd_url, nats_url=a.nats_url, metrics_port=a.metrics_port, metrics_host=a.metrics_host,
        kv_silent_after_s=a.kv_silent_after, speedup=a.speedup, load_reports=a.load_reports,
        residency_recovery=a.residency_recovery, link_bandwidth_gbps=a.link_bandwidth_gbps)
