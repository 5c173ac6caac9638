"""Plays Dynamo's planner for `serve --planner external` (tests/test_planner_e2e.py): publishes
scaling decisions through the runtime's real ``VirtualConnectorCoordinator``, the object Dynamo
1.6.1's ``VirtualConnector`` drives, and waits for each to be reported done as the planner does.

    python tests/planner_decisions.py ETCD_URL NATS_URL NAMESPACE decode=2 decode=1 ...

Prints ``done ID PREFILL DECODE SECONDS`` per decision (-1: the count left unset), then reads a
line from stdin before the next one (and before it exits): one coordinator across the steps, as
one planner's life."""

import asyncio
import os
import sys
import time

from dynamo_ppd.launch.process import free_port
from dynamo_ppd.launch.servers import Endpoints, dynamo_env


async def main(etcd_url: str, nats_url: str, namespace: str, steps: list[str]) -> None:
    from dynamo._core import VirtualConnectorCoordinator
    from dynamo.runtime import DistributedRuntime

    os.environ.update(dynamo_env(Endpoints(nats_url=nats_url, etcd_url=etcd_url), free_port(below=32768)))
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    # check every 1 s, give up after 120 s, as virtual.py builds it (10 s and 30 min there)
    coordinator = VirtualConnectorCoordinator(runtime, namespace, 1, 120, 120)
    await coordinator.async_init()
    for index, step in enumerate(steps):
        if index:
            await asyncio.to_thread(sys.stdin.readline)
        counts = dict(part.split("=") for part in step.split(","))
        started = time.monotonic()
        await coordinator.update_scaling_decision(
            num_prefill=int(counts["prefill"]) if "prefill" in counts else None,
            num_decode=int(counts["decode"]) if "decode" in counts else None)
        # Polled here: 1.6.1's wait_for_scaling_completion gave up at once on a second decision
        # of one coordinator (its retries are not counted per decision).
        while not await coordinator.is_scaling_ready():
            if time.monotonic() - started > 120:
                raise SystemExit(f"decision {step} not acknowledged in 120 s")
            await asyncio.sleep(0.5)
        state = coordinator.read_state()
        print(f"done {state.decision_id} {state.num_prefill_workers} {state.num_decode_workers} "
              f"{time.monotonic() - started:.1f}", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # a planner's decisions go with its etcd lease
    runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
