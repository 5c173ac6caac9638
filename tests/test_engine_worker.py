"""The simulated TensorRT-LLM worker, live: dynamo.trtllm's request contract over Dynamo's real
request plane, and KV events over NATS that a Dynamo RadixTree turns into the worker's cache."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import msgspec
import pytest

from dynamo_ppd.engine.handoff import unpack_params
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.launch.servers import Endpoints, dynamo_env

BLOCK = 32
D_CAPACITY_BLOCKS = 96  # small, so the eviction step is cheap

GRAPH = """
name: contract
components:
  - name: frontend
    command: ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}", "--router-mode", "kv"]
    ready: {http: "http://127.0.0.1:{http_port}/health"}
  - name: prefill
    command: ["{python}", "-m", "dynamo_ppd.worker", "--model-path", "{model_dir}",
              "--disaggregation-mode", "prefill"]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
  - name: decode
    command: ["{python}", "-m", "dynamo_ppd.worker", "--model-path", "{model_dir}",
              "--disaggregation-mode", "decode", "--kv-capacity-blocks", "D_CAPACITY_BLOCKS"]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
""".replace("D_CAPACITY_BLOCKS", str(D_CAPACITY_BLOCKS))


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("contract")
    graph = tmp / "contract.yaml"
    graph.write_text(GRAPH)
    dep = start(ServeOptions(graph=str(graph), http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), model_dir=model_dir, run_dir=tmp / "run"),
                log=lambda _m: None)
    yield dep
    dep.stop()


class Workers:
    """A Dynamo runtime in the test process, with clients for the prefill and decode workers and
    a RadixTree fed from their KV events on NATS."""

    def __init__(self, endpoints: Endpoints):
        self.endpoints = endpoints

    async def __aenter__(self):
        import nats
        from dynamo._core import RadixTree
        from dynamo.runtime import DistributedRuntime

        os.environ.update(dynamo_env(self.endpoints, free_port(below=32768)))
        self.runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
        self.clients = {}
        for role, comp in (("prefill", "prefill"), ("decode", "backend")):
            for ep in ("generate", "status"):
                client = await self.runtime.endpoint(f"dynamo.{comp}.{ep}").client()
                await client.wait_for_instances()
                self.clients[(role, ep)] = client
        self.ids = {role: self.clients[(role, "generate")].instance_ids()[0]
                    for role in ("prefill", "decode")}
        self.tree = RadixTree()
        self.nats = await nats.connect(self.endpoints.nats_url)
        self.events_seen = {"stored": 0, "removed": 0}

        async def on_event(msg):
            envelope = msgspec.msgpack.decode(msg.data)
            for router_event in msgspec.msgpack.decode(envelope["payload"]):
                self.events_seen["stored" if "stored" in router_event["event"]["data"] else "removed"] += 1
                self.tree.apply_event(router_event["worker_id"],
                                      json.dumps(router_event["event"] | {"dp_rank": 0}).encode())

        await self.nats.subscribe("namespace.dynamo.component.*.endpoint.generate.kv-events", cb=on_event)
        return self

    async def __aexit__(self, *exc):
        await self.nats.close()
        self.runtime.shutdown()

    async def call(self, role: str, request: dict, endpoint: str = "generate") -> list[dict]:
        stream = await self.clients[(role, endpoint)].direct(request, self.ids[role], annotated=False)
        return [chunk async for chunk in stream]

    async def cached_blocks(self, role: str) -> set[int]:
        [status] = await self.call(role, {"blocks": True}, endpoint="status")
        return set(status["cached_block_hashes"])

    def tree_blocks(self, role: str) -> set[int]:
        blocks = set()
        for line in self.tree.dump_tree_as_events():
            event = json.loads(line)
            if event["worker_id"] == self.ids[role]:
                blocks.update(b["block_hash"] for b in event["event"]["data"]["stored"]["blocks"])
        return blocks

    async def assert_tree_matches_cache(self, role: str) -> None:
        await asyncio.sleep(0.5)  # events travel over NATS
        assert self.tree_blocks(role) == await self.cached_blocks(role)


def request(tokens: list[int], max_tokens: int, **extra) -> dict:
    return {"token_ids": tokens, "stop_conditions": {"max_tokens": max_tokens}, **extra}


def tokens_of(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2000, 8000) for _ in range(n)]


@pytest.mark.e2e
def test_contract_and_kv_events(deployment):
    asyncio.run(_contract_and_kv_events(deployment))


async def _contract_and_kv_events(dep):
    async with Workers(dep.endpoints) as w:
        turn1 = prompt(600, seed=1)

        # Prefill: context_only, one token, disaggregated_params naming the transfer.
        chunks = await w.call("prefill", request(turn1, 50))
        assert len(tokens_of(chunks)) == 1
        final = chunks[-1]
        handle, first_token = unpack_params(final["disaggregated_params"])
        assert final["disaggregated_params"]["request_type"] == "context_only"
        assert handle.prompt_tokens == 600 and handle.num_bytes == 600 * 128 * 1024
        assert final["completion_usage"]["prompt_tokens"] == 600
        await w.assert_tree_matches_cache("prefill")
        assert len(w.tree_blocks("prefill")) == 600 // BLOCK

        # Decode with prefill_result: generation_only, starts with the prefill's token, receives the
        # KV (its blocks become cached here and are announced), reports the prefill's usage details.
        details = final["completion_usage"]["prompt_tokens_details"]
        chunks = await w.call("decode", request(turn1, 40, prefill_result={
            "disaggregated_params": final["disaggregated_params"], "prompt_tokens_details": details}))
        out1 = tokens_of(chunks)
        assert out1[0] == first_token and len(out1) == 40
        assert chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["completion_usage"]["prompt_tokens_details"] == details
        await w.assert_tree_matches_cache("decode")
        # The transferred prompt and the blocks its generated tokens filled are all cached.
        assert len(w.tree_blocks("decode")) == (600 + 40 - 1) // BLOCK

        # Decode with the bypass annotation: an append-prefill of only the new tokens.
        turn2 = turn1 + out1 + prompt(50, seed=2)
        chunks = await w.call("decode", request(turn2, 8, annotations=["x-bypass-remote-prefill"]))
        assert len(tokens_of(chunks)) == 8
        cached = chunks[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (600 + 40 - 1) // BLOCK * BLOCK
        scores = w.tree.find_matches(_local_hashes(turn2)).scores
        assert scores[(w.ids["decode"], 0)] == len(turn2) // BLOCK
        await w.assert_tree_matches_cache("decode")

        # Decode with neither: TensorRT-LLM's error.
        with pytest.raises(Exception, match="Disaggregated params are required for decode mode"):
            await w.call("decode", request(prompt(40, seed=3), 4))

        # Eviction: unrelated prompts on a small cache push the conversation's blocks out.
        for seed in range(10, 16):
            await w.call("decode", request(prompt(1200, seed=seed), 2,
                                           annotations=["x-bypass-remote-prefill"]))
        await w.assert_tree_matches_cache("decode")
        assert w.events_seen["removed"] > 0
        assert (w.ids["decode"], 0) not in w.tree.find_matches(_local_hashes(turn1)).scores
        assert len(await w.cached_blocks("decode")) <= D_CAPACITY_BLOCKS


@pytest.mark.e2e
def test_request_larger_than_cache_is_refused_with_a_message(deployment):
    async def run():
        async with Workers(deployment.endpoints) as w:
            chunks = await w.call("decode", request(prompt(D_CAPACITY_BLOCKS * BLOCK, seed=4), 64,
                                                    annotations=["x-bypass-remote-prefill"]))
            assert "KV blocks" in chunks[-1]["finish_reason"]["error"]
            assert tokens_of(chunks) == []
    asyncio.run(run())


@pytest.mark.e2e
def test_cancelled_request_frees_the_engine(deployment):
    async def run():
        async with Workers(deployment.endpoints) as w:
            stream = await w.clients[("decode", "generate")].direct(
                request(prompt(100, seed=5), 2000, annotations=["x-bypass-remote-prefill"]),
                w.ids["decode"], annotated=False)
            got = 0
            async for _chunk in stream:
                got += 1
                if got == 3:
                    break
            del stream
            for _ in range(50):
                [status] = await w.call("decode", {}, endpoint="status")
                if status["load"]["decode_requests"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert status["load"]["decode_requests"] == 0
    asyncio.run(run())


def _local_hashes(tokens: list[int]) -> list[int]:
    from dynamo._core import compute_block_hash_for_seq

    return compute_block_hash_for_seq(tokens, BLOCK)


@pytest.mark.unit
def test_graph_files_run_the_simulated_worker():
    repo = Path(__file__).resolve().parent.parent
    for name in ("pd", "agg", "cond-disagg"):
        text = (repo / "graphs" / f"{name}.yaml").read_text()
        assert "dynamo_ppd.worker" in text and "dynamo.mocker" not in text
    assert "--router-conditional-disagg" in (repo / "graphs" / "cond-disagg.yaml").read_text()
