"""A prompt over the engine's max_seq_len (issue 48, item 3): the simulated worker registers its
limit as dynamo.trtllm 1.6.1 does, so Dynamo's frontend refuses such a prompt with a 400 before
any worker sees it (it answered 500 before: the worker's KV-capacity refusal, or computed a prompt
over the model's context); a prompt that reaches a worker anyway gets TensorRT-LLM's refusal as
dynamo.trtllm's handler relays it, and a max_tokens past the limit is cut as TensorRT-LLM cuts it
(`dynamo_ppd/worker/limits.py` cites the sources)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_passthrough_e2e import _served_by_worker

from dynamo_ppd.engine.profile import load_profile
from dynamo_ppd.engine.scheduler import Engine, EngineConfig
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.worker.args import parse_args
from dynamo_ppd.worker.handler import SimulatedTrtllmHandler, max_seq_len_of
from dynamo_ppd.worker.limits import inferred_max_seq_len, publish_max_seq_len
from dynamo_ppd.worker.live import WallClockEngine

LIMIT = 512


def _worker(mode: str = "agg", *extra: str) -> SimulatedTrtllmHandler:
    config = parse_args(["--disaggregation-mode", mode, "--speedup", "1000", "--no-register-model",
                         "--max-seq-len", str(LIMIT), *extra])
    profile = load_profile(config.profile)
    live = WallClockEngine(Engine(profile, EngineConfig()), config.speedup)
    live.start()
    return SimulatedTrtllmHandler(config, profile, live, 1)


def _answer(mode: str, prompt_tokens: int, max_tokens: int) -> tuple[SimulatedTrtllmHandler, list[dict]]:
    """A fresh in-process worker's chunks for one request."""
    request = {"token_ids": list(range(2000, 2000 + prompt_tokens)),
               "stop_conditions": {"max_tokens": max_tokens}}

    async def run():
        worker = _worker(mode)
        try:
            return worker, [chunk async for chunk in worker.generate(request, None)]
        finally:
            await worker.live.stop()
    return asyncio.run(run())


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["agg", "prefill"])
def test_a_prompt_that_fills_max_seq_len_gets_trtllm_s_refusal_and_never_runs(mode):
    worker, chunks = _answer(mode, LIMIT, 4)
    # dynamo.trtllm 1.6.1's `except RequestError` chunk, with TensorRT-LLM's message.
    assert chunks == [{"finish_reason": {"error": (
        f"`default_max_tokens` (0) must be greater than 0, `default_max_tokens` (0) = max_seq_len "
        f"({LIMIT}) - `splited_prompt_len` ({LIMIT}) - `query_token_len` (0)")}, "token_ids": []}]
    assert worker.live.engine.iterations == 0 and worker.served == {}


@pytest.mark.unit
def test_max_tokens_past_max_seq_len_is_cut_to_fit():
    _, chunks = _answer("agg", LIMIT - 10, 50)
    assert sum(len(c["token_ids"]) for c in chunks) == 10
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 10


@pytest.mark.unit
def test_registration_publishes_what_dynamo_trtllm_publishes(tmp_path):
    from dynamo.llm import ModelRuntimeConfig
    from dynamo.trtllm.utils.trtllm_utils import publish_trtllm_token_budget

    ours, theirs = ModelRuntimeConfig(), ModelRuntimeConfig()
    publish_max_seq_len(ours, 32768)
    theirs.context_length = 32768  # dynamo/trtllm/workers/llm_worker.py, next to the call below
    publish_trtllm_token_budget(theirs, 32768)
    assert ours.context_length == theirs.context_length == 32768
    assert ours.runtime_data == theirs.runtime_data
    assert json.loads(ours.runtime_data["token_budget"]) == {
        "combined_limit": 32768, "reject_prompt_overflow": True, "reject_total_overflow": False}
    # Unset, the limit is what TensorRT-LLM infers from the checkpoint's config.json.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    assert max_seq_len_of(parse_args([]), str(tmp_path)) == 131072
    assert max_seq_len_of(parse_args(["--max-seq-len", "4096"]), str(tmp_path)) == 4096
    assert inferred_max_seq_len(tmp_path / "missing") == 2048


@pytest.mark.e2e
@pytest.mark.slow
def test_the_frontend_refuses_an_over_context_prompt_with_400_before_any_worker(model_dir, tmp_path):
    # `pd`: Dynamo's frontend straight in front of the simulated workers, max_seq_len cut to 512.
    limit = ["--max-seq-len", str(LIMIT)]
    dep = start(ServeOptions(graph="pd", http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), model_dir=model_dir, run_dir=tmp_path / "run",
                             extra_args={"prefill": limit, "decode": limit}), log=lambda _m: None)
    try:
        before = _served_by_worker(dep)
        huge = "word " * 333_334  # ~1M tokens
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                           ("/v1/completions", {"prompt": huge, "stream": True}),
                           ("/v1/responses", {"input": huge})):
            reply = httpx.post(f"{dep.base_url}{path}", json={"model": dep.model_name, "max_tokens": 8,
                                                              **body}, timeout=120)
            assert reply.status_code == 400, (path, reply.text)
            details = reply.json()["details"]
            assert details["type"] == "context_length" and details["limit"] == LIMIT
            assert details["actual"] > 1_000_000
        reply = httpx.post(f"{dep.base_url}/v1/messages", timeout=120, json={
            "model": dep.model_name, "max_tokens": 8, "messages": [{"role": "user", "content": huge}]})
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert _served_by_worker(dep) == before  # no worker saw any of them
        # A prompt that fits, with a max_tokens that does not: the frontend lets it through
        # (reject_total_overflow false) and the worker cuts max_tokens to what is left.
        reply = httpx.post(f"{dep.base_url}/v1/completions", timeout=120, json={
            "model": dep.model_name, "max_tokens": 400, "prompt": "word " * 130})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == LIMIT
    finally:
        dep.stop()
