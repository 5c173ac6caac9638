"""`dynamo-ppd sim paper`: the paper authors' benchmark on the simulated cluster, point for point.

Every (workload, QPS) point of their protocol (`dynamo_ppd.workloads.generators`: the 18 workloads,
2 turns, arrivals over 10 s, 120 s request timeout, a 50-connection client, a point abandoned
after 600 s) runs on one of the paper's configurations (``1P_3D``, ``1P_2D_1pD``, ``4R``,
``1R_1P_2D`` ...: `dynamo_ppd.sim.routing.parse_paper_config`), placed as the authors' proxy
places conversations (`paper_proxy_router`), and is summarized by the one outcome summary into
the **same columns as their comprehensive.csv**, so a run can be diffed against the
measurements (`dynamo-ppd sim fidelity` does).

The authors' client sends the history as text to `/v1/completions`, so every follow-up's prompt
re-tokenizes the previous output (`Conversation.history_as_text`): no cache matches past the
previous prompt, on P, D or R alike.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import msgspec

from ..argtypes import cli_error, comma_choices, positive_floats, positive_int
from ..engine.profile import EngineProfile, ProfileError, TransferConstants, link_preset, load_profile
from ..experiment.progress import Progress
from ..sim import Cluster, Conversation, simulate
from ..sim.cluster import Router
from ..sim.outcome import PAPER_TIMEOUT_S, SUCCESS_BAR, paper_columns
from ..sim.routing import paper_proxy_router, parse_paper_config
from ..sim.run import SimResult
from ..workloads.generators import (
    PAPER_KILL_AFTER_S,
    PAPER_MAX_CONNECTIONS,
    PAPER_QPS,
    PAPER_WORKLOADS,
    paper_workload,
)
from .measured import COLUMNS, PaperPoint, point_from_columns

PAPER_PROFILE = "h100-llama3.1-8b-vllm-paper"


class PointSpec(msgspec.Struct, frozen=True):
    """One point to simulate (picklable: points run in worker processes)."""

    config: str
    workload: str
    qps: float
    seed: int = 0


def simulate_point(profile: EngineProfile, cluster_config: str, router: Router,
                   conversations: list[Conversation], timeout_s: float, seed: int = 0,
                   link: TransferConstants | None = None, link_bandwidth_bytes_s: float | None = None,
                   max_connections: int | None = None) -> SimResult:
    """One point on a fresh cluster: the conversations through ``router``, each turn given
    ``timeout_s``, the run cut at the protocol's 600 s. A router that learns from outcomes
    (``on_finish``) sees every finished turn."""
    cluster = Cluster.from_config(profile, cluster_config, seed=seed, link=link,
                                  link_bandwidth_bytes_s=link_bandwidth_bytes_s)
    return simulate(cluster, conversations, router, until_s=PAPER_KILL_AFTER_S, timeout_s=timeout_s,
                    max_connections=max_connections, on_finish=getattr(router, "on_finish", None))


def run_protocol(profile: EngineProfile, cluster_config: str, router: Router, workload: str, qps: float,
                 seed: int = 0, link: TransferConstants | None = None,
                 link_bandwidth_bytes_s: float | None = None, history_as_text: bool = True) -> SimResult:
    """One (workload, QPS) point of the authors' protocol with any router: their arrivals and two
    turns, their client (50 connections, 120 s timeout, the history sent as text unless
    ``history_as_text`` is False: then token for token, as our router's chat clients send it)."""
    conversations = paper_workload(workload, qps, seed)
    if history_as_text:
        conversations = [msgspec.structs.replace(c, history_as_text=True) for c in conversations]
    return simulate_point(profile, cluster_config, router, conversations, PAPER_TIMEOUT_S, seed, link,
                          link_bandwidth_bytes_s, PAPER_MAX_CONNECTIONS)


def run_point(profile: EngineProfile, spec: PointSpec, link: TransferConstants | None = None) -> PaperPoint:
    """One point of one of the paper's configurations, placed by their proxy, as their CSV's columns."""
    config = parse_paper_config(spec.config)
    result = run_protocol(profile, config.cluster_config, paper_proxy_router(config, spec.seed),
                          spec.workload, spec.qps, spec.seed, link)
    return point_from_columns(spec.config, spec.workload, spec.qps, paper_columns(result.outcome()))


def _run_in_worker(args: tuple[str | EngineProfile, PointSpec, TransferConstants | None]) -> PaperPoint:
    profile, spec, link = args
    return run_point(load_profile(profile) if isinstance(profile, str) else profile, spec, link)


def run_points(profile: str | EngineProfile, specs: Sequence[PointSpec],
               link: TransferConstants | None = None, jobs: int = 1,
               on_point: Callable[[PaperPoint], None] | None = None,
               label: str = "sim paper") -> list[PaperPoint]:
    """Simulate every point (in ``jobs`` processes), in the order given; shows progress."""
    progress = Progress(len(specs), label)
    points: list[PaperPoint] = []
    if jobs <= 1:
        loaded = load_profile(profile) if isinstance(profile, str) else profile
        for spec in specs:
            points.append(run_point(loaded, spec, link))
            progress.step()
            if on_point:
                on_point(points[-1])
        return points
    with ProcessPoolExecutor(jobs) as pool:
        # Heaviest points first would balance better, but the order of results must stay the
        # order asked: map keeps it, and chunks of one keep the bar moving.
        for point in pool.map(_run_in_worker, [(profile, spec, link) for spec in specs], chunksize=1):
            points.append(point)
            progress.step()
            if on_point:
                on_point(point)
    return points


def paper_specs(config: str, workloads: Iterable[str] = PAPER_WORKLOADS,
                rates: Iterable[float] = PAPER_QPS, seed: int = 0) -> list[PointSpec]:
    parse_paper_config(config)  # fail before any work
    return [PointSpec(config, workload, float(qps), seed) for workload in workloads for qps in rates]


def points_csv(points: Iterable[PaperPoint]) -> str:
    """Points as CSV text with comprehensive.csv's columns (loadable by `paper_data.parse_points`)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for p in points:
        row: list[object] = [p.config, p.workload, f"{p.qps:g}", p.success_rate, p.total_requests, p.failed,
                             p.duration_s, p.error]
        for turn in (p.turn1, p.turn2):
            row += [turn.count, turn.avg_ttft_ms, turn.p50_ttft_ms, turn.p99_ttft_ms, turn.avg_tpot_ms,
                    turn.p50_tpot_ms, turn.p99_tpot_ms, turn.avg_e2e_ms]
        row.append(p.tokens_per_sec)
        writer.writerow(row)
    return out.getvalue()


# -- CLI -----------------------------------------------------------------------------------------

def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options `sim paper` and `sim fidelity` share."""
    parser.add_argument("--profile", default=PAPER_PROFILE,
                        help="engine profile: a bundled name or a path to a profile YAML (default: the "
                        "paper authors' vLLM stack on H100, fitted to their measurements)")
    parser.add_argument("--link", choices=("profile", "intra-node", "cross-node"), default="profile",
                        help="KV link of the prefill workers: the profile's own (default) or a preset")
    parser.add_argument("--workloads", type=comma_choices("workload", list(PAPER_WORKLOADS)),
                        default=list(PAPER_WORKLOADS), metavar="NAMES",
                        help="comma-separated paper workloads (default: all 18)")
    parser.add_argument("--qps", type=positive_floats("rates"), default=list(PAPER_QPS), metavar="RATES",
                        help="comma-separated conversation rates (default: the paper's 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts, tokens and placement")
    parser.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                        help="points simulated in parallel processes (default: one per CPU)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd sim paper`."""
    parser.add_argument("--config", required=True,
                        help="one of the paper's configurations: 1P_3D, 1P_3pD, 1P_2D_1pD, 3P_1D, 4R, "
                        "1R_1P_2D, ... (<n>P, <n>D, <n>pD, <n>R joined by '_')")
    add_common_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, metavar="PATH",
                        help="CSV to write, with the columns of the paper's comprehensive.csv")


def resolve_link(name: str) -> TransferConstants | None:
    return None if name == "profile" else link_preset(name)


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd sim paper`: 0 on success, 2 with a one-line error for bad settings."""
    try:
        specs = paper_specs(args.config, args.workloads, args.qps, args.seed)
        profile = load_profile(args.profile)
        link = resolve_link(args.link)
    except (ProfileError, ValueError) as exc:
        return cli_error(exc)
    points = run_points(profile, specs, link, args.jobs, label=f"sim paper {args.config}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(points_csv(points))
    failed = sum(1 for p in points if p.success_rate < SUCCESS_BAR)
    print(f"{args.config} on {profile.name}: {len(points)} points ({failed} under {SUCCESS_BAR:.0f}% "
          f"success) -> {args.out}")
    return 0
