"""The figures of `dynamo-ppd bench picker` (`picker_path`): from the requests the driver timed
to one `Point` per (kind, rate), the highest follow-up rate sustained, and the report written as
JSON (`Report`, validated on load), markdown and a PNG.

Pure but for `save`, `load` and `plot`; deterministic for a seed (the bootstrap's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from ..experiment import plots
from ..experiment.stats import Interval, bootstrap
from ..picker.stages import STAGES

REPORT_VERSION = 1
GRPC = "grpc"  # round trip - path: both gRPC ends, the loopback transport, the driver's scheduling
COLUMNS = (*STAGES, GRPC)  # the stage breakdown, in path order
FOLLOW_UP = "follow-up"
SUSTAINED_FRACTION = 0.95  # a point is sustained when it routed at least this share of its rate
BUSY_CORE = 0.9  # a process at this many cores or more was what held a point back
TAIL_SAMPLES = 100  # the slowest 1% is shown for points of this many samples (one request or more)
RESAMPLES = 1000  # bootstrap draws per interval (points reach 2,000 samples; 1,000 keeps it quick)


class ReportError(Exception):
    """A file that is not a picker-path report of this version."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the driver saw it; seconds from the point's start."""

    group: str  # its conversation (follow-ups) or itself (first turns): the bootstrap's unit
    due_s: float  # when the schedule (open loop) or a free slot (closed loop) said to send it
    late_s: float  # sent - due: the driver's own lag
    completed_s: float  # when its route (or refusal, or failure) came back
    round_trip_us: float  # the driver's round trip (`gateway.extproc.CalloutResult.seconds`)
    timings_us: dict[str, float] | None  # the picker's ``ppd.picker`` metadata; None: no route
    prompt_tokens: int  # estimated (`picker_path.estimated_prompt_tokens`)
    error: str | None = None  # "HTTP <status>: <body>" for a refusal, else the failure

    @property
    def routed(self) -> bool:
        return self.error is None and self.timings_us is not None and "path_us" in self.timings_us


@dataclass(frozen=True, slots=True)
class CpuUse:
    """CPU seconds over a point (its first send to its last answer) and what they paid for."""

    picker_s: float  # the picker process, all threads (/proc/<pid>/stat utime + stime)
    driver_s: float  # this process
    machine_s: float  # every core of the machine busy (/proc/stat: all but idle and iowait)
    wall_s: float
    picks: int  # routes the picker gave in that time (the point's left-out start included)
    graph_s: dict[str, float] = field(default_factory=dict)  # each process of the graph, by label
    picker_idle_cores: float = 0.0  # the picker's CPU with no requests (measured before the points)
    picker_threads_s: dict[str, float] = field(default_factory=dict)  # the picker's, by thread name


class Point(msgspec.Struct, frozen=True, kw_only=True):
    """One kind at one rate (open loop) or one concurrency (closed loop). Times in microseconds;
    the p50s with their 95% bootstrap interval over conversations (first turns: over requests)."""

    kind: str
    loop: str  # "open" (evenly spaced arrivals at target_rate) or "closed" (concurrency in flight)
    target_rate: float  # requests/s offered; 0 for closed loop
    concurrency: int = 0  # closed loop: requests in flight
    sent: int  # measured requests (the point's first --warmup seconds left out)
    samples: int  # of those, routed with the picker's timings
    refused: int  # answered with an immediate response (HTTP 4xx/5xx)
    failed: int  # gRPC errors, timeouts, or unanswered at the point's deadline
    achieved_rate: float  # routed requests/s
    prompt_tokens: float  # mean, estimated
    path_p50_us: Interval | None
    path_p99_us: float
    round_trip_p50_us: Interval | None
    round_trip_p99_us: float
    path_mean_us: float
    stage_mean_us: dict[str, float]  # `COLUMNS`: each stage's mean, and grpc's
    tail_stage_mean_us: dict[str, float] = {}  # the same over the slowest 1% (path >= its p99)
    picker_cpu_us_per_pick: float  # the picker's whole CPU over the point / its picks
    picker_busy_us_per_pick: float  # the same less its idle CPU (what picking added)
    picker_cores: float
    driver_cores: float
    machine_cores: float
    graph_cores: dict[str, float] = {}  # each process of the graph
    # The picker's CPU per pick by thread name: Python's main thread ("python": the event loop,
    # the pick, grpc.aio's Python side), gRPC's C-core threads, Dynamo's Rust runtime, NATS'.
    picker_threads_us_per_pick: dict[str, float] = {}
    late_p99_ms: float  # how late the driver sent, p99
    wall_s: float
    first_error: str = ""
    # Follow-ups: the messages all their conversations held by the end of the point (visited in
    # turn, they are the working set of the picker's encode cache).
    conversation_messages: int = 0


