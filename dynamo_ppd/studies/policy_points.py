"""One policy at one point of `dynamo-ppd sim compare`, the paper's score between two, and the
figures the load sweeps add (`dynamo_ppd.studies.saturation`): P50/P99 turn-2+ TTFT and TPOT with
their bootstrap replicates, and output throughput per GPU.

Kept apart from `policies` (the command) so that the sweep's report (`sweep_report`) reads
points and scores without importing the command that runs them.

Intervals: a sweep point keeps, for each figure, its value in each of ``BOOTSTRAP_RESAMPLES``
cluster-bootstrap resamples of the point's conversations (as `dynamo_ppd.experiment.stats` resamples:
whole conversations, since a conversation's turns share a history and a worker). Resample b
draws its conversations from one seeded generator over the point's conversation ids, so at two
points that ran the same conversations (two policies at one workload, rate and seed) the b-th
resamples hold the same conversations: a ratio's interval comes from the b-th values' ratios, a
paired bootstrap between points simulated in different processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

from ..experiment.stats import LEVEL, Interval
from ..sim.cluster import parse_config
from ..sim.outcome import SUCCESS_BAR, Outcome
from ..sim.run import SimResult

TIE = 0.02  # |score| at or below it is a tie
BOOTSTRAP_RESAMPLES = 200  # per sweep point: the JSON keeps every one, so not stats.RESAMPLES
BOOTSTRAP_SEED = 0  # one seed for every point: what pairs the resamples of two points


class Replicates(msgspec.Struct, frozen=True):
    """A sweep point's figures in each bootstrap resample (seconds; None where a resample holds
    no successful follow-up). Resample b of two points that ran the same conversations drew
    the same ones."""

    turn2_p50_ttft_s: list[float | None]
    turn2_p99_ttft_s: list[float | None]
    turn2_p50_tpot_s: list[float | None]


class Predictions(msgspec.Struct, frozen=True, omit_defaults=True):
    """PPD's own view of a point (`dynamo_ppd.policy.simulate.PredictionLog`): the mean
    predicted decode-local and via-prefill TTFT/TPOT over its follow-up decisions, and the mean
    observed TTFT/TPOT of the follow-ups that finished on each route (seconds; None where none)."""

    decisions: int  # follow-up decisions
    local_ttft_s: float | None = None
    local_tpot_s: float | None = None
    via_ttft_s: float | None = None
    via_tpot_s: float | None = None
    observed_local_ttft_s: float | None = None
    observed_local_tpot_s: float | None = None
    observed_via_ttft_s: float | None = None
    observed_via_tpot_s: float | None = None


class PolicyPoint(msgspec.Struct, frozen=True, omit_defaults=True):
    """One policy at one point and seed: the figures the comparison reads."""

    config: str
    link: str
    workload: str
    rate: float
    policy: str
    success_rate: float
    turn2_ttft_s: float | None  # mean, failed follow-ups at the timeout
    turn2_tpot_s: float | None  # mean over successful follow-ups
    turn2_p99_ttft_s: float | None
    tokens_per_sec: float
    local_share: float  # follow-ups that ran decode-local (aggregated counts as neither)
    # CPU seconds of the simulation (on the first point of those that share it, 0 on the others):
    # what the grid costs whatever else the machine runs.
    sim_cpu_s: float = 0.0
    # The load sweeps' figures (`sweep_figures`), over successful requests; left out on the
    # paper/chat grid's points, where nothing reads them (the report's JSON stays its size).
    turn1_p50_ttft_s: float | None = None
    turn2_p50_ttft_s: float | None = None
    turn2_p50_tpot_s: float | None = None
    turn2_p99_tpot_s: float | None = None
    conversations: int = 0  # conversations sent: the sample count behind the intervals
    replicates: Replicates | None = None
    seed: int = 0  # of arrivals, prompts, tokens and draws (`sim compare --seeds`)
    # What pooling over seeds weighs a point's figures by (`seeds.pool`; 0: not recorded, as in
    # reports before --seeds): requests sent (every turn) and follow-ups sent.
    requests: int = 0
    follow_ups: int = 0
    predictions: Predictions | None = None  # PPD's (ppd@w) only


def score(a: PolicyPoint, b: PolicyPoint, w_tpot: float, w_ttft: float = 1.0) -> float:
    """The paper's score of ``a`` against ``b`` (> 0: a is better); -inf when a misses the
    success bar and b does not, +inf the other way round."""
    a_ok, b_ok = a.success_rate >= SUCCESS_BAR, b.success_rate >= SUCCESS_BAR
    if a_ok != b_ok:
        return math.inf if a_ok else -math.inf
    if not (a.turn2_ttft_s and b.turn2_ttft_s and a.turn2_tpot_s and b.turn2_tpot_s):
        return 0.0  # nothing to compare (no follow-up answered on a side): neither is better
    return (w_ttft * (b.turn2_ttft_s - a.turn2_ttft_s) / b.turn2_ttft_s
            - w_tpot * (a.turn2_tpot_s - b.turn2_tpot_s) / b.turn2_tpot_s)


def outcome_of(value: float) -> str:
    return "win" if value > TIE else "loss" if value < -TIE else "tie"


def gpu_count(config: str) -> int:
    """GPUs of a configuration (1P3D, 4R, 1P2D1R: every worker is one GPU)."""
    return sum(parse_config(config))


def tokens_per_sec_per_gpu(point: PolicyPoint) -> float:
    """Output tokens per second per GPU: the point's successful output over its duration,
    divided by its configuration's GPUs. Every policy of a point runs on the configuration's
    GPUs (replicas and hybrid re-deploy the same count), so the divisor is the configuration's."""
    return point.tokens_per_sec / gpu_count(point.config)


