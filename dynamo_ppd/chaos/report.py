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
    # The workers that served it (Dynamo's ``nvext.worker_id``; None when the answer did not say).
    # A follow-up with a decode worker and no prefill worker ran decode-local.
    decode_worker: int | None = None
    prefill_worker: int | None = None


class Fault(msgspec.Struct, frozen=True):
    """A fault as injected: what, on which process, when (seconds from the run's start), and when
    the process was back (ready again), if known."""

    kind: str
    target: str
    at_s: float
    graph: str = ""
    back_after_s: float | None = None
    target_inflight: float | None = None  # requests in flight on the target when it was hit


class ChangeStep(msgspec.Struct):
    """One step of a planned change (planned.py); times in seconds from the run's start."""

    action: str  # "restart", "add" or "retire"
    label: str
    started_s: float
    done_s: float | None = None  # ready again (restart, add), or exited (retire); None: not in time
    instance: int | None = None  # the worker's Dynamo instance id (as it served, or serves now)
    # The P:D configuration the graph had once the step was done ("2P2D"), and when a routing
    # process first reported deciding in it.
    configuration: str = ""
    seen_s: float | None = None

    @property
    def switch_s(self) -> float | None:
        """From the change (a retired worker's SIGTERM, which takes it out of discovery; a new
        worker's readiness) to the routing deciding in the new configuration; None: not seen, or
        the step changed no configuration."""
        if self.seen_s is None or self.action == "restart":
            return None
        changed = self.started_s if self.action == "retire" else self.done_s
        return None if changed is None else round(max(0.0, self.seen_s - changed), 3)


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
    # A planned change (planned.py): its steps, what the routing decided in over the run
    # ((t, configuration, basis) at each change), and `change_figures`.
    steps: list[ChangeStep] = []
    configurations: list[tuple[float, str, str]] = []
    decode_local_during: float | None = None  # follow-ups sent while the change ran
    follow_ups_during: int = 0
    decode_local_since: float | None = None  # follow-ups sent once it was done
    follow_ups_since: int = 0
    # A decode worker that joined: its share of the conversations that started in the
    # `JOINED_WINDOW_S` after it was ready, against its fair share (1 / decode workers).
    joined_share: float | None = None
    joined_fair_share: float | None = None
    joined_conversations: int = 0
    # The sessions whose last turn before a decode worker left was served there, and how their
    # next turns went: decode-local elsewhere, through a prefill worker, not ok.
    moved_sessions: int = 0
    moved_local: int = 0
    moved_via_prefill: int = 0
    moved_not_ok: int = 0


JOINED_WINDOW_S = 30.0
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


def named_workers(record: TurnRecord) -> bool:
    """Whether the frontend named the turn's own workers. Behind the relay router it names the
    router, its one aggregated backend, as both prefill and decode worker: no worker of ours."""
    return record.decode_worker is not None and record.decode_worker != record.prefill_worker


def served_decode_local(record: TurnRecord) -> bool | None:
    """Whether a successful follow-up ran decode-local: by the workers Dynamo says served it, else
    by its cached tokens (see the module docstring); None when unknown."""
    if record.turn < 2 or record.status != "ok":
        return None
    if named_workers(record):
        return record.prefill_worker is None
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


def mark_seen(steps: list[ChangeStep], configurations: list[tuple[float, str, str]]) -> None:
    """Each step's ``seen_s``: the first time, after the step began and before the next one did (a
    later step may bring the same configuration back: that is not this one's), that the routing
    decided in the configuration the step left the graph in. ``configurations``: (t, configuration,
    basis) at each change of what the routing reported; between two, it reported the earlier one
    (so a step whose configuration the routing was in already, e.g. 1P3D again after a passing
    1P4D it never planned a turn in, is seen at once)."""
    for step, following in zip(steps, [*steps[1:], None], strict=True):
        until = following.started_s if following is not None else float("inf")
        current = [config for t, config, _ in configurations if t <= step.started_s][-1:]
        if current == [step.configuration]:
            step.seen_s = step.started_s
            continue
        step.seen_s = next((t for t, config, _ in configurations
                            if step.started_s <= t < until and config == step.configuration), None)


def change_figures(records: list[TurnRecord], fault: Fault, steps: list[ChangeStep]) -> dict:
    """The figures of a planned change (`FaultResult`'s fields from ``decode_local_during`` on):
    the decode-local share during and after it, a joining decode worker's share of new
    conversations, and where the sessions of a leaving decode worker went."""
    end = fault.at_s + (fault.back_after_s or 0.0)
    during, n_during = _share([r for r in records if fault.at_s <= r.sent_s < end])
    since, n_since = _share([r for r in records if r.sent_s >= end])
    out: dict = {"decode_local_during": during, "follow_ups_during": n_during,
                 "decode_local_since": since, "follow_ups_since": n_since}
    joined = next((s for s in steps if s.action == "add" and s.label.startswith("decode")
                   and s.instance is not None and s.done_s is not None), None)
    if fault.kind not in ("scale-out", "ratio-change"):
        joined = None  # (a rolling restart's new decode workers replace old ones: no fair share to take)
    if joined is not None:
        assert joined.done_s is not None
        started = [r for r in records if r.turn == 1 and r.status == "ok" and named_workers(r)
                   and joined.done_s <= r.sent_s < joined.done_s + JOINED_WINDOW_S]
        workers = int(joined.configuration.partition("P")[2].rstrip("D") or 0)
        out.update(joined_conversations=len(started),
                   joined_share=(sum(r.decode_worker == joined.instance for r in started) / len(started)
                                 if started else None),
                   joined_fair_share=1 / workers if workers and started else None)
    by_conversation: dict[str, list[TurnRecord]] = {}
    for r in sorted(records, key=lambda r: (r.conversation_id, r.turn)):
        by_conversation.setdefault(r.conversation_id, []).append(r)
    moved = local = via = not_ok = 0
    for step in steps:
        if step.action != "retire" or not step.label.startswith("decode") or step.instance is None:
            continue
        for turns in by_conversation.values():
            before = [r for r in turns if r.sent_s < step.started_s]
            after = [r for r in turns if r.sent_s >= step.started_s]
            if not before or not after or not named_workers(before[-1]) \
                    or before[-1].decode_worker != step.instance:
                continue
            moved += 1
            following = after[0]
            if following.status != "ok":
                not_ok += 1
            elif following.prefill_worker is None:
                local += 1
            else:
                via += 1
    out.update(moved_sessions=moved, moved_local=local, moved_via_prefill=via, moved_not_ok=not_ok)
    return out


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


