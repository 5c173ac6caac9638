"""`dynamo-ppd sim compare`: every P/D policy on one simulated cluster, and where PPD wins, ties
and loses.

Each point is (configuration, KV link, workload, rate); every policy runs it on a fresh cluster
of the same profile and seed, so they see the same conversations, once per seed of ``--seeds``
(default: one, 0). The report keeps each seed's figures and scores figures pooled over the seeds
(`seeds`). Policies:

- ``x0`` (every turn through a prefill worker), ``x1`` (every follow-up decode-local),
  ``x0.5`` (half of the follow-ups decode-local, drawn per turn);
- ``replicas``: the configuration's GPUs as aggregated workers (1P3D -> 4R) placed by Dynamo's KV
  router (`peers.DynamoKvRouter`);
- ``hybrid``: one decode GPU turned into a replica (1P3D -> 1R_1P_2D), placed as the paper
  authors' proxy places conversations;
- ``ppd@w``: our router's policy as it runs by default (``--table none``: the cost model priced
  as the fleet pays it, corrected by observed outcomes) at weights (1, w);
- every peer of `dynamo_ppd.sim.peers` (Dynamo's conditional disaggregation, llm-d, vLLM's
  router), each implemented from its own source.

The score of A against B is the paper's, on turn-2+ mean TTFT (a failed follow-up counted at
the timeout: `Outcome.turn2_ttft_mean_with_timeouts_s`) and turn-2+ mean TPOT:
``w_ttft (TTFT_B - TTFT_A)/TTFT_B - w_tpot (TPOT_A - TPOT_B)/TPOT_B``; a point where A misses the
95% success bar and B does not is a loss for A whatever the latencies. A policy's score at a
point is its score against the best other policy (the minimum over the others); |score| <= 0.02
is a tie. The page opens with PPD's done-when check per workload family (`families`), and sets
the tie band beside the seeds' spread (`seeds`) and PPD's worst points beside its predictions.

Clients here are the router's (a chat template over token ids: the decode worker holds the
history token for token), not the paper authors' text client; the paper's arrivals, two turns
and 120 s timeout for its 18 workloads, the chat workloads' own turns and 30 s timeout.

Two parts: the grid (the paper's 18 workloads and the chat ones at the paper's 10 rates, on both
links), scored above; and the load sweeps (`saturation`: long-context, many-turn, agent-32k, each
policy up a ladder of rates to its saturation, on one link), reported apart by `sweep_report`
("Where disaggregation pays"). Both run in one process pool; the sweeps after the grid, rung by
rung, since a rung's points decide which lanes climb to the next. The policies of one point run
in one task and share a simulation while they decide alike (`dynamo_ppd.sim.shared_run`): the
same figures as each alone, for about a quarter less CPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from ..argtypes import cli_error, comma_choices, positive_floats, positive_int
from ..engine.profile import (
    DEFAULT_PROFILE,
    EngineProfile,
    ProfileError,
    believed_link,
    link_preset,
    load_profile,
)
from ..experiment import plots
from ..experiment.progress import Progress
from ..paper.protocol import simulate_point
from ..policy.decision import Mode, Policy, PolicyConfig, ProfilePredictor
from ..policy.simulate import PolicyRouter
from ..policy.table import CONFIGS
from ..sim import Conversation, peers
from ..sim.cluster import Router, parse_config
from ..sim.outcome import CHAT_TIMEOUT_S, PAPER_TIMEOUT_S
from ..sim.routing import fraction_router, local_router, paper_proxy_router, parse_paper_config, pd_router
from ..sim.shared_run import simulate_shared
from ..workloads.generators import PAPER_QPS, PAPER_WORKLOADS, make_workload, paper_workload
from ..workloads.manifest import to_sim
from . import families, saturation, seeds, sweep_report
from .families import CHAT_WORKLOADS, DoneWhen, FamilyRow, WorstPoint
from .policy_points import TIE, PolicyPoint, Predictions, measured_replicas_against_pd, score, sweep_figures
from .seeds import SeedSpread
from .standings import (
    OTHER_DEPLOYMENTS,
    HeadToHead,
    PolicySummary,
    Standing,
    group_points,
    head_to_head,
    standings,
    summarize_standings,
)

__all__ = ["OTHER_DEPLOYMENTS", "CHAT_WORKLOADS", "Standing", "score", "standings", "group_points",
           "head_to_head", "summarize_standings"]

LINKS = ("intra-node", "cross-node")
WEIGHTS = (1.0, 3.0, 6.0)  # w_tpot, with w_ttft 1
CHAT_WINDOW_S = 10.0  # seconds of conversation arrivals per chat point, as the paper's window
SWEEP_LINK = "cross-node"  # the profiles' own link; one link keeps the sweeps in the time budget
BASE_POLICIES = ("x0", "x1", "x0.5", "replicas", "hybrid")


def _peers() -> list[str]:
    """The peers that run on the P/D configuration itself (`dynamo_ppd.sim.peers`); Dynamo's KV
    router over aggregated workers is the ``replicas`` policy."""
    # dynamo-isl-or-load is the same rule as dynamo-isl-or-load-ours (Dynamo 1.6.1 has no default
    # busy threshold, so both use our graph's 0.5): run it once.
    return [name for name in peers.PEER_ROUTERS
            if name not in peers.REPLICA_PEERS and name != "dynamo-isl-or-load"]


def policy_names(weights: Iterable[float] = WEIGHTS) -> list[str]:
    return [*BASE_POLICIES, *_peers(), *(f"ppd@{w:g}" for w in weights)]


# Left out of the sweeps by default (each lane costs a ladder of simulations): x0.5 lies between
# x0 and x1, which run; Dynamo's prefill_load is isl_or_load's load rule alone, and sustained the
# same rates as isl_or_load on every configuration of a full long-context sweep (2026-12-03);
# hybrid is neither the P/D deployment nor replicas.
SWEEP_LEFT_OUT = ("x0.5", "dynamo-prefill-load", "hybrid")


def sweep_policies(policies: Sequence[str]) -> list[str]:
    """The sweeps' default policies: ``policies`` without `SWEEP_LEFT_OUT` and with PPD at its
    first weight only (the section reads one PPD)."""
    ppd = next((p for p in policies if p.startswith("ppd@")), None)
    return [p for p in policies if p not in SWEEP_LEFT_OUT and (not p.startswith("ppd@") or p == ppd)]


def replica_config(config: str) -> str:
    p, d, r = parse_config(config)
    return f"{p + d + r}R"


def hybrid_config(config: str) -> str:
    """One GPU of the configuration turned into a replica, in the paper's naming: a decode GPU
    if two or more remain, else a prefill GPU (1P3D -> 1R_1P_2D, 3P1D -> 1R_2P_1D)."""
    p, d, _ = parse_config(config)
    if d >= 2:
        return f"1R_{p}P_{d - 1}D"
    return f"1R_{p - 1}P_{d}D"


class CompareSpec(msgspec.Struct, frozen=True):
    profile: str
    config: str
    link: str
    workload: str
    rate: float  # conversations per second
    policy: str
    seed: int = 0
    # PPD's belief (`router_for`): the profile it decides with ("": the cluster's) and the link
    # bandwidth it assumes ("": the point's link; GB/s, or "4x" of the point's: `believed_link`).
    router_profile: str = ""
    router_link: str = ""


def _conversations(workload: str, rate: float, seed: int) -> tuple[list[Conversation], float]:
    if workload in saturation.SWEEPS:
        return saturation.conversations(workload, rate, seed)
    if workload in PAPER_WORKLOADS:
        return paper_workload(workload, rate, seed), PAPER_TIMEOUT_S
    return to_sim(make_workload(workload, rate, CHAT_WINDOW_S, seed)), CHAT_TIMEOUT_S


def _ppd(profile: EngineProfile, w_tpot: float) -> PolicyRouter:
    """PPD as the router runs it by default (``--table none``: the cost model, learning from
    outcomes) at weights (1, w_tpot)."""
    return PolicyRouter(Policy(PolicyConfig(Mode.PPD, w_ttft=1.0, w_tpot=w_tpot), ProfilePredictor(profile)))


def cluster_config_for(config: str, policy: str) -> str:
    """The simulator's worker counts that run ``policy`` on ``config``'s GPUs."""
    if policy == "replicas":
        return replica_config(config)
    if policy == "hybrid":
        return parse_paper_config(hybrid_config(config)).cluster_config
    return config


def router_for(profile: EngineProfile, config: str, policy: str, seed: int,
               link: str | None = None, router_profile: str = "",
               router_link: str = "") -> tuple[str, Router]:
    """(the simulator's worker counts, the router) that run ``policy`` on ``config``'s GPUs.
    ``link``: the KV link preset the cluster runs with; PPD's cost model is given it, as an
    operator's profile describes the link of the deployment it routes (None: the profile's).
    ``router_profile``, ``router_link``: what PPD believes instead (`CompareSpec`)."""
    cluster_config = cluster_config_for(config, policy)
    if policy == "x0":
        return cluster_config, pd_router
    if policy == "x1":
        return cluster_config, local_router
    if policy == "x0.5":
        return cluster_config, fraction_router(0.5, seed)
    if policy == "replicas":
        return cluster_config, peers.make_peer_router("dynamo-kv-agg", seed, profile)
    if policy == "hybrid":
        return cluster_config, paper_proxy_router(parse_paper_config(hybrid_config(config)), seed)
    if policy.startswith("ppd@"):
        truth = link_preset(link) if link is not None else profile.transfer
        believed = load_profile(router_profile) if router_profile else profile
        believed = msgspec.structs.replace(believed, transfer=believed_link(router_link, truth))
        return cluster_config, _ppd(believed, float(policy[4:]))
    if policy in _peers():
        return cluster_config, peers.make_peer_router(policy, seed, profile)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(policy_names())}")


def simulation_key(spec: CompareSpec) -> tuple:
    """What decides a spec's simulation: specs with one key run the same cluster, router and
    conversations, so one run serves them all (``replicas`` is 4R under every configuration,
    and without a prefill worker no KV crosses a link). No router is built for it."""
    cluster_config = cluster_config_for(spec.config, spec.policy)
    has_prefill = parse_config(cluster_config)[0] > 0
    ppd = spec.policy.startswith("ppd@")
    return (spec.profile, cluster_config, spec.link if has_prefill else None, spec.workload, spec.rate,
            spec.config if ppd else None, spec.policy, spec.seed,
            (spec.router_profile, spec.router_link) if ppd else None)


def run_specs(specs: Sequence[CompareSpec], details: bool = False) -> list[PolicyPoint]:
    """Policies at one point (the same profile, workload, rate and seed; ``config`` and ``link``
    may differ only where `simulation_key` says the run is the same), in their order. Those on
    one cluster share runs while they decide alike (`sim.shared_run`): a run's CPU time is
    counted on its lead, 0 on the others. ``details`` (sim compare's): also the counts that
    pooling over seeds weighs by and PPD's own predictions (`Predictions`, from the router of
    the run whose result it got: a follower that never differed was asked every question itself)."""
    first = specs[0]
    if any((s.profile, s.workload, s.rate, s.seed) != (first.profile, first.workload, first.rate, first.seed)
           for s in specs):
        raise ValueError("run_specs takes the policies of one point")
    started = time.process_time()
    profile = load_profile(first.profile)
    conversations, timeout_s = _conversations(first.workload, first.rate, first.seed)
    ids = [c.conversation_id for c in conversations]
    by_cluster: dict[tuple[str, str], list[int]] = {}
    for i, spec in enumerate(specs):
        by_cluster.setdefault((cluster_config_for(spec.config, spec.policy), spec.link), []).append(i)
    made: dict[str, Router] = {}  # each name's latest router: the one of the run it got its result from

    def factory(name: str, spec: CompareSpec) -> Callable[[], Router]:
        def make() -> Router:
            made[name] = router_for(profile, spec.config, spec.policy, spec.seed, spec.link,
                                    spec.router_profile, spec.router_link)[1]
            return made[name]
        return make

    out: dict[int, PolicyPoint] = {}
    costs: list[float] = []  # CPU seconds of each simulation, in the order they ran
    cpu: dict[int, float] = {}  # by the spec that led the run
    for (cluster_config, link), members in by_cluster.items():
        def run(router: Router, cluster_config: str = cluster_config, link: str = link):
            begun = time.process_time()
            result = simulate_point(profile, cluster_config, router, conversations, timeout_s, first.seed,
                                    link_preset(link))
            costs.append(time.process_time() - begun)
            return result

        ran = len(costs)
        runs = simulate_shared(run, [(str(i), factory(str(i), specs[i])) for i in members])
        for k, shared in enumerate(runs):
            cpu[int(shared.routers[0])] = costs[ran + k]
            result, outcome = shared.result, shared.result.outcome()
            # The sweeps' percentiles, and the bootstrap replicates where a ratio reads them (PPD
            # against replicas); the grid's points do without (the JSON's size). Computed once
            # per run and kind, whichever of its policies read them.
            extras: dict[bool, dict[str, Any]] = {}
            for name in shared.routers:
                spec = specs[int(name)]
                extra: dict[str, Any] = {}
                if spec.workload in saturation.SWEEPS:
                    replicates = spec.policy == "replicas" or spec.policy.startswith("ppd@")
                    if replicates not in extras:
                        extras[replicates] = sweep_figures(result, outcome, ids, replicates=replicates)
                    extra = extras[replicates]
                if details:
                    extra = {**extra, "requests": outcome.total_requests, "follow_ups": outcome.turn2.sent}
                    router = made[name]
                    if isinstance(router, PolicyRouter):
                        means = router.predictions.means().items()
                        extra["predictions"] = Predictions(router.predictions.decisions, **{
                            k: None if v is None else round(v, 7) for k, v in means})
                out[int(name)] = PolicyPoint(
                    spec.config, spec.link, spec.workload, spec.rate, spec.policy, outcome.success_rate,
                    outcome.turn2_ttft_mean_with_timeouts_s, outcome.turn2.avg_tpot_s,
                    outcome.turn2.p99_ttft_s, outcome.tokens_per_sec, result.local_share(), seed=spec.seed,
                    **extra)
    # The point's other CPU (its conversations, the figures) on the first run's lead.
    cpu[next(iter(cpu))] += time.process_time() - started - sum(costs)
    return [msgspec.structs.replace(out[i], sim_cpu_s=cpu.get(i, 0.0)) for i in range(len(specs))]


# -- scoring -------------------------------------------------------------------------------------

class CompareReport(msgspec.Struct, frozen=True):
    profile: str
    seeds: list[int]
    points: list[PolicyPoint]
    summaries: dict[str, list[PolicySummary]]  # by "<link> w_tpot <w>"
    # The same, without the other deployments (`OTHER_DEPLOYMENTS`): on the P/D workers alone.
    same_deployment: dict[str, list[PolicySummary]] = {}
    head_to_head: dict[str, list[HeadToHead]] = {}  # ppd@w against each policy, by the same key
    # PPD per workload family and the done-when targets (`families`), its worst grid points by
    # "w_tpot <w>", and its score's spread across seeds (`seeds`; none for one seed).
    families: list[FamilyRow] = []
    done_when: list[DoneWhen] = []
    worst: dict[str, list[WorstPoint]] = {}
    seed_spread: list[SeedSpread] = []
    router_profile: str = ""  # PPD's belief, as `CompareSpec`'s ("": the truth)
    router_link: str = ""


def compare(points: Sequence[PolicyPoint], links: Sequence[str], weights: Sequence[float],
            profile: str, seed_list: list[int]) -> CompareReport:
    """Every seed's point kept; the scores of points pooled over seeds (`seeds.pool`); the
    summaries over the paper/chat grid's only: a sweep's rates are its lanes' ladder and a lane
    stops at its saturation, so its points are no grid of equals (`sweep_report` and `families`
    read them)."""
    keys = [(f"{link} w_tpot {w:g}", link, w) for link in links for w in weights]
    everything = list(points)
    points = seeds.pool([p for p in everything if p.workload not in saturation.SWEEPS])
    summaries = {key: summarize_standings(group_points(points, link), w) for key, link, w in keys}
    same = {key: summarize_standings(group_points(points, link), w, OTHER_DEPLOYMENTS)
            for key, link, w in keys}
    versus = {key: head_to_head(group_points(points, link), w) for key, link, w in keys}
    rows = families.family_rows(everything, links, weights)
    return CompareReport(profile, seed_list, everything, summaries, same, versus, rows,
                         families.done_when(rows), families.worst_points(everything, weights),
                         seeds.seed_spread(everything, links, weights))


# -- report --------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def markdown(report: CompareReport, command: str, wall_s: float, reused: int = 0,
             stem: str = "policies") -> str:
    """The report page; ``stem``: the name its PNGs start with (beside it)."""
    grid = [p for p in report.points if p.workload not in saturation.SWEEPS]
    n_points = len({(p.config, p.link, p.workload, p.rate) for p in grid})
    swept = len(report.points) - len(grid)
    reuse = f" ({reused} of the policy runs reused from the --reuse report)" if reused else ""
    cpu_s = sum(p.sim_cpu_s for p in report.points)
    simulations = sum(p.sim_cpu_s > 0 for p in report.points)
    lines = ["# Every P/D policy on one simulated cluster", "",
             f"Produced by `{command}` in {wall_s / 60:.1f} min{reuse}: {n_points} grid points x policies"
             + (f" and {swept} policy runs of the load sweeps" if swept else "") +
             f" ({len(report.points)} policy runs from {simulations} simulations: {cpu_s / 60:.1f} CPU min, "
             f"{cpu_s / 120:.1f} min on 2 cores), profile "
             f"`{report.profile}`, seeds {report.seeds}"
             + (" (scores of figures pooled over them: `dynamo_ppd/studies/seeds.py`)"
                if len(report.seeds) > 1 else "")
             + ". Score of A against B: the paper's, "
             "`w_ttft (TTFT_B - TTFT_A)/TTFT_B - w_tpot (TPOT_A - TPOT_B)/TPOT_B` on turn-2+ mean TTFT "
             "(failed follow-ups at the timeout) and turn-2+ mean TPOT; missing the 95% success bar "
             "where B does not is a loss. A policy's score at a point is against the best other "
             f"policy there; |score| <= {TIE} is a tie. Module docstring of "
             "`dynamo_ppd/studies/policies.py`: every policy and its source.", ""]
    lines += families.done_when_lines(report.done_when, report.seeds)
    lines += ["## PPD at a glance", "",
              "PPD at each weight against the best other policy: among all of them, and among those that "
              f"run the P/D workers as they are (without {', '.join(OTHER_DEPLOYMENTS)}, which turn "
              "GPUs into aggregated workers: another deployment, not another routing decision).", "",
              "| link | w_tpot | points | >= -0.02 (all) | > +0.02 (all) | >= -0.02 (same P/D) "
              "| > +0.02 (same P/D) | beaten most by (same P/D) |",
              "|---|---|---|---|---|---|---|---|"]
    for key, summaries in report.summaries.items():
        link, w = key.split(" w_tpot ")
        mine = next((s for s in summaries if s.policy == f"ppd@{w}"), None)
        same = next((s for s in report.same_deployment.get(key, []) if s.policy == f"ppd@{w}"), None)
        if mine and same:
            lines.append(f"| {link} | {w} | {mine.points} | {_pct(mine.at_least_minus_tie)} | "
                         f"{_pct(mine.above_tie)} | {_pct(same.at_least_minus_tie)} | {_pct(same.above_tie)} "
                         f"| {same.beaten_most_by or '-'} |")
    # A report says what its run measured: the paper's replicas-vs-P/D counts only beside
    # replicas this run simulated (the project's own history of fixes is in docs/history.md).
    if any(p.policy == "replicas" for p in report.points):
        measured = measured_replicas_against_pd()
        lines += ["", "For replicas beside P/D, the paper authors' own H100 measurements (bundled, "
                  "`dynamo_ppd/paper/data`), scored the same way at weights 1,1, each P/D configuration "
                  "against 4R: "
                  + "; ".join(f"{c} {w} wins, {t} ties, {lo} losses" for c, w, t, lo in measured)
                  + ". Four aggregated GPUs decode with four; a P/D split decodes with its D GPUs only."]
    lines.append("")
    lines += [*families.family_lines(report.families), *seeds.spread_lines(report.seed_spread),
              *families.worst_lines(report.worst)]
    lines += sweep_report.section(report.points, stem)
    for key, summaries in report.summaries.items():
        lines += [f"## {key}", "",
                  "| policy | points | wins | ties | losses | score >= -0.02 | score > +0.02 "
                  "| beaten most by |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in summaries:
            lines.append(f"| {s.policy} | {s.points} | {s.wins} | {s.ties} | {s.losses} | "
                         f"{_pct(s.at_least_minus_tie)} | {_pct(s.above_tie)} | {s.beaten_most_by or '-'} |")
        versus = report.head_to_head.get(key, [])
        if versus:
            lines += ["", f"PPD at w_tpot {key.split(' w_tpot ')[1]} against each policy alone:", "",
                      "| against | points | PPD >= -0.02 | PPD > +0.02 | median score |",
                      "|---|---|---|---|---|"]
            lines += [f"| {h.policy} | {h.points} | {_pct(h.at_least_minus_tie)} | {_pct(h.above_tie)} | "
                      f"{h.median_score:+.3f} |" for h in versus]
        lines.append("")
    return "\n".join(lines)


def plot(report: CompareReport, out_dir: Path, stem: str) -> list[Path]:
    """Pareto views per configuration and link: P99 turn-2 TTFT vs throughput, mean turn-2 TTFT
    vs TPOT (each policy's mean over the points)."""
    plt = plots.pyplot()
    grid = [p for p in report.points if p.workload not in saturation.SWEEPS]
    paths = []
    for config in sorted({p.config for p in grid}):
        for link in sorted({p.link for p in grid}):
            pts = [p for p in grid if p.config == config and p.link == link]
            if not pts:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(12, 5))
            cmap = plt.get_cmap("tab20")
            colors = [cmap(i) for i in range(20)]  # 13+ policies: tab10 would repeat colours
            for index, policy in enumerate(sorted({p.policy for p in pts})):
                style = {"color": colors[index % len(colors)], "marker": "os^Dv"[index % 5], "s": 36,
                         "label": policy}
                mine = [p for p in pts if p.policy == policy and p.turn2_ttft_s and p.turn2_tpot_s]
                if not mine:
                    continue
                p99 = [p.turn2_p99_ttft_s for p in mine if p.turn2_p99_ttft_s]
                axes[0].scatter(sum(p.tokens_per_sec for p in mine) / len(mine),
                                1e3 * sum(p99) / max(1, len(p99)), **style)
                axes[1].scatter(1e3 * sum(p.turn2_tpot_s or 0 for p in mine) / len(mine),
                                1e3 * sum(p.turn2_ttft_s or 0 for p in mine) / len(mine), **style)
            axes[0].set_xlabel("throughput (output tok/s, mean over points)")
            axes[0].set_ylabel("turn-2+ P99 TTFT (ms, mean over points)")
            axes[1].set_xlabel("turn-2+ mean TPOT (ms)")
            axes[1].set_ylabel("turn-2+ mean TTFT (ms)")
            for ax in axes:
                ax.grid(alpha=0.3)
            axes[1].legend(fontsize=7, ncol=2)
            fig.suptitle(f"{config}, {link} link: every policy (lower-left is better on the right)")
            paths.append(plots.save(fig, out_dir / f"{stem}-{config.lower()}-{link}.png", dpi=100))
    return paths