class Report(msgspec.Struct, kw_only=True):
    version: int = REPORT_VERSION
    command: str
    graph: str
    arrivals: str
    conversations: int
    duration_s: float
    warmup_s: float
    min_requests: int
    max_requests: int
    p99_limit_ms: float
    cpus: int
    load_before: list[float]  # 1, 5 and 15 min load averages before the graph started
    picker_idle_cores: float
    wall_s: float
    points: list[Point]
    sustained_follow_up_rate: float | None  # `sustained_rate`
    notes: list[str] = []


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation); 0 for no values (JSON has no NaN:
    a point without samples says so by its ``samples``)."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else 0.0


def _p50(outcomes: Sequence[Outcome], value: Callable[[Outcome], float], seed: int) -> Interval | None:
    groups: dict[str, list[float]] = {}
    for o in outcomes:
        groups.setdefault(o.group, []).append(value(o))
    return bootstrap(groups, resamples=RESAMPLES, seed=seed)


def achieved_rate(outcomes: Sequence[Outcome], target_rate: float) -> float:
    """Routed requests per second from the first one due to the last answer; open loop, one slot
    (1/rate) is added so that a point that keeps up comes out at its rate, not above it."""
    routed = [o for o in outcomes if o.routed]
    if not routed:
        return 0.0
    span = max(o.completed_s for o in routed) - min(o.due_s for o in outcomes)
    span += 1.0 / target_rate if target_rate else 0.0
    return len(routed) / span if span > 0 else 0.0


def _path(o: Outcome) -> float:
    return (o.timings_us or {}).get("path_us", 0.0)