PLANNED_KINDS = ("rolling-restart", "scale-out", "scale-in", "ratio-change")  # planned.PLANNED


def markdown(results: list[FaultResult]) -> str:
    """The faults' table (and notes), then the planned changes' (`planned_markdown`)."""
    faults = [r for r in results if r.kind not in PLANNED_KINDS]
    planned = [r for r in results if r.kind in PLANNED_KINDS]
    parts = [_faults_markdown(faults)] if faults else []
    return "\n\n".join([*parts, *([planned_markdown(planned)] if planned else [])])


def _counters(r: FaultResult) -> str:
    """The routers' counters of a fault, as a note reads them ("rehomes 4, residency_misses 5")."""
    return ", ".join(f"{k.removesuffix('_total').removeprefix('ppd_')} {v:g}"
                     for k, v in r.router_counters.items())


def _switch(r: FaultResult) -> str:
    """The slowest step's switch; a configuration no decision was made in (a step's, left before the
    routing planned a turn, e.g. 1P2D between a ratio change's retirement and its addition) is
    counted apart."""
    switches = [s.switch_s for s in r.steps if s.action != "restart"]
    if not switches:
        return "–"
    seen = [x for x in switches if x is not None]
    unseen = len(switches) - len(seen)
    text = f"{max(seen):.2f} s" if seen else "not seen"
    return text + (f" ({unseen} passing configuration{'s' if unseen > 1 else ''} not decided in)"
                   if unseen and seen else "")


def planned_markdown(results: list[FaultResult]) -> str:
    """Planned changes: what each did, its failures, the decode-local share of follow-ups before,
    during and after it, and the routing's switch to the new P:D configuration (the slowest step's);
    then per change its steps, a joining worker's share, where a leaving worker's sessions went."""
    rows = ["| change | graph | what | took | requests | failed | truncated | decode-local before "
            "| during | after | switch to the new configuration |", "|" + "---|" * 11]
    notes = []
    for r in results:
        rows.append(f"| {r.kind} | {r.graph} | {r.target} | {_s(r.back_after_s)} | {r.requests} "
                    f"| {r.failed} | {r.truncated} | {_pct(r.decode_local_before)} ({r.follow_ups_before}) "
                    f"| {_pct(r.decode_local_during)} ({r.follow_ups_during}) "
                    f"| {_pct(r.decode_local_since)} ({r.follow_ups_since}) | {_switch(r)} |")
        steps = "; ".join(
            f"{s.action} {s.label} at {s.started_s:.1f} s, done "
            f"{_s(None if s.done_s is None else s.done_s - s.started_s)}"
            + (f", {s.configuration} decided in after {_s(s.switch_s)}" if s.action != "restart" else "")
            for s in r.steps)
        notes.append(f"- {r.kind}: {steps}")
        if r.joined_fair_share is not None:
            notes.append(f"- {r.kind}: the joining decode worker took {_pct(r.joined_share)} of the "
                         f"{r.joined_conversations} conversations that started in the {JOINED_WINDOW_S:g} s "
                         f"after it was ready (fair share {_pct(r.joined_fair_share)})")
        elif r.kind in ("scale-out", "ratio-change"):
            notes.append(f"- {r.kind}: no answer named its decode worker (behind the relay router the "
                         "frontend names the router), so the joining worker's share and the leaving "
                         "worker's sessions are not measured")
        if r.moved_sessions:
            notes.append(f"- {r.kind}: {r.moved_sessions} sessions last served by a decode worker that left "
                         f"went on: {r.moved_local} decode-local, {r.moved_via_prefill} through a prefill "
                         f"worker, {r.moved_not_ok} not ok")
        if r.configurations:
            notes.append(f"- {r.kind}: the routing decided in " + ", ".join(
                f"{config} ({basis}) from {t:.1f} s" for t, config, basis in r.configurations))
        if r.router_counters:
            notes.append(f"- {r.kind}: router counters from the change on: {_counters(r)}")
        if r.errors:
            notes.append(f"- {r.kind}: errors seen: {'; '.join(r.errors)}")
    return "\n".join(rows) + "\n\n" + "\n".join(notes)


def _faults_markdown(results: list[FaultResult]) -> str:
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
    notes += [f"- {r.kind}: router counters from the fault on: {_counters(r)}"
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
        new = msgspec.structs.replace(new, other_restarts=old.other_restarts,
                                      router_counters=old.router_counters, steps=old.steps,
                                      configurations=old.configurations)
        if old.steps:
            mark_seen(old.steps, old.configurations)
            new = msgspec.structs.replace(new, **change_figures(records[old.kind], fault, old.steps))
        results.append(new)
    return msgspec.structs.replace(report, window_s=window_s, recovery_window_s=recovery_window_s,
                                   tolerance=tolerance, results=results)
