"""`sim compare` over several seeds (``--seeds 0,1,2``): pooling a policy's figures across seeds,
and how the tie band (|score| <= 0.02) compares with the seed-to-seed spread of PPD's score.

Every policy runs a point on the same seeds (a seed draws the arrivals, prompts, tokens and the
policies' own draws), and the report keeps every seed's `PolicyPoint`. Scores are of pooled
points (`pool`): per (configuration, link, workload, rate, policy), turn-2+ mean TTFT and TPOT
are the seeds' means weighted by their follow-ups sent (TTFT's mean is over those; TPOT's over
the successful ones among them, nearly all where the figure counts), and the success rate the
seeds' weighted by their requests sent (a plain mean over seeds where a point lacks its counts,
as points of reports before ``--seeds`` do). PPD's mean predictions are weighted by its
decisions. Pooled-vs-pooled is then scored exactly as one seed's points
(`policy_points.score`): pooling first weighs a seed by its traffic and lets one seed's bad luck
count as much as its share of the follow-ups, where averaging per-seed scores would not (a
success-bar miss on one seed is an infinite score there).

The spread (`seed_spread`): for PPD at each weight, at each grid point, its score against the
best same-deployment policy on each seed alone, and the standard deviation of those scores
across seeds. If the typical spread is near or above the tie band, a tie/loss at 0.02 is within
the noise of one seed, and only the pooled figures say anything.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

import msgspec
import numpy as np

from .policy_points import TIE, PolicyPoint, Predictions
from .saturation import SWEEPS
from .standings import OTHER_DEPLOYMENTS, standings


def parse_seeds(text: str) -> list[int]:
    """An argparse type: a comma-separated list of seeds (integers >= 0), each once, in order."""
    try:
        seeds = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(seed < 0 for seed in seeds):
        raise argparse.ArgumentTypeError(f"seeds are integers >= 0 separated by commas (0,1,2), not {text!r}")
    return list(dict.fromkeys(seeds))


PooledKey = tuple[str, str, str, float, str]


def point_key(p: PolicyPoint) -> PooledKey:
    return (p.config, p.link, p.workload, p.rate, p.policy)


def _mean(values: Sequence[float | None], weights: Sequence[int] | None = None) -> float | None:
    """The mean of the values that are not None, weighted by ``weights`` (None: not recorded),
    plain where theirs add up to nothing."""
    pairs = [(v, 1 if weights is None else weights[i]) for i, v in enumerate(values) if v is not None]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    if total > 0:
        return sum(v * w for v, w in pairs) / total
    return sum(v for v, _ in pairs) / len(pairs)


def _pool_predictions(points: Sequence[PolicyPoint]) -> Predictions | None:
    mine = [p.predictions for p in points if p.predictions is not None]
    if not mine:
        return None
    weights = [p.decisions for p in mine]
    fields = {name: _mean([getattr(p, name) for p in mine], weights)
              for name in Predictions.__struct_fields__ if name != "decisions"}
    return Predictions(sum(weights), **fields)


def pool_one(points: Sequence[PolicyPoint]) -> PolicyPoint:
    """One policy's points at one point (several seeds) as one: see the module docstring. The
    sweeps' percentiles are plain means over seeds (no replicates: those pair conversations of
    one seed); CPU time and counts are sums; ``seed`` is the first point's."""
    if len(points) == 1:
        return points[0]
    first = points[0]
    counted = all(p.requests > 0 for p in points)  # else a report from before the counts
    follow_ups = [p.follow_ups for p in points] if counted else None

    def mean(field: str, weights: Sequence[int] | None = None) -> float | None:
        return _mean([getattr(p, field) for p in points], weights)

    return msgspec.structs.replace(
        first, success_rate=mean("success_rate", [p.requests for p in points] if counted else None),
        turn2_ttft_s=mean("turn2_ttft_s", follow_ups), turn2_tpot_s=mean("turn2_tpot_s", follow_ups),
        turn2_p99_ttft_s=mean("turn2_p99_ttft_s"), tokens_per_sec=mean("tokens_per_sec"),
        local_share=mean("local_share", follow_ups), sim_cpu_s=sum(p.sim_cpu_s for p in points),
        turn1_p50_ttft_s=mean("turn1_p50_ttft_s"), turn2_p50_ttft_s=mean("turn2_p50_ttft_s"),
        turn2_p50_tpot_s=mean("turn2_p50_tpot_s"), turn2_p99_tpot_s=mean("turn2_p99_tpot_s"),
        conversations=sum(p.conversations for p in points), replicates=None,
        requests=sum(p.requests for p in points), follow_ups=sum(p.follow_ups for p in points),
        predictions=_pool_predictions(points))