def stage_means(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Mean us per stage (`COLUMNS`) of routed requests; a stage a request did not lap counts 0."""
    means = {s: _mean([(o.timings_us or {}).get(f"{s}_us", 0.0) for o in outcomes]) for s in STAGES}
    means[GRPC] = _mean([o.round_trip_us - _path(o) for o in outcomes])
    return means


def summarize(kind: str, loop: str, target_rate: float, outcomes: Sequence[Outcome], cpu: CpuUse,
              concurrency: int = 0, seed: int = 0, conversation_messages: int = 0) -> Point:
    """A point's figures from its measured requests (its left-out start already dropped) and the
    CPU over the whole point."""
    routed = [o for o in outcomes if o.routed]
    refused = sum(1 for o in outcomes if o.error is not None and o.error.startswith("HTTP "))
    paths = [_path(o) for o in routed]
    trips = [o.round_trip_us for o in routed]
    p99 = percentile(paths, 99)
    tail = [o for o in routed if _path(o) >= p99]
    wall = cpu.wall_s or float("inf")
    busy = cpu.picker_s - cpu.picker_idle_cores * cpu.wall_s
    return Point(
        kind=kind, loop=loop, target_rate=target_rate, concurrency=concurrency, sent=len(outcomes),
        samples=len(routed), refused=refused, failed=len(outcomes) - len(routed) - refused,
        achieved_rate=achieved_rate(outcomes, target_rate),
        prompt_tokens=_mean([o.prompt_tokens for o in outcomes]),
        path_p50_us=_p50(routed, _path, seed), path_p99_us=p99,
        round_trip_p50_us=_p50(routed, lambda o: o.round_trip_us, seed),
        round_trip_p99_us=percentile(trips, 99), path_mean_us=_mean(paths),
        stage_mean_us=stage_means(routed), tail_stage_mean_us=stage_means(tail),
        picker_cpu_us_per_pick=cpu.picker_s / cpu.picks * 1e6 if cpu.picks else 0.0,
        picker_busy_us_per_pick=max(0.0, busy) / cpu.picks * 1e6 if cpu.picks else 0.0,
        picker_cores=cpu.picker_s / wall, driver_cores=cpu.driver_s / wall,
        machine_cores=cpu.machine_s / wall,
        graph_cores={label: s / wall for label, s in cpu.graph_s.items()},
        picker_threads_us_per_pick={name: s / cpu.picks * 1e6 for name, s in cpu.picker_threads_s.items()
                                    if s > 0 and cpu.picks},
        late_p99_ms=percentile([o.late_s for o in outcomes], 99) * 1e3, wall_s=cpu.wall_s,
        first_error=next((o.error for o in outcomes if o.error), ""),
        conversation_messages=conversation_messages)


def encode_cache_note(points: Sequence[Point], cache_pieces: int, jump: float = 3.0) -> list[str]:
    """A note when the follow-ups' tokenize time per prompt token rose ``jump``-fold or more up the
    ladder: their conversations' messages outgrew the picker's encode cache."""
    follow = [p for p in points if p.kind == FOLLOW_UP and p.loop == "open" and p.samples]

    def per_token(p: Point) -> float:
        return p.stage_mean_us["tokenize"] / max(p.prompt_tokens, 1.0)

    if len(follow) < 2:
        return []
    low, high = min(follow, key=per_token), max(follow, key=per_token)
    if per_token(high) < jump * per_token(low) or high.target_rate < low.target_rate:
        return []
    return [f"Follow-up tokenization per prompt token rose {per_token(high) / per_token(low):.1f}-fold from "
            f"{low.target_rate:g}/s ({low.stage_mean_us['tokenize']:,.0f} us a follow-up) to "
            f"{high.target_rate:g}/s ({high.stage_mean_us['tokenize']:,.0f} us): by then the conversations "
            f"held {high.conversation_messages:,} messages, more than the picker's encode cache keeps "
            f"({cache_pieces:,} pieces, least recently used dropped: `picker.prompt.ENCODE_CACHE_PIECES`), "
            "and as they take turns each follow-up re-encoded its history, not only its new message."]


def sustained(point: Point, p99_limit_us: float | None = None) -> bool:
    """The point kept up: it routed at least `SUSTAINED_FRACTION` of its rate, nothing failed, and
    (with ``p99_limit_us``) its p99 path was within the limit."""
    if not point.samples or point.failed:
        return False
    if point.loop == "open" and point.achieved_rate < SUSTAINED_FRACTION * point.target_rate:
        return False
    return p99_limit_us is None or point.path_p99_us <= p99_limit_us


def sustained_rate(points: Sequence[Point], p99_limit_us: float, kind: str = FOLLOW_UP) -> float | None:
    """The highest open-loop rate of ``kind`` up to which every point was sustained with its p99
    path within ``p99_limit_us``; None when not even the lowest was."""
    best = None
    for point in sorted((p for p in points if p.kind == kind and p.loop == "open"),
                        key=lambda p: p.target_rate):
        if not sustained(point, p99_limit_us):
            break
        best = point.target_rate
    return best


def limited_by(point: Point, p99_limit_us: float | None, cpus: int) -> str:
    """What held an open-loop point back ("" when it was sustained): the picker's core, the
    driver's, the whole machine, failures, or the picker's own time (p99 over the limit with CPU
    to spare)."""
    if point.loop != "open" or sustained(point, p99_limit_us):
        return ""
    if point.picker_cores >= BUSY_CORE:
        return "picker (a core)"
    if point.driver_cores >= BUSY_CORE:
        return "driver (a core)"
    if point.machine_cores >= BUSY_CORE * cpus:
        return f"machine ({cpus} cores busy)"
    if point.failed:
        return "failures"
    if point.achieved_rate < SUSTAINED_FRACTION * point.target_rate:
        return "driver or machine (no core full)"
    return "p99 path over the limit"


def picks_per_core(point: Point, picker_idle_cores: float) -> float:
    """Picks/s one core could give at this point's CPU per pick, the picker's idle CPU kept."""
    if not point.picker_busy_us_per_pick:
        return 0.0
    return max(0.0, 1.0 - picker_idle_cores) / point.picker_busy_us_per_pick * 1e6


# --- markdown ----------------------------------------------------------------------------------

def _ms(us: float) -> str:
    return f"{us / 1e3:,.{2 if us < 1e5 else 1}f}"


def _interval_ms(interval: Interval | None) -> str:
    if interval is None:
        return "-"
    return interval.text(digits=2 if interval.value < 1e5 else 1, scale=1e-3)


def _rate(point: Point) -> str:
    return f"{point.target_rate:g}" if point.loop == "open" else f"{point.concurrency} in flight"


def _limit_for(point: Point, report: Report) -> float | None:
    """Follow-ups must keep their p99 path within the limit; first turns only keep up."""
    return report.p99_limit_ms * 1e3 if point.kind == FOLLOW_UP else None


def _row(p: Point, report: Report) -> str:
    n = f"{p.samples}" + (f" ({p.refused} refused)" if p.refused else "") + (
        f" ({p.failed} failed)" if p.failed else "")
    times = (f"{_interval_ms(p.path_p50_us)} | {_ms(p.path_p99_us)} | {_interval_ms(p.round_trip_p50_us)} | "
             f"{_ms(p.round_trip_p99_us)}") if p.samples else "- | - | - | -"
    limit = limited_by(p, _limit_for(p, report), report.cpus) or "-"
    return (f"| {p.kind} | {_rate(p)} | {p.achieved_rate:,.1f} | {n} | {p.prompt_tokens:,.0f} | {times} | "
            f"{p.picker_cpu_us_per_pick:,.0f} ({p.picker_busy_us_per_pick:,.0f}) | {p.picker_cores:.2f} | "
            f"{p.driver_cores:.2f} | {p.machine_cores:.2f} | {limit} |")


def markdown(report: Report) -> str:
    load = " ".join(f"{x:.2f}" for x in report.load_before)
    out = ["# The endpoint picker's request path", "", f"`{report.command}`", "",
           f"Graph: {report.graph}. The driver (this process, Python grpc.aio) calls the picker's ext_proc "
           f"port directly: no gateway, and nothing is served. Arrivals: {report.arrivals}; each point "
           f"{report.duration_s:g} s of requests (at least {report.min_requests}, at most "
           f"{report.max_requests}) after {report.warmup_s:g} s left out. Follow-ups continue "
           f"{report.conversations} warm-up conversations of ~2K tokens. {report.cpus} cores, shared by the "
           f"graph and the driver; load average before the run {load}; the picker idles at "
           f"{report.picker_idle_cores:.3f} cores; the run took {report.wall_s / 60:.1f} min.", "",
           "Path: the picker's own time from its first ext_proc message in to the route out (`path_us` "
           "of its `ppd.picker` metadata); round trip: the driver's, from opening the stream to the route "
           "back. Times in ms: p50 [95% bootstrap interval, resampling conversations for follow-ups and "
           "requests for first turns], p99. Picker CPU per pick: the picker process's CPU over the point "
           "(all threads) over its picks, and the same less its idle CPU. Cores: CPU seconds over wall "
           "seconds; the machine's count every process on it, this run's or not. /proc counts CPU in "
           "10 ms ticks: at 1/s (about 10 picks) a CPU per pick is good to ~1 ms.", "",
           "| kind | rate/s | achieved/s | n | prompt tokens | path p50 | path p99 | round trip p50 | "
           "round trip p99 | picker CPU/pick us (less idle) | picker cores | driver cores | "
           "machine cores | limited by |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out += [_row(p, report) for p in report.points]
    out += ["", "Where the picker's time goes, mean us per stage (path: their sum; grpc: round trip - path, "
            "both gRPC ends and the transport):", "",
            "| kind | rate/s | " + " | ".join(STAGES) + " | path | grpc | round trip |",
            "|---|---|" + "---|" * (len(COLUMNS) + 2)]
    out += [_stage_row(p, p.stage_mean_us) for p in report.points if p.samples]
    tails = [p for p in report.points if p.samples >= TAIL_SAMPLES and p.tail_stage_mean_us]
    if tails:
        out += ["", f"The slowest 1% (path >= its p99; points of {TAIL_SAMPLES} samples or more), mean us "
                "per stage: where a tail comes from.", "",
                "| kind | rate/s | " + " | ".join(STAGES) + " | path | grpc | round trip |",
                "|---|---|" + "---|" * (len(COLUMNS) + 2)]
        out += [_stage_row(p, p.tail_stage_mean_us) for p in tails]
    out += thread_table(report.points)
    out += ["", sustained_text(report), ""]
    out += [f"- {line}" for line in biggest_stages(report.points)]
    out += [f"- {note}" for note in report.notes]
    return "\n".join(out).rstrip() + "\n"


# The picker's threads by what runs on them (Linux thread names, 15 characters at most).
THREAD_GROUPS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("main thread (event loop: the pick, grpc.aio, aetcd)", lambda name: name == "python"),
    ("gRPC core threads", lambda name: name.startswith(("event_engine", "grpc"))),
    ("Dynamo runtime (tokio)", lambda name: name.startswith("tokio")),
)


def thread_groups(per_thread: dict[str, float]) -> list[float]:
    """Per-thread figures summed by `THREAD_GROUPS`, and the rest last."""
    sums = [sum(v for k, v in per_thread.items() if test(k)) for _, test in THREAD_GROUPS]
    return [*sums, max(0.0, sum(per_thread.values()) - sum(sums))]


def thread_table(points: Sequence[Point]) -> list[str]:
    shown = [p for p in points if p.picker_threads_us_per_pick]
    if not shown:
        return []
    names = [name for name, _ in THREAD_GROUPS] + ["other threads"]
    out = ["", "The picker's CPU per pick by thread, us (over the whole point, its idle CPU included): what "
           "the picker spends beyond its path.", "",
           "| kind | rate/s | " + " | ".join(names) + " | all |", "|---|---|" + "---|" * (len(names) + 1)]
    for p in shown:
        groups = thread_groups(p.picker_threads_us_per_pick)
        out.append(f"| {p.kind} | {_rate(p)} | " + " | ".join(f"{v:,.0f}" for v in groups)
                   + f" | {sum(groups):,.0f} |")
    return out


def _stage_row(p: Point, means: dict[str, float]) -> str:
    path = sum(means[s] for s in STAGES)
    stages = " | ".join(f"{means[s]:,.0f}" for s in STAGES)
    grpc = means[GRPC]
    return f"| {p.kind} | {_rate(p)} | {stages} | {path:,.0f} | {grpc:,.0f} | {path + grpc:,.0f} |"


def biggest_stages(points: Sequence[Point], top: int = 3) -> list[str]:
    """Per kind, at its lowest open-loop rate: the stages that take most of the path, and what
    gRPC adds on top."""
    out = []
    for kind in dict.fromkeys(p.kind for p in points):
        runs = [p for p in points if p.kind == kind and p.loop == "open" and p.samples and p.path_mean_us > 0]
        if not runs:
            continue
        p = min(runs, key=lambda q: q.target_rate)
        stages = sorted(STAGES, key=lambda s: -p.stage_mean_us[s])[:top]
        shares = ", ".join(f"{s} {p.stage_mean_us[s] / p.path_mean_us:.0%}" for s in stages)
        out.append(f"{kind} at {p.target_rate:g}/s: mean path {_ms(p.path_mean_us)} ms, of which {shares}; "
                   f"gRPC adds {_ms(p.stage_mean_us[GRPC])} ms to the round trip.")
    return out


def sustained_text(report: Report) -> str:
    """The follow-ups' sustained rate, and what stopped the climb."""
    follow = sorted((p for p in report.points if p.kind == FOLLOW_UP and p.loop == "open"),
                    key=lambda p: p.target_rate)
    if not follow:
        return "No follow-up points ran."
    limit_us, rate = report.p99_limit_ms * 1e3, report.sustained_follow_up_rate
    head = (f"**Follow-ups: the picker sustained {rate:g} requests/s** with p99 path <= "
            f"{report.p99_limit_ms:g} ms" if rate is not None else
            f"**Follow-ups: no rate was sustained** with p99 path <= {report.p99_limit_ms:g} ms")
    miss = next((p for p in follow if not sustained(p, limit_us)), None)
    if miss is None:
        return head + f" (the highest rate tried; the picker used {follow[-1].picker_cores:.2f} cores there)."
    why = limited_by(miss, limit_us, report.cpus)
    text = (f"; at {miss.target_rate:g}/s it routed {miss.achieved_rate:,.0f}/s with p99 path "
            f"{_ms(miss.path_p99_us)} ms, limited by {why} (picker {miss.picker_cores:.2f} cores, driver "
            f"{miss.driver_cores:.2f}, machine {miss.machine_cores:.2f} of {report.cpus}).")
    if not why.startswith("picker"):
        text += (f" The picker had no core to itself there, so its own ceiling is above that: at "
                 f"{miss.picker_busy_us_per_pick:,.0f} us of CPU per pick (less idle), a core of its own "
                 f"would route ~{picks_per_core(miss, report.picker_idle_cores):,.0f} follow-ups/s.")
    return head + text


# --- the plot ----------------------------------------------------------------------------------

def plot(report: Report, path: Path) -> Path:
    """Left: p50 (solid) and p99 (dashed) path against rate per kind. Right: each kind's round trip
    at its lowest rate split by stage, as shares, with the total above each bar."""
    from matplotlib.ticker import ScalarFormatter

    plt = plots.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6))
    kinds = list(dict.fromkeys(p.kind for p in report.points))
    lowest = []
    for i, kind in enumerate(kinds):
        pts = sorted((p for p in report.points if p.kind == kind and p.loop == "open" and p.samples),
                     key=lambda p: p.target_rate)
        if not pts:
            continue
        lowest.append(pts[0])
        rates = [p.target_rate for p in pts]
        left.plot(rates, [p.path_p50_us.value / 1e3 if p.path_p50_us else 0.0 for p in pts], "o-",
                  color=f"C{i}", label=f"{kind} p50")
        left.plot(rates, [p.path_p99_us / 1e3 for p in pts], "s--", color=f"C{i}", alpha=0.6,
                  label=f"{kind} p99")
    left.axhline(report.p99_limit_ms, color="grey", lw=1, ls=":")
    left.set_xscale("log")
    left.set_yscale("log")
    for axis in (left.xaxis, left.yaxis):
        axis.set_major_formatter(ScalarFormatter())
    left.set_xlabel("requests/s offered (open loop, evenly spaced)")
    left.set_ylabel("picker path (ms)")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    totals = np.array([p.path_mean_us + p.stage_mean_us[GRPC] for p in lowest])
    bottoms = np.zeros(len(lowest))
    for j, column in enumerate(COLUMNS):
        shares = np.array([max(0.0, p.stage_mean_us[column]) for p in lowest]) / np.maximum(totals, 1e-9)
        right.bar(range(len(lowest)), shares * 100, bottom=bottoms, color=f"C{j}", label=column)
        bottoms += shares * 100
    for x, total in enumerate(totals):
        right.text(x, min(bottoms[x], 100) + 1, f"{total / 1e3:,.2f} ms", ha="center", fontsize=8)
    right.set_xticks(range(len(lowest)), [f"{p.kind}\n@{p.target_rate:g}/s" for p in lowest], fontsize=8)
    right.set_ylabel("share of the mean round trip (%)")
    right.set_ylim(0, 112)
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    right.set_title("where the round trip goes, each kind at its lowest rate", fontsize=10)
    fig.suptitle("PPD endpoint picker, its request path alone (ext_proc driven directly)")
    return plots.save(fig, path)


# --- files -------------------------------------------------------------------------------------

class _Version(msgspec.Struct):
    version: int


def save(report: Report, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    return path


def load(path: Path) -> Report:
    """A report file, validated; `ReportError` for another version or a malformed file."""
    data = path.read_bytes()
    try:
        version = msgspec.json.decode(data, type=_Version).version
        if version != REPORT_VERSION:
            raise ReportError(f"{path}: report version {version}; this dynamo-ppd reads {REPORT_VERSION}")
        return msgspec.json.decode(data, type=Report)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ReportError(f"{path}: not a picker-path report ({exc})") from None
