"""One definition of a run's outcome: which requests succeeded, and the TTFT/TPOT/success figures
every table, evaluation, reproduction, simulator run and live benchmark reports.

Both the simulator's `RequestRecord`s and the live client's `RequestResult`s are turned into
`TurnResult`s (one per request SENT, finished or not) and summarized by `summarize`. The
definitions are the PPD paper authors' benchmark protocol (``freelulul/vllm-ppd``,
``ppd/scripts/benchmark/comprehensive_benchmark.py`` at ``baaceea6``; ``../shared/paper-data``'s
README), the reference our numbers are checked against:

- A request SUCCEEDS iff it finished its whole answer within ``timeout_s`` of being sent and had
  no error (their aiohttp ``ClientTimeout(total=120)`` covers the whole stream). One still
  running when the run was cut, one that finished late, and one that errored FAILED.
  ``success_rate`` is the percent of all requests sent, every turn counted.
- A conversation whose turn failed sends no further turn (their ``run_conversation``); the
  senders (`dynamo_ppd.sim.run`, `dynamo_ppd.bench.client`) do that, not this module.
- Latency figures per turn group (turn 1; turns 2+ together as ``turn2``; all turns) are over
  successful requests only. A request's TPOT is ``(e2e - TTFT) / (output_tokens - 1)``, and
  requests with fewer than 2 tokens have none. Percentiles are numpy's (linear), as theirs.
- ``duration_s`` runs from the run's start (0: arrivals are times from it; their clock starts
  before the first arrival) to when the last request finished or was given up (sent +
  ``timeout_s``, or the cut); ``tokens_per_sec`` is the successful requests' output over it.

For scoring a route (the PPD table's cells, ``table evaluate``, peer comparisons) the figure is
``turn2_ttft_mean_with_timeouts_s``: the mean TTFT over follow-ups SENT, each failed one counted
at ``timeout_s`` (a failure must not vanish from the mean, nor be cheaper than the deadline), with
``tpot_mean_s`` over successful requests of every turn.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec
import numpy as np

# The paper's protocol (`REQUEST_TIMEOUT_SEC = 120` in the authors' comprehensive benchmark), per
# request; an aiohttp total, so it includes the wait for a connection of the pool.
PAPER_TIMEOUT_S = 120.0
# The chat workloads (WildChat-/ShareGPT-like), the PPD tables' cells and the live benchmark
# client: a request not answered within 30 s fails (the paper's text for its chat experiments).
CHAT_TIMEOUT_S = 30.0
# The chaos runs (`dynamo-ppd chaos`): a fault may stall a turn (a restart, a re-home) that is
# still answered; one not answered within 60 s fails.
CHAOS_TIMEOUT_S = 60.0

SUCCESS_BAR = 95.0  # percent of requests: the paper's bar for a point that "did not fail"

TIMEOUT_LABEL = "timeout"  # a request that finished late, or was still running at the cut
UNFINISHED_LABEL = "unfinished"  # still running at the cut of a run with no timeout


class TurnResult(msgspec.Struct, frozen=True):
    """One request that was sent, as any sender saw it. Times are seconds; ``arrival_s`` is
    when it was sent, from the run's start."""

    conversation_id: str
    turn: int  # 1-based
    arrival_s: float
    ttft_s: float | None  # None: no first token (error, or none yet at the cut)
    e2e_s: float | None  # None: the answer never completed (error, or still running at the cut)
    output_tokens: int
    error: str | None = None  # what went wrong, as the sender names it (not for a timeout)


def succeeded(turn: TurnResult, timeout_s: float | None) -> bool:
    """Finished within ``timeout_s`` of being sent (any time, for None) and no error."""
    return (turn.error is None and turn.e2e_s is not None and turn.ttft_s is not None
            and (timeout_s is None or turn.e2e_s <= timeout_s))


def tpot_s(turn: TurnResult) -> float | None:
    """(e2e - TTFT) / (tokens - 1); None below 2 tokens or for an unfinished request."""
    if turn.ttft_s is None or turn.e2e_s is None or turn.output_tokens < 2:
        return None
    return (turn.e2e_s - turn.ttft_s) / (turn.output_tokens - 1)


def failure_label(turn: TurnResult, timeout_s: float | None) -> str:
    """Why a failed request failed: the sender's error, else a timeout (or unfinished)."""
    if turn.error is not None:
        return turn.error
    return TIMEOUT_LABEL if timeout_s is not None else UNFINISHED_LABEL


def ended_s(turn: TurnResult, timeout_s: float | None, cut_s: float | None) -> float:
    """When the sender was done with a request: it finished, or gave up at sent + timeout, or
    the run was cut. An errored request without a time ends when it was sent."""
    limit = turn.arrival_s + timeout_s if timeout_s is not None else float("inf")
    if turn.e2e_s is not None:
        return min(turn.arrival_s + turn.e2e_s, limit)
    if turn.error is not None:
        return turn.arrival_s + (turn.ttft_s or 0.0)
    cut = cut_s if cut_s is not None else float("inf")
    end = min(limit, cut)
    return end if end != float("inf") else turn.arrival_s


class TurnGroup(msgspec.Struct, frozen=True):
    """Figures of one group of turns: counts of requests sent and successful, and latencies over
    the successful ones (None where none succeeded; TPOT also None without a 2-token answer)."""

    sent: int
    count: int  # successful requests (the paper's ``turnN_count``)
    avg_ttft_s: float | None
    p50_ttft_s: float | None
    p99_ttft_s: float | None
    avg_tpot_s: float | None
    p50_tpot_s: float | None
    p99_tpot_s: float | None
    avg_e2e_s: float | None


