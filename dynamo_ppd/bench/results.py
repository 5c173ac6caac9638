"""Benchmark results: one schema for `results.json`, the side-by-side markdown table, the plots.

A point is one (system, workload, QPS) run, summarized by the one outcome summary of the
simulator and the tables (`dynamo_ppd.sim.outcome`): success = finished within the timeout
without error, over every request sent; latencies per turn 1 / turns 2+ over successful
requests (the paper's distinction: only follow-ups can be decode-local); TPOT = (e2e - TTFT) /
(tokens - 1); throughput = output tokens of successful requests over the run's duration.

A dilated point (`dynamo_ppd.bench.client`) is in model seconds and says its dilation; a point
cut at a horizon leaves the requests running then out (``cut`` counts them). Each point keeps
its successful requests' TTFT and TPOT per conversation (``samples``) so that every figure and
every ratio in the table gets a 95% bootstrap interval over conversations (`dynamo_ppd.experiment.stats`),
and, when `bench compare` simulated the same manifest on the virtual clock, the simulation's
samples too (``sim_samples``): live against virtual, per system.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec

from ..experiment import plots
from ..experiment import stats as bs
from ..sim.outcome import CHAT_TIMEOUT_S, Outcome, TurnResult
from ..sim.outcome import summarize as summarize_outcome
from . import routes
from .client import RequestResult

# 2: a point carries the Outcome (`dynamo_ppd.sim.outcome`) instead of its own TTFT/TPOT stats.
# 3: dilation, horizon and cut requests, per-request samples (intervals), the simulation's
#    samples of the same manifest, CPU shares; client lag in model milliseconds.
RESULTS_VERSION = 3


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


class Sample(msgspec.Struct, frozen=True, array_like=True):
    """One successful request's figures (model seconds)."""

    conversation_id: str
    turn: int
    ttft_s: float
    tpot_s: float | None


class Point(msgspec.Struct, frozen=True):
    system: str
    workload: str
    qps: float  # conversation arrival rate asked for
    outcome: Outcome
    achieved_rps: float  # requests per second actually sent
    client_lag_ms: Stats  # how late the client sent requests against the schedule (model ms)
    dilation: float = 1.0  # the workers ran this many times slower; times are model seconds
    conversations: int = 0  # in the manifest played
    horizon_s: float | None = None  # the run was cut here (model seconds), None: ran to the end
    cut: int = 0  # requests running at the horizon, left out of the outcome
    wall_s: float = 0.0
    cpu_cores: dict[str, float] = {}  # process (group) -> cores used over the point
    load_avg: float | None = None  # the machine's 1-minute load average at the point's end
    samples: list[Sample] = []
    sim_samples: list[Sample] | None = None  # the virtual-clock simulation of the same manifest
    sim_outcome: Outcome | None = None
    routes: dict[str, int] = {}  # requests the workers answered, by route (`bench.routes`)
    sim_routes: dict[str, int] | None = None  # the same in the simulation
    note: str = ""  # why the point is not what was asked for (e.g. its interval is too wide)
    # The routing process's own counts (PPD systems): follow-up decisions, and how many found
    # their history on another decode worker than the one the planner had chosen
    # (`ppd_decode_divergence_total`: behind the endpoint picker, Dynamo's frontend chose it).
    routing: dict[str, float] = {}


def samples_of(results: list[RequestResult]) -> list[Sample]:
    return [Sample(r.conversation_id, r.turn, r.ttft_s, r.tpot_s) for r in results
            if r.ok and r.ttft_s is not None]


def by_conversation(samples: list[Sample], field: str) -> dict[str, list[float]]:
    """``turn2_ttft`` (follow-ups' TTFT) or ``tpot`` (every turn's TPOT) per conversation."""
    out: dict[str, list[float]] = {}
    for s in samples:
        value = s.ttft_s if field == "turn2_ttft" and s.turn > 1 else s.tpot_s if field == "tpot" else None
        if value is not None:
            out.setdefault(s.conversation_id, []).append(value)
    return out


