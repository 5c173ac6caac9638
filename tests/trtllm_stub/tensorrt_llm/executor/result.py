"""Imitates tensorrt_llm/executor/result.py (NVIDIA/TensorRT-LLM, stored snapshot 005bc848, and
the rc-series fields Dynamo 1.6.1 reads):

- ``CompletionOutput.token_ids`` are cumulative: every result carries all tokens generated so far
  (``_handle_sequence`` extends the list); dynamo.trtllm slices off what it already sent.
- ``finish_reason`` is 'length' / 'stop' once the request is done, None before.
- a context-only request's output carries ``disaggregated_params`` built from the executor's
  context-phase params (``request_type='context_only'``, ``first_gen_tokens``,
  ``ctx_request_id`` = the executor's int request id, ``opaque_state`` = bytes, ...).
- a generation-only request's outputs start with the first token the context server produced
  (TensorRT-LLM's own OpenAI server hides it in streaming mode; Dynamo's handler does not).
- ``cached_tokens``: the prompt tokens the KV cache manager did not have to compute (Dynamo 1.6.1
  handler_base.py ``_prompt_tokens_details`` reads it; a generation-only request reports its whole
  transferred prompt).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] | None = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list | None = field(default_factory=list)
    prompt_logprobs: list | None = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    generation_logits: Any = None
    disaggregated_params: Any = None
    request_perf_metrics: Any = None


class GenerationResult:
    """An async iterator of snapshots of one request, as ``LLM.generate_async`` returns it.

    ``steps`` produces, one call per engine iteration, ``(new_tokens, finished, finish_reason)``;
    with ``streaming`` every iteration is yielded, without it only the final one."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], streaming: bool,
                 steps: Callable[[], AsyncIterator[tuple[list[int], bool, str | None]]],
                 cached_tokens: int, disaggregated_params: Any = None):
        self.request_id = request_id
        self.prompt = None
        self.prompt_token_ids = prompt_token_ids
        self.cached_tokens = cached_tokens
        self.disaggregated_params = disaggregated_params
        self._streaming = streaming
        self._steps = steps
        self._outputs = [CompletionOutput(0)]
        self._done = False
        self.aborted = False

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self.aborted = True

    async def __aiter__(self):
        async for new_tokens, finished, reason in self._steps():
            if self.aborted:
                finished, reason = True, "cancelled"
            output = self._outputs[0]
            output.token_ids.extend(new_tokens)
            output.disaggregated_params = self.disaggregated_params
            self._done = finished
            if finished:
                output.finish_reason = reason
            if self._streaming or finished:
                yield self
            if finished:
                return
            await asyncio.sleep(0)
