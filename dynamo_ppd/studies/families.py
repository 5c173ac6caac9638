"""`sim compare`'s check of PPD per workload family, its "Done-when check", and its worst points.

Families: the paper grid (the paper's 18 workloads), chat (wildchat, sharegpt), and each load
sweep (long-context, many-turn, agent-32k). PPD at each weight is scored on pooled points
(`seeds.pool`) against the P/D deployment's other policies (same GPUs, same P and D workers:
`standings.OTHER_DEPLOYMENTS` left out, other weights of PPD too):

- the share of points where it is within the tie band of the best of them (score >= -0.02
  against the one it scores lowest against);
- the share where it is >= -0.02 against ``x1`` alone and against ``dynamo-isl-bounding`` alone.

A sweep's points are scored only at rungs where neither side saturated on any seed (as
`sweep_report` scores them: a saturated rung's follow-up latencies say nothing of a queue that
grows for the whole window), and its lanes by their sustained rate: PPD's, the highest rate
every seed sustained, against each same-GPU policy's.

Targets (`TARGETS`): on the paper grid, >= 95% within the band of the best same-GPU policy and
>= 98% against x1 and against dynamo-isl-bounding alone, at every weight and link; on the
sweeps, >= -0.02 against x1 and against dynamo-isl-bounding at every rung where neither
saturated.

Worst points (`worst_points`): PPD's lowest pooled scores on the grid against the best
same-GPU policy, with both sides' figures and what PPD predicted there (`Predictions`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..workloads.generators import PAPER_WORKLOADS
from .policy_points import TIE, PolicyPoint, Predictions, score
from .saturation import SWEEPS, Lane, lane_of, saturation_rates
from .seeds import pool, pool_one
from .standings import OTHER_DEPLOYMENTS

CHAT_WORKLOADS = ("wildchat", "sharegpt")
PAPER_GRID = "paper grid"
FAMILIES: dict[str, tuple[str, ...]] = {PAPER_GRID: tuple(PAPER_WORKLOADS), "chat": CHAT_WORKLOADS,
                                        **{name: (name,) for name in SWEEPS}}
X1, ISL_BOUNDING = "x1", "dynamo-isl-bounding"
# The done-when targets: (figure, share of points) on the paper grid; every rung on the sweeps.
TARGETS = {"best": 0.95, X1: 0.98, ISL_BOUNDING: 0.98}
WORST = 10  # worst points listed per weight


class Share(msgspec.Struct, frozen=True):
    """Points where PPD's score was >= -0.02 (``ok``) of those scored (``of``), and its lowest."""

    ok: int = 0
    of: int = 0
    worst: float | None = None

    @property
    def value(self) -> float | None:
        return self.ok / self.of if self.of else None

    def add(self, value: float) -> Share:
        return Share(self.ok + (value >= -TIE), self.of + 1,
                     value if self.worst is None else min(self.worst, value))

    def text(self) -> str:
        if not self.of:
            return "-"
        worst = "" if self.worst is None or self.worst >= -TIE else f", worst {_score(self.worst)}"
        return f"{100 * self.ok / self.of:.0f}% ({self.ok}/{self.of}{worst})"


class FamilyRow(msgspec.Struct, frozen=True, omit_defaults=True):
    """PPD at one weight on one link over one family's points."""

    family: str
    link: str
    w_tpot: float
    best: Share  # within the tie band of the best same-GPU policy
    x1: Share  # >= -0.02 against x1 alone
    isl_bounding: Share  # >= -0.02 against dynamo-isl-bounding alone
    # Sweeps: the (configuration, workload) lanes, and those where PPD's sustained rate is below a
    # same-GPU policy's ("2P2D: 8 < 16 x1").
    lanes: int = 0
    behind: list[str] = []


class DoneWhen(msgspec.Struct, frozen=True):
    part: str  # "paper grid" or "sweeps: <workload>"
    link: str
    w_tpot: float
    figure: str
    value: str
    target: str
    met: bool | None  # None: nothing scored


