"""The local graph's side of Dynamo's planner: a ``VirtualConnectorClient`` that turns each of the
planner's decisions into the launcher's scale-out and scale-in, and reports it done.

Dynamo 1.6.1's ``VirtualConnector`` (``dynamo/planner/connectors/virtual.py``) publishes a
decision (``decision_id``, ``num_prefill_workers``, ``num_decode_workers``; -1 means unset) and
waits for the deployment to call ``complete`` on it; it then also checks that the worker counts it
discovers match. This process runs beside the graph (`serve --planner` starts it, planner.py):

1. wait for a decision (``wait``, polled every 2 s so a stop is never held up), and act on it
   if it is new or the graph's running replicas (the control channel's ``/status``) differ from
   it: level-triggered, as an operator reconciles a Deployment's replicas, so a replica count the
   planner set holds (the planner owns the prefill and decode counts while it runs);
2. add the missing replicas first, then retire the surplus (a surge, as a rollout does: capacity
   never dips below the smaller of the two layouts), each through the control channel, which
   waits for a new worker to be ready and for a retired one to drain and exit;
3. ``complete`` the decision, and append what was done to RUN_DIR/planner-decisions.jsonl.

Which replica leaves on a scale-in follows from what a scale-in costs PPD: every session whose
history the leaving decode worker holds is re-prefilled elsewhere on its next turn. So the replica
holding the least KV leaves (its ``dynamo_ppd_engine_kv_used_blocks``); on a tie, the newest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import signal
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .control import ControlError, call, control_url
from .graph import replicas_of
from .planner import DECISIONS_FILE, ROLES

log = logging.getLogger("dynamo_ppd.scaler")

WAIT_POLL_S = 2.0  # how long one wait() may block before the loop looks again
STEP_TIMEOUT_S = 120.0  # one replica's start or drain


def _replica_index(label: str) -> int:
    tail = label.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0


@dataclass
class ScalePlan:
    add: list[str] = field(default_factory=list)  # component names, one entry a replica
    retire: list[str] = field(default_factory=list)  # process labels

    @property
    def empty(self) -> bool:
        return not (self.add or self.retire)


def plan(running: dict[str, list[str]], wanted: dict[str, int], kv_used: dict[str, float]) -> ScalePlan:
    """What takes ``running`` (component -> replica labels) to ``wanted`` (component -> count; a
    negative count is unset and left alone). A scale-in retires the replicas holding the least KV
    (``kv_used``: label -> blocks; unknown counts as the most), newest first on a tie."""
    out = ScalePlan()
    for component, count in wanted.items():
        if count < 0:
            continue
        have = running.get(component, [])
        if count > len(have):
            out.add += [component] * (count - len(have))
        elif count < len(have):
            ranked = sorted(have, key=lambda label: (kv_used.get(label, math.inf), -_replica_index(label)))
            out.retire += ranked[:len(have) - count]
    return out


class Decision(msgspec.Struct):
    """One of the planner's decisions and what this client did about it: a line of
    RUN_DIR/planner-decisions.jsonl."""

    decision_id: int
    prefill: int  # -1: left unset
    decode: int
    received_at: float  # unix time
    before: dict[str, int]  # role -> running replicas when it arrived
    added: list[str] = msgspec.field(default_factory=list)
    retired: list[str] = msgspec.field(default_factory=list)
    errors: list[str] = msgspec.field(default_factory=list)
    completed_at: float | None = None


def read_decisions(path: Path) -> list[Decision]:
    """The decisions file, validated; empty when no decision was made."""
    if not path.exists():
        return []
    return [msgspec.json.decode(line, type=Decision) for line in path.read_bytes().splitlines() if line]


_KV_USED = re.compile(r"^dynamo_ppd_engine_kv_used_blocks\s+(\S+)", re.MULTILINE)


def _kv_used(system_port: int | None) -> float | None:
    if not system_port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{system_port}/metrics", timeout=2) as response:  # noqa: S310
            found = _KV_USED.search(response.read().decode())
    except OSError:
        return None
    return float(found.group(1)) if found else None


class GraphControl:
    """The running graph as this client sees it: run.json and the control channel."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.url = control_url(run_dir)

    def running(self) -> dict[str, list[str]]:
        alive = [p["label"] for p in call(self.url, "/status")["processes"] if p["alive"]]
        return {component: replicas_of(alive, component) for component in ROLES.values()}

    def kv_used(self, labels: list[str]) -> dict[str, float]:
        record = json.loads((self.run_dir / "run.json").read_text())
        ports = {p["label"]: p.get("system_port") for p in record["processes"]}
        used = {label: _kv_used(ports.get(label)) for label in labels}
        return {label: value for label, value in used.items() if value is not None}

    def add(self, component: str) -> str:
        return str(call(self.url, "/add", {"component": component, "timeout_s": STEP_TIMEOUT_S},
                        timeout_s=STEP_TIMEOUT_S + 30)["label"])

    def retire(self, label: str) -> None:
        call(self.url, "/retire", {"label": label, "timeout_s": STEP_TIMEOUT_S},
             timeout_s=STEP_TIMEOUT_S + 30)


