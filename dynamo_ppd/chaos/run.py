"""One chaos run per fault: a fresh supervised graph, the workload, the fault at its time, the turn
records, the analysis (report.py). The adapters around the pure report: processes, HTTP, clocks.

Faults (each on its own graph so one cannot colour the next):

- ``decode-kill``: SIGKILL the decode worker with the most requests in flight (its Dynamo system
  metrics), or ``--target``; the supervisor starts it again (empty KV cache, new instance id);
- ``prefill-kill``: the same for a prefill worker, on 2P2D by default;
- ``router-restart``: SIGTERM one of two replicas of the graph's routing component (the relay
  router of ``ppd-relay``, the endpoint picker of ``ppd``) and start it again (a rolling restart);
- ``picker-kill``: SIGKILL the endpoint picker (the `ppd` graph; with one replica, the gateway
  fails open to Dynamo's frontend meanwhile); the supervisor starts it again. Not in the default
  set: its figure is the decode-local share once the picker is back (`report.SETTLE_S`);
- ``etcd-restart``: SIGTERM etcd and start it again on the same data directory;
- ``nats-restart``: SIGTERM nats-server and start it again (same JetStream store directory).

Planned changes (planned.py; not in the default set): ``rolling-restart``, ``scale-out``,
``scale-in``, ``ratio-change`` (1P3D to 2P2D and back).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..launch import Deployment, ServeOptions, start
from ..launch.graph import load_graph
from ..launch.process import free_port
from ..workloads.manifest import Manifest
from .client import play
from .planned import PLANNED, RATIO_HOLD_S, Change, ConfigurationWatch, run_change
from .report import Fault, FaultResult, TurnRecord, analyze, change_figures, counter_delta, mark_seen

FAULTS = ("decode-kill", "prefill-kill", "router-restart", "etcd-restart", "nats-restart", "picker-kill",
          *PLANNED)
DEFAULT_FAULTS = FAULTS[:5]

# The layout each fault runs on (over the graph's own counts; --replicas overrides).
FAULT_REPLICAS: dict[str, dict[str, int]] = {
    "decode-kill": {},
    "prefill-kill": {"prefill": 2, "decode": 2},
    "router-restart": {"router": 2},  # the picker's on a graph with one (`_layout`)
    "etcd-restart": {},
    "nats-restart": {},
    "picker-kill": {},
    "rolling-restart": {},
    "scale-out": {},
    "scale-in": {},  # a prefill worker's (--target prefill): 2P2D (`_layout`)
    "ratio-change": {"prefill": 1, "decode": 3},  # to 2P2D and back
}


@dataclass
class RunSettings:
    graph: str = "ppd"
    rate: float = 2.0
    duration_s: float = 90.0  # arrivals; no turn is sent after it
    fault_at_s: float = 45.0
    workload: str = "wildchat"
    seed: int = 0
    replicas: dict[str, int] = field(default_factory=dict)
    target: str | None = None  # a process label; default: chosen per fault
    aim_s: float = 10.0  # worker kills: wait this long at most for a request in flight
    window_s: float = 25.0
    recovery_window_s: float = 10.0
    tolerance: float = 0.05
    run_root: Path = Path("runs/chaos")
    mode: str | None = None  # the routing component's --mode (relay router or picker); None: the graph's
    system_tokens: int = 0  # a system prompt of this many tokens, the same in every conversation
    hold_s: float = RATIO_HOLD_S  # ratio-change: how long the new ratio holds before it goes back


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


_INFLIGHT = re.compile(r'^dynamo_component_inflight_requests\{[^}]*dynamo_endpoint="generate"[^}]*\}\s+(\S+)',
                       re.MULTILINE)


def inflight(dep: Deployment, label: str) -> float:
    """Requests in flight on a worker's generate endpoint (Dynamo's system metrics); -1 if unread."""
    port = dep.process(label).env.get("DYN_SYSTEM_PORT")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:  # noqa: S310
            text = response.read().decode()
    except OSError:
        return -1.0
    return sum(float(v) for v in _INFLIGHT.findall(text))


ROUTER_COUNTERS = ("ppd_migrations_total", "ppd_residency_misses_total", "ppd_rehomes_total",
                   "ppd_request_errors_total", "ppd_residency_resyncs_total", "ppd_residency_gaps_total",
                   "ppd_residency_orphans_total")


def router_counters(dep: Deployment) -> dict[str, dict[str, float]]:
    """Per router process (``label@pid``): the counters of ROUTER_COUNTERS (summed over labels)
    and the follow-up decisions by route and reason (``follow_up:<route>:<reason>``). Unreadable
    routers are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for label, url in dep.metrics_urls.items():
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback)
                text = response.read().decode()
        except OSError:
            continue
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ROUTER_COUNTERS:
                    counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
                elif sample.name == "ppd_decisions_total" and sample.labels.get("turn") == "follow_up":
                    key = f"follow_up:{sample.labels.get('route')}:{sample.labels.get('reason')}"
                    counters[key] = counters.get(key, 0.0) + sample.value
        popen = dep.process(label).popen
        out[f"{label}@{popen.pid if popen else 0}"] = counters
    return out


