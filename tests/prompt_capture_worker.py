"""A Dynamo worker that records the token ids Dynamo's frontend sends it (tests/test_picker_prompt.py).

``python tests/prompt_capture_worker.py --out FILE --model DIR=NAME [--model DIR=NAME ...]``
registers each model directory under its name (``ModelInput.Tokens``, chat and completions, like
`dynamo_ppd.relay.passthrough`) on its own endpoint ``{namespace}.capture{i}.generate``, and
answers every request with one token and ``finish_reason: "stop"`` (the shape
`dynamo_ppd.worker.handler` yields) after appending one JSON line to ``FILE``:
``{"model": NAME, "token_ids": [...]}``. The frontend's preprocessing (chat template, tokenizer)
is then what the test compares `dynamo_ppd.picker.prompt.PromptTokenizer` with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from any directory

from dynamo_ppd.runtime import create_runtime, run_component  # noqa: E402

ANSWER_TOKEN = 1000  # a " word" token of the project's model directory (model.GENERATION_RANGE_START)


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    runtime = create_runtime()
    out = open(args.out, "a", buffering=1)  # noqa: SIM115  (one line per request, flushed)

    def handler(name: str):
        async def generate(request: dict, context=None):
            token_ids = list(request.get("token_ids") or [])
            out.write(json.dumps({"model": name, "token_ids": token_ids}) + "\n")
            yield {"token_ids": [ANSWER_TOKEN], "index": 0, "finish_reason": "stop",
                   "completion_usage": {"prompt_tokens": len(token_ids), "completion_tokens": 1,
                                        "total_tokens": len(token_ids) + 1}}
        return generate

    served = []
    for i, spec in enumerate(args.model):
        path, _, name = spec.partition("=")
        endpoint = runtime.endpoint(f"{args.namespace}.capture{i}.generate")
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, path,
                             name, worker_type=WorkerType.Aggregated, kv_cache_block_size=32,
                             runtime_config=ModelRuntimeConfig())
        served.append(endpoint.serve_endpoint(handler(name), graceful_shutdown=True))
    await asyncio.gather(*served)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="file the captured token ids are appended to")
    parser.add_argument("--model", action="append", required=True, help="DIR=NAME: a model to serve")
    parser.add_argument("--namespace", default="capture")
    run_component(serve, parser.parse_args())


if __name__ == "__main__":
    main()
