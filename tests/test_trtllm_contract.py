"""The TensorRT-LLM path against Dynamo 1.6.1's own `dynamo.trtllm` handler code, without a GPU
(issue 15).

The router's real outgoing requests (`PpdRouter.generate` -> `relay/dispatch.py`) go, through a
JSON round trip standing in for Dynamo's request plane, to Dynamo's real ``PrefillHandler``,
``DecodeHandler`` and ``AggregatedHandler`` (from the installed ai-dynamo 1.6.1 wheel), whose
engine is ``dynamo.trtllm.engine.TensorRTLLMEngine`` over the fake ``tensorrt_llm.LLM`` of
`tests/trtllm_stub` (built from our shipped engine YAMLs). The tests check what each handler asks
of the engine (request type, disaggregated params, sampling params, max tokens, streaming) and what
comes back to the router; then the same conversations through our simulated worker
(`dynamo_ppd.worker.handler.SimulatedTrtllmHandler`, in process) must answer in the same shape.

The stand-in is on ``sys.path`` only while these tests run (module fixture `trtllm`), and its
modules are dropped again afterwards, so no other test sees the fake torch or TensorRT-LLM.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_ppd.engine.blocks import dynamo_block_hasher
from dynamo_ppd.engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION, DECODE_NEEDS_PARAMS_ERROR
from dynamo_ppd.engine.profile import load_profile
from dynamo_ppd.engine.scheduler import Engine, EngineConfig
from dynamo_ppd.relay.router import PpdRouter
from dynamo_ppd.routing.args import parse_args as router_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.worker.args import parse_args as worker_args
from dynamo_ppd.worker.handler import SimulatedTrtllmHandler
from dynamo_ppd.worker.live import WallClockEngine

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
STUB = Path(__file__).resolve().parent / "trtllm_stub"
ENGINE_YAML = {"prefill": ROOT / "deploy" / "engine" / "prefill.yaml",
               "decode": ROOT / "deploy" / "engine" / "decode.yaml"}
PREFILL, DECODE, REPLICA = 0x11, 0x21, 0x31
PROMPT = list(range(2000, 2300))  # 300 tokens: 9 full 32-token blocks and a partial one
MAX_TOKENS = 6
_STUBBED = ("tensorrt_llm", "torch", "blake3")


@pytest.fixture(scope="module")
def trtllm():
    """Dynamo 1.6.1's dynamo.trtllm imported over the TensorRT-LLM stand-in."""
    sys.path.insert(0, str(STUB))
    before = set(sys.modules)
    try:
        from dynamo.trtllm.constants import DisaggregationMode
        from dynamo.trtllm.engine import TensorRTLLMEngine
        from dynamo.trtllm.request_handlers.handler_base import RequestHandlerConfig
        from dynamo.trtllm.request_handlers.handlers import get_request_handler
        from tensorrt_llm.disaggregated_params import DisaggregatedParams
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_options
        from tensorrt_llm.sampling_params import SamplingParams

        yield SimpleNamespace(Mode=DisaggregationMode, Engine=TensorRTLLMEngine,
                              Config=RequestHandlerConfig, handler=get_request_handler,
                              Params=DisaggregatedParams, SamplingParams=SamplingParams,
                              merge_yaml=update_llm_args_with_extra_options)
    finally:
        sys.path.remove(str(STUB))
        for name in set(sys.modules) - before:  # what may hold the fake torch or TensorRT-LLM
            module = sys.modules[name]
            python_source = str(getattr(module, "__file__", "") or "").endswith(".py")
            if name.split(".")[0] in _STUBBED or (name.startswith("dynamo.") and python_source):
                del sys.modules[name]  # (compiled extensions cannot be loaded twice: kept)


# ---------------------------------------------------------------------------------------------
# Workers: Dynamo's real handlers over the fake engine, and our simulated worker


