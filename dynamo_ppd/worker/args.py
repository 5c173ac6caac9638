"""Command line of the simulated TensorRT-LLM worker (`python -m dynamo_ppd.worker`). Flags that
`python -m dynamo.trtllm` has keep its names, so graphs can swap one for the other."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..argtypes import positive_float, positive_int
from ..engine.profile import DEFAULT_PROFILE, bundled_profiles

DEFAULT_NAMESPACE = "dynamo"


@dataclass(frozen=True)
class WorkerConfig:
    mode: str  # prefill | decode | agg
    namespace: str
    component: str
    endpoint: str
    model_path: Path | None
    served_model_name: str | None
    profile: str
    speedup: float
    link_bandwidth_gbps: float | None
    kv_capacity_blocks: int | None
    max_batch_size: int | None
    max_num_tokens: int | None
    max_seq_len: int | None
    default_max_tokens: int
    register_model: bool
    publish_kv_events: bool
    publish_metrics: bool
    seed: int


def _parse_endpoint(text: str) -> tuple[str, str, str]:
    parts = text.removeprefix("dyn://").split(".")
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not dyn://namespace.component.endpoint")
    return parts[0], parts[1], parts[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynamo_ppd.worker",
        description="Simulated TensorRT-LLM worker: dynamo.trtllm's request contract and "
        "registration, with timing from an engine model instead of a GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode", "agg"], default="agg",
                   help="prefill: context_only requests; decode: generation_only (with "
                   "prefill_result) or context_and_generation (with the x-bypass-remote-prefill "
                   "annotation); agg: prefill and decode here")
    p.add_argument("--endpoint", help="dyn://namespace.component.endpoint; default "
                   "dyn://dynamo.prefill.generate for prefill, dyn://dynamo.backend.generate else")
    p.add_argument("--model-path", type=Path, help="local model directory; default: dynamo-ppd's "
                   "cache directory model (created by `dynamo-ppd model init`)")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name",
                   help="model name clients use; default: the model directory's")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"engine profile name ({', '.join(bundled_profiles())}) or YAML path")
    p.add_argument("--speedup", type=positive_float, default=1.0,
                   help="run the modeled time this many times faster than real time")
    p.add_argument("--link-bandwidth-gbps", type=positive_float,
                   help="prefill workers: outgoing KV link bandwidth in GB/s (default: profile's)")
    p.add_argument("--kv-capacity-blocks", type=positive_int,
                   help="KV cache size in blocks (default: derived from the profile's memory)")
    p.add_argument("--max-batch-size", type=positive_int, help="default: profile's")
    p.add_argument("--max-num-tokens", type=positive_int, help="default: profile's")
    p.add_argument("--max-seq-len", type=positive_int,
                   help="longest sequence (prompt + output) a request may have, as TensorRT-LLM's "
                   "max_seq_len: published to the frontend, which refuses longer prompts with a 400 "
                   "(default: the model directory's max_position_embeddings, what TensorRT-LLM "
                   "infers when it is unset)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="output length when a request sets no max_tokens")
    p.add_argument("--no-register-model", dest="register_model", action="store_false",
                   help="serve the endpoint without advertising the public model (for a router "
                   "that sits in front and registers it itself)")
    p.add_argument("--publish-kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="publish KV stored/removed events over the event plane")
    p.add_argument("--publish-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="publish load metrics (worker metrics, forward-pass metrics, Prometheus)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated token ids")
    return p


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    default = "prefill" if args.disaggregation_mode == "prefill" else "backend"
    try:
        endpoint_path = args.endpoint or f"{DEFAULT_NAMESPACE}.{default}.generate"
        namespace, component, endpoint = _parse_endpoint(endpoint_path)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return WorkerConfig(
        mode=args.disaggregation_mode, namespace=namespace, component=component, endpoint=endpoint,
        model_path=args.model_path, served_model_name=args.served_model_name, profile=args.profile,
        speedup=args.speedup, link_bandwidth_gbps=args.link_bandwidth_gbps,
        kv_capacity_blocks=args.kv_capacity_blocks, max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
        default_max_tokens=args.default_max_tokens,
        register_model=args.register_model, publish_kv_events=args.publish_kv_events,
        publish_metrics=args.publish_metrics, seed=args.seed)
