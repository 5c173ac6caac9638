"""One model, two clocks: the live worker (wall clock, real Dynamo request plane) and the
virtual-clock simulation give the same TTFT and TPOT for the same small multi-turn workload."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.launch.servers import dynamo_env
from dynamo_ppd.sim import Cluster, Conversation, Turn, replica_router, simulate
from dynamo_ppd.sim.conversation import ConversationPrompts

pytestmark = pytest.mark.e2e

# Modeled time runs at a quarter of real speed, so the few milliseconds the request plane and
# the Python handler add to each request on a busy 2-core machine (which the model does not
# include) weigh a quarter as much against modeled times.
SPEEDUP = 0.25

GRAPH = """
name: wall
components:
  - name: frontend
    command: ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}"]
    ready: {http: "http://127.0.0.1:{http_port}/health"}
  - name: worker
    command: ["{python}", "-m", "dynamo_ppd.worker", "--model-path", "{model_dir}",
              "--disaggregation-mode", "agg", "--speedup", "SPEEDUP"]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
""".replace("SPEEDUP", str(SPEEDUP))

# Six overlapping conversations of two turns: long first prompts, then follow-ups appended to the
# cached history. The think time lets every first-turn prefill finish before the follow-ups
# start: otherwise a follow-up arriving a fraction of a millisecond on either side of a 40 ms
# prefill iteration's start (the client sees tokens slightly after the model emits them) waits
# that whole iteration in one run and not in the other, which is noise, not model error.
WORKLOAD = [Conversation(f"c{i}", arrival_s=0.15 * i,
                         turns=[Turn(1200 + 100 * i, 40), Turn(400, 40, think_time_s=1.0)], seed=3)
            for i in range(6)]


async def _live(endpoints) -> dict[tuple[str, int], tuple[float, float]]:
    """(TTFT, TPOT) in model seconds per (conversation, turn), measured by a client of the live
    worker."""
    from dynamo.runtime import DistributedRuntime

    os.environ.update(dynamo_env(endpoints, free_port(below=32768)))
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    client = await runtime.endpoint("dynamo.backend.generate").client()
    await client.wait_for_instances()
    worker = client.instance_ids()[0]
    results: dict[tuple[str, int], tuple[float, float]] = {}

    async def conversation(conv: Conversation, t0: float) -> None:
        prompts = ConversationPrompts(conv)
        await asyncio.sleep(max(0.0, t0 + conv.arrival_s / SPEEDUP - time.perf_counter()))
        for index, turn in enumerate(conv.turns, start=1):
            await asyncio.sleep(turn.think_time_s / SPEEDUP)
            prompt, _ = prompts.next_prompt(turn)
            sent = time.perf_counter()
            body = {"token_ids": prompt, "stop_conditions": {"max_tokens": turn.max_tokens}}
            stream = await client.direct(body, worker, annotated=False)
            times, tokens = [], []
            async for chunk in stream:
                times.append(time.perf_counter())
                tokens += chunk["token_ids"]
            prompts.record_output(tokens)
            ttft = (times[0] - sent) * SPEEDUP
            tpot = (times[-1] - times[0]) / (len(times) - 1) * SPEEDUP
            results[(conv.conversation_id, index)] = (ttft, tpot)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, t0) for c in WORKLOAD))
    finally:
        runtime.shutdown()
    return results


@pytest.mark.slow
def test_wall_clock_worker_agrees_with_virtual_clock_simulation(model_dir, tmp_path):
    graph = tmp_path / "wall.yaml"
    graph.write_text(GRAPH)
    dep = start(ServeOptions(graph=str(graph), http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), model_dir=model_dir, run_dir=tmp_path / "run"),
                log=lambda _m: None)
    try:
        live = asyncio.run(_live(dep.endpoints))
    finally:
        dep.stop()
    sim = simulate(Cluster(load_profile(), 0, 0, num_replica=1), WORKLOAD, replica_router)
    virtual = {(r.conversation_id, r.turn): (r.ttft_s, r.tpot_s) for r in sim.records}
    assert live.keys() == virtual.keys() and len(live) == 12

    live_ttft = statistics.mean(t for t, _ in live.values())
    sim_ttft = statistics.mean(t for t, _ in virtual.values())
    live_tpot = statistics.mean(p for _, p in live.values())
    sim_tpot = statistics.mean(p for _, p in virtual.values())
    print(f"mean TTFT live {live_ttft * 1e3:.2f} ms vs virtual {sim_ttft * 1e3:.2f} ms; "
          f"mean TPOT live {live_tpot * 1e3:.3f} ms vs virtual {sim_tpot * 1e3:.3f} ms")
    for key in sorted(live):
        print(key, [f"{v * 1e3:.2f}" for v in (*live[key], *virtual[key])])
    assert abs(live_ttft - sim_ttft) / sim_ttft < 0.10
    assert abs(live_tpot - sim_tpot) / sim_tpot < 0.10