def measured_replicas_against_pd() -> list[tuple[str, int, int, int]]:
    """The paper authors' own H100 measurements (bundled): each P/D configuration against 4R at
    weights 1,1, scored as here ((config, wins, ties, losses) over the points both completed):
    how much of replicas' lead is the hardware's, not the simulator's."""
    from ..paper.measured import bundled_points

    by_key = {(p.config, p.workload, p.qps): p for p in bundled_points()}
    out = []
    for config in ("1P_3pD", "1P_3D", "3P_1pD", "3P_1D"):
        wins = ties = losses = 0
        for (c, workload, qps), replica in by_key.items():
            other = by_key.get((config, workload, qps))
            if c != "4R" or other is None or not (replica.completed and other.completed):
                continue
            a = PolicyPoint("", "", workload, qps, config, other.success_rate, other.turn2.avg_ttft_ms,
                            other.turn2.avg_tpot_ms, None, other.tokens_per_sec, 0.0)
            b = PolicyPoint("", "", workload, qps, "4R", replica.success_rate, replica.turn2.avg_ttft_ms,
                            replica.turn2.avg_tpot_ms, None, replica.tokens_per_sec, 0.0)
            result = outcome_of(score(a, b, 1.0))
            wins, ties = wins + (result == "win"), ties + (result == "tie")
            losses += result == "loss"
        out.append((config, wins, ties, losses))
    return out


# -- the sweeps' figures -------------------------------------------------------------------------

def _percentiles(values: np.ndarray, qs: Sequence[float]) -> list[float | None]:
    if not values.size:
        return [None] * len(qs)
    return [round(float(v), 6) for v in np.percentile(values, qs)]


def _by_conversation(samples: dict[str, list[float]], ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every value, and the index in ``ids`` of its conversation."""
    values = [v for i, cid in enumerate(ids) for v in samples.get(cid, ())]
    index = [i for i, cid in enumerate(ids) for _ in samples.get(cid, ())]
    return np.asarray(values, dtype=float), np.asarray(index, dtype=int)


def sweep_figures(result: SimResult, outcome: Outcome, conversation_ids: Sequence[str],
                  replicates: bool = True, resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, object]:
    """The sweep fields of a `PolicyPoint` from one simulation: P50 TTFT of turn 1, P50/P99
    turn-2+ TTFT and TPOT over successful requests (``outcome``: the result's), the number of
    conversations sent, and (``replicates``) the turn-2+ figures' bootstrap replicates over those
    conversations (``conversation_ids``: every conversation the point sent, so that two points
    that sent the same ones resample alike whatever each answered)."""
    fields: dict[str, object] = {
        "turn1_p50_ttft_s": outcome.turn1.p50_ttft_s, "turn2_p50_ttft_s": outcome.turn2.p50_ttft_s,
        "turn2_p50_tpot_s": outcome.turn2.p50_tpot_s, "turn2_p99_tpot_s": outcome.turn2.p99_tpot_s,
        "conversations": len(conversation_ids)}
    if not replicates:
        return fields
    ok = [r for r in result.records if r.turn > 1 and (result.timeout_s is None
                                                       or r.finished_s - r.arrival_s <= result.timeout_s)]
    ttft: dict[str, list[float]] = {}
    tpot: dict[str, list[float]] = {}
    for r in ok:
        ttft.setdefault(r.conversation_id, []).append(r.ttft_s)
        if r.tpot_s is not None:
            tpot.setdefault(r.conversation_id, []).append(r.tpot_s)
    ids = sorted(conversation_ids)
    ttft_values, ttft_index = _by_conversation(ttft, ids)
    tpot_values, tpot_index = _by_conversation(tpot, ids)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    p50s, p99s, tpots = [], [], []
    for _ in range(resamples if ids else 0):
        counts = np.bincount(rng.integers(0, len(ids), len(ids)), minlength=len(ids))
        p50, p99 = _percentiles(np.repeat(ttft_values, counts[ttft_index]), (50, 99))
        p50s.append(p50)
        p99s.append(p99)
        tpots.append(_percentiles(np.repeat(tpot_values, counts[tpot_index]), (50,))[0])
    return {**fields, "replicates": Replicates(p50s, p99s, tpots)}


FIGURES = {"p50 ttft": ("turn2_p50_ttft_s", "turn2_p50_ttft_s"),
           "p99 ttft": ("turn2_p99_ttft_s", "turn2_p99_ttft_s"),
           "p50 tpot": ("turn2_p50_tpot_s", "turn2_p50_tpot_s")}
"""A figure's name -> (the point's field, the replicates' field)."""


def paired_ratio(a: PolicyPoint, b: PolicyPoint, figure: str) -> Interval | None:
    """``a``'s figure over ``b``'s with its 95% interval from the paired resamples (see the module
    docstring); None when either lacks the figure or its replicates, or the points did not run
    the same number of conversations (then they are not the same conversations)."""
    field, replicate = FIGURES[figure]
    value_a, value_b = getattr(a, field), getattr(b, field)
    if (not value_a or not value_b or a.replicates is None or b.replicates is None
            or a.conversations != b.conversations):
        return None
    ratios = [x / y for x, y in zip(getattr(a.replicates, replicate), getattr(b.replicates, replicate),
                                    strict=True) if x is not None and y]
    if not ratios:
        return None
    low, high = np.percentile(ratios, [(1 - LEVEL) / 2 * 100, (1 + LEVEL) / 2 * 100])
    return Interval(value_a / value_b, float(low), float(high), a.conversations)
