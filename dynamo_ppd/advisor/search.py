"""Which candidates `advise` simulates: every one (``exhaustive``), or a staged search
(``staged``, the default) that simulates a fraction of them and finds the same recommendation.

Every candidate of N workers is one of: replicas, a P:D split p:(N-p) with a policy (PPD at four
weights, three reference policies), or a hybrid k:p:(N-k-p). Simulating all of them costs about
9N simulations, each in proportion to the workload's rate, so the whole grows with N^2. The
staged search, per TP degree, at the workload's rate:

1. scan: the replicas; PPD at the first weights (`advise.PPD_WEIGHTS`) on at most `SCAN` splits
   evenly spread over 1..N-1; at most `SCAN` hybrids per replica count;
2. refine: around the best `REFINE` splits (and the best hybrid per replica count), the splits at
   half the last step on both sides, until the step is 1 (a bisection of a cost that changes
   slowly with the split);
3. policies: on the best `POLICY_SPLITS` splits, the other PPD weights and the reference
   policies.

Then, as for the exhaustive search, the shortlist (`advise.SHORTLIST` best, and the replicas of
every TP degree) again at the other rate factors. Ranking at every stage is `advise.rank`: SLO
attainment when SLOs are given, then the weighted cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from ..engine.profile import EngineProfile
from ..sim.cluster import parse_config
from ..sim.routing import parse_paper_config
from ..workloads.manifest import Manifest
from . import advise

Search = Literal["staged", "exhaustive"]
SEARCHES: tuple[Search, ...] = ("staged", "exhaustive")
SCAN = 8  # splits (and hybrids per replica count) scanned first
REFINE = 2  # the best splits refined
POLICY_SPLITS = 3  # the best splits every policy runs on


class Runner:
    """Simulates specs as jobs of one workload (the arguments of `advise.jobs_for`), remembering
    every result so that no candidate runs twice."""

    def __init__(self, manifest: Manifest, profiles: dict[int, EngineProfile], processes: int,
                 on_done: Callable[[], None] = lambda: None, **job_args):
        self.manifest, self.profiles, self.processes = manifest, profiles, processes
        self.on_done, self.job_args = on_done, job_args
        self.done: dict[advise.CandidateSpec, advise.Measured] = {}

    def run(self, specs: Sequence[advise.CandidateSpec]) -> list[advise.Measured]:
        todo = [s for s in dict.fromkeys(specs) if s not in self.done]
        jobs = advise.jobs_for(self.manifest, todo, profiles=self.profiles, **self.job_args)
        for spec, measured in zip(todo, advise.simulate_all(jobs, self.processes, self.on_done), strict=True):
            self.done[spec] = measured
        return [self.done[s] for s in specs]

    def points(self) -> list[advise.Measured]:
        return list(self.done.values())


def evenly(values: Sequence[int], count: int) -> list[int]:
    """At most ``count`` of ``values`` (sorted), evenly spread, both ends kept."""
    if len(values) <= count:
        return list(values)
    picks = {values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def _split(deployment: str) -> int:
    """The prefill workers of ``pPdD`` or ``kR_pP_dD`` (the simulator's and the paper's config names)."""
    return parse_paper_config(deployment).prefill if "_" in deployment else parse_config(deployment)[0]


def staged_nominal(runner: Runner, workers: int, tp: int, weights: tuple[float, float],
                   slo: advise.Slo) -> None:
    """Stages 1-3 (the module docstring) for one TP degree, at the workload's rate."""
    scan_policy = "ppd@{:g},{:g}".format(*advise.PPD_WEIGHTS[0])

    def pd(p: int, policy: str = scan_policy) -> advise.CandidateSpec:
        return advise.CandidateSpec(f"{p}P{workers - p}D", policy, 1.0, tp)

    def hybrid(k: int, p: int) -> advise.CandidateSpec:
        return advise.CandidateSpec(f"{k}R_{p}P_{workers - k - p}D", "paper-proxy", 1.0, tp)

    def best_splits(points: list[advise.Measured]) -> list[int]:
        return [_split(m.deployment) for m in advise.rank(points, weights, slo)]

    def scanned_pd() -> list[advise.Measured]:
        return [m for m in runner.points() if m.tp == tp and m.rate_factor == 1.0
                and advise.kind_of(m.deployment) == "pd" and m.policy == scan_policy]

    splits = list(range(1, workers))
    hybrids = {k: list(range(1, workers - k)) for k in sorted({1, workers // 2}) if workers - k >= 2}
    scanned = evenly(splits, SCAN)
    specs = [advise.CandidateSpec(f"{workers}R", "dynamo-kv-agg", 1.0, tp)] + [pd(p) for p in scanned]
    for k, ps in hybrids.items():
        specs += [hybrid(k, p) for p in evenly(ps, SCAN)]
    runner.run(specs)
    step = max(1, math.ceil((len(splits) - 1) / (SCAN - 1))) if len(splits) > SCAN else 1
    while step > 1:
        step = math.ceil(step / 2)
        more = [pd(p + d) for p in best_splits(scanned_pd())[:REFINE] for d in (-step, step)
                if 1 <= p + d < workers]
        for k, ps in hybrids.items():
            mine = [m for m in runner.points() if m.tp == tp and m.rate_factor == 1.0
                    and m.deployment.startswith(f"{k}R_")]
            more += [hybrid(k, p + d) for p in best_splits(mine)[:1] for d in (-step, step) if p + d in ps]
        runner.run(more)
    runner.run([pd(p, policy) for p in best_splits(scanned_pd())[:POLICY_SPLITS]
                for policy in advise.policies_for(f"{p}P{workers - p}D") if policy != scan_policy])


def tp_degrees(gpus: int, tps: Iterable[int]) -> list[int]:
    """The TP degrees of ``tps`` (sorted) that divide ``gpus`` into 2 workers or more."""
    return [tp for tp in sorted(tps) if gpus % tp == 0 and gpus // tp >= 2]


def search(runner: Runner, gpus: int, rate_factors: Sequence[float], weights: tuple[float, float],
           slo: advise.Slo, how: Search = "staged") -> list[advise.Measured]:
    """Every candidate simulated, by ``how``, at every TP degree of ``runner.profiles`` (a degree
    that does not divide ``gpus`` into 2 workers or more is skipped); the nominal rate first, then
    the shortlist at the other rate factors."""
    for tp in tp_degrees(gpus, runner.profiles):
        if how == "exhaustive":
            runner.run(advise.plan(gpus // tp, [1.0], tp=tp))
        else:
            staged_nominal(runner, gpus // tp, tp, weights, slo)
    nominal = [m for m in runner.points() if m.rate_factor == 1.0]
    keep = advise.shortlist(nominal, weights, slo)  # with the replicas of every degree
    runner.run([advise.CandidateSpec(d, p, f, tp) for f in rate_factors if f != 1.0 for d, p, tp in keep])
    return runner.points()


def planned(gpus: int, degrees: Sequence[int], rate_factors: Sequence[float], how: Search) -> int:
    """About how many simulations `search` runs (for the progress bar)."""
    around = (len([f for f in rate_factors if f != 1.0])) * (advise.SHORTLIST + len(degrees))
    total = 0
    for tp in degrees:
        workers = gpus // tp
        if how == "exhaustive":
            total += len(advise.plan(workers, [1.0]))
            continue
        hybrids = sum(1 for k in {1, workers // 2} if workers - k >= 2)
        rounds = max(0, math.ceil(math.log2(max(1, (workers - 2) / (SCAN - 1))))) if workers - 1 > SCAN else 0
        total += (1 + min(SCAN, workers - 1) * (1 + hybrids) + rounds * 2 * (REFINE + hybrids)
                  + POLICY_SPLITS * (len(advise.PPD_WEIGHTS) - 1 + len(advise.REFERENCE_POLICIES)))
    return total + around