# -- CLI -----------------------------------------------------------------------------------------

def _names(text: str) -> list[str]:
    """A comma-separated list, checked in `main` (ppd@w accepts any weight)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd sim compare`."""
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="engine profile (default: the TensorRT-LLM one)")
    parser.add_argument("--configs", type=comma_choices("configuration", list(CONFIGS)),
                        default=list(CONFIGS), metavar="LIST",
                        help="P:D configurations (default: 1P3D,2P2D,3P1D)")
    parser.add_argument("--links", type=comma_choices("link", list(LINKS)), default=list(LINKS),
                        metavar="LIST",
                        help="KV link presets of the paper/chat grid (default: intra-node,cross-node)")
    workloads = [*PAPER_WORKLOADS, *CHAT_WORKLOADS, *saturation.SWEEPS]
    default = [w for w in workloads if w not in saturation.OPT_IN]
    parser.add_argument("--workloads", type=comma_choices("workload", workloads), default=default,
                        metavar="LIST",
                        help="the paper's 18 workloads, wildchat, sharegpt (the grid, at --rates) and "
                        f"{', '.join(saturation.SWEEPS)} (swept up to saturation; see --sweep-links) "
                        f"(default: all {len(default)} but {', '.join(saturation.OPT_IN)}, whose "
                        "long sessions cost as much as the rest: name it to run it)")
    parser.add_argument("--rates", type=positive_floats("rates"), default=list(PAPER_QPS), metavar="LIST",
                        help="conversation rates of the grid's workloads (default: the paper's 10); the "
                        "swept workloads climb their own ladders (dynamo_ppd/studies/saturation.py)")
    parser.add_argument("--sweep-links", type=comma_choices("link", list(LINKS)), default=[SWEEP_LINK],
                        metavar="LIST",
                        help=f"KV link presets of the swept workloads (default: {SWEEP_LINK}, the "
                        "profiles' own: Dynamo's workers as pods)")
    parser.add_argument("--weights", type=positive_floats("weights"), default=list(WEIGHTS), metavar="LIST",
                        help="w_tpot values (w_ttft 1) to score at and to run PPD at (default: 1,3,6)")
    parser.add_argument("--policies", type=_names, metavar="LIST",
                        help="policies to run (default: all: x0, x1, x0.5, replicas, hybrid, the peers, "
                        "ppd@w)")
    parser.add_argument("--sweep-policies", type=_names, metavar="LIST",
                        help="policies of the swept workloads (default: --policies without x0.5, hybrid "
                        "and dynamo-prefill-load, and with PPD at its first weight only: every policy costs "
                        "a ladder of simulations)")
    seed = parser.add_mutually_exclusive_group()
    seed.add_argument("--seeds", type=seeds.parse_seeds, metavar="LIST",
                      help="seeds of arrivals, prompts, tokens and draws: every policy runs every point on "
                      "each, and points are scored on figures pooled over them (default: 0)")
    seed.add_argument("--seed", type=int, default=0, help="one seed: --seeds SEED")
    parser.add_argument("--router-profile", metavar="PROFILE",
                        help="the engine profile PPD decides with (its belief), a bundled name or a YAML "
                        "path; default: --profile, the simulated workers' own (the truth)")
    parser.add_argument("--router-link-bandwidth", metavar="GB/S|Nx",
                        help="the KV link bandwidth PPD believes: GB/s, or a factor of each point's link "
                        "(e.g. 4x: believed 4 times faster than it is; 0.25x: slower); default: the "
                        "point's own link")
    parser.add_argument("--jobs", type=positive_int, default=2, help="parallel processes")
    parser.add_argument("--reuse", type=Path, metavar="JSON",
                        help="a previous report whose points are kept: only the (point, policy, seed) "
                        "triples it lacks are simulated (same profile)")
    parser.add_argument("--out", type=Path, default=Path("docs/policies"), metavar="PREFIX",
                        help="writes PREFIX.md, PREFIX.json, PREFIX-<config>-<link>.png and, with a swept "
                        "workload, PREFIX-sweep-<link>-p99-ttft.png and PREFIX-sweep-<link>-tpot.png")


