"""A bare pass-through relay: the floor the PPD router's hop is measured against.

`python -m dynamo_ppd.router.passthrough` registers the public model like the PPD router does and
forwards every request to a decode worker, decode-local (``x-bypass-remote-prefill``), yielding
each of the worker's chunks unchanged: no sessions, no residency, no policy, no bookkeeping. It
exists only for the relay benchmark (`just bench-relay`, `dynamo_ppd.bench.relay`): what
any Python Dynamo component in the data path costs per relayed token, so what the PPD router adds
on top of it can be told apart from what Dynamo's bindings cost. Graph: `graphs/relay.yaml`.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path

from .. import model as model_dir
from ..engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION
from ..runtime import create_runtime, run_component

log = logging.getLogger("dynamo_ppd.passthrough")


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    runtime = create_runtime()
    decode = await runtime.endpoint(f"{args.workers_namespace}.{args.decode_component}.generate").client()
    await decode.wait_for_instances()
    turn = itertools.count()

    async def generate(request: dict, context=None):
        ids = decode.instance_ids()
        request["annotations"] = [*(request.get("annotations") or []), BYPASS_REMOTE_PREFILL_ANNOTATION]
        # Round robin: the decode workers share the load; no cache affinity (this is not a router).
        worker = ids[next(turn) % len(ids)]
        async for chunk in await decode.direct(request, worker, annotated=False, context=context):
            yield chunk

    path = model_dir.ensure_model_dir(args.model_path)
    name = args.served_model_name or model_dir.load_model_info(path).served_model_name
    endpoint = runtime.endpoint(f"{args.namespace}.router.generate")
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, str(path),
                         name, worker_type=WorkerType.Aggregated, kv_cache_block_size=args.block_size,
                         runtime_config=ModelRuntimeConfig())
    log.info("pass-through relay serving %s in %s; decode workers %s.%s", name, args.namespace,
             args.workers_namespace, args.decode_component)
    await endpoint.serve_endpoint(generate, graceful_shutdown=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.router.passthrough", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="local model directory (default: the "
                        "project's, created if missing)")
    parser.add_argument("--served-model-name", default=None, help="public model name (default: the "
                        "model directory's)")
    parser.add_argument("--namespace", default="ppd", help="namespace the public model is registered in")
    parser.add_argument("--workers-namespace", default="workers", help="namespace of the decode workers")
    parser.add_argument("--decode-component", default="backend", help="component of the decode workers")
    parser.add_argument("--block-size", type=int, default=32, help="KV block size registered with the model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_component(serve, parse_args(argv))


if __name__ == "__main__":
    main()
