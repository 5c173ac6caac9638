"""What route each answered request took, as the simulated worker publishes it and `bench
compare` reads it back (`bench.routes`), against the worker's own handler in process."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from dynamo_ppd.bench import routes
from dynamo_ppd.engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION
from dynamo_ppd.engine.profile import load_profile
from dynamo_ppd.engine.scheduler import Engine, EngineConfig
from dynamo_ppd.worker.args import parse_args as worker_args
from dynamo_ppd.worker.handler import SimulatedTrtllmHandler, served_lines
from dynamo_ppd.worker.live import WallClockEngine

pytestmark = pytest.mark.unit


def _worker(mode: str, seed: int = 0) -> SimulatedTrtllmHandler:
    config = worker_args(["--disaggregation-mode", mode, "--speedup", "1000", "--no-register-model"])
    profile = load_profile(config.profile)
    live = WallClockEngine(Engine(profile, EngineConfig(seed=seed)), config.speedup)
    live.start()
    return SimulatedTrtllmHandler(config, profile, live, instance_id=seed + 1)


async def _answer(worker: SimulatedTrtllmHandler, request: dict) -> list[dict]:
    return [chunk async for chunk in worker.generate(request, None)]


def test_the_worker_counts_each_answered_request_by_its_route_and_bench_reads_it_back():
    async def run():
        prefill, decode = _worker("prefill"), _worker("decode", seed=1)
        prompt = list(range(3000, 3300))
        request = {"token_ids": prompt, "stop_conditions": {"max_tokens": 3}, "annotations": []}
        # Through P: the prefill leg, then the decode worker with the prefill's params.
        [*_, last] = await _answer(prefill, {**request, "stop_conditions": {"max_tokens": 1}})
        result = {"disaggregated_params": last["disaggregated_params"],
                  "prompt_tokens_details": last["completion_usage"]["prompt_tokens_details"]}
        await _answer(decode, {**request, "prefill_result": result})
        # A follow-up decode-local (the bypass annotation), twice.
        follow = {**request, "token_ids": prompt + [5, 6, 7],
                  "annotations": [BYPASS_REMOTE_PREFILL_ANNOTATION]}
        await _answer(decode, follow)
        await _answer(decode, follow)
        # Refused (no params, no annotation): answered with an error, not counted.
        with pytest.raises(ValueError):
            await _answer(decode, request)
        return prefill.served, decode.served

    prefill_served, decode_served = asyncio.run(run())
    assert prefill_served == Counter(prefill_leg=1)
    assert decode_served == Counter(via_prefill=1, decode_local=2)
    pages = ["\n".join(served_lines(prefill_served)), "\n".join(served_lines(decode_served)),
             "# a frontend's page: no such metric\n"]
    counted = routes.add(routes.parse(page) for page in pages)
    assert counted == {"decode_local": 2, "via_prefill": 1}  # a prefill leg is half a route
    assert routes.local_share(counted) == pytest.approx(2 / 3)
    assert routes.local_share({}) is None and routes.local_share({"aggregated": 4}) is None
