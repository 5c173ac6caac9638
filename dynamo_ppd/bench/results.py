"""Benchmark results: one schema for `results.json`, the side-by-side markdown table, the plots.

A point is one (system, workload, QPS) run. TTFT is split into turn 1 and turns 2+ (the paper's
distinction: only follow-ups can be decode-local); TPOT is the mean gap between streamed tokens of
each request; throughput counts output tokens of successful requests over the run.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec

from .client import RequestResult

RESULTS_VERSION = 1


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
    turn1_ttft_ms: Stats
    turn2p_ttft_ms: Stats
    tpot_ms: Stats
    throughput_tok_s: float
    success_rate: float
    requests: int
    achieved_rps: float  # requests per second actually sent
    client_lag_ms: Stats  # how late the client sent requests against the schedule
    duration_s: float


class BenchResults(msgspec.Struct):
    version: int
    config: str
    points: list[Point]


def summarize(system: str, workload: str, qps: float, results: list[RequestResult],
              duration_s: float) -> Point:
    ok = [r for r in results if r.ok]
    first = [r.ttft_s * 1e3 for r in ok if r.turn == 1 and r.ttft_s is not None]
    later = [r.ttft_s * 1e3 for r in ok if r.turn > 1 and r.ttft_s is not None]
    tpots = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    span = max([duration_s] + [r.sent_s + (r.e2e_s or 0) for r in results])
    return Point(system=system, workload=workload, qps=qps, turn1_ttft_ms=stats(first),
                 turn2p_ttft_ms=stats(later), tpot_ms=stats(tpots),
                 throughput_tok_s=sum(r.output_tokens for r in ok) / span if span else 0.0,
                 success_rate=len(ok) / len(results) if results else 1.0, requests=len(results),
                 achieved_rps=len(results) / span if span else 0.0,
                 client_lag_ms=stats([r.lag_s * 1e3 for r in results]), duration_s=span)


def save(results: BenchResults, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(results)) + b"\n")


def load(path: Path) -> BenchResults:
    return msgspec.json.decode(path.read_bytes(), type=BenchResults)


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
        ttft_ratio = ratio(p.turn2p_ttft_ms.p50, b.turn2p_ttft_ms.p50 if b else None)
        tpot_ratio = ratio(p.tpot_ms.p50, b.tpot_ms.p50 if b else None)
        lines.append(
            f"| {p.system} | {p.workload} | {p.qps:g} | {p.turn1_ttft_ms.p50:.1f} ms | "
            f"{p.turn2p_ttft_ms.p50:.1f} ms{ttft_ratio} | {p.tpot_ms.p50:.2f} ms{tpot_ratio} | "
            f"{p.turn2p_ttft_ms.p99:.1f} ms | {p.throughput_tok_s:.0f} | {p.success_rate:.0%} | "
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
            axes[0].plot([p.throughput_tok_s for p in mine], [p.turn2p_ttft_ms.p99 for p in mine], "o-",
                         label=system)
            axes[1].plot([p.qps for p in mine], [p.turn2p_ttft_ms.p50 for p in mine], "o-", label=system)
            axes[2].plot([p.qps for p in mine], [p.tpot_ms.p50 for p in mine], "o-", label=system)
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