def choose_target(dep: Deployment, kind: str, named: str | None,
                  aim_s: float = 0.0) -> tuple[str, float | None]:
    """The process to hit and the requests it has in flight (None where not a worker). For a
    worker kill, wait up to ``aim_s`` for one to have a request in flight: a prefill takes tens of
    milliseconds, so a prefill worker picked at a random instant is almost always idle and its kill
    would test nothing."""
    if named:
        label = dep.process(named).label
        seen = inflight(dep, label) if dep.process(label).env.get("DYN_SYSTEM_PORT") else -1.0
        return label, None if seen < 0 else seen
    if kind in ("decode-kill", "prefill-kill"):
        labels = dep.labels("decode" if kind == "decode-kill" else "prefill")
        if not labels:
            raise ValueError(f"the graph has no {kind.split('-')[0]} worker to kill")
        # The busiest one: the most answers to break, the most sessions to move.
        deadline = time.monotonic() + aim_s
        while True:
            load = {label: inflight(dep, label) for label in labels}
            if max(load.values()) >= 1 or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        _say(f"  requests in flight: {', '.join(f'{k} {v:g}' for k, v in load.items())}")
        busiest = max(labels, key=lambda label: load[label])
        return busiest, load[busiest]
    if kind == "picker-kill":
        labels = dep.labels(ROUTING_COMPONENTS[1])
        if not labels:
            raise ValueError("the graph has no endpoint picker to kill (use --graph ppd)")
        return labels[0], None
    if kind == "router-restart":
        label = (dep.labels("router") or dep.labels(ROUTING_COMPONENTS[1]))[0]
        return label, inflight(dep, label) if dep.process(label).env.get("DYN_SYSTEM_PORT") else None
    return ("etcd" if kind == "etcd-restart" else "nats-server"), None


def inject(dep: Deployment, kind: str, target: str) -> float | None:
    """Inject the fault; block until the process is back and ready; seconds it took (None: never)."""
    assert dep.supervisor is not None
    went_down = time.monotonic()
    if kind.endswith("-kill"):
        before = dep.supervisor.restarts(target)
        dep.kill(target, signal.SIGKILL)
        deadline = went_down + 90
        while time.monotonic() < deadline:
            events = [e for e in dep.supervisor.events if e.label == target]
            if dep.supervisor.restarts(target) > before and events[-1].ready_at is not None:
                return events[-1].ready_at - went_down
            time.sleep(0.1)
        return None
    try:
        event = dep.restart(target, timeout_s=90)
    except TimeoutError:
        return None
    return None if event.ready_at is None else event.ready_at - went_down


class _Progress:
    def __init__(self, label: str):
        self.label, self.done, self.failed, self.truncated = label, 0, 0, 0
        self.last = 0.0

    def __call__(self, record: TurnRecord) -> None:
        self.done += 1
        self.failed += record.status == "failed"
        self.truncated += record.status == "truncated"
        if record.status != "ok":
            _say(f"  {self.label}: turn {record.turn} of {record.conversation_id} {record.status} at "
                 f"{record.sent_s:.1f} s: {record.error or record.finish_reason or 'short'}")
        now = time.monotonic()
        if now - self.last > 10:
            self.last = now
            _say(f"  {self.label}: {self.done} turns, {self.failed} failed, {self.truncated} truncated")


