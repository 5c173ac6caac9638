"""`dynamo-ppd advise`: which deployment to run, for a workload and a GPU count.

It simulates, on the virtual clock and the engine profile, ways to spend the GPUs (a worker is
the profile's TP GPUs; with several TP degrees, each degree's workers in turn: `search` says
which candidates run, all of them or a staged search):

- ``NR``: N aggregated replicas, placed by Dynamo's KV router (`peers.DynamoKvRouter`);
- every P:D split ``pPdD`` (p + d = N), routed by PPD at a sweep of weights (``ppd@W_TTFT,W_TPOT``,
  the shipped table of the split when there is one for the profile, else predictions from the
  profile alone), and, for reference, by every turn via prefill (``x0``, Dynamo's plain
  disaggregation), every follow-up decode-local (``x1``) and Dynamo's conditional disaggregation
  (``dynamo-isl-or-load-ours``, our graph's thresholds);
- hybrids ``kR_pP_dD`` (k replicas beside a P/D group; k = 1 and k = N/2), placed as the paper
  authors' proxy places conversations;

at the workload's rate; then the shortlist (the best `SHORTLIST` candidates at that rate, and
the replicas) again around it (``--rate-factors``). Each candidate is measured on the
requests a user waits on: the follow-ups (turns 2+), or every turn for a single-turn workload.
Reported: TTFT p50/p99 and TPOT p50 over those, output tokens/s per GPU, the success rate and,
with SLOs, the share of those requests that met both (attainment).

The recommendation, among the deployable candidates (replicas, hybrids, PPD at a weight; the
reference policies are shown, and named when one does better) that meet the 95% success bar at
the workload's rate:

- with SLOs (``--slo-ttft``/``--slo-tpot``, ms): the highest attainment; then the highest
  attainment at the highest rate factor (headroom); then the weighted latency cost below;
- with weights only: the lowest weighted latency cost,
  ``W_TTFT * (TTFT_p50 / best + TTFT_p99 / best) / 2 + W_TPOT * TPOT_p50 / best`` (2 is a
  candidate best on all three), the paper's score made absolute, with the TTFT a user waits for
  taken as its typical and its tail value alike (a deployment whose median is 1% better and
  whose p99 is 20 times worse is not the better one).

The margin is the runner-up's distance on the deciding key. The Pareto front is taken over
(TTFT p50, TTFT p99, TPOT p50: lower; tokens/s per GPU: higher) at the workload's rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

import msgspec

from ..engine.profile import EngineProfile, link_preset
from ..paper.protocol import simulate_point
from ..policy.simulate import ppd_router as simulate_ppd_router
from ..policy.table import Weights, load_table, shipped_table
from ..sim import peers
from ..sim.cluster import Router
from ..sim.outcome import SUCCESS_BAR, TurnResult, succeeded, tpot_s
from ..sim.routing import local_router, paper_proxy_router, parse_paper_config, pd_router
from ..workloads.manifest import Manifest, scale_arrivals, to_sim

PPD_WEIGHTS: tuple[tuple[float, float], ...] = ((1.0, 1.0), (2.0, 1.0), (1.0, 3.0), (1.0, 6.0))
REFERENCE_POLICIES = ("x0", "x1", "dynamo-isl-or-load-ours")
RATE_FACTORS = (0.5, 1.0, 1.5)
SHORTLIST = 8  # candidates simulated again around the workload's rate


def deployments(gpus: int) -> list[str]:
    """Every deployment of ``gpus`` GPUs this advises among, in the simulator's / paper's names:
    replicas, each P:D split, hybrids with one replica and with half the GPUs as replicas."""
    if gpus < 2:
        raise ValueError("advise needs at least 2 GPUs (a P:D split has a prefill and a decode worker)")
    out = [f"{gpus}R"] + [f"{p}P{gpus - p}D" for p in range(1, gpus)]
    for k in sorted({1, gpus // 2}):
        rest = gpus - k
        if rest >= 2:
            out += [f"{k}R_{p}P_{rest - p}D" for p in range(1, rest)]
    return out


def kind_of(deployment: str) -> str:
    if deployment.endswith("R") and "_" not in deployment:
        return "replicas"
    return "hybrid" if "_" in deployment else "pd"


def policies_for(deployment: str, weights: Sequence[tuple[float, float]] = PPD_WEIGHTS) -> list[str]:
    kind = kind_of(deployment)
    if kind == "replicas":
        return ["dynamo-kv-agg"]
    if kind == "hybrid":
        return ["paper-proxy"]
    return [f"ppd@{w_ttft:g},{w_tpot:g}" for w_ttft, w_tpot in weights] + list(REFERENCE_POLICIES)


def ppd_router(profile: EngineProfile, profile_name: str, config: str,
               weights: tuple[float, float]) -> Router:
    """PPD at ``weights``, as `sim run --router ppd` builds it: the table shipped for ``config``
    when one ships for this profile (the 4-GPU splits of the default profile), else decisions
    predicted from the profile alone (what the router does with ``--table none``)."""
    path = shipped_table(profile_name, config)
    return simulate_ppd_router(profile, Weights(*weights), load_table(path) if path else None)


def make_router(profile: EngineProfile, profile_name: str, deployment: str, policy: str,
                seed: int) -> tuple[str, Router]:
    """(the simulator's worker counts, the router) of one candidate."""
    kind = kind_of(deployment)
    if kind == "replicas":
        return deployment, peers.make_peer_router("dynamo-kv-agg", seed, profile)
    if kind == "hybrid":
        config = parse_paper_config(deployment)
        return config.cluster_config, paper_proxy_router(config, seed)
    if policy.startswith("ppd@"):
        w_ttft, w_tpot = (float(x) for x in policy[4:].split(","))
        return deployment, ppd_router(profile, profile_name, deployment, (w_ttft, w_tpot))
    if policy == "x0":
        return deployment, pd_router
    if policy == "x1":
        return deployment, local_router
    return deployment, peers.make_peer_router(policy, seed, profile)


class Slo(msgspec.Struct, frozen=True):
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met(self, turn: TurnResult, timeout_s: float | None) -> bool:
        if not succeeded(turn, timeout_s):
            return False
        if self.ttft_s is not None and (turn.ttft_s is None or turn.ttft_s > self.ttft_s):
            return False
        tpot = tpot_s(turn)
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


class CandidateSpec(msgspec.Struct, frozen=True):
    deployment: str  # in workers of ``tp`` GPUs each
    policy: str
    rate_factor: float
    tp: int = 1


class Measured(msgspec.Struct, frozen=True):
    """One candidate at one rate, on the requests a user waits on (turns 2+, or all turns of a
    single-turn workload)."""

    deployment: str  # in workers of ``tp`` GPUs each
    policy: str
    rate_factor: float
    rate: float  # conversations per second
    success_rate: float  # percent, every turn
    requests: int  # the requests the latencies are over
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tokens_per_s_per_gpu: float
    slo_attainment: float | None  # share of those requests within both SLOs (None: no SLO)
    local_share: float  # follow-ups run decode-local (P/D only)
    tp: int = 1  # GPUs per worker

    @property
    def key(self) -> tuple[str, str, int]:
        """The candidate, whatever its rate."""
        return self.deployment, self.policy, self.tp


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class Job(msgspec.Struct, frozen=True):
    """Everything one simulation needs, picklable for a worker process."""

    profile: EngineProfile  # the candidate's TP degree's (its name finds a shipped table)
    link: str
    gpus: int
    manifest: bytes  # the workload at the candidate's rate (msgspec JSON of `Manifest`)
    timeout_s: float
    seed: int
    slo: Slo
    spec: CandidateSpec
    rate: float


def run_job(job: Job) -> Measured:
    profile = job.profile
    manifest = msgspec.json.decode(job.manifest, type=Manifest)
    cluster_config, router = make_router(profile, profile.name, job.spec.deployment, job.spec.policy,
                                         job.seed)
    result = simulate_point(profile, cluster_config, router, to_sim(manifest), job.timeout_s, job.seed,
                            link_preset(job.link))
    outcome = result.outcome()
    turns = result.turn_results()
    waited = [t for t in turns if t.turn > 1] or turns  # single-turn: every turn
    ok = [t for t in waited if succeeded(t, job.timeout_s)]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [v for v in (tpot_s(t) for t in ok) if v is not None]
    attainment = (sum(job.slo.met(t, job.timeout_s) for t in waited) / len(waited)
                  if job.slo.given and waited else None)
    return Measured(job.spec.deployment, job.spec.policy, job.spec.rate_factor, job.rate,
                    outcome.success_rate, len(waited), _percentile(ttfts, 0.5), _percentile(ttfts, 0.99),
                    _percentile(tpots, 0.5), outcome.tokens_per_sec / job.gpus, attainment,
                    result.local_share() if kind_of(job.spec.deployment) == "pd" else 0.0, job.spec.tp)


def plan(workers: int, rate_factors: Sequence[float], weights: Sequence[tuple[float, float]] = PPD_WEIGHTS,
         tp: int = 1) -> list[CandidateSpec]:
    """Every candidate of ``workers`` workers of ``tp`` GPUs at each rate factor."""
    return [CandidateSpec(d, p, f, tp) for f in rate_factors for d in deployments(workers)
            for p in policies_for(d, weights)]


def shortlist(nominal: Sequence[Measured], weights: tuple[float, float], slo: Slo,
              size: int = SHORTLIST) -> list[tuple[str, str, int]]:
    """(deployment, policy) of the candidates worth a look around the rate: the best ``size`` at
    the workload's rate (by SLO attainment, then weighted cost), and the replicas whatever their
    rank (the baseline every P/D deployment is weighed against)."""
    keep = [p.key for p in rank(nominal, weights, slo)[:size]]
    keep += [p.key for p in nominal if kind_of(p.deployment) == "replicas" and p.key not in keep]
    return keep


def rank(points: Sequence[Measured], weights: tuple[float, float], slo: Slo) -> list[Measured]:
    """The eligible ``points``, best first: by SLO attainment when SLOs are given, then by the
    weighted cost among them."""
    costs = weighted_costs(points, weights)
    return sorted((p for p in points if id(p) in costs),
                  key=lambda p: (-(p.slo_attainment or 0.0) if slo.given else 0.0, costs[id(p)]))


def simulate_all(jobs: Sequence[Job], processes: int, on_done: Callable[[], None] = lambda: None
                 ) -> list[Measured]:
    """Every job, on ``processes`` worker processes (1: in this process), in the jobs' order."""
    if processes <= 1:
        out = []
        for job in jobs:
            out.append(run_job(job))
            on_done()
        return out
    with ProcessPoolExecutor(processes) as pool:
        futures = [pool.submit(run_job, job) for job in jobs]
        results = []
        for future in futures:
            results.append(future.result())
            on_done()
        return results


def jobs_for(manifest: Manifest, specs: Sequence[CandidateSpec], *, profiles: dict[int, EngineProfile],
             link: str, gpus: int, rate: float, timeout_s: float, seed: int, slo: Slo) -> list[Job]:
    """One job per spec; ``profiles``: the engine profile of each TP degree."""
    encoded: dict[float, bytes] = {}
    jobs = []
    for spec in specs:
        if spec.rate_factor not in encoded:
            scaled = (scale_arrivals(manifest, rate * spec.rate_factor) if spec.rate_factor != 1.0
                      else manifest)
            encoded[spec.rate_factor] = msgspec.json.encode(scaled)
        jobs.append(Job(profiles[spec.tp], link, gpus, encoded[spec.rate_factor], timeout_s, seed, slo,
                        spec, rate * spec.rate_factor))
    return jobs


# -- choosing --------------------------------------------------------------------------------

def eligible(points: Sequence[Measured]) -> list[Measured]:
    return [p for p in points if p.success_rate >= SUCCESS_BAR and p.ttft_p50_s and p.tpot_p50_s]


def weighted_costs(points: Sequence[Measured], weights: tuple[float, float]) -> dict[int, float]:
    """id(point) -> W_TTFT * (TTFT_p50 / best + TTFT_p99 / best) / 2 + W_TPOT * TPOT_p50 / best
    over the eligible ``points`` (the module docstring)."""
    ok = [p for p in eligible(points) if p.ttft_p99_s]
    if not ok:
        return {}
    best_p50 = min(p.ttft_p50_s or math.inf for p in ok)
    best_p99 = min(p.ttft_p99_s or math.inf for p in ok)
    best_tpot = min(p.tpot_p50_s or math.inf for p in ok)
    return {id(p): weights[0] * ((p.ttft_p50_s or 0.0) / best_p50 + (p.ttft_p99_s or 0.0) / best_p99) / 2
            + weights[1] * (p.tpot_p50_s or 0.0) / best_tpot for p in ok}


def pareto_front(points: Sequence[Measured]) -> list[Measured]:
    """The candidates no other one beats on every axis (lower TTFT p50/p99 and TPOT p50, higher
    tokens/s per GPU) and beats on one."""
    ok = eligible(points)

    def axes(p: Measured) -> tuple[float, ...]:
        return (p.ttft_p50_s or math.inf, p.ttft_p99_s or math.inf, p.tpot_p50_s or math.inf,
                -p.tokens_per_s_per_gpu)

    front = []
    for p in ok:
        a = axes(p)
        if not any(all(x <= y for x, y in zip(axes(q), a, strict=True)) and axes(q) != a for q in ok):
            front.append(p)
    return front


class Recommendation(msgspec.Struct, frozen=True):
    best: Measured
    runner_up: Measured | None
    key: str  # what decided: "slo attainment", "headroom", "weighted cost"
    margin: str  # the runner-up's distance on it, in words
    better_reference: Measured | None = None  # a reference policy that beat ``best`` on the same key


def recommend(points: Sequence[Measured], weights: tuple[float, float], slo: Slo,
              top_factor: float) -> Recommendation | None:
    """The recommended candidate at the workload's rate (rate factor 1; see the module docstring)."""
    nominal = [p for p in points if p.rate_factor == 1.0]
    ok = [p for p in eligible(nominal) if p.policy not in REFERENCE_POLICIES]
    if not ok:
        return None
    costs = weighted_costs(nominal, weights)
    headroom = {p.key: p.slo_attainment or 0.0 for p in points if p.rate_factor == top_factor}

    def key(p: Measured) -> tuple[float, ...]:
        if slo.given:
            return (-(p.slo_attainment or 0.0), -headroom.get(p.key, 0.0), costs[id(p)])
        return (costs[id(p)],)

    ranked = sorted(ok, key=key)
    best = ranked[0]
    references = [p for p in eligible(nominal) if p.policy in REFERENCE_POLICIES and key(p) < key(best)]
    better = min(references, key=key) if references else None
    runner = next((p for p in ranked[1:] if (p.deployment, p.tp) != (best.deployment, best.tp)), None)
    if runner is None:
        return Recommendation(best, None, "only candidate", "no other deployment met the success bar", better)
    kb, kr = key(best), key(runner)
    if slo.given and kb[0] != kr[0]:
        return Recommendation(best, runner, "slo attainment",
                              f"{-kb[0]:.1%} of requests within the SLOs against {-kr[0]:.1%}", better)
    if slo.given and kb[1] != kr[1]:
        return Recommendation(best, runner, "headroom",
                              f"at {top_factor:g}x the rate: {-kb[1]:.1%} within the SLOs against "
                              f"{-kr[1]:.1%}",
                              better)
    return Recommendation(best, runner, "weighted cost",
                          f"weighted cost {kb[-1]:.3f} against {kr[-1]:.3f} "
                          f"({(kr[-1] - kb[-1]) / kb[-1]:+.1%} for the runner-up)", better)
