"""Running the relay router: Dynamo runtime, public model registration, endpoint, metrics server."""

from __future__ import annotations

import logging

from .. import model as model_dir
from ..routing.args import RoutingConfig, parse_args
from ..routing.metrics import RoutingMetrics
from ..routing.start import build_policy, start_routing
from ..runtime import create_runtime, run_component
from .router import PpdRouter

log = logging.getLogger("dynamo_ppd.relay")


async def serve(config: RoutingConfig) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    runtime = create_runtime()
    metrics = RoutingMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.metrics_host)
    router = PpdRouter(runtime, config, build_policy(config), metrics)
    path, cards = await start_routing(router)
    name = config.served_model_name or model_dir.load_model_info(path).served_model_name
    endpoint = runtime.endpoint(f"{config.namespace}.router.generate")
    runtime_config = ModelRuntimeConfig()
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, str(path),
                         name, worker_type=WorkerType.Aggregated, kv_cache_block_size=config.block_size,
                         runtime_config=runtime_config)
    log.info("PPD router (mode %s, weights %g,%g) serving %s in %s; workers in %s",
             config.mode.value, config.w_ttft, config.w_tpot, name, config.namespace,
             config.workers_namespace)
    try:
        await endpoint.serve_endpoint(router.generate, graceful_shutdown=True)
    finally:
        if cards is not None:
            await cards.stop()
        await router.stop()


def main(argv: list[str] | None = None) -> None:
    run_component(serve, parse_args(argv))