async def real_worker(trtllm, mode: str):
    """Dynamo's handler for ``mode`` (prefill | decode | agg) and its fake ``LLM``; the engine
    arguments are our shipped YAML merged over the model path, as llm_worker.py does."""
    dyn_mode = {"prefill": trtllm.Mode.PREFILL, "decode": trtllm.Mode.DECODE,
                "agg": trtllm.Mode.AGGREGATED}[mode]
    args = trtllm.merge_yaml({"model": "/models/llama"}, str(ENGINE_YAML.get(mode, ENGINE_YAML["decode"])))
    engine = trtllm.Engine(args, dyn_mode)
    await engine.initialize()
    config = trtllm.Config(engine=engine, default_sampling_params=trtllm.SamplingParams(),
                           publisher=None, disaggregation_mode=dyn_mode)
    return trtllm.handler(config), engine.llm


def sim_worker(mode: str, instance_id: int) -> SimulatedTrtllmHandler:
    config = worker_args(["--disaggregation-mode", mode, "--speedup", "1000", "--no-register-model"])
    profile = load_profile(config.profile)
    live = WallClockEngine(Engine(profile, EngineConfig(seed=instance_id)), config.speedup)
    live.start()
    return SimulatedTrtllmHandler(config, profile, live, instance_id)


class Context:
    """What Dynamo's request context offers a handler (dynamo._core.Context): never cancelled."""

    def __init__(self, request_id: str):
        self._id = request_id

    def id(self) -> str:
        return self._id

    def trace_headers(self):
        return None

    def async_killed_or_stopped(self):
        return asyncio.get_running_loop().create_future()

    def is_stopped(self) -> bool:
        return False

    def is_killed(self) -> bool:
        return False

    def notify_first_token(self) -> None:
        pass


def wire(obj: Any) -> Any:
    """A request or answer as it crosses Dynamo's request plane (JSON-like values only)."""
    return json.loads(json.dumps(obj))


class WireClient:
    """A Dynamo endpoint client whose ``direct`` calls a handler in this process."""

    def __init__(self, handlers: dict[int, Any]):
        self.handlers = handlers
        self.sent: list[tuple[int, dict]] = []
        self.answers: list[list[dict]] = []

    def instance_ids(self) -> list[int]:
        return list(self.handlers)

    async def direct(self, request, worker, annotated=False, context=None):
        request = wire(request)
        self.sent.append((worker, request))
        answer: list[dict] = []
        self.answers.append(answer)
        handler = self.handlers[worker]

        async def stream():
            try:
                async for chunk in handler.generate(wire(request), Context(f"req-{len(self.sent)}")):
                    answer.append(wire(chunk))
                    yield answer[-1]
            except ValueError as exc:  # how Dynamo 1.6.1 hands a handler's ValueError to the
                # caller (relay/dispatch.py's notes): the request's fault
                raise ValueError(f"InvalidRequest: ValueError: {exc}") from exc
        return stream()


def make_router(mode: str, prefill=None, decode=None, replica=None) -> PpdRouter:
    argv = ["--mode", mode, "--table", "none"]
    if replica is not None:
        argv += ["--replica-component", "replica"]
    config = router_args(argv)
    clients = {"prefill": WireClient({PREFILL: prefill} if prefill else {}),
               "decode": WireClient({DECODE: decode} if decode else {})}
    if replica is not None:
        clients["replica"] = WireClient({REPLICA: replica})
    return PpdRouter(None, config, build_policy(config), RoutingMetrics(), clients=clients)


def frontend_request(tokens: list[int], session: str = "s") -> dict:
    """A request as Dynamo's frontend hands it on (its preprocessed-request fields)."""
    return {"model": "llama", "token_ids": tokens,
            "stop_conditions": {"max_tokens": MAX_TOKENS, "min_tokens": 2,
                                "stop_token_ids_hidden": [128009]},
            "sampling_options": {"temperature": 0.7, "top_p": 0.9, "seed": 7},
            "output_options": {}, "eos_token_ids": [128009], "annotations": [],
            "agent_context": {"session_id": session}}


async def turn(router: PpdRouter, tokens: list[int], session: str = "s") -> list[dict]:
    return [chunk async for chunk in router.generate(frontend_request(tokens, session))]