def settled(running: dict[str, list[str]], wanted: dict[str, int]) -> bool:
    """Whether the running replicas already match every count the decision sets."""
    return all(count < 0 or len(running.get(component, [])) == count for component, count in wanted.items())


def carry_out(graph: GraphControl, decision: Decision, running: dict[str, list[str]],
              say: Callable[[str], None]) -> Decision:
    """Scale the graph from ``running`` to ``decision``'s counts (blocking: run it off the event
    loop)."""
    decision.before = {role: len(running[component]) for role, component in ROLES.items()}
    wanted = {ROLES["prefill"]: decision.prefill, ROLES["decode"]: decision.decode}
    steps = plan(running, wanted, graph.kv_used([label for labels in running.values() for label in labels]))
    for component in steps.add:
        try:
            label = graph.add(component)
            decision.added.append(label)
            say(f"  added {label}")
        except ControlError as exc:
            decision.errors.append(f"add {component}: {exc}")
            say(f"  could not add a {component} replica: {exc}")
    for label in steps.retire:
        try:
            graph.retire(label)
            decision.retired.append(label)
            say(f"  retired {label}")
        except ControlError as exc:
            decision.errors.append(f"retire {label}: {exc}")
            say(f"  could not retire {label}: {exc}")
    return decision


def _layout(counts: dict[str, int]) -> str:
    return f"{counts.get('prefill', 0)}P{counts.get('decode', 0)}D"


async def run(run_dir: Path, namespace: str) -> None:
    from dynamo._core import VirtualConnectorClient

    from ..runtime import create_runtime

    runtime = create_runtime()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # over create_runtime's: stop the loop, then the runtime

        def stop() -> None:
            stopping.set()
            runtime.shutdown()

        loop.add_signal_handler(sig, stop)
    client = VirtualConnectorClient(runtime, namespace)
    graph = GraphControl(run_dir)
    record_path = run_dir / DECISIONS_FILE
    log.info("waiting for the planner's decisions in namespace %s (control channel %s)", namespace, graph.url)
    done: int | None = None
    while not stopping.is_set():
        try:
            await asyncio.wait_for(client.wait(), timeout=WAIT_POLL_S)
            got = await client.get()
        except asyncio.TimeoutError:
            got = await client.get()
        except Exception:  # noqa: BLE001 (the runtime's "Runtime shutdown" once we are stopped)
            if stopping.is_set():
                break
            raise
        # 1.6.1's _core.pyi names decision_id in PlannerDecision's docstring but not as a field.
        decision_id = int(got.decision_id)  # type: ignore[attr-defined]
        if decision_id < 0:
            continue
        wanted = {ROLES["prefill"]: int(got.num_prefill_workers),
                  ROLES["decode"]: int(got.num_decode_workers)}
        # Level-triggered, as an operator reconciles replicas: a decision already reported done is
        # acted on again while the graph differs from it. A restarted 1.6.1 planner numbers its
        # decisions from 0 again, and its coordinator takes the old acknowledgement of decision 0
        # as this one's (`VirtualConnectorCoordinator` keeps no count across restarts).
        try:
            running = await asyncio.to_thread(graph.running)
        except ControlError as exc:  # the graph is stopping, or its channel is busy: look again
            log.warning("cannot read the graph's replicas: %s", exc)
            await asyncio.sleep(WAIT_POLL_S)
            continue
        if decision_id == done and settled(running, wanted):
            continue
        decision = Decision(decision_id, wanted[ROLES["prefill"]], wanted[ROLES["decode"]],
                            round(time.time(), 3), {})
        log.info("planner decision %d: prefill %s, decode %s", decision.decision_id,
                 decision.prefill if decision.prefill >= 0 else "unchanged",
                 decision.decode if decision.decode >= 0 else "unchanged")
        decision = await asyncio.to_thread(carry_out, graph, decision, running, log.info)
        await client.complete(got)
        decision.completed_at = round(time.time(), 3)
        done = decision_id
        after = {role: count if count >= 0 else decision.before.get(role, 0)
                 for role, count in (("prefill", decision.prefill), ("decode", decision.decode))}
        log.info("planner decision %d done in %.1f s: %s -> %s", decision.decision_id,
                 decision.completed_at - decision.received_at, _layout(decision.before), _layout(after))
        with open(record_path, "a") as out:
            out.write(msgspec.json.encode(decision).decode() + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_ppd.launch.scaler",
        description="Act on Dynamo's planner's decisions for a graph run by `dynamo-ppd serve`: add "
        "and retire its prefill and decode replicas through the serve run's control channel.")
    parser.add_argument("--run-dir", type=Path, required=True, help="the serve run's directory (run.json)")
    parser.add_argument("--namespace", default="dynamo", help="the graph's Dynamo namespace")
    args = parser.parse_args(argv)
    from ..runtime import run_component

    run_component(lambda a: run(a.run_dir, a.namespace), args)


if __name__ == "__main__":
    main()