def interval(point: Point, field: str, sim: bool = False) -> bs.Interval | None:
    samples = point.sim_samples if sim else point.samples
    return bs.bootstrap(by_conversation(samples or [], field))


def ratio(a: Point, b: Point | None, field: str, b_sim: bool = False) -> bs.Interval | None:
    """a's median over b's (or b's simulation's), paired over the conversations of the manifest."""
    if b is None:
        return None
    other = b.sim_samples if b_sim else b.samples
    if other is None:
        return None
    return bs.paired_ratio(by_conversation(a.samples, field), by_conversation(other, field))


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
              duration_s: float, timeout_s: float = CHAT_TIMEOUT_S, **extra) -> Point:
    """A point from every request the client sent (those cut at a horizon left out of the
    outcome); ``duration_s`` (the schedule's span) is only the floor of the span the request rate
    is taken over. ``extra``: the other fields of `Point`."""
    kept = [r for r in results if not r.cut]
    outcome = summarize_outcome([turn_result(r) for r in kept], timeout_s)
    span = max(duration_s, outcome.duration_s)
    return Point(system=system, workload=workload, qps=qps, outcome=outcome,
                 achieved_rps=len(results) / span if span else 0.0,
                 client_lag_ms=stats([r.lag_s * 1e3 for r in results]), cut=len(results) - len(kept),
                 samples=samples_of(kept), **extra)


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
                           f"{RESULTS_VERSION} (points carry per-request samples for intervals since 3); "
                           "rerun the benchmark to get it")
    try:
        return msgspec.json.decode(data, type=BenchResults)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ResultsError(f"{path}: {exc}") from None


def _ms(value: float | None) -> float:
    """Milliseconds; 0 where no request succeeded (as the paper's columns)."""
    return value * 1e3 if value is not None else 0.0


def _iv(value: bs.Interval | None, digits: int = 1, scale: float = 1e3, unit: str = " ms") -> str:
    return value.text(digits, scale, unit) if value is not None else "-"


def _x(value: bs.Interval | None) -> str:
    return value.text(2, 1.0, "x") if value is not None else "-"


def _cores(cores: dict[str, float]) -> str:
    """Cores by kind of process: router(s), frontend, workers (summed), client."""
    kinds: dict[str, float] = {}
    for label, share in cores.items():
        kind = label.split("-")[0] if label.split("-")[-1].isdigit() else label
        kind = "workers" if kind in ("prefill", "decode", "worker") else kind
        kinds[kind] = kinds.get(kind, 0.0) + share
    order = ["router", "frontend", "workers", "client"]
    names = [k for k in order if k in kinds] + sorted(k for k in kinds if k not in order)
    return ", ".join(f"{k} {kinds[k]:.2f}" for k in names) or "-"


