"""Scoring a point's policies against each other (`sim compare`'s tables): each policy against the
best other (`standings`), wins/ties/losses over points (`summarize_standings`), and PPD at a
weight against each other policy alone (`head_to_head`). Kept apart from `policies` (the command)
so that the reports built on them (`seeds`, `families`) read points without importing it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from .policy_points import TIE, PolicyPoint, outcome_of, score

# Policies that run the configuration's GPUs as another deployment (aggregated workers), not as
# its P and D workers: the report also ranks PPD without them, among the policies a router of
# that P/D deployment could choose from.
OTHER_DEPLOYMENTS = ("replicas", "hybrid")


class Standing(msgspec.Struct, frozen=True):
    """A policy at one point against the best of the others."""

    policy: str
    score: float  # min over the others of score(policy, other)
    best_other: str


def standings(points: Sequence[PolicyPoint], w_tpot: float, leave_out: Sequence[str] = ()) -> list[Standing]:
    """Each policy's score against the best other policy at one point (ppd@w for other weights
    left out: a weight is one operator's choice, not a competitor; so are ``leave_out``)."""
    chosen = [p for p in points if (not p.policy.startswith("ppd@") or p.policy == f"ppd@{w_tpot:g}")
              and p.policy not in leave_out]
    out = []
    for a in chosen:
        others = [(score(a, b, w_tpot), b.policy) for b in chosen if b is not a]
        if others:
            value, name = min(others)
            out.append(Standing(a.policy, value, name))
    return out


class PolicySummary(msgspec.Struct, frozen=True):
    policy: str
    points: int
    wins: int
    ties: int
    losses: int
    at_least_minus_tie: float  # share of points with score >= -0.02
    above_tie: float  # share of points with score > +0.02
    beaten_most_by: str | None


class HeadToHead(msgspec.Struct, frozen=True):
    """PPD at one weight against one other policy over the points both ran."""

    policy: str
    points: int
    at_least_minus_tie: float  # share of points where PPD's score against it is >= -0.02
    above_tie: float  # ... > +0.02
    median_score: float


def summarize_standings(groups: Iterable[Sequence[PolicyPoint]], w_tpot: float,
                        leave_out: Sequence[str] = ()) -> list[PolicySummary]:
    by_policy: dict[str, list[Standing]] = {}
    for group in groups:
        for standing in standings(group, w_tpot, leave_out):
            by_policy.setdefault(standing.policy, []).append(standing)
    summaries = []
    for policy, items in by_policy.items():
        results = [outcome_of(s.score) for s in items]
        losers = [s.best_other for s in items if s.score < -TIE]
        summaries.append(PolicySummary(
            policy, len(items), results.count("win"), results.count("tie"), results.count("loss"),
            sum(s.score >= -TIE for s in items) / len(items), sum(s.score > TIE for s in items) / len(items),
            # A tie goes to the first name: a set's order changes with the process's hash seed.
            max(sorted(set(losers)), key=losers.count) if losers else None))
    return sorted(summaries, key=lambda s: (-s.at_least_minus_tie, s.policy))


def group_points(points: Sequence[PolicyPoint], link: str) -> list[list[PolicyPoint]]:
    groups: dict[tuple[str, str, float], list[PolicyPoint]] = {}
    for p in points:
        if p.link == link:
            groups.setdefault((p.config, p.workload, p.rate), []).append(p)
    return list(groups.values())


def head_to_head(groups: Iterable[Sequence[PolicyPoint]], w_tpot: float) -> list[HeadToHead]:
    """PPD at ``w_tpot`` against each other policy alone: where a peer wins, and by how much."""
    mine = f"ppd@{w_tpot:g}"
    scores: dict[str, list[float]] = {}
    for group in groups:
        ppd = next((p for p in group if p.policy == mine), None)
        if ppd is None:
            continue
        for other in group:
            if not other.policy.startswith("ppd@"):
                scores.setdefault(other.policy, []).append(score(ppd, other, w_tpot))
    out = []
    for policy, values in scores.items():
        values.sort()
        out.append(HeadToHead(policy, len(values), sum(v >= -TIE for v in values) / len(values),
                              sum(v > TIE for v in values) / len(values), values[len(values) // 2]))
    return sorted(out, key=lambda h: (h.at_least_minus_tie, h.policy))
