"""Dynamo adapter of the simulated TensorRT-LLM worker: registers like `dynamo.trtllm`, turns its
request dicts into engine requests, streams the outputs, publishes KV events and load metrics.

Request contract (dynamo.trtllm 1.6.1, request_handlers/handler_base.py):
- prefill mode: ``context_only``; max_tokens forced to 1; the final chunk carries
  ``disaggregated_params`` (see `handoff`) and ``completion_usage``.
- every context attempt (not a generation-only one) ends with
  ``engine_data.kv_cache_hit = {prompt_tokens, reused_tokens}``.
- decode mode with ``prefill_result.disaggregated_params``: ``generation_only``; reports the
  prefill's ``prompt_tokens_details``.
- decode mode with the ``x-bypass-remote-prefill`` annotation: ``context_and_generation`` here.
- decode mode with neither: ``ValueError("Disaggregated params are required for decode mode")``.
- agg mode: ``context_and_generation``.
- a prompt of ``max_seq_len`` tokens or more: the final chunk ``finish_reason.error`` with
  TensorRT-LLM's message; a longer ``max_tokens`` is cut to fit. The frontend refuses such prompts
  itself (400) from the limit the worker registers (`limits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from typing import Any

import msgspec

from .. import model as model_dir
from ..engine.cost import TransferLink
from ..engine.handoff import (
    BYPASS_REMOTE_PREFILL_ANNOTATION,
    DECODE_NEEDS_PARAMS_ERROR,
    HandoffError,
    TransferHandle,
    decode_leg,
    pack_params,
    prefill_leg,
    ship_prompt_kv,
    unpack_params,
)
from ..engine.kv_cache import KvEvent, KvStored
from ..engine.profile import EngineProfile, load_profile
from ..engine.scheduler import Engine, EngineConfig, EngineRequest, Iteration, RequestKind, RequestRejected
from ..runtime import create_runtime, run_component
from .args import WorkerConfig, parse_args
from .limits import SequenceTooLong, fit_to_max_seq_len, inferred_max_seq_len, publish_max_seq_len
from .live import WallClockEngine

log = logging.getLogger("dynamo_ppd.worker")

# Requests answered to the end, by route (`SimulatedTrtllmHandler.served`), on the system port.
SERVED_METRIC = "dynamo_ppd_worker_served_requests_total"


def served_lines(served: Counter[str]) -> list[str]:
    """`SERVED_METRIC` in Prometheus text, one line per route."""
    return [f"# TYPE {SERVED_METRIC} counter",
            *(f'{SERVED_METRIC}{{route="{route}"}} {n}' for route, n in sorted(served.items()))]


class SimulatedTrtllmHandler:
    """The endpoint handler: one instance per worker process."""

    def __init__(self, config: WorkerConfig, profile: EngineProfile, live: WallClockEngine,
                 instance_id: int, max_seq_len: int | None = None):
        self.config = config
        # TensorRT-LLM's max_seq_len (`limits`); None: no limit (in-process tests).
        self.max_seq_len = max_seq_len or config.max_seq_len
        self.profile = profile
        self.live = live
        self.instance_id = instance_id
        bandwidth = (config.link_bandwidth_gbps * 1e9 if config.link_bandwidth_gbps
                     else profile.transfer.link_bandwidth_bytes_s)
        self.link = TransferLink(bandwidth, profile.transfer.transfer_setup_s)
        self.requests_total = 0
        # Requests answered to the end, by the route their prompt's KV came by (the simulator's
        # route names): what `bench compare` reads off the workers to set the live run's decisions
        # beside its virtual-clock twin's.
        self.served: Counter[str] = Counter()

    def _engine_request(self, request: dict[str, Any], request_id: str) -> tuple[EngineRequest, dict | None]:
        engine_request, prefill_details = self._leg(request, request_id)
        if self.max_seq_len is not None:
            fit_to_max_seq_len(engine_request, self.max_seq_len)
        return engine_request, prefill_details

    def _leg(self, request: dict[str, Any], request_id: str) -> tuple[EngineRequest, dict | None]:
        token_ids = list(request.get("token_ids") or [])
        stop = request.get("stop_conditions") or {}
        max_tokens = stop.get("max_tokens") or self.config.default_max_tokens
        annotations = request.get("annotations") or []
        prefill_result = request.get("prefill_result") or None
        mode = self.config.mode
        if mode == "prefill":
            return prefill_leg(request_id, token_ids), None
        if mode == "decode" and prefill_result and prefill_result.get("disaggregated_params"):
            handle, first_token = unpack_params(prefill_result["disaggregated_params"])
            if handle.prompt_tokens != len(token_ids):
                raise HandoffError(f"prefill result covers {handle.prompt_tokens} tokens, "
                                   f"the request has {len(token_ids)}")
            return (decode_leg(request_id, token_ids, max_tokens, first_token, handle.kv_ready_at),
                    prefill_result.get("prompt_tokens_details"))
        if mode == "decode" and BYPASS_REMOTE_PREFILL_ANNOTATION not in annotations:
            raise ValueError(DECODE_NEEDS_PARAMS_ERROR)
        return EngineRequest(request_id, token_ids, max_tokens, RequestKind.CONTEXT_AND_GENERATION), None

    async def generate(self, request: dict[str, Any], context):
        self.requests_total += 1
        request_id = context.id() if context is not None else f"req-{self.requests_total}"
        try:
            engine_request, prefill_details = self._engine_request(request, request_id)
        except SequenceTooLong as exc:
            # dynamo.trtllm 1.6.1 (handler_base.py, generate_locally, `except RequestError`).
            yield {"finish_reason": {"error": str(exc)}, "token_ids": []}
            return
        try:
            queue = self.live.submit(engine_request)
        except RequestRejected as exc:
            yield {"token_ids": [], "finish_reason": {"error": str(exc)}}
            return
        stopped = context.async_killed_or_stopped() if context is not None else None
        finished = False
        try:
            while not finished:
                out = await _next_or_stop(queue, stopped)
                if out is None:
                    return  # client went away: finally cancels the engine request
                chunk: dict[str, Any] = {"token_ids": out.token_ids, "index": 0}
                if out.finished:
                    finished = True
                    chunk["finish_reason"] = out.finish_reason or "length"
                    details = prefill_details or {"cached_tokens": out.cached_tokens}
                    chunk["completion_usage"] = {
                        "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens,
                        "total_tokens": out.prompt_tokens + out.completion_tokens,
                        "prompt_tokens_details": details,
                    }
                    if engine_request.kind is not RequestKind.GENERATION_ONLY:
                        # dynamo.trtllm 1.6.1 (handler_base.py, _kv_cache_hit_engine_data): a
                        # context attempt's cache reuse, read by Dynamo's KV router.
                        chunk["engine_data"] = {"kv_cache_hit": {"prompt_tokens": out.prompt_tokens,
                                                                 "reused_tokens": out.cached_tokens}}
                    if self.config.mode == "prefill":
                        chunk["disaggregated_params"] = self._start_transfer(engine_request, out.at,
                                                                             out.token_ids[0])
                    self.served[self._route(engine_request)] += 1
                yield chunk
        finally:
            if not finished:
                self.live.cancel(request_id)

    def _route(self, request: EngineRequest) -> str:
        if self.config.mode == "prefill":
            return "prefill_leg"
        if request.kind is RequestKind.GENERATION_ONLY:
            return "via_prefill"
        return "decode_local" if self.config.mode == "decode" else "aggregated"

    async def status(self, request: dict[str, Any] | None = None, context=None):
        """The ``status`` endpoint: load, and (with ``{"blocks": true}``) the ids of every cached
        block, to check what KV events told a router against the cache itself."""
        load = self.live.engine.load()
        reply: dict[str, Any] = {"instance_id": self.instance_id, "mode": self.config.mode,
                                 "profile": self.profile.name, "load": dataclasses.asdict(load),
                                 "link_backlog_s": self.link.backlog_s(self.live.model_now()),
                                 "prefill_tokens_total": self.live.engine.prefill_tokens_computed}
        if request and request.get("blocks"):
            reply["cached_block_hashes"] = sorted(self.live.engine.cache.cached_hashes())
        yield reply

    def _start_transfer(self, request: EngineRequest, ready_at: float, first_token: int) -> dict:
        """Queue the prompt's KV on this prefill worker's link; the decode worker's params."""
        num_bytes, start, finish = ship_prompt_kv(self.link, request.prompt_tokens,
                                                  self.profile.gpu_kv_bytes_per_token, ready_at)
        handle = TransferHandle(transfer_id=request.request_id, source_worker=self.instance_id,
                                prompt_tokens=request.prompt_tokens, num_bytes=num_bytes,
                                kv_ready_at=finish, link_queue_s=start - ready_at)
        return pack_params(handle, first_token)