def markdown(results: BenchResults, baseline: str = "pd",
             contest: tuple[str, str] = ("ppd", "cond-disagg")) -> str:
    """The results table (one row per point; medians with 95% bootstrap intervals over
    conversations, ratios to the baseline system at the same workload and QPS paired over the
    same conversations), the head-to-head of ``contest`` when both ran, and the run-health table
    (dilation, interval width against the +-10% target, live against the virtual clock, client
    lag, CPU per process)."""
    points = sorted(results.points, key=lambda p: (p.workload, p.qps, p.system))
    by = {(p.workload, p.qps, p.system): p for p in points}
    lines = [f"| system | workload | QPS | turn-1 TTFT p50 | turn-2+ TTFT p50 [95% CI] | vs {baseline} | "
             f"TPOT p50 [95% CI] | vs {baseline} | P99 TTFT 2+ | throughput tok/s | success |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        b = by.get((p.workload, p.qps, baseline))
        o = p.outcome
        lines.append(
            f"| {p.system} | {p.workload} | {p.qps:g} | {_ms(o.turn1.p50_ttft_s):.1f} ms | "
            f"{_iv(interval(p, 'turn2_ttft'))} | {_x(ratio(p, b, 'turn2_ttft')) if b is not p else '1'} | "
            f"{_iv(interval(p, 'tpot'), 2)} | {_x(ratio(p, b, 'tpot')) if b is not p else '1'} | "
            f"{_ms(o.turn2.p99_ttft_s):.1f} ms | {o.tokens_per_sec:.0f} | {o.success_rate:.0f}% |")
    a_name, b_name = contest
    heads = [(p, by[(p.workload, p.qps, b_name)]) for p in points
             if p.system == a_name and (p.workload, p.qps, b_name) in by]
    if heads:
        lines += ["", f"{a_name} against {b_name}, paired over the same conversations (below 1: {a_name} "
                  "faster; the verdict needs the whole interval on one side of 1):", "",
                  f"| workload | QPS | turn-2+ TTFT p50 {a_name}/{b_name} | TPOT p50 {a_name}/{b_name} | "
                  f"{a_name} <= {b_name} (turn-2+ TTFT p50) |", "|---|---|---|---|---|"]
        for a, b in heads:
            r = ratio(a, b, "turn2_ttft")
            verdict = ("-" if r is None else "yes" if r.high <= 1 else "no" if r.low > 1
                       else f"{'yes' if r.value <= 1 else 'no'} (interval spans 1)")
            lines.append(f"| {a.workload} | {a.qps:g} | {_x(r)} | {_x(ratio(a, b, 'tpot'))} | {verdict} |")
    lines += ["", "Run health: dilation N (workers at --speedup 1/N, times divided by N); conversations "
              "played, follow-ups answered and requests cut at the horizon; the turn-2+ TTFT interval's "
              "half-width against the +-10% target; live over the virtual-clock simulation of the same "
              "manifest; client lag p99 (model ms, and wall ms = model x N); cores each kind of process "
              "used over the point, and the machine's load average (everything running on it) at its end; "
              "the share of requests (every turn) that ran decode-local, live (counted by the workers) "
              "and simulated: where it differs, the two decided differently.",
              "", "| system | QPS | N | conv | follow-ups | cut | TTFT 2+ CI +- | live/sim TTFT 2+ p50 | "
              "live/sim TPOT p50 | decode-local live / sim | client lag p99 | cores | load | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        iv = interval(p, "turn2_ttft")
        width = "-" if iv is None else f"{iv.half_width * 100:.1f}%{'' if iv.within() else ' (> 10%)'}"
        lines.append(
            f"| {p.system} | {p.qps:g} | {p.dilation:g} | {p.conversations} | {p.outcome.turn2.count} | "
            f"{p.cut} | {width} | {_x(ratio(p, p, 'turn2_ttft', b_sim=True))} | "
            f"{_x(ratio(p, p, 'tpot', b_sim=True))} | {_shares(p)} | {p.client_lag_ms.p99:.2f} ms "
            f"({p.client_lag_ms.p99 * p.dilation:.1f}) | {_cores(p.cpu_cores)} | "
            f"{'-' if p.load_avg is None else f'{p.load_avg:.1f}'} | {p.note} |")
    routed = [p for p in points if p.routing]
    if routed:
        lines += ["", "The PPD routing processes' own counts: follow-up decisions, and those whose history "
                  "was on another decode worker than the planner had chosen (behind the endpoint picker, "
                  "Dynamo's frontend picks the decode worker of every turn it does not pin).", "",
                  "| system | QPS | follow-ups decided | decode-local | via prefill "
                  "| on another decode worker | residency misses |", "|---|---|---|---|---|---|---|"]
        for p in routed:
            counts = p.routing
            follow = sum(v for k, v in counts.items() if k.startswith("follow_up:"))
            diverged = counts.get("ppd_decode_divergence_total", 0.0)
            share = f" ({diverged / follow:.1%})" if follow else ""
            local, via = counts.get("follow_up:decode_local", 0), counts.get("follow_up:via_prefill", 0)
            lines.append(f"| {p.system} | {p.qps:g} | {follow:.0f} | {local:.0f} | {via:.0f} | "
                         f"{diverged:.0f}{share} | {counts.get('ppd_residency_misses_total', 0):.0f} |")
    return "\n".join(lines)


def _shares(p: Point) -> str:
    """The decode-local share live / simulated, with the live count ("-": not counted)."""
    live, sim = routes.local_share(p.routes), routes.local_share(p.sim_routes)
    if live is None and sim is None:
        return "-"
    n = p.routes.get("decode_local", 0) + p.routes.get("via_prefill", 0)
    return (f"{'-' if live is None else f'{live:.0%}'} / {'-' if sim is None else f'{sim:.0%}'}"
            f"{f' of {n}' if n else ''}")


def versus(a: BenchResults, b: BenchResults, label_a: str, label_b: str) -> str:
    """The points two runs share (system, workload, QPS: e.g. a dilated and an undilated run of
    the same manifest), ``a`` over ``b``: turn-2+ TTFT and TPOT medians, paired over the same
    conversation ids, with 95% intervals; and ``a``'s own live over virtual clock."""
    theirs = {(p.system, p.workload, p.qps): p for p in b.points}
    lines = [f"| system | workload | QPS | N {label_a} | N {label_b} | turn-2+ TTFT p50 {label_a} | "
             f"{label_b} | {label_a}/{label_b} | TPOT p50 {label_a} | {label_b} | {label_a}/{label_b} |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(a.points, key=lambda p: (p.workload, p.qps, p.system)):
        q = theirs.get((p.system, p.workload, p.qps))
        if q is None:
            continue
        lines.append(
            f"| {p.system} | {p.workload} | {p.qps:g} | {p.dilation:g} | {q.dilation:g} | "
            f"{_iv(interval(p, 'turn2_ttft'))} | {_iv(interval(q, 'turn2_ttft'))} | "
            f"{_x(ratio(p, q, 'turn2_ttft'))} | {_iv(interval(p, 'tpot'), 2)} | "
            f"{_iv(interval(q, 'tpot'), 2)} | {_x(ratio(p, q, 'tpot'))} |")
    return "\n".join(lines)


def plot(results: BenchResults, out_dir: Path) -> list[Path]:
    """PNGs: P99 turn-2+ TTFT vs throughput (paper Fig. 1/9) and medians vs QPS per system with
    their 95% intervals and the virtual clock's medians (Fig. 4/11), one figure per workload."""
    plt = plots.pyplot()

    written = []
    for workload in sorted({p.workload for p in results.points}):
        points = [p for p in results.points if p.workload == workload]
        systems = sorted({p.system for p in points})
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for system in systems:
            mine = sorted((p for p in points if p.system == system), key=lambda p: p.qps)
            axes[0].plot([p.outcome.tokens_per_sec for p in mine],
                         [_ms(p.outcome.turn2.p99_ttft_s) for p in mine], "o-", label=system)
            for ax, field in ((axes[1], "turn2_ttft"), (axes[2], "tpot")):
                ivs = [(p.qps, iv) for p in mine if (iv := interval(p, field)) is not None]
                if not ivs:
                    continue
                line = ax.errorbar([q for q, _ in ivs], [iv.value * 1e3 for _, iv in ivs],
                                   yerr=[[(iv.value - iv.low) * 1e3 for _, iv in ivs],
                                         [(iv.high - iv.value) * 1e3 for _, iv in ivs]],
                                   fmt="o-", capsize=3, label=f"{system} (95% CI)")
                sims = [(p.qps, iv) for p in mine if (iv := interval(p, field, sim=True)) is not None]
                if sims:
                    ax.plot([q for q, _ in sims], [iv.value * 1e3 for _, iv in sims], "x--",
                            color=line[0].get_color(), alpha=0.7, label=f"{system} (virtual clock)")
        titles = [("throughput (output tok/s)", "turn-2+ TTFT p99 (ms)", "P99 TTFT vs throughput"),
                  ("conversations/s", "turn-2+ TTFT p50 (ms)", "TTFT vs load"),
                  ("conversations/s", "TPOT p50 (ms)", "TPOT vs load")]
        for ax, (x, y, title) in zip(axes, titles, strict=True):
            ax.set_xlabel(x)
            ax.set_ylabel(y)
            ax.set_title(f"{workload}: {title}")
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(plots.save(fig, out_dir / f"{workload}.png"))
    return written
