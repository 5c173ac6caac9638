#!/usr/bin/env python3
"""Turn a Hugging Face model into a model directory that dynamo-ppd accepts.

`dynamo-ppd serve --model-dir DIR` and the router's `--model-path DIR` expect, besides the usual
Hugging Face files (config.json, generation_config.json, tokenizer.json, tokenizer_config.json),
a `dynamo_ppd_model.json` naming the served model. Without it both take DIR for a missing
*simulated* model directory and write one there, replacing what DIR held. This script downloads
the model (or uses a local copy) and adds that file, so a real model can be served:

    # a GPU node: the whole model for the TensorRT-LLM workers and the router (needs HF_TOKEN;
    # Llama 3.1 is gated), about 16 GB
    python deploy/prepare_model.py --model meta-llama/Llama-3.1-8B-Instruct \\
        --out ~/models/llama-3.1-8b-instruct

    # the router's pod (Helm chart init container): tokenizer and config files only
    python deploy/prepare_model.py --model meta-llama/Llama-3.1-8B-Instruct --out /model --tokenizer-only

    # a model already on disk: add the file in place
    python deploy/prepare_model.py --model /models/Llama-3.1-8B-Instruct

Exit codes: 0 done, 2 bad input (one line on stderr), 1 download or validation failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MARKER = "dynamo_ppd_model.json"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
TOKENIZER_PATTERNS = [*HF_FILES, "special_tokens_map.json"]
# Everything the TensorRT-LLM PyTorch backend loads; not `original/` (Meta's consolidated
# checkpoint, a second copy of the weights).
FULL_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
FORMAT_VERSION = 1  # dynamo_ppd.model.MODEL_FORMAT_VERSION


class PrepareError(Exception):
    pass


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PrepareError(f"{path}: {exc}") from exc


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def model_info(model_dir: Path, served_model_name: str) -> dict:
    """The dynamo_ppd_model.json for a real model (schema: dynamo_ppd.model.ModelInfo)."""
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    tokenizer = _read_json(model_dir / "tokenizer.json")
    special = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", []) if "content" in t}
    eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    if not eos:
        raise PrepareError(f"{model_dir}: no eos_token_id in generation_config.json or config.json")
    bos = generation.get("bos_token_id", config.get("bos_token_id"))
    if bos is None:
        raise PrepareError(f"{model_dir}: no bos_token_id in generation_config.json or config.json")
    return {
        "format_version": FORMAT_VERSION,
        "served_model_name": served_model_name,
        "vocab_size": int(config["vocab_size"]),
        # The simulated model guarantees that ids in this range survive detokenize -> template ->
        # tokenize; a real BPE tokenizer guarantees it for none, so the range is empty.
        "generation_token_range": [0, 0],
        "bos_token_id": int(bos),
        "eot_token_id": int(special.get("<|eot_id|>", eos[0])),
        "eos_token_ids": eos,
    }


def download(model: str, out: Path, tokenizer_only: bool, revision: str | None) -> None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise PrepareError("huggingface_hub is not installed (it comes with `uv sync --extra trtllm` "
                           "and with Dynamo's runtime images)") from exc
    patterns = TOKENIZER_PATTERNS if tokenizer_only else FULL_PATTERNS
    print(f"downloading {model} ({'tokenizer and config' if tokenizer_only else 'full model'}) "
          f"into {out}", flush=True)
    # The token comes from HF_TOKEN (or a prior `hf auth login`).
    snapshot_download(repo_id=model, revision=revision, local_dir=str(out), allow_patterns=patterns,
                      ignore_patterns=["original/*"])


def prepare(model: str, out: Path | None, served_model_name: str | None, tokenizer_only: bool,
            revision: str | None = None) -> Path:
    local = Path(model).expanduser()
    if local.is_dir():
        target = (out or local).expanduser()
        if target.resolve() != local.resolve():
            raise PrepareError("--out must be the model directory itself when --model is a local "
                               "directory (the file is added in place)")
        name = served_model_name or local.name
    else:
        if out is None:
            raise PrepareError(f"--out is required when --model ({model}) is a Hugging Face id")
        target = out.expanduser()
        if target.is_dir() and any(target.iterdir()) and not (target / "config.json").is_file() \
                and not (target / ".cache").is_dir():
            raise PrepareError(f"{target} exists, is not empty and holds no model; choose another --out")
        target.mkdir(parents=True, exist_ok=True)
        download(model, target, tokenizer_only, revision)
        name = served_model_name or model
    missing = [f for f in HF_FILES if not (target / f).is_file()]
    if missing:
        raise PrepareError(f"{target}: missing {', '.join(missing)}; not a Hugging Face model directory")
    info = model_info(target, name)
    (target / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    _validate(target, info)
    return target


def _validate(target: Path, info: dict) -> None:
    """When dynamo_ppd is importable, check the directory the way `serve` and the router will."""
    try:
        from dynamo_ppd import model as ppd_model
    except ImportError:
        return
    if not ppd_model.is_complete(target):
        raise PrepareError(f"{target}: dynamo_ppd still does not accept this directory")
    loaded = ppd_model.load_model_info(target)
    if loaded.served_model_name != info["served_model_name"]:
        raise PrepareError(f"{target}: {MARKER} did not round-trip")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                   help="Hugging Face model id, or a local model directory (default: %(default)s)")
    p.add_argument("--out", type=Path, help="target directory (required for a Hugging Face id)")
    p.add_argument("--served-model-name", help="public model name (default: the model id, or the "
                   "local directory's name)")
    p.add_argument("--tokenizer-only", action="store_true",
                   help="download only the tokenizer and config files (what the router needs)")
    p.add_argument("--revision", help="Hugging Face revision (branch, tag or commit)")
    args = p.parse_args(argv)
    try:
        target = prepare(args.model, args.out, args.served_model_name, args.tokenizer_only, args.revision)
    except PrepareError as exc:
        print(f"prepare_model: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (download failures: one line, exit 1)
        print(f"prepare_model: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    info = json.loads((target / MARKER).read_text())
    print(f"{target}: ready (served as {info['served_model_name']!r}); "
          f"use it as `dynamo-ppd serve ... --model-dir {target}`", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
