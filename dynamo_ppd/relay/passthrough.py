"""A bare pass-through relay: the floor the PPD router's hop is measured against.

`python -m dynamo_ppd.relay.passthrough` registers the public model like the PPD router does and
forwards every request to a decode worker, decode-local (``x-bypass-remote-prefill``), yielding
each of the worker's chunks unchanged: no sessions, no residency, no policy, no bookkeeping. It
exists only for the relay benchmark (`just bench-relay`, `dynamo_ppd.bench.relay`): what
any Python Dynamo component in the data path costs per relayed token, so what the PPD router adds
on top of it can be told apart from what Dynamo's bindings cost. Graph: `graphs/relay.yaml`.

``--first-turn-via-prefill`` (the benchmark's ``relay-pd``): a conversation's first request (the
first one carrying its ``x-dynamo-session-id``) goes through a prefill worker first, as Dynamo's
frontend sends a PD request (``max_tokens = 1`` there, its ``disaggregated_params`` handed to the
decode request as ``prefill_result``), and its later requests go decode-local to the same decode
worker. Those are the requests the PPD router sends for the relay benchmark's load (turn 1 through
P, the follow-up on D), with no policy, no etcd, no KV events: what the PPD router's routes cost
through Dynamo's bindings, apart from its own state.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .. import model as model_dir
from ..engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION
from ..runtime import create_runtime, run_component
from .dispatch import prefill_leg_request, with_prefill_result

log = logging.getLogger("dynamo_ppd.relay.passthrough")

HOMES = 100_000  # sessions whose decode worker --first-turn-via-prefill remembers (oldest forgotten)


async def _prefilled(prefill, request: dict, worker: int, context) -> dict:
    """``request`` as Dynamo's frontend sends it to the decode worker after a remote prefill."""
    params = details = None
    async for chunk in await prefill.direct(prefill_leg_request(request), worker, annotated=False,
                                            context=context):
        params = chunk.get("disaggregated_params") or params
        details = (chunk.get("completion_usage") or {}).get("prompt_tokens_details") or details
    if params is None:
        raise RuntimeError(f"prefill worker {worker:x} returned no disaggregated_params")
    return with_prefill_result(request, params, details)


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    runtime = create_runtime()
    decode = await runtime.endpoint(f"{args.workers_namespace}.{args.decode_component}.generate").client()
    await decode.wait_for_instances()
    prefill: Any = None  # a Dynamo client, with --first-turn-via-prefill
    if args.first_turn_via_prefill:
        prefill_endpoint = f"{args.workers_namespace}.{args.prefill_component}.generate"
        prefill = await runtime.endpoint(prefill_endpoint).client()
        await prefill.wait_for_instances()
    turn = itertools.count()
    homes: OrderedDict[str, int] = OrderedDict()  # session id -> its decode worker (--first-turn-via-prefill)

    async def generate(request: dict, context=None):
        ids = decode.instance_ids()
        # Round robin: the decode workers share the load; no cache affinity (this is not a router).
        worker = ids[next(turn) % len(ids)]
        session = (request.get("agent_context") or {}).get("session_id") if prefill is not None else None
        if session is not None and session not in homes:
            homes[session] = worker
            if len(homes) > HOMES:
                homes.popitem(last=False)
            prefill_ids = prefill.instance_ids()
            request = await _prefilled(prefill, request, prefill_ids[next(turn) % len(prefill_ids)], context)
        else:
            worker = homes.get(session, worker) if session is not None else worker
            request["annotations"] = [*(request.get("annotations") or []), BYPASS_REMOTE_PREFILL_ANNOTATION]
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
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.relay.passthrough", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None, help="local model directory (default: the "
                        "project's, created if missing)")
    parser.add_argument("--served-model-name", default=None, help="public model name (default: the "
                        "model directory's)")
    parser.add_argument("--namespace", default="ppd", help="namespace the public model is registered in")
    parser.add_argument("--workers-namespace", default="workers", help="namespace of the decode workers")
    parser.add_argument("--decode-component", default="backend", help="component of the decode workers")
    parser.add_argument("--prefill-component", default="prefill", help="component of the prefill workers "
                        "(used with --first-turn-via-prefill)")
    parser.add_argument("--first-turn-via-prefill", action="store_true", help="send each conversation's "
                        "first request (by its x-dynamo-session-id) through a prefill worker, then to a "
                        "decode worker, and its later requests decode-local to that decode worker: the "
                        "requests the PPD router sends for the relay benchmark's load, without its state")
    parser.add_argument("--block-size", type=int, default=32, help="KV block size registered with the model")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_component(serve, parse_args(argv))


if __name__ == "__main__":
    main()
