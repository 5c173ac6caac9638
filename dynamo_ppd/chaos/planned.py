"""Planned changes of a running graph, as a deployment sees them (issue 42): the adapters that make
them (processes, clocks) and what the routing component said meanwhile. The analysis of the turns
is report.py's.

- ``rolling-restart``: every prefill and decode worker in turn is replaced, as a Deployment rollout
  replaces its pods under Kubernetes' default strategy (maxSurge 25% rounded up, maxUnavailable 25%
  rounded down: 1 and 0 for up to 3 replicas): a new process (a new Dynamo instance id) starts and
  is ready, then the old one gets SIGTERM and its grace period (the component's stop timeout); the
  next waits `ROLL_GAP_S`. (Restarting a graph's only prefill worker in place instead leaves the
  frontend without one: it answers every request 503 "not ready" until the worker is back.)
- ``scale-out``: one more decode worker (``--target prefill``: a prefill worker) joins.
- ``scale-in``: the busiest decode worker (``--target``: another) is drained and leaves.
- ``ratio-change``: 1P3D becomes 2P2D (the busiest decode worker leaves, a prefill worker joins)
  and, `RATIO_HOLD_S` later, back (the newest prefill worker leaves, a decode worker joins).

A worker that leaves gets SIGTERM: Dynamo's graceful shutdown (``runtime.shutdown()``, our
components' `runtime.create_runtime`; ``serve_endpoint(..., graceful_shutdown=True)``) takes it out
of discovery at once and lets it finish the answers it is streaming, so the frontend and the
picker stop sending it work while nothing in flight is cut. The harness adds no mechanism of its
own: what it measures is what Dynamo and PPD do with that.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from ..launch import Deployment
from .report import ChangeStep as Step

PLANNED = ("rolling-restart", "scale-out", "scale-in", "ratio-change")
ROLL_GAP_S = 2.0  # between one worker of a rolling restart being ready and the next one's SIGTERM
RATIO_HOLD_S = 20.0  # how long the new ratio holds before a ratio change goes back
_INSTANCE = re.compile(r"serving \S+ as instance ([0-9a-f]+)")
_CONFIGURATION = re.compile(r'^ppd_pd_configuration\{([^}]*)\}\s+(\S+)', re.MULTILINE)


@dataclass
class Change:
    """A planned change as it ran: its steps, the worker it aimed at, and what the routing
    processes reported deciding in (configuration, basis) over the run."""

    kind: str
    target: str
    steps: list[Step] = field(default_factory=list)
    configurations: list[tuple[float, str, str]] = field(default_factory=list)  # (t, configuration, basis)


def instance_id(dep: Deployment, label: str) -> int | None:
    """The Dynamo instance id a worker serves as, from its latest start's log line."""
    proc = dep.process(label)
    try:
        with open(proc.log_path, "rb") as log:
            log.seek(proc.log_offset)
            found = _INSTANCE.findall(log.read().decode(errors="replace"))
    except OSError:
        return None
    return int(found[-1], 16) if found else None


def configuration(dep: Deployment) -> str:
    """The graph's P:D configuration as its process list stands ("1P3D")."""
    return f"{len(dep.labels('prefill'))}P{len(dep.labels('decode'))}D"


class ConfigurationWatch:
    """Polls the routing processes' ``ppd_pd_configuration`` gauge (every ``poll_s``) and keeps
    each change of what they decide in, with its time from ``t0``."""

    def __init__(self, dep: Deployment, t0: float, poll_s: float = 0.25):
        self.dep, self.t0, self.poll_s = dep, t0, poll_s
        self.seen: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-configuration-watch", daemon=True)

    def __enter__(self) -> ConfigurationWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _read(self) -> tuple[str, str] | None:
        try:
            urls = list(self.dep.metrics_urls.values())
        except RuntimeError:  # a scale step changed the dict mid-copy: the next poll reads it
            return None
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 (loopback)
                    text = response.read().decode()
            except OSError:
                continue
            for labels, value in _CONFIGURATION.findall(text):
                if float(value) == 1.0:
                    pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                    return pairs.get("configuration", ""), pairs.get("basis", "")
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self._read()
            if now is not None and (not self.seen or self.seen[-1][1:] != now):
                self.seen.append((round(time.monotonic() - self.t0, 3), *now))
            self._stop.wait(self.poll_s)


def _busiest(dep: Deployment, component: str, inflight: Callable[[Deployment, str], float]) -> str:
    labels = dep.labels(component)
    if not labels:
        raise ValueError(f"the graph has no {component} worker")
    return max(labels, key=lambda label: inflight(dep, label))


def run_change(dep: Deployment, kind: str, target: str | None, t0: float,
               inflight: Callable[[Deployment, str], float], say: Callable[[str], None],
               roll_gap_s: float = ROLL_GAP_S, hold_s: float = RATIO_HOLD_S) -> Change:
    """Make the planned change ``kind`` on ``dep`` (blocking: run it in a thread); ``target``: a
    process label (scale-in), or the component to add (scale-out: ``prefill``)."""
    clock = lambda: round(time.monotonic() - t0, 3)  # noqa: E731

    def add(component: str) -> Step:
        step = Step("add", component, clock())
        label, event = dep.add_replica(component, timeout_s=120)
        step.label = label
        step.done_s = None if event.ready_at is None else round(event.ready_at - t0, 3)
        step.instance, step.configuration = instance_id(dep, label), configuration(dep)
        say(f"  {kind}: {label} joined, ready after "
            f"{(step.done_s or step.started_s) - step.started_s:.1f} s ({step.configuration})")
        return step

    def retire(label: str) -> Step:
        step = Step("retire", label, clock(), instance=instance_id(dep, label))
        event = dep.retire(label, timeout_s=120)
        step.done_s, step.configuration = clock(), configuration(dep)
        say(f"  {kind}: {label} drained and gone after {step.done_s - step.started_s:.1f} s "
            f"(exit {event.exit_code}; {step.configuration})")
        return step

    if kind == "rolling-restart":
        change = Change(kind, "every prefill and decode worker, surge first")
        for i, label in enumerate([*dep.labels("prefill"), *dep.labels("decode")]):
            if i:
                time.sleep(roll_gap_s)
            change.steps += [add(label.partition("-")[0]), retire(label)]
    elif kind == "scale-out":
        component = target or "decode"
        change = Change(kind, f"+1 {component}")
        change.steps.append(add(component))
    elif kind == "scale-in":
        label = target if target and target not in ("decode", "prefill") else \
            _busiest(dep, target or "decode", inflight)
        change = Change(kind, label)
        change.steps.append(retire(label))
    elif kind == "ratio-change":
        leaving = _busiest(dep, "decode", inflight)
        change = Change(kind, f"{configuration(dep)} -> {len(dep.labels('prefill')) + 1}P"
                              f"{len(dep.labels('decode')) - 1}D -> back")
        change.steps += [retire(leaving), add("prefill")]
        time.sleep(hold_s)
        change.steps += [retire(dep.labels("prefill")[-1]), add("decode")]
    else:
        raise ValueError(f"not a planned change: {kind!r} (one of {', '.join(PLANNED)})")
    return change