PointKey = tuple[str, str, str, float, str, int]


def _key(p: PolicyPoint | CompareSpec) -> PointKey:
    return (p.config, p.link, p.workload, p.rate, p.policy, p.seed)


def _run(pool: ProcessPoolExecutor, specs: Sequence[CompareSpec], previous: dict[PointKey, PolicyPoint],
         label: str) -> list[PolicyPoint]:
    """The points of ``specs``, in their order: the --reuse report's where it has them, else
    simulated, one simulation per distinct key (its figures stand for every spec that shares it),
    the policies of one point in one task (`run_specs`: they share runs while they decide
    alike). Tasks go in the order of their first spec (a caller that sends heavy points first
    keeps that order)."""
    done: dict[int, PolicyPoint] = {i: previous[_key(s)] for i, s in enumerate(specs) if _key(s) in previous}
    sharing: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        if i not in done:
            sharing.setdefault(simulation_key(spec), []).append(i)
    tasks: dict[tuple, list[list[int]]] = {}
    for group in sharing.values():
        first = specs[group[0]]
        at = (first.profile, first.config, first.link, first.workload, first.rate, first.seed)
        tasks.setdefault(at, []).append(group)
    progress = Progress(max(1, len(tasks)), label)
    task_list = list(tasks.values())
    results = pool.map(functools.partial(run_specs, details=True),
                       [[specs[g[0]] for g in task] for task in task_list], chunksize=1)
    for task, points in zip(task_list, results, strict=True):
        for group, point in zip(task, points, strict=True):
            for n, i in enumerate(group):
                done[i] = msgspec.structs.replace(point, config=specs[i].config, link=specs[i].link,
                                                  sim_cpu_s=point.sim_cpu_s if n == 0 else 0.0)
        progress.step()
    return [done[i] for i in range(len(specs))]