def tokens_of(chunks: list[dict]) -> list[int]:
    return [t for chunk in chunks for t in chunk.get("token_ids") or []]


def hold(router: PpdRouter, worker: int, tokens: list[int]) -> None:
    """The decode worker's KV events, as the router would have read them from NATS."""
    local = dynamo_block_hasher()(tokens, 32)
    blocks = [{"block_hash": (worker << 32) + i, "tokens_hash": h} for i, h in enumerate(local)]
    router.residency.apply(worker, {"event_id": 0, "data": {"stored": {"parent_hash": None,
                                                                          "blocks": blocks}}})


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------
# The shape of an answer, and of TensorRT-LLM's disaggregated params on the wire

def _json_type(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_json_type(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + (_json_type(value[0]) if value else "") + "]"
    return type(value).__name__


def shape(chunks: list[dict]) -> list[str]:
    """Per chunk: its keys and the JSON types of what the router and the frontend read (token ids,
    finish reason, usage with cached tokens, engine data), not the values."""
    out = []
    for chunk in chunks:
        kept = {k: v for k, v in chunk.items() if k != "disaggregated_params"}
        out.append(_json_type(kept) + (" +disaggregated_params" if "disaggregated_params" in chunk else ""))
    return out


def params_errors(trtllm, params: dict) -> list[str]:
    """Where a ``disaggregated_params`` dict from a prefill worker is not what dynamo.trtllm's
    decode handler can turn back into TensorRT-LLM's `DisaggregatedParams` for a generation-only
    request (handler_base.py ``_decode_disaggregated_params_from_prefill``)."""
    fields = {f.name for f in dataclasses.fields(trtllm.Params)} | {"worker_id", "_epd_metadata"}
    errors = [f"{k}: not a DisaggregatedParams field" for k in params if k not in fields]
    expected = {"request_type": str, "first_gen_tokens": list, "ctx_request_id": int,
                "opaque_state": str, "disagg_request_id": int}  # opaque_state: base64 on the wire
    for key, kind in expected.items():
        if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
            errors.append(f"{key}: {params.get(key)!r} is not a {kind.__name__}")
    if isinstance(params.get("first_gen_tokens"), list) and not all(
            isinstance(t, int) for t in params["first_gen_tokens"]):
        errors.append("first_gen_tokens: not token ids")
    if isinstance(params.get("opaque_state"), str):
        try:
            base64.b64decode(params["opaque_state"], validate=True)
        except ValueError:
            errors.append("opaque_state: not base64")
    return errors


# ---------------------------------------------------------------------------------------------
# Via prefill: the prefill leg and the decode leg with prefill_result


async def _via_prefill_real(trtllm):
    prefill, p_llm = await real_worker(trtllm, "prefill")
    decode, d_llm = await real_worker(trtllm, "decode")
    router = make_router("pd", prefill=prefill, decode=decode)
    chunks = await turn(router, list(PROMPT))
    second = await turn(router, PROMPT + tokens_of(chunks) + list(range(3000, 3040)))
    return router, chunks, second, p_llm, d_llm


def test_via_prefill_through_dynamos_prefill_and_decode_handlers(trtllm):
    router, chunks, second, p_llm, d_llm = run(_via_prefill_real(trtllm))

    # The prefill leg: the router's max_tokens=1 request, a context-only engine request.
    (p_worker, p_request), _ = router.clients["prefill"].sent
    assert p_worker == PREFILL and p_request["stop_conditions"]["max_tokens"] == 1
    assert "prefill_result" not in p_request and p_request["annotations"] == []
    p_call, p_call2 = p_llm.calls
    assert p_call.request_type == "context_only" and p_call.streaming is False
    assert p_call.prompt_token_ids == PROMPT
    assert p_call.sampling_params.max_tokens == 1 and p_call.sampling_params.temperature == 0.7
    assert isinstance(p_call.disaggregated_params.disagg_request_id, int)
    [p_chunk] = router.clients["prefill"].answers[0]  # one chunk: params and the cache report
    assert p_chunk["finish_reason"] == "length" and len(p_chunk["token_ids"]) == 1
    assert params_errors(trtllm, p_chunk["disaggregated_params"]) == []
    assert p_chunk["completion_usage"]["prompt_tokens"] == len(PROMPT)
    assert p_chunk["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    # The decode leg: prefill_result carries the prefill's params and cache report verbatim.
    (d_worker, d_request), _ = router.clients["decode"].sent
    assert d_worker == DECODE and d_request["stop_conditions"]["max_tokens"] == MAX_TOKENS
    assert d_request["annotations"] == []
    assert d_request["prefill_result"] == {
        "disaggregated_params": p_chunk["disaggregated_params"],
        "prompt_tokens_details": p_chunk["completion_usage"]["prompt_tokens_details"]}
    d_call, _ = d_llm.calls
    sent = p_call.result.outputs[0].disaggregated_params
    assert d_call.request_type == "generation_only" and d_call.streaming is True
    assert d_call.disaggregated_params.opaque_state == sent.opaque_state  # bytes again
    assert d_call.disaggregated_params.first_gen_tokens == sent.first_gen_tokens
    assert d_call.disaggregated_params.ctx_request_id == sent.ctx_request_id
    assert d_call.disaggregated_params.disagg_request_id == p_call.disaggregated_params.disagg_request_id
    assert d_call.prompt_token_ids == PROMPT
    params = d_call.sampling_params
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_p, params.seed) == \
        (MAX_TOKENS, 2, 0.7, 0.9, 7)
    assert 128009 in params.stop_token_ids

    # What the client gets: the decode worker's stream, starting with the prefill's token.
    out = tokens_of(chunks)
    assert len(out) == MAX_TOKENS and out[0] == sent.first_gen_tokens[0]
    final = chunks[-1]
    assert final["finish_reason"] == "length"
    assert final["completion_usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": MAX_TOKENS,
                                         "total_tokens": len(PROMPT) + MAX_TOKENS,
                                         "prompt_tokens_details": {"cached_tokens": 0}}
    assert "disaggregated_params" not in final

    # The second turn through the prefill worker: the history's full blocks are in its cache, and
    # its report reaches the client through the decode worker's answer.
    assert p_call2.request_type == "context_only" and p_call2.result.cached_tokens == len(PROMPT) // 32 * 32
    assert second[-1]["completion_usage"]["prompt_tokens_details"] == \
        {"cached_tokens": len(PROMPT) // 32 * 32} == router.clients["prefill"].answers[1][0][
            "completion_usage"]["prompt_tokens_details"]


def test_decode_handler_without_params_or_annotation_is_refused_like_ours(trtllm):
    async def scenario():
        decode, _ = await real_worker(trtllm, "decode")
        request = wire(frontend_request(list(PROMPT)))
        with pytest.raises(ValueError) as real:
            [c async for c in decode.generate(request, Context("r"))]
        ours = sim_worker("decode", 3)
        with pytest.raises(ValueError) as sim:
            [c async for c in ours.generate(wire(frontend_request(list(PROMPT))), None)]
        await ours.live.stop()
        return str(real.value), str(sim.value)

    real, sim = run(scenario())
    assert real == sim == DECODE_NEEDS_PARAMS_ERROR


# ---------------------------------------------------------------------------------------------
# Decode-local: a follow-up turn with the bypass annotation


async def _two_turns(prefill, decode) -> tuple[PpdRouter, list[dict], list[dict]]:
    router = make_router("local", prefill=prefill, decode=decode)
    first = await turn(router, list(PROMPT))
    history = PROMPT + tokens_of(first)
    hold(router, DECODE, history)
    second = await turn(router, history + list(range(3000, 3040)))
    return router, first, second


def test_follow_up_decode_local_through_dynamos_decode_handler(trtllm):
    async def scenario():
        prefill, _ = await real_worker(trtllm, "prefill")
        decode, d_llm = await real_worker(trtllm, "decode")
        return (*await _two_turns(prefill, decode), d_llm)

    router, first, second, d_llm = run(scenario())
    worker, request = router.clients["decode"].sent[-1]
    assert worker == DECODE and request["annotations"] == [BYPASS_REMOTE_PREFILL_ANNOTATION]
    assert "prefill_result" not in request and len(router.clients["prefill"].sent) == 1
    call = d_llm.calls[-1]
    # The decode worker runs the whole turn: prefill of what it lacks, then decode.
    assert call.request_type == "context_and_generation" and call.streaming is True
    assert call.disaggregated_params.opaque_state is None and call.sampling_params.max_tokens == MAX_TOKENS
    history = PROMPT + tokens_of(first)
    assert call.prompt_token_ids == request["token_ids"] == history + list(range(3000, 3040))
    final = second[-1]
    # The history's full blocks were in this worker's cache (received from the prefill worker).
    cached = len(PROMPT) // 32 * 32
    assert final["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert final["engine_data"]["kv_cache_hit"] == {"prompt_tokens": len(call.prompt_token_ids),
                                                    "reused_tokens": cached}
    assert len(tokens_of(second)) == MAX_TOKENS


# ---------------------------------------------------------------------------------------------
# Replica: aggregated workers


def test_replica_through_dynamos_aggregated_handler(trtllm):
    async def scenario():
        agg, llm = await real_worker(trtllm, "agg")
        router = make_router("replica", replica=agg)
        return router, await turn(router, list(PROMPT)), llm

    router, chunks, llm = run(scenario())
    [(worker, request)] = router.clients["replica"].sent
    assert worker == REPLICA and request["annotations"] == [] and "prefill_result" not in request
    [call] = llm.calls
    assert call.request_type == "context_and_generation" and call.disaggregated_params is None
    assert call.sampling_params.max_tokens == MAX_TOKENS and call.streaming is True
    assert len(tokens_of(chunks)) == MAX_TOKENS and chunks[-1]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------
# Our simulated worker answers the router's requests in the same shape


def test_simulated_worker_answers_in_the_shape_of_dynamos_handlers(trtllm):
    async def routes(workers):
        pd = make_router("pd", prefill=workers("prefill", 1), decode=workers("decode", 2))
        await turn(pd, list(PROMPT))
        local_router, _, second = await _two_turns(workers("prefill", 3), workers("decode", 4))
        replica = make_router("replica", replica=workers("agg", 5))
        agg = await turn(replica, list(PROMPT))
        return {"prefill leg": pd.clients["prefill"].answers[0],
                "decode leg": pd.clients["decode"].answers[0],
                "decode-local": local_router.clients["decode"].answers[-1],
                "replica": agg}

    async def real():
        made = {}

        async def make(mode, _n):
            made[_n] = (await real_worker(trtllm, mode))[0]
            return made[_n]
        handlers = {n: await make(m, n) for n, m in
                    ((1, "prefill"), (2, "decode"), (3, "prefill"), (4, "decode"), (5, "agg"))}
        return await routes(lambda _mode, n: handlers[n])

    async def simulated():
        workers = {}

        def make(mode, n):
            workers[n] = sim_worker(mode, n)
            return workers[n]
        try:
            return await routes(make)
        finally:
            for worker in workers.values():
                await worker.live.stop()

    theirs, ours = run(real()), run(simulated())
    for route in theirs:
        assert shape(ours[route]) == shape(theirs[route]), route
    # The prefill leg's params: what Dynamo's decode handler can read back for TensorRT-LLM.
    [ours_prefill] = ours["prefill leg"]
    assert params_errors(trtllm, ours_prefill["disaggregated_params"]) == []

    async def read_back():
        decode, _ = await real_worker(trtllm, "decode")
        prefill_result = {"disaggregated_params": wire(ours_prefill["disaggregated_params"])}
        return decode._decode_disaggregated_params_from_prefill(prefill_result)[0]

    params = run(read_back())
    assert params.request_type == "generation_only" and isinstance(params.opaque_state, bytes)
    assert params.first_gen_tokens == ours_prefill["token_ids"]
