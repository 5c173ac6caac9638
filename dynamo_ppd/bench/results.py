"""Benchmark results: one schema for `results.json`, the side-by-side markdown table, the plots.

A point is one (system, workload, QPS) run, summarized by the one outcome summary of the
simulator and the tables (`dynamo_ppd.sim.outcome`): success = finished within the timeout
without error, over every request sent; latencies per turn 1 / turns 2+ over successful
requests (the paper's distinction: only follow-ups can be decode-local); TPOT = (e2e - TTFT) /
(tokens - 1); throughput = output tokens of successful requests over the run's duration.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec

from ..sim.outcome import CHAT_TIMEOUT_S, Outcome, TurnResult
from ..sim.outcome import summarize as summarize_outcome
from .client import RequestResult

# 2: a point carries the Outcome (`dynamo_ppd.sim.outcome`) instead of its own TTFT/TPOT stats.
RESULTS_VERSION = 2


class ResultsError(ValueError):
    """A results file this version cannot read (one line, names the file)."""


class Stats(msgspec.Struct, frozen=True):
    p50: float
    p90: float
    p99: float
    mean: float
    count: int


def stats(values: list[float]) -> Stats:
    if not values:
        return Stats(0.0, 0.0, 0.0, 0.0, 0)
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p * (len(ordered) - 1))))]

    return Stats(q(0.5), q(0.9), q(0.99), statistics.fmean(values), len(values))


class Point(msgspec.Struct, frozen=True):
    system: str
    workload: str
    qps: float  # conversation arrival rate asked for
    outcome: Outcome
    achieved_rps: float  # requests per second actually sent
    client_lag_ms: Stats  # how late the client sent requests against the schedule


class BenchResults(msgspec.Struct):
    version: int
    config: str
    points: list[Point]


def turn_result(result: RequestResult) -> TurnResult:
    """A live request as the outcome summary takes it. The client's own timeouts (httpx's, when
    no byte came for the timeout) are timeouts, not errors: the request did not finish in time."""
    timed_out = result.error is not None and "Timeout" in result.error.split(":", 1)[0]
    return TurnResult(result.conversation_id, result.turn, result.sent_s,
                      None if timed_out else result.ttft_s, None if timed_out else result.e2e_s,
                      result.output_tokens, None if timed_out else result.error)


def summarize(system: str, workload: str, qps: float, results: list[RequestResult],
              duration_s: float, timeout_s: float = CHAT_TIMEOUT_S) -> Point:
    """A point from every request the client sent; ``duration_s`` (the schedule's span or the
    run's wall time) is only the floor of the span the request rate is taken over."""
    outcome = summarize_outcome([turn_result(r) for r in results], timeout_s)
    span = max(duration_s, outcome.duration_s)
    return Point(system=system, workload=workload, qps=qps, outcome=outcome,
                 achieved_rps=len(results) / span if span else 0.0,
                 client_lag_ms=stats([r.lag_s * 1e3 for r in results]))


def save(results: BenchResults, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(results)) + b"\n")


class _Version(msgspec.Struct):
    version: int


def load(path: Path) -> BenchResults:
    """Read a results.json; ResultsError for another version or a malformed file."""
    data = path.read_bytes()
    try:
        version = msgspec.json.decode(data, type=_Version).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResultsError(f"{path}: not a benchmark results file ({exc})") from None
    if version != RESULTS_VERSION:
        raise ResultsError(f"{path}: results version {version}, this dynamo-ppd reads version "
                           f"{RESULTS_VERSION} (points carry the one outcome summary since 2); rerun "
                           "the benchmark to get it")
    try:
        return msgspec.json.decode(data, type=BenchResults)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResultsError(f"{path}: {exc}") from None


def _ms(value: float | None) -> float:
    """Milliseconds; 0 where no request succeeded (as the paper's columns)."""
    return value * 1e3 if value is not None else 0.0


def markdown(results: BenchResults, baseline: str = "pd") -> str:
    """One row per point; ratios to the baseline system at the same workload and QPS."""
    base = {(p.workload, p.qps): p for p in results.points if p.system == baseline}
    lines = [f"| system | workload | QPS | turn-1 TTFT p50 | turn-2+ TTFT p50 (vs {baseline}) | "
             f"TPOT p50 (vs {baseline}) | P99 TTFT 2+ | throughput tok/s | success | req/s | "
             "client lag p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(value: float, ref: float | None) -> str:
        return f" ({value / ref:.2f}x)" if ref else ""

    for p in sorted(results.points, key=lambda p: (p.workload, p.qps, p.system)):
        b = base.get((p.workload, p.qps))
        o = p.outcome
        ttft2, tpot = _ms(o.turn2.p50_ttft_s), _ms(o.all_turns.p50_tpot_s)
        ttft_ratio = ratio(ttft2, _ms(b.outcome.turn2.p50_ttft_s) if b else None)
        tpot_ratio = ratio(tpot, _ms(b.outcome.all_turns.p50_tpot_s) if b else None)
        lines.append(
            f"| {p.system} | {p.workload} | {p.qps:g} | {_ms(o.turn1.p50_ttft_s):.1f} ms | "
            f"{ttft2:.1f} ms{ttft_ratio} | {tpot:.2f} ms{tpot_ratio} | "
            f"{_ms(o.turn2.p99_ttft_s):.1f} ms | {o.tokens_per_sec:.0f} | {o.success_rate:.0f}% | "
            f"{p.achieved_rps:.2f} | {p.client_lag_ms.p99:.1f} ms |")
    return "\n".join(lines)


def plot(results: BenchResults, out_dir: Path) -> list[Path]:
    """PNGs: P99 turn-2+ TTFT vs throughput (paper Fig. 1/9) and latency vs QPS per system
    (Fig. 4/11), one figure per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload in sorted({p.workload for p in results.points}):
        points = [p for p in results.points if p.workload == workload]
        systems = sorted({p.system for p in points})
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for system in systems:
            mine = sorted((p for p in points if p.system == system), key=lambda p: p.qps)
            axes[0].plot([p.outcome.tokens_per_sec for p in mine],
                         [_ms(p.outcome.turn2.p99_ttft_s) for p in mine], "o-", label=system)
            axes[1].plot([p.qps for p in mine], [_ms(p.outcome.turn2.p50_ttft_s) for p in mine], "o-",
                         label=system)
            axes[2].plot([p.qps for p in mine], [_ms(p.outcome.all_turns.p50_tpot_s) for p in mine], "o-",
                         label=system)
        titles = [("throughput (output tok/s)", "turn-2+ TTFT p99 (ms)", "P99 TTFT vs throughput"),
                  ("conversations/s", "turn-2+ TTFT p50 (ms)", "TTFT vs load"),
                  ("conversations/s", "TPOT p50 (ms)", "TPOT vs load")]
        for ax, (x, y, title) in zip(axes, titles, strict=True):
            ax.set_xlabel(x)
            ax.set_ylabel(y)
            ax.set_title(f"{workload}: {title}")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out_dir / f"{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