def _score(value: float) -> str:
    return "fail" if value == float("-inf") else "+inf" if value == float("inf") else f"{value:+.3f}"


def _same_gpu(points: Sequence[PolicyPoint]) -> list[PolicyPoint]:
    return [p for p in points if not p.policy.startswith("ppd@") and p.policy not in OTHER_DEPLOYMENTS]


def _grid_row(family: str, link: str, w: float, groups: Sequence[Sequence[PolicyPoint]]) -> FamilyRow:
    mine = f"ppd@{w:g}"
    best, x1, isl = Share(), Share(), Share()
    for group in groups:
        ppd = next((p for p in group if p.policy == mine), None)
        others = _same_gpu(group)
        if ppd is None or not others:
            continue
        best = best.add(min(score(ppd, o, w) for o in others))
        for other in others:
            if other.policy == X1:
                x1 = x1.add(score(ppd, other, w))
            elif other.policy == ISL_BOUNDING:
                isl = isl.add(score(ppd, other, w))
    return FamilyRow(family, link, w, best, x1, isl)


def _sweep_row(family: str, link: str, w: float, points: Sequence[PolicyPoint]) -> FamilyRow:
    """``points``: every seed's points of one sweep on one link."""
    mine = f"ppd@{w:g}"
    sat = saturation_rates(points)
    seeds = sorted({p.seed for p in points})
    at = {(p.config, p.rate, p.policy, p.seed): p for p in points}

    def kept(config: str, rate: float, policy: str) -> list[PolicyPoint] | None:
        """The policy's points at the rung on every seed, if none was at or past its saturation."""
        out = []
        for seed in seeds:
            p = at.get((config, rate, policy, seed))
            s = None if p is None else sat.get(lane_of(p))
            if p is None or s is None or (s.saturated_at is not None and p.rate >= s.saturated_at):
                return None
            out.append(p)
        return out

    best, x1, isl = Share(), Share(), Share()
    configs = sorted({p.config for p in points if p.policy == mine})
    behind = []
    for config in configs:
        policies = sorted({p.policy for p in _same_gpu(points) if p.config == config})
        for rate in sorted({p.rate for p in points if p.config == config}):
            ppd_points = kept(config, rate, mine)
            if ppd_points is None:
                continue
            ppd = pool_one(ppd_points)
            scored = {}
            for policy in policies:
                other = kept(config, rate, policy)
                if other is not None:
                    scored[policy] = score(ppd, pool_one(other), w)
            if scored:
                best = best.add(min(scored.values()))
            if X1 in scored:
                x1 = x1.add(scored[X1])
            if ISL_BOUNDING in scored:
                isl = isl.add(scored[ISL_BOUNDING])

        def sustained(policy: str, config: str = config) -> float | None:
            """The highest rate every seed sustained (0: one saturated at the lightest rung)."""
            rates = [sat.get(Lane(config, link, family, policy, seed)) for seed in seeds]
            if any(s is None for s in rates):
                return None
            return min(s.sustained or 0.0 for s in rates if s is not None)

        own = sustained(mine)
        theirs = {policy: sustained(policy) for policy in policies}
        beaten = [(r, p) for p, r in theirs.items() if own is not None and r is not None and r > own]
        if beaten:
            top, policy = max(beaten)
            behind.append(f"{config}: {own:g} < {top:g} {policy}")
    return FamilyRow(family, link, w, best, x1, isl, len(configs), behind)


