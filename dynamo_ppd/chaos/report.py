"""What a chaos run measured, from the turn records and the fault's time alone (pure: no I/O).

Per fault:

- **failed requests**: turns that got no answer (HTTP error, connection error, error event or
  timeout before the first token);
- **truncated streams**: turns that started answering but ended without a ``finish_reason``, with
  an error event or a broken connection, or with fewer tokens than ``max_tokens`` (the client sends
  ``ignore_eos``, so a whole answer has exactly ``max_tokens``);
- **added p99 TTFT**: p99 TTFT of the turns sent in the ``window_s`` after the fault minus that of
  the turns sent in the ``window_s`` before it;
- **recovery**: seconds from the fault to the start of the first ``recovery_window_s`` window of
  follow-ups (stepping ``step_s``) whose decode-local share is back within ``tolerance`` of the
  share in the ``recovery_window_s`` just before the fault (a window as wide as those it is
  compared with, and late enough that the run's warm-up, when the share is still climbing, does
  not lower the bar). A follow-up ran decode-local when its decode worker
  reused more cached tokens than the previous turn's whole prompt: a via-prefill turn reports the
  prefill worker's prefix-cache hit, which can cover at most the previous prompt (the prefill
  worker never held the previous answer), while the conversation's own decode worker holds the
  previous prompt *and* answer.
"""

from __future__ import annotations

import math

import msgspec

REPORT_VERSION = 1


class TurnRecord(msgspec.Struct, frozen=True):
    """One request as the chaos client saw it; times in seconds from the run's start."""

    conversation_id: str
    turn: int  # 1-based
    sent_s: float
    status: str  # "ok", "failed" or "truncated"
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prev_prompt_tokens: int | None = None  # the previous turn's prompt_tokens (follow-ups)
    error: str | None = None


class Fault(msgspec.Struct, frozen=True):
    """A fault as injected: what, on which process, when (seconds from the run's start), and when
    the process was back (ready again), if known."""

    kind: str
    target: str
    at_s: float
    graph: str = ""
    back_after_s: float | None = None
    target_inflight: float | None = None  # requests in flight on the target when it was hit


class FaultResult(msgspec.Struct, frozen=True):
    kind: str
    target: str
    graph: str
    at_s: float
    back_after_s: float | None
    target_inflight: float | None
    requests: int
    failed: int
    truncated: int
    ttft_p99_before_s: float | None
    ttft_p99_after_s: float | None
    added_ttft_p99_s: float | None
    decode_local_before: float | None  # share of follow-ups in the recovery window before the fault
    decode_local_after: float | None  # share of follow-ups sent after the recovery point
    follow_ups_before: int
    follow_ups_after: int
    recovery_s: float | None  # None: not back to the pre-fault share within the run
    errors: list[str] = []  # a few distinct error messages, for the reader
    other_restarts: list[str] = []  # processes the supervisor restarted besides the target
    # The routers' counters from the fault to the end of the run (summed over replicas):
    # migrations, residency misses, re-homes, errors, follow-up decisions by route and reason.
    router_counters: dict[str, float] = {}
    # Share of follow-ups sent `SETTLE_S` or more after the target was back (and how many): where
    # a restarted routing process must be routing as before.
    decode_local_settled: float | None = None
    follow_ups_settled: int = 0


SETTLE_S = 10.0
SETTLED_FAULTS = ("picker-kill", "router-restart")  # the report says their settled share


class ChaosReport(msgspec.Struct):
    version: int
    command: str
    workload: str
    rate_conv_per_s: float
    duration_s: float
    window_s: float
    recovery_window_s: float
    tolerance: float
    results: list[FaultResult]
    commit: str = ""  # the tree measured (git describe --always --dirty), when known


def served_decode_local(record: TurnRecord) -> bool | None:
    """Whether a successful follow-up ran decode-local (see the module docstring); None when unknown."""
    if record.turn < 2 or record.status != "ok":
        return None
    if record.cached_tokens is None or record.prev_prompt_tokens is None:
        return None
    return record.cached_tokens > record.prev_prompt_tokens