def pool(points: Sequence[PolicyPoint]) -> list[PolicyPoint]:
    """Every (configuration, link, workload, rate, policy)'s points pooled over their seeds, in
    the order of each one's first point."""
    groups: dict[PooledKey, list[PolicyPoint]] = {}
    for p in points:
        groups.setdefault(point_key(p), []).append(p)
    return [pool_one(sorted(group, key=lambda p: p.seed)) for group in groups.values()]


# -- the tie band against the seeds' spread -------------------------------------------------------

class SeedSpread(msgspec.Struct, frozen=True):
    """PPD at one weight and link over the grid's points: how much its score against the best
    same-deployment policy moves from seed to seed."""

    link: str
    w_tpot: float
    points: int  # grid points with a finite score on every seed
    median_sd: float
    p90_sd: float
    within_sd: float  # share of those points where |pooled score| < that point's sd
    seeds: int
    success_flips: int = 0  # points left out: the success bar decided the score on some seed


def seed_spread(points: Sequence[PolicyPoint], links: Sequence[str],
                weights: Sequence[float]) -> list[SeedSpread]:
    """One row per link and weight (none with fewer than 2 seeds); the grid's points only."""
    grid = [p for p in points if p.workload not in SWEEPS]
    seeds = sorted({p.seed for p in grid})
    if len(seeds) < 2:
        return []
    by_seed: dict[tuple[str, str, str, float], dict[int, list[PolicyPoint]]] = {}
    for p in grid:
        by_seed.setdefault((p.config, p.link, p.workload, p.rate), {}).setdefault(p.seed, []).append(p)
    rows = []
    for link in links:
        for w in weights:
            mine, sds, inside, flips = f"ppd@{w:g}", [], 0, 0
            for (_, point_link, _, _), groups in by_seed.items():
                if point_link != link:
                    continue
                values = [_ppd_score(group, mine, w) for group in groups.values()]
                known = [v for v in values if v is not None]
                if len(known) < 2:
                    continue
                pooled = _ppd_score(pool([p for group in groups.values() for p in group]), mine, w)
                if not all(math.isfinite(v) for v in known) or pooled is None or not math.isfinite(pooled):
                    flips += 1
                    continue
                sd = statistics.stdev(known)
                sds.append(sd)
                inside += abs(pooled) < sd
            if sds:
                rows.append(SeedSpread(link, w, len(sds), float(np.median(sds)),
                                       float(np.percentile(sds, 90)), inside / len(sds), len(seeds), flips))
    return rows


def _ppd_score(group: Sequence[PolicyPoint], mine: str, w_tpot: float) -> float | None:
    """PPD's score against the best same-deployment policy at one point (None: PPD, or any
    other, did not run there)."""
    return next((s.score for s in standings(group, w_tpot, OTHER_DEPLOYMENTS) if s.policy == mine), None)


def spread_lines(rows: Sequence[SeedSpread]) -> list[str]:
    """The report's table (none for one seed)."""
    if not rows:
        return []
    lines = ["## The tie band against the seeds' spread", "",
             "PPD's score against the best same-deployment policy, on each of the "
             f"{rows[0].seeds} seeds alone: its standard deviation across seeds at each grid point, the "
             f"median and P90 over points, beside the tie band {TIE}; and the share of points where the "
             "pooled score's magnitude is under that point's deviation (the seeds cannot tell PPD from the "
             "best there). Points where the 95% success bar decided the score on some seed are left out "
             "and counted.", "",
             "| link | w_tpot | points | median sd | p90 sd | tie band | \\|pooled\\| < sd | left out |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.link} | {r.w_tpot:g} | {r.points} | {r.median_sd:.3f} | {r.p90_sd:.3f} | {TIE} | "
              f"{100 * r.within_sd:.0f}% | {r.success_flips} |" for r in rows]
    return [*lines, ""]
