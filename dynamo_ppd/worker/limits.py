"""A request longer than the engine's ``max_seq_len``: what ``dynamo.trtllm`` and TensorRT-LLM do
with it, kept by the simulated worker (issue 48, item 3).

- Registration, Dynamo 1.6.1 (ai-dynamo wheel, ``dynamo/trtllm/workers/llm_worker.py``, where the
  worker registers its model): ``runtime_config.context_length = config.max_seq_len`` and
  ``publish_trtllm_token_budget(runtime_config, config.max_seq_len)``
  (``dynamo/trtllm/utils/trtllm_utils.py``), i.e. the engine-specific ``token_budget``
  ``TokenBudget(combined_limit=max_seq_len, reject_prompt_overflow=True,
  reject_total_overflow=False)`` of ``dynamo/common/token_budget.py``. Dynamo's frontend reads it
  from the model card and refuses a prompt of ``max_seq_len`` tokens or more with HTTP 400 before
  any worker sees it; a prompt that fits, with a ``max_tokens`` that does not, goes on to the
  engine. dynamo.trtllm publishes both only when ``max_seq_len`` is configured (the engine YAMLs
  of deploy/engine set 32768); this worker always knows its limit and always publishes it.
- The engine, TensorRT-LLM (ai-dynamo[trtllm] 1.6.1 pins 1.3.0rc29; read on NVIDIA/TensorRT-LLM
  main, ``tensorrt_llm/executor/base_worker.py``, ``BaseWorker._enqueue_request._deduce_max_tokens``):
  ``default_max_tokens = max_seq_len - prompt_len``; at most 0 it raises ``ValueError``, which
  ``_enqueue_request`` re-raises as ``RequestError`` (a RuntimeError); a larger ``max_tokens`` is cut
  to it with a warning. Unset, ``max_seq_len`` is inferred from the checkpoint:
  ``max_position_embeddings`` (``tensorrt_llm/_torch/models/modeling_utils.py``,
  ``infer_max_seq_len``; not scaled for ``llama3`` rope; 2048 without the field).
- The handler, Dynamo 1.6.1 (``dynamo/trtllm/request_handlers/handler_base.py``,
  ``generate_locally``, ``except RequestError``): answers it with the final chunk
  ``{"finish_reason": {"error": message}, "token_ids": []}``, which the frontend answers 500
  ("backend asserted status 500", its message kept server-side). So a client gets a 4xx only from
  the frontend's own check, which the registration enables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..engine.scheduler import EngineRequest

# TensorRT-LLM's max_seq_len when the checkpoint has no max_position_embeddings.
TRTLLM_FALLBACK_MAX_SEQ_LEN = 2048


class SequenceTooLong(Exception):
    """The prompt leaves no room for one output token (TensorRT-LLM's ``RequestError``)."""


def inferred_max_seq_len(model_path: str | Path) -> int:
    """TensorRT-LLM's ``max_seq_len`` for a model directory when none is configured."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return TRTLLM_FALLBACK_MAX_SEQ_LEN
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else TRTLLM_FALLBACK_MAX_SEQ_LEN


def fit_to_max_seq_len(request: EngineRequest, max_seq_len: int) -> None:
    """Cut ``max_tokens`` to what is left of ``max_seq_len`` after the prompt, as TensorRT-LLM
    does; SequenceTooLong (its message) when nothing is left."""
    left = max_seq_len - request.prompt_tokens
    if left <= 0:
        raise SequenceTooLong(
            f"`default_max_tokens` ({left}) must be greater than 0, `default_max_tokens` ({left}) = "
            f"max_seq_len ({max_seq_len}) - `splited_prompt_len` ({request.prompt_tokens}) - "
            "`query_token_len` (0)")
    request.max_tokens = min(request.max_tokens, left)


def publish_max_seq_len(runtime_config: Any, max_seq_len: int) -> None:
    """What dynamo.trtllm 1.6.1 registers for its ``max_seq_len`` (see the module docstring)."""
    from dynamo.common.token_budget import TokenBudget, publish_token_budget

    runtime_config.context_length = max_seq_len
    publish_token_budget(runtime_config, TokenBudget(combined_limit=max_seq_len,
                                                     reject_prompt_overflow=True,
                                                     reject_total_overflow=False))