async def _next_or_stop(queue: asyncio.Queue, stopped) -> Any:
    """The next output, or None once the request is cancelled by the caller."""
    if stopped is None:
        return await queue.get()
    getter = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({getter, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    return None


def build_engine(config: WorkerConfig) -> tuple[EngineProfile, Engine, model_dir.ModelInfo, str]:
    profile = load_profile(config.profile)
    limits = profile.engine
    if config.max_batch_size or config.max_num_tokens:
        limits = msgspec.structs.replace(
            limits, max_batch_size=config.max_batch_size or limits.max_batch_size,
            max_num_tokens=config.max_num_tokens or limits.max_num_tokens)
        profile = msgspec.structs.replace(profile, engine=limits)
    path = model_dir.ensure_model_dir(config.model_path)
    info = model_dir.load_model_info(path)
    engine = Engine(profile, EngineConfig(token_range=info.generation_token_range, seed=config.seed,
                                          capacity_blocks=config.kv_capacity_blocks))
    return profile, engine, info, str(path)


def max_seq_len_of(config: WorkerConfig, model_path: str) -> int:
    """--max-seq-len, else what TensorRT-LLM infers from the model directory."""
    return config.max_seq_len or inferred_max_seq_len(model_path)


class _Publishers:
    """KV events and load metrics over Dynamo's event plane, and Prometheus text."""

    def __init__(self, endpoint, engine: Engine, config: WorkerConfig, instance_id: int):
        from dynamo.llm import FpmDirectPublisher, KvEventPublisher, WorkerMetricsPublisher

        self.engine = engine
        self.block_size = engine.block_size
        self.kv = (KvEventPublisher(endpoint, kv_block_size=self.block_size, enable_local_indexer=True)
                   if config.publish_kv_events else None)
        self.metrics = WorkerMetricsPublisher() if config.publish_metrics else None
        self.fpm = FpmDirectPublisher(endpoint, str(instance_id), 1) if config.publish_metrics else None
        self.endpoint = endpoint
        self.iterations = 0
        self.served: Counter[str] | None = None  # the handler's, set once it exists

    async def start(self) -> None:
        if self.metrics:
            await self.metrics.create_endpoint(self.endpoint)
            self.endpoint.metrics.register_prometheus_expfmt_callback(self.prometheus_text)

    def kv_events(self, events: list[KvEvent]) -> None:
        if self.kv is None:
            return
        for event in events:
            if isinstance(event, KvStored):
                self.kv.publish_stored(event.token_ids, [self.block_size] * len(event.block_hashes),
                                       event.block_hashes, event.parent_hash)
            else:
                self.kv.publish_removed(event.block_hashes)

    def iteration(self, iteration: Iteration) -> None:
        self.iterations += 1
        if not (self.metrics and self.fpm):
            return
        load = self.engine.load()
        self.metrics.publish(0, load.kv_active_blocks, load.kv_used_blocks)
        self.fpm.publish(
            dp_rank=0,
            scheduled_num_prefill_requests=len(iteration.prefill),
            scheduled_sum_prefill_tokens=sum(n for _, n in iteration.prefill),
            scheduled_sum_prefill_kv_tokens=sum(r.computed_tokens for r, _ in iteration.prefill),
            scheduled_num_decode_requests=len(iteration.decode),
            scheduled_sum_decode_kv_tokens=sum(r.kv.kv_tokens for r in iteration.decode),
            queued_num_prefill_requests=load.waiting_requests,
            queued_sum_prefill_tokens=load.waiting_prompt_tokens,
            queued_num_decode_requests=load.awaiting_kv_requests,
            queued_sum_decode_kv_tokens=0,
            wall_time_secs=iteration.duration_s)

    def prometheus_text(self) -> str:
        load = self.engine.load()
        gauges = {
            "kv_used_blocks": load.kv_used_blocks, "kv_active_blocks": load.kv_active_blocks,
            "kv_capacity_blocks": load.kv_capacity_blocks, "waiting_requests": load.waiting_requests,
            "prefill_requests": load.prefill_requests, "decode_requests": load.decode_requests,
            "awaiting_kv_requests": load.awaiting_kv_requests,
        }
        lines = []
        for name, value in gauges.items():
            lines += [f"# TYPE dynamo_ppd_engine_{name} gauge", f"dynamo_ppd_engine_{name} {value}"]
        counters = {"iterations_total": self.engine.iterations,
                    "prefill_tokens_total": self.engine.prefill_tokens_computed}
        for name, value in counters.items():
            lines += [f"# TYPE dynamo_ppd_engine_{name} counter", f"dynamo_ppd_engine_{name} {value}"]
        return "\n".join(lines + served_lines(self.served or Counter())) + "\n"


async def serve(config: WorkerConfig) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    runtime = create_runtime()
    profile, engine, info, path = build_engine(config)
    endpoint = runtime.endpoint(f"{config.namespace}.{config.component}.{config.endpoint}")
    instance_id = endpoint.connection_id()
    publishers = _Publishers(endpoint, engine, config, instance_id)
    await publishers.start()
    live = WallClockEngine(engine, config.speedup, publishers.kv_events, publishers.iteration)
    max_seq_len = max_seq_len_of(config, path)
    handler = SimulatedTrtllmHandler(config, profile, live, instance_id, max_seq_len)
    publishers.served = handler.served
    live.start()
    if config.register_model:
        runtime_config = ModelRuntimeConfig()
        runtime_config.total_kv_blocks = engine.cache.capacity
        runtime_config.max_num_seqs = engine.max_batch_size
        runtime_config.max_num_batched_tokens = engine.max_num_tokens
        runtime_config.enable_local_indexer = config.publish_kv_events
        runtime_config.kv_event_publishing_enabled = config.publish_kv_events
        publish_max_seq_len(runtime_config, max_seq_len)
        if config.mode == "prefill":
            model_type, worker_type, needs = ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]
        elif config.mode == "decode":
            model_type = ModelType.Chat | ModelType.Completions
            worker_type, needs = WorkerType.Decode, [[WorkerType.Prefill]]
        else:
            model_type, worker_type, needs = ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, []
        await register_model(ModelInput.Tokens, model_type, endpoint, path,
                             config.served_model_name or info.served_model_name,
                             worker_type=worker_type, kv_cache_block_size=engine.block_size,
                             runtime_config=runtime_config, needs=needs)
    log.info("simulated TensorRT-LLM worker (%s, profile %s, %d KV blocks, max_seq_len %d, speedup %g) "
             "serving %s.%s.%s as instance %x", config.mode, profile.name, engine.cache.capacity,
             max_seq_len, config.speedup, config.namespace, config.component, config.endpoint, instance_id)
    status = runtime.endpoint(f"{config.namespace}.{config.component}.status")
    try:
        await asyncio.gather(
            endpoint.serve_endpoint(handler.generate, graceful_shutdown=True,
                                    metrics_labels=[("model", info.served_model_name)]),
            status.serve_endpoint(handler.status, graceful_shutdown=True))
    finally:
        await live.stop()


def main(argv: list[str] | None = None) -> None:
    run_component(serve, parse_args(argv))