async def _play_with_fault(dep: Deployment, manifest: Manifest, settings: RunSettings, kind: str,
                           progress: _Progress
                           ) -> tuple[list[TurnRecord], Fault, dict[str, float], Change | None]:
    t0 = time.monotonic()
    fault: list[Fault] = []
    snapshots: list[dict[str, dict[str, float]]] = []
    changes: list[Change] = []

    async def change_task() -> None:
        await asyncio.sleep(max(0.0, t0 + settings.fault_at_s - time.monotonic()))
        snapshots.append(await asyncio.to_thread(router_counters, dep))
        at = time.monotonic() - t0
        _say(f"  {kind}: starting at {at:.1f} s")
        change = await asyncio.to_thread(run_change, dep, kind, settings.target, t0, inflight, _say,
                                         hold_s=settings.hold_s)
        changes.append(change)
        done = max((s.done_s or s.started_s for s in change.steps), default=at)
        fault.append(Fault(kind, change.target, round(at, 3), back_after_s=round(done - at, 3)))

    async def fault_task() -> None:
        await asyncio.sleep(max(0.0, t0 + settings.fault_at_s - time.monotonic()))
        target, load = await asyncio.to_thread(choose_target, dep, kind, settings.target, settings.aim_s)
        snapshots.append(await asyncio.to_thread(router_counters, dep))
        at = time.monotonic() - t0
        _say(f"  {kind}: {target} at {at:.1f} s")
        back = await asyncio.to_thread(inject, dep, kind, target)
        _say(f"  {kind}: {target} back (ready) after {back:.1f} s" if back is not None
             else f"  {kind}: {target} NOT back within 90 s")
        fault.append(Fault(kind, target, round(at, 3), back_after_s=None if back is None else round(back, 3),
                           target_inflight=load))

    planned = kind in PLANNED
    # A planned change's routing reports what it decides in throughout (`ConfigurationWatch`).
    with ConfigurationWatch(dep, t0) if planned else contextlib.nullcontext() as watch:
        faulting = asyncio.create_task(change_task() if planned else fault_task())
        records = await play(dep.base_url, manifest, t0, seed=settings.seed, on_record=progress,
                             stop_sending_s=settings.duration_s, system_tokens=settings.system_tokens)
        await faulting
    change = changes[0] if changes else None
    if change is not None and watch is not None:
        change.configurations = list(watch.seen)
        mark_seen(change.steps, change.configurations)
    snapshots.append(await asyncio.to_thread(router_counters, dep))
    return records, fault[0], counter_delta(snapshots[0], snapshots[1]), change


ROUTING_COMPONENTS = ("router", "picker")  # the relay router's graphs, the endpoint picker's


def _layout(kind: str, graph: str, target: str | None = None) -> dict[str, int]:
    """The fault's replica counts on ``graph``: ``router-restart`` doubles whichever routing
    component the graph has."""
    layout = dict(FAULT_REPLICAS[kind])
    if kind == "scale-in" and target is not None and target.startswith("prefill"):
        layout = {"prefill": 2, "decode": 2}  # a prefill worker can leave only where there are two
    if "router" in layout:
        names = {c.name for c in load_graph(graph)[0].components}
        if "router" not in names and ROUTING_COMPONENTS[1] in names:
            layout[ROUTING_COMPONENTS[1]] = layout.pop("router")
    return layout


def run_fault(kind: str, settings: RunSettings, manifest: Manifest) -> tuple[FaultResult, list[TurnRecord]]:
    replicas = {**_layout(kind, settings.graph, settings.target), **settings.replicas}
    layout = ",".join(f"{k}={v}" for k, v in replicas.items()) or "graph defaults"
    run_dir = settings.run_root / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    _say(f"{kind}: bringing up {settings.graph} ({layout}, supervised), logs in {run_dir}/logs")
    extra = {}
    if settings.mode:
        names = {c.name for c in load_graph(settings.graph)[0].components}
        extra = {c: ["--mode", settings.mode] for c in ROUTING_COMPONENTS if c in names}
    dep = start(ServeOptions(graph=settings.graph, http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), run_dir=run_dir, replicas=replicas, supervise=True,
                             extra_args=extra),
                log=lambda m: None)
    try:
        counts = {c.name: c.replicas for c in dep.graph.components}
        routing = "router" if "router" in counts else ROUTING_COMPONENTS[1]
        graph = f"{counts.get('prefill', 0)}P{counts.get('decode', 0)}D" + (
            f", {counts[routing]} {routing}s" if counts.get(routing, 1) > 1 else "")
        progress = _Progress(kind)
        _say(f"{kind}: playing {len(manifest.conversations)} conversations over {settings.duration_s:.0f} s "
             f"at {settings.rate:g} conv/s; fault at {settings.fault_at_s:.0f} s")
        played = asyncio.run(_play_with_fault(dep, manifest, settings, kind, progress))
        records, fault, counters, change = played
        events = dep.supervisor.events if dep.supervisor else []
        # e.g. a worker that exited because etcd went away: part of the fault's effect.
        others = [f"{e.label} (exit {e.exit_code})" for e in events
                  if e.label != fault.target and e.reason == "exited"]
        if others:
            _say(f"{kind}: other processes restarted by the supervisor: {', '.join(others)}")
    finally:
        dep.stop()
    fault = msgspec.structs.replace(fault, graph=graph)
    result = analyze(records, fault, window_s=settings.window_s,
                     recovery_window_s=settings.recovery_window_s, tolerance=settings.tolerance)
    result = msgspec.structs.replace(result, other_restarts=others, router_counters=counters)
    if change is not None:
        result = msgspec.structs.replace(result, steps=change.steps, configurations=change.configurations,
                                         **change_figures(records, fault, change.steps))
    _say(f"{kind}: {result.requests} turns, {result.failed} failed, {result.truncated} truncated, "
         f"recovery {result.recovery_s} s")
    return result, records
