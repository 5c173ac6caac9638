"""Running the endpoint picker: Dynamo runtime (discovery of the workers), the shared routing
state, the prompt tokenizer, the ext_proc gRPC server with gRPC health, metrics."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..routing.args import RoutingConfig
from ..routing.metrics import RoutingMetrics
from ..routing.start import build_policy, start_routing
from ..routing.state import Routing
from ..runtime import create_runtime, run_component
from .args import PickerConfig, parse_args
from .budget import TokenizeBudget
from .extproc import ExtProcService
from .frontends import Frontends
from .metrics import PickerMetrics
from .picker import Picker
from .prompt import PromptTokenizer
from .tls import server_credentials

log = logging.getLogger("dynamo_ppd.picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


async def serve(configs: tuple[RoutingConfig, PickerConfig]) -> None:
    config, picker_config = configs
    runtime = create_runtime()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # no endpoint to serve: wait for this instead
        loop.add_signal_handler(sig, stopping.set)
    metrics = RoutingMetrics()
    picker_metrics = PickerMetrics(metrics)
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.metrics_host)
    routing = Routing(runtime, config, build_policy(config), metrics)
    path, cards = await start_routing(routing)
    frontends = Frontends(picker_config.frontends, picker_config.frontend_refresh_s)
    await frontends.start()
    tokenizer = PromptTokenizer.from_model_dir(
        path, strip_anthropic_preamble=picker_config.strip_anthropic_preamble,
        fast=picker_config.fast_tokenizer)
    log.info("prompts encoded with %s", tokenizer.encoder)
    picker = Picker(routing, tokenizer, frontends, send_token_ids=picker_config.send_token_ids,
                    observe_share=picker_config.observe_share, session_headers=picker_config.session_headers,
                    budget=TokenizeBudget(picker_config.deadline_ms / 1e3),
                    served_models=[config.served_model_name] if config.served_model_name else None,
                    prompt_memo_mb=picker_config.prompt_memo_mb)
    if routing.kv_sync is not None and not await routing.kv_sync.settled():
        log.warning("the workers' residency was not rebuilt within 10 s of start; serving anyway "
                    "(follow-ups go through prefill until their decode workers' KV events arrive)")

    # What start-up made (the tokenizer, the tables, the sessions loaded from etcd) lives as long
    # as the process: out of the collector's way, so a full collection walks only what requests
    # make since (a pause there is a pick's tail latency).
    gc.collect()
    gc.freeze()
    health_servicer = health.aio.HealthServicer()
    servers = []
    for port, ext_proc in ((picker_config.grpc_port, True), (picker_config.health_port, False)):
        if not port:
            continue
        server = grpc.aio.server()
        if ext_proc:
            external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
                ExtProcService(picker, picker_metrics, picker_config.timings), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f"{picker_config.grpc_host}:{port}"
        if ext_proc and picker_config.secure_serving:
            credentials, _ = server_credentials(picker_config.cert_path)
            server.add_secure_port(address, credentials)
        else:
            server.add_insecure_port(address)
        await server.start()
        servers.append(server)
    for service in ("", EXT_PROC_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("PPD endpoint picker (mode %s, weights %g,%g) on ext_proc %s:%d%s, frontends %s; "
             "workers in %s", config.mode.value, config.w_ttft, config.w_tpot, picker_config.grpc_host,
             picker_config.grpc_port, " (TLS)" if picker_config.secure_serving else "",
             ",".join(picker_config.frontends), config.workers_namespace)
    try:
        await stopping.wait()
    finally:
        for service in ("", EXT_PROC_SERVICE):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for server in servers:
            await server.stop(grace=2.0)
        await frontends.stop()
        picker.budget.close()  # tokenizations not started yet are dropped
        if cards is not None:
            await cards.stop()
        await routing.stop()
        runtime.shutdown()


def main(argv: list[str] | None = None) -> None:
    run_component(serve, parse_args(argv))
