"""Imitates ``update_llm_args_with_extra_options`` of tensorrt_llm/llmapi/llm_utils.py (stored
snapshots 1520735490 / 292162234 of the function): the YAML file's mapping is loaded and merged
over the arguments Dynamo built, top-level keys replacing Dynamo's (dynamo/trtllm/workers/
llm_worker.py 1.6.1 calls it with ``--extra-engine-args``). The nested configs stay dicts here;
`LLM` checks them against the vendored field lists in `llm_args`."""

from __future__ import annotations

import yaml


def update_llm_args_with_extra_options(llm_args: dict, extra_llm_api_options: str | None) -> dict:
    if extra_llm_api_options is None:
        return llm_args
    with open(extra_llm_api_options) as f:
        extra = yaml.safe_load(f) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{extra_llm_api_options}: the root must be a mapping")
    return llm_args | extra