def family_rows(points: Sequence[PolicyPoint], links: Sequence[str],
                weights: Sequence[float]) -> list[FamilyRow]:
    """Per link and weight, one row per family that ran: the grid's over ``links`` and
    ``weights``; the sweeps' over the links and PPD weights they ran. ``points``: every seed's."""
    grid = pool([p for p in points if p.workload not in SWEEPS])
    rows = []
    for link in links:
        for w in weights:
            for family, workloads in FAMILIES.items():
                if family in SWEEPS:
                    continue
                groups: dict[tuple[str, str, float], list[PolicyPoint]] = {}
                for p in grid:
                    if p.link == link and p.workload in workloads:
                        groups.setdefault((p.config, p.workload, p.rate), []).append(p)
                if groups:
                    rows.append(_grid_row(family, link, w, list(groups.values())))
    swept = [p for p in points if p.workload in SWEEPS]
    sweep_weights = sorted({float(p.policy[4:]) for p in swept if p.policy.startswith("ppd@")})
    for link in sorted({p.link for p in swept}):
        for w in sweep_weights:
            for family in SWEEPS:
                mine = [p for p in swept if p.workload == family and p.link == link]
                if any(p.policy == f"ppd@{w:g}" for p in mine):
                    rows.append(_sweep_row(family, link, w, mine))
    return rows


def done_when(rows: Sequence[FamilyRow]) -> list[DoneWhen]:
    """The targets (module docstring) against the family rows: the paper grid's three shares at
    each weight and link, each sweep's two at each."""
    out = []
    for row in rows:
        if row.family == PAPER_GRID:
            for figure, share, target in (
                    ("within 0.02 of the best same-GPU policy", row.best, TARGETS["best"]),
                    (f">= -0.02 against {X1} alone", row.x1, TARGETS[X1]),
                    (f">= -0.02 against {ISL_BOUNDING} alone", row.isl_bounding, TARGETS[ISL_BOUNDING])):
                value = share.value
                out.append(DoneWhen(PAPER_GRID, row.link, row.w_tpot, figure, share.text(),
                                    f">= {100 * target:.0f}%", None if value is None else value >= target))
        elif row.family in SWEEPS:
            for name, share in ((X1, row.x1), (ISL_BOUNDING, row.isl_bounding)):
                out.append(DoneWhen(f"sweeps: {row.family}", row.link, row.w_tpot,
                                    f">= -0.02 against {name} at rungs neither saturated", share.text(),
                                    "every rung", None if not share.of else share.ok == share.of))
    return out


# -- worst points ---------------------------------------------------------------------------------

class WorstPoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """One of PPD's lowest pooled scores against the best same-GPU policy on the grid."""

    config: str
    link: str
    workload: str
    rate: float
    score: float
    best_other: str
    ppd_local_share: float
    other_local_share: float
    ppd_ttft_s: float | None
    ppd_tpot_s: float | None
    other_ttft_s: float | None
    other_tpot_s: float | None
    ppd_success: float
    other_success: float
    predictions: Predictions | None = None


def worst_points(points: Sequence[PolicyPoint], weights: Sequence[float], count: int = WORST
                 ) -> dict[str, list[WorstPoint]]:
    """PPD's ``count`` worst grid points at each weight (by "w_tpot <w>"), over every link.
    ``points``: every seed's (pooled here)."""
    groups: dict[tuple[str, str, str, float], list[PolicyPoint]] = {}
    for p in pool([p for p in points if p.workload not in SWEEPS]):
        groups.setdefault((p.config, p.link, p.workload, p.rate), []).append(p)
    out = {}
    for w in weights:
        mine, found = f"ppd@{w:g}", []
        for group in groups.values():
            ppd = next((p for p in group if p.policy == mine), None)
            others = _same_gpu(group)
            if ppd is None or not others:
                continue
            value, other = min(((score(ppd, o, w), o) for o in others), key=lambda v: (v[0], v[1].policy))
            found.append(WorstPoint(ppd.config, ppd.link, ppd.workload, ppd.rate, value, other.policy,
                                    ppd.local_share, other.local_share, ppd.turn2_ttft_s, ppd.turn2_tpot_s,
                                    other.turn2_ttft_s, other.turn2_tpot_s, ppd.success_rate,
                                    other.success_rate, ppd.predictions))
        found.sort(key=lambda p: (p.score, p.config, p.link, p.workload, p.rate))
        if found:
            out[f"w_tpot {w:g}"] = found[:count]
    return out


# -- markdown -------------------------------------------------------------------------------------