def _sweep(pool: ProcessPoolExecutor, lanes: list[saturation.Lane], profile: str,
           previous: dict[PointKey, PolicyPoint], belief: tuple[str, str] = ("", "")) -> list[PolicyPoint]:
    """The sweeps, rung by rung; within a rung the lanes that cost most at the rung below are
    sent first (longest first: the rung ends when its last point does, so a heavy point sent
    last would leave the other processes idle)."""
    cost: dict[saturation.Lane, float] = {}

    def run(todo: list[tuple[saturation.Lane, float]], rung: int) -> list[PolicyPoint]:
        order = sorted(range(len(todo)), key=lambda i: -cost.get(todo[i][0], 0.0))
        specs = [CompareSpec(profile, lane.config, lane.link, lane.workload, rate, lane.policy, lane.seed,
                             *belief) for lane, rate in (todo[i] for i in order)]
        points = _run(pool, specs, previous, f"sim compare sweeps, rung {rung + 1}")
        out: list[PolicyPoint] = [points[0]] * len(todo)
        for i, point in zip(order, points, strict=True):
            out[i] = point
            cost[todo[i][0]] = point.sim_cpu_s
        return out

    return saturation.sweep(lanes, run)


def main(args: argparse.Namespace) -> int:
    try:
        load_profile(args.profile)
        if args.router_profile:
            load_profile(args.router_profile)
        believed_link(args.router_link_bandwidth, link_preset(LINKS[0]))  # a bad value: one line here
        policies = args.policies or policy_names(args.weights)
        swept = args.sweep_policies or sweep_policies(policies)
        unknown = [p for p in dict.fromkeys([*policies, *swept])
                   if p not in policy_names(args.weights) and not p.startswith("ppd@")]
        if unknown:
            known = ", ".join(policy_names())
            raise ValueError(f"unknown policies {', '.join(unknown)}; choose from {known}")
    except (ProfileError, ValueError) as exc:
        return cli_error(exc)
    grid = [w for w in args.workloads if w not in saturation.SWEEPS]
    seed_list = args.seeds or [args.seed]
    belief = (args.router_profile or "", args.router_link_bandwidth or "")
    specs = [CompareSpec(args.profile, c, link, w, r, policy, seed, *belief) for c in args.configs
             for link in args.links for w in grid for r in args.rates for seed in seed_list
             for policy in policies]
    lanes = [saturation.Lane(c, link, w, policy, seed) for c in args.configs for link in args.sweep_links
             for w in args.workloads if w in saturation.SWEEPS for seed in seed_list for policy in swept]
    previous: dict[PointKey, PolicyPoint] = {}
    if args.reuse is not None:
        try:
            report = msgspec.json.decode(args.reuse.read_bytes(), type=CompareReport)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return cli_error(f"--reuse {args.reuse}: {exc}")
        if report.profile != args.profile:
            return cli_error(f"--reuse {args.reuse} was run with profile {report.profile}, "
                             f"not {args.profile}")
        # PPD's points hold its belief; another belief keeps the other policies' points only.
        same_belief = (report.router_profile, report.router_link) == belief
        previous = {_key(p): p for p in report.points if same_belief or not p.policy.startswith("ppd@")}
    started = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        points = _run(pool, specs, previous, "sim compare")
        points += _sweep(pool, lanes, args.profile, previous, belief)
    wall = time.monotonic() - started
    reused = sum(_key(p) in previous for p in points)
    report = msgspec.structs.replace(compare(points, args.links, args.weights, args.profile, seed_list),
                                     router_profile=belief[0], router_link=belief[1])
    text = markdown(report, "dynamo-ppd " + " ".join(sys.argv[1:]), wall, reused, args.out.name)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # (Not with_suffix: an out name like policies-link-0.25x has a dot of its own.)
    (args.out.parent / f"{args.out.name}.md").write_text(text)
    (args.out.parent / f"{args.out.name}.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    for path in [*plot(report, args.out.parent, args.out.name),
                 *sweep_report.plot(report.points, args.out.parent, args.out.name)]:
        print(f"wrote {path}")
    return 0