def p99(values: list[float]) -> float | None:
    """Nearest-rank p99 (no interpolation: with few samples, the worst or next-worst value)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _share(records: list[TurnRecord]) -> tuple[float | None, int]:
    marks = [m for m in (served_decode_local(r) for r in records) if m is not None]
    return (sum(marks) / len(marks) if marks else None), len(marks)


def analyze(records: list[TurnRecord], fault: Fault, *, window_s: float = 20.0,
            recovery_window_s: float = 10.0, tolerance: float = 0.05, step_s: float = 0.5,
            min_follow_ups: int = 5) -> FaultResult:
    before = [r for r in records if fault.at_s - window_s <= r.sent_s < fault.at_s]
    after = [r for r in records if fault.at_s <= r.sent_s < fault.at_s + window_s]
    ttft_before = p99([r.ttft_s for r in before if r.ttft_s is not None])
    ttft_after = p99([r.ttft_s for r in after if r.ttft_s is not None])
    share_before, n_before = _share([r for r in records
                                     if fault.at_s - recovery_window_s <= r.sent_s < fault.at_s])

    recovery_s = None
    if share_before is not None:
        last = max((r.sent_s for r in records), default=fault.at_s)
        t = fault.at_s
        while t + recovery_window_s <= last + step_s:
            share, n = _share([r for r in records if t <= r.sent_s < t + recovery_window_s])
            if share is not None and n >= min_follow_ups and share >= share_before - tolerance:
                recovery_s = round(t - fault.at_s, 3)
                break
            t += step_s
    share_after, n_after = _share([r for r in records if r.sent_s >= fault.at_s + (recovery_s or 0.0)])
    settled_from = fault.at_s + (fault.back_after_s or 0.0) + SETTLE_S
    share_settled, n_settled = _share([r for r in records if r.sent_s >= settled_from])

    errors: list[str] = []
    for r in records:
        if r.error and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    return FaultResult(
        kind=fault.kind, target=fault.target, graph=fault.graph, at_s=fault.at_s,
        back_after_s=fault.back_after_s, target_inflight=fault.target_inflight, requests=len(records),
        failed=sum(r.status == "failed" for r in records),
        truncated=sum(r.status == "truncated" for r in records),
        ttft_p99_before_s=ttft_before, ttft_p99_after_s=ttft_after,
        added_ttft_p99_s=None if ttft_before is None or ttft_after is None else ttft_after - ttft_before,
        decode_local_before=share_before, decode_local_after=share_after,
        follow_ups_before=n_before, follow_ups_after=n_after, recovery_s=recovery_s, errors=errors,
        decode_local_settled=share_settled, follow_ups_settled=n_settled)


def counter_delta(before: dict[str, dict[str, float]],
                  after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Counter increase from ``before`` to ``after``, summed over processes. Processes are keyed by
    label and pid (``router-0@1234``): one started in between (a restart) counts from zero."""
    total: dict[str, float] = {}
    for process, counters in after.items():
        old = before.get(process, {})
        for name, value in counters.items():
            grown = value - old.get(name, 0.0)
            if grown:
                total[name] = total.get(name, 0.0) + grown
    return dict(sorted(total.items()))


def _s(value: float | None, unit: str = " s") -> str:
    return "–" if value is None else f"{value:.2f}{unit}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def markdown(results: list[FaultResult]) -> str:
    head = ("| fault | graph | target (in flight) | back after | requests | failed | truncated "
            "| p99 TTFT before | p99 TTFT after | added p99 TTFT | decode-local before "
            "| decode-local after | recovery |")
    rows = [head, "|" + "---|" * 13]
    for r in results:
        recovery = "not recovered" if r.recovery_s is None and r.decode_local_before is not None \
            else _s(r.recovery_s)
        added = "–" if r.added_ttft_p99_s is None else f"{r.added_ttft_p99_s:+.2f} s"
        target = r.target if r.target_inflight is None else f"{r.target} ({r.target_inflight:g})"
        rows.append(f"| {r.kind} | {r.graph} | {target} | {_s(r.back_after_s)} | {r.requests} "
                    f"| {r.failed} | {r.truncated} | {_s(r.ttft_p99_before_s)} | {_s(r.ttft_p99_after_s)} "
                    f"| {added} | {_pct(r.decode_local_before)} ({r.follow_ups_before}) "
                    f"| {_pct(r.decode_local_after)} ({r.follow_ups_after}) | {recovery} |")
    notes = [f"- {r.kind}: also restarted by the supervisor: {', '.join(r.other_restarts)}"
             for r in results if r.other_restarts]
    notes += [f"- {r.kind}: router counters from the fault on: "
              + ", ".join(f"{k.removesuffix('_total').removeprefix('ppd_')} {v:g}"
                          for k, v in r.router_counters.items())
              for r in results if r.router_counters]
    notes += [f"- {r.kind}: errors seen: {'; '.join(r.errors)}" for r in results if r.errors]
    notes += [f"- {r.kind}: follow-ups sent {SETTLE_S:g} s or more after {r.target} was back: "
              f"{_pct(r.decode_local_settled)} decode-local ({r.follow_ups_settled})"
              for r in results if r.kind in SETTLED_FAULTS and r.follow_ups_settled]
    return "\n".join(rows) + ("\n\n" + "\n".join(notes) if notes else "")


def passed(result: FaultResult) -> bool:
    """The issue's target: no failed request and no truncated stream."""
    return result.failed == 0 and result.truncated == 0


def reanalyze(report: ChaosReport, records: dict[str, list[TurnRecord]], *, window_s: float,
              recovery_window_s: float, tolerance: float) -> ChaosReport:
    """``report`` recomputed from its turn records with other windows (no graph is started)."""
    results = []
    for old in report.results:
        fault = Fault(old.kind, old.target, old.at_s, old.graph, old.back_after_s, old.target_inflight)
        new = analyze(records[old.kind], fault, window_s=window_s,
                      recovery_window_s=recovery_window_s, tolerance=tolerance)
        results.append(msgspec.structs.replace(new, other_restarts=old.other_restarts,
                                               router_counters=old.router_counters))
    return msgspec.structs.replace(report, window_s=window_s, recovery_window_s=recovery_window_s,
                                   tolerance=tolerance, results=results)