def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def done_when_lines(rows: Sequence[DoneWhen], seeds: Sequence[int]) -> list[str]:
    if not rows:
        return []
    pooled = f"pooled over seeds {list(seeds)}" if len(seeds) > 1 else f"one seed ({seeds[0]})"
    lines = ["## Done-when check", "",
             "PPD against the policies of the same P/D deployment (same GPUs; "
             f"{', '.join(OTHER_DEPLOYMENTS)} left out), {pooled}. Paper grid: the paper's "
             f"{len(PAPER_WORKLOADS)} workloads. Sweeps: only "
             "rungs where neither PPD nor the other policy saturated on any seed. Value: share of points "
             "(met / scored, the lowest score where it is under -0.02).", "",
             "| part | link | w_tpot | figure | value | target | met |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "not run" if r.met is None else "met" if r.met else "**missed**"
        lines.append(f"| {r.part} | {r.link} | {r.w_tpot:g} | {r.figure} | {r.value} | {r.target} | {met} |")
    return [*lines, ""]


def family_lines(rows: Sequence[FamilyRow]) -> list[str]:
    if not rows:
        return []
    lines = ["## PPD per workload family", "",
             "PPD's share of points within 0.02 of the best same-GPU policy, and >= -0.02 against x1 and "
             "against dynamo-isl-bounding alone (met / scored, the lowest score where under -0.02); sweeps "
             "at rungs where neither side saturated. Sustained: (configuration) lanes where PPD's sustained "
             "rate (the highest every seed sustained) is below a same-GPU policy's.", "",
             "| family | link | w_tpot | within 0.02 of best | vs x1 | vs dynamo-isl-bounding | sustained |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        sustained = "-" if not r.lanes else (
            f"{r.lanes - len(r.behind)}/{r.lanes} at least every other"
            + (f" (behind: {'; '.join(r.behind)})" if r.behind else ""))
        lines.append(f"| {r.family} | {r.link} | {r.w_tpot:g} | {r.best.text()} | {r.x1.text()} | "
                     f"{r.isl_bounding.text()} | {sustained} |")
    return [*lines, ""]


def worst_lines(worst: dict[str, list[WorstPoint]]) -> list[str]:
    if not worst:
        return []
    lines = ["## PPD's worst points, and why", "",
             "PPD's lowest pooled scores on the grid against the best same-GPU policy. Local: share of "
             "follow-ups run decode-local. TTFT, TPOT: turn-2+ means (ms), PPD / the other. Predicted: PPD's "
             "mean predictions over its follow-up decisions, decode-local and via prefill (TTFT / TPOT, ms); "
             "observed: the mean of its follow-ups that finished on each route.", ""]
    for key, points in worst.items():
        lines += [f"PPD at {key}:", "",
                  "| config | link | workload | conv/s | score | best other | local | TTFT | TPOT "
                  "| predicted local | predicted via P | observed local | observed via P |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            pr = p.predictions
            pairs = ["-" if pr is None else f"{_ms(getattr(pr, a))} / {_ms(getattr(pr, b))}"
                     for a, b in (("local_ttft_s", "local_tpot_s"), ("via_ttft_s", "via_tpot_s"),
                                  ("observed_local_ttft_s", "observed_local_tpot_s"),
                                  ("observed_via_ttft_s", "observed_via_tpot_s"))]
            shown = _score(p.score) if abs(p.score) != float("inf") else (
                f"{_score(p.score)} (success {p.ppd_success:.0f}% / {p.other_success:.0f}%)")
            local = f"{100 * p.ppd_local_share:.0f}% / {100 * p.other_local_share:.0f}%"
            lines.append(f"| {p.config} | {p.link} | {p.workload} | {p.rate:g} | {shown} | "
                         f"{p.best_other} | {local} | "
                         f"{_ms(p.ppd_ttft_s)} / {_ms(p.other_ttft_s)} | {_ms(p.ppd_tpot_s)} / "
                         f"{_ms(p.other_tpot_s)} | " + " | ".join(pairs) + " |")
        lines.append("")
    return lines
