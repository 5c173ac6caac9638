"""`dynamo-ppd engine profile`: an engine profile for a model's config.json, a TP degree and a
precision on a named GPU (`dynamo_ppd.engine.presets`), written as the YAML every ``--profile``
takes."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from ..argtypes import cli_error, positive_int
from ..engine.presets import DTYPES, GPUS, MODELS, build_profile, describe, model_config
from ..engine.profile import ProfileError, dump_profile

DESCRIPTION = """\
Writes an engine profile for your model on your GPUs: the model's shape from its config.json
(--config PATH, or --model NAME for a shipped one: {}), TP GPUs per worker (weights,
heads and KV split over them, two NVLink all-reduces per layer), bf16 or FP8 (weights and KV
cache), on a named GPU ({}). The cost constants start from the GPU's fitted Llama-3.1-8B
profile, the fixed per-iteration time scaled by the number of layers; `dynamo-ppd engine aic
--profile OUT.yaml --refit OUT.yaml` checks and refits them against NVIDIA AIConfigurator at the
profile's TP and precision. Every command with --profile takes the file: sim run, sim compare,
table build, advise, serve (the simulated workers' --profile).""".format(", ".join(MODELS), ", ".join(GPUS))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, metavar="PATH",
                        help="the model's Hugging Face config.json (a dense decoder: Llama, Qwen2/3, "
                        "Mistral)")
    source.add_argument("--model", metavar="NAME",
                        help=f"a shipped model's name (its config.json ships): {', '.join(MODELS)}")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel GPUs per worker (must divide the attention heads)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="bf16, or fp8: FP8 weights (GEMMs on FP8 tensor cores) and an FP8 KV cache")
    parser.add_argument("--gpu", choices=list(GPUS), default="h100", help="the GPU of every worker")
    parser.add_argument("--name", help="the profile's name (default: like h100-llama3.1-70b-tp4)")
    parser.add_argument("--out", type=Path, metavar="OUT.yaml",
                        help="write the profile here (default: print it)")


def main(args: argparse.Namespace) -> int:
    try:
        name, config = model_config(str(args.config) if args.config else args.model)
        profile = build_profile(config, name, gpu=args.gpu, tp=args.tp, dtype=args.dtype, name=args.name)
    except ProfileError as exc:
        return cli_error(exc)
    source = textwrap.fill(GPUS[args.gpu].source + ".", 96, initial_indent="# ", subsequent_indent="# ")
    text = (f"# Built by `dynamo-ppd engine profile {' '.join(sys.argv[3:])}`:\n{source}\n"
            f"# Cost constants: {GPUS[args.gpu].base_profile}'s, the fixed per-iteration time scaled\n"
            f"# to {profile.model.num_layers} layers; refit with `dynamo-ppd engine aic`.\n").encode()
    text += dump_profile(profile)
    if args.out is None:
        sys.stdout.write(text.decode())
        return 0
    try:
        args.out.write_bytes(text)
    except OSError as exc:
        return cli_error(f"cannot write {args.out}: {exc.strerror}")
    print(f"wrote {args.out}: {describe(profile)}", file=sys.stderr)
    return 0