def _stats(values: list[float]) -> tuple[float | None, float | None, float | None]:
    if not values:
        return None, None, None
    p50, p99 = (float(v) for v in np.percentile(values, [50, 99]))
    return float(np.mean(values)), p50, p99


def _group(turns: list[TurnResult], timeout_s: float | None) -> TurnGroup:
    ok = [t for t in turns if succeeded(t, timeout_s)]
    ttft = _stats([t.ttft_s for t in ok if t.ttft_s is not None])
    tpot = _stats([v for v in (tpot_s(t) for t in ok) if v is not None])
    e2e = [t.e2e_s for t in ok if t.e2e_s is not None]
    return TurnGroup(sent=len(turns), count=len(ok), avg_ttft_s=ttft[0], p50_ttft_s=ttft[1],
                     p99_ttft_s=ttft[2], avg_tpot_s=tpot[0], p50_tpot_s=tpot[1], p99_tpot_s=tpot[2],
                     avg_e2e_s=float(np.mean(e2e)) if e2e else None)


class Outcome(msgspec.Struct, frozen=True):
    """A run's outcome under one timeout (see the module's docstring for every definition)."""

    timeout_s: float | None  # None: no deadline (a request fails only by error or the cut)
    total_requests: int  # sent, every turn
    failed: int
    success_rate: float  # percent of total_requests (0 for a run that sent nothing, as theirs)
    error: str | None  # the most common failure label (the paper's ``error`` column)
    errors: dict[str, int]  # failures by label
    duration_s: float
    output_tokens: int  # of successful requests
    tokens_per_sec: float
    turn1: TurnGroup
    turn2: TurnGroup  # turns 2 and later
    all_turns: TurnGroup
    # For scoring: mean follow-up TTFT over follow-ups sent, a failed one counted at timeout_s.
    # None when no follow-up was sent, or when one failed and there is no timeout to count it at.
    turn2_ttft_mean_with_timeouts_s: float | None

    @property
    def tpot_mean_s(self) -> float | None:
        """Mean TPOT over successful requests of every turn (the scoring TPOT)."""
        return self.all_turns.avg_tpot_s

    @property
    def success_share(self) -> float:
        """success_rate as a fraction in [0, 1]."""
        return self.success_rate / 100


def summarize(turns: Iterable[TurnResult], timeout_s: float | None, cut_s: float | None = None) -> Outcome:
    """The outcome of the requests sent in a run. ``timeout_s``: the deadline a request must
    finish within (None: none); ``cut_s``: when the run was stopped, if requests were still
    running then (the end of their part of the duration when it comes before their deadline)."""
    sent = sorted(turns, key=lambda t: (t.arrival_s, t.conversation_id, t.turn))
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s}")
    ok = [t for t in sent if succeeded(t, timeout_s)]
    labels = Counter(failure_label(t, timeout_s) for t in sent if not succeeded(t, timeout_s))
    duration = max((ended_s(t, timeout_s, cut_s) for t in sent), default=0.0)
    output = sum(t.output_tokens for t in ok)
    follow_ups = [t for t in sent if t.turn > 1]
    with_timeouts: float | None = None
    if follow_ups:
        ttfts = [t.ttft_s if succeeded(t, timeout_s) else timeout_s for t in follow_ups]
        if all(v is not None for v in ttfts):
            with_timeouts = float(np.mean([v for v in ttfts if v is not None]))
    return Outcome(
        timeout_s=timeout_s, total_requests=len(sent), failed=len(sent) - len(ok),
        success_rate=100.0 * len(ok) / len(sent) if sent else 0.0,
        error=min(labels, key=lambda label: (-labels[label], label)) if labels else None,
        errors=dict(sorted(labels.items())), duration_s=duration, output_tokens=output,
        tokens_per_sec=output / duration if duration > 0 else 0.0,
        turn1=_group([t for t in sent if t.turn == 1], timeout_s), turn2=_group(follow_ups, timeout_s),
        all_turns=_group(sent, timeout_s), turn2_ttft_mean_with_timeouts_s=with_timeouts)


# The columns of ../shared/paper-data/comprehensive.csv after config, workload and qps.
PAPER_COLUMNS = ("success_rate", "total_requests", "failed", "duration_s", "error",
                 *(f"{turn}_{name}" for turn in ("turn1", "turn2")
                   for name in ("count", "avg_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "avg_tpot_ms",
                                "p50_tpot_ms", "p99_tpot_ms", "avg_e2e_ms")),
                 "tokens_per_sec")


def paper_columns(outcome: Outcome) -> dict[str, float | int | str]:
    """The outcome as a row of the paper's comprehensive.csv (milliseconds; 0 where no request
    of a turn succeeded, and an empty error, as the authors write them)."""
    row: dict[str, float | int | str] = {
        "success_rate": outcome.success_rate, "total_requests": outcome.total_requests,
        "failed": outcome.failed, "duration_s": outcome.duration_s, "error": outcome.error or ""}
    for name, group in (("turn1", outcome.turn1), ("turn2", outcome.turn2)):
        row[f"{name}_count"] = group.count
        for field in ("avg_ttft", "p50_ttft", "p99_ttft", "avg_tpot", "p50_tpot", "p99_tpot", "avg_e2e"):
            value = getattr(group, f"{field}_s")
            row[f"{name}_{field}_ms"] = value * 1e3 if value is not None else 0.0
    row["tokens_per_sec"] = outcome.tokens_per_sec
    assert tuple(row) == PAPER_COLUMNS
    return row
