"""The fake engine: imitates ``tensorrt_llm.LLM`` (tensorrt_llm/llmapi/llm.py) at the surface
dynamo.trtllm 1.6.1 uses, ``LLM(**engine_args)`` and ``generate_async(...)``.

- The constructor rejects what ``TorchLlmArgs`` (pydantic, extra="forbid") would, from the field
  lists vendored in `llm_args`; ``llm.args`` holds the arguments.
- ``generate_async`` takes TensorRT-LLM's keyword arguments (no ``**kwargs``: a keyword Dynamo
  renamed would be a TypeError, as on the real signature), records the call in ``llm.calls`` and
  returns a `GenerationResult` (`RequestOutput`):
  * ``context_only``: one token, finish_reason 'length', ``disaggregated_params`` with the first
    token, an int ``ctx_request_id`` and bytes ``opaque_state`` naming the KV it keeps for a
    generation server (the cache transceiver is `TRANSCEIVER`, shared by every fake engine of the
    process);
  * ``generation_only``: pulls that KV by ``opaque_state`` (which must be bytes, as the C++
    ``ContextPhaseParams`` binding requires), fails the request (`RequestError`) if it is unknown
    or for another prompt, then streams the first token followed by the rest, up to max_tokens;
  * ``context_and_generation`` (or no params): prefill here, then decode.
- A toy deterministic model (the next token is a function of the sequence) and a block prefix
  cache (32-token blocks, as ``kv_cache_config.tokens_per_block``) that reports ``cached_tokens``:
  full blocks already held, never the prompt's last token; a generation-only request reports its
  whole transferred prompt as cached (Dynamo 1.6.1 handler_base.py ``_prompt_tokens_details``).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..disaggregated_params import DisaggregatedParams
from ..executor.request import DEFAULT_REQUEST_PRIORITY
from ..executor.result import GenerationResult
from ..executor.utils import RequestError
from ..sampling_params import SamplingParams
from .llm_args import llm_args_errors

BLOCK = 32
TRANSCEIVER: dict[bytes, tuple[list[int], int]] = {}  # opaque_state -> (prompt, first token)
_request_ids = itertools.count(1)


@dataclass
class PreprocessedInputs:
    prompt_token_ids: Any


@dataclass
class EngineCall:
    """What one ``generate_async`` call asked of the engine."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    disaggregated_params: DisaggregatedParams | None
    streaming: bool
    scheduling_params: Any
    priority: float
    cache_salt: str | None
    result: GenerationResult | None = field(default=None, repr=False)

    @property
    def request_type(self) -> str:
        params = self.disaggregated_params
        return params.request_type if params is not None and params.request_type else \
            "context_and_generation"


class RequestOutput(GenerationResult):
    pass


class BaseLLM:
    pass


class MultimodalEncoder(BaseLLM):
    def __init__(self, **_kwargs):
        raise NotImplementedError("MultimodalEncoder stand-in: encode workers are not tested")


def next_token(sequence: list[int]) -> int:
    """The toy model."""
    return 1000 + (sequence[-1] * 7 + len(sequence) * 13) % 30000


class LLM(BaseLLM):
    def __init__(self, **kwargs):
        errors = llm_args_errors(kwargs)
        if "model" not in kwargs:
            errors.insert(0, "model: Field required")
        if errors:
            raise ValueError(f"{len(errors)} validation error(s) for TorchLlmArgs\n" + "\n".join(errors))
        self.args = SimpleNamespace(**kwargs)
        self.tokenizer = None
        self.calls: list[EngineCall] = []
        self._blocks: set[tuple[int, ...]] = set()  # block-aligned prefixes whose KV is held

    def shutdown(self) -> None:
        pass

    # -- the KV cache ---------------------------------------------------------------------
    def _hit_tokens(self, prompt: list[int]) -> int:
        blocks = 0
        while (blocks + 1) * BLOCK <= len(prompt) and tuple(prompt[:(blocks + 1) * BLOCK]) in self._blocks:
            blocks += 1
        return min(blocks * BLOCK, max(len(prompt) - 1, 0))

    def _store(self, sequence: list[int]) -> None:
        for end in range(BLOCK, len(sequence) + 1, BLOCK):
            self._blocks.add(tuple(sequence[:end]))

    # -- requests -------------------------------------------------------------------------
    def generate_async(self, inputs, sampling_params: SamplingParams | None = None,
                       lora_request=None, prompt_adapter_request=None, streaming: bool = False,
                       kv_cache_retention_config=None,
                       disaggregated_params: DisaggregatedParams | None = None,
                       trace_headers=None, _postproc_params=None, scheduling_params=None,
                       cache_salt: str | None = None, conversation_params=None,
                       priority: float = DEFAULT_REQUEST_PRIORITY) -> RequestOutput:
        prompt = inputs.prompt_token_ids if isinstance(inputs, PreprocessedInputs) else inputs
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids")
        prompt = [int(t) for t in prompt] if prompt is not None and not isinstance(prompt, list) else prompt
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("the prompt must be a non-empty list of token ids")
        sampling_params = sampling_params or SamplingParams()
        if disaggregated_params is not None and not isinstance(disaggregated_params, DisaggregatedParams):
            raise TypeError(f"disaggregated_params must be DisaggregatedParams, not "
                            f"{type(disaggregated_params).__name__}")
        call = EngineCall(list(prompt), sampling_params, disaggregated_params, streaming,
                          scheduling_params, priority, cache_salt)
        self.calls.append(call)
        kind = call.request_type
        request_id = (disaggregated_params.disagg_request_id
                      if disaggregated_params is not None and disaggregated_params.disagg_request_id
                      else next(_request_ids))
        if kind == "generation_only":
            result = self._generation_only(call, request_id)
        else:
            result = self._with_context(call, request_id, context_only=kind == "context_only")
        call.result = result
        return result

    def _with_context(self, call: EngineCall, request_id: int, context_only: bool) -> RequestOutput:
        prompt, params = call.prompt_token_ids, call.sampling_params
        cached = self._hit_tokens(prompt)
        max_tokens = 1 if context_only else params.max_tokens
        out_params = None
        if context_only:
            first = next_token(prompt)
            opaque = b"kv:" + request_id.to_bytes(8, "little") + os.urandom(4)
            TRANSCEIVER[opaque] = (list(prompt), first)
            given = call.disaggregated_params
            out_params = DisaggregatedParams(
                request_type="context_only", first_gen_tokens=[first], ctx_request_id=request_id,
                opaque_state=opaque, draft_tokens=None,
                disagg_request_id=given.disagg_request_id if given else None, ctx_dp_rank=0,
                ctx_info_endpoint="fake://ctx")
        return RequestOutput(request_id, prompt, call.streaming,
                             self._decode_steps(prompt, [], max_tokens, params), cached, out_params)

    def _generation_only(self, call: EngineCall, request_id: int) -> RequestOutput:
        params = call.disaggregated_params
        assert params is not None
        if not isinstance(params.opaque_state, (bytes, bytearray)):
            raise TypeError("ContextPhaseParams(): opaque_state must be bytes, got "
                            f"{type(params.opaque_state).__name__}")
        if not params.first_gen_tokens:
            raise ValueError("a generation-only request needs first_gen_tokens")
        if not isinstance(params.ctx_request_id if params.disagg_request_id is None
                          else params.disagg_request_id, int):
            raise TypeError("ContextPhaseParams(): the request id must be an int")
        prompt = call.prompt_token_ids

        def steps():
            transferred = TRANSCEIVER.pop(bytes(params.opaque_state), None)
            if transferred is None:
                raise RequestError("KV cache transfer failed: unknown context request")
            if transferred[0] != prompt:
                raise RequestError("KV cache transfer: the context was computed for another prompt")
            self._store(prompt)  # the received KV now lives in this engine's cache
            return self._decode_steps(prompt, list(params.first_gen_tokens), call.sampling_params.max_tokens,
                                      call.sampling_params, store=False)()

        return RequestOutput(request_id, prompt, call.streaming, steps, len(prompt), None)

    def _decode_steps(self, prompt: list[int], first: list[int], max_tokens: int,
                      params: SamplingParams, store: bool = True):
        stop_ids = set(params.stop_token_ids or [])
        if params.end_id is not None:
            stop_ids.add(params.end_id)

        async def steps():
            if store:
                self._store(prompt)
            sequence = list(prompt)
            produced = 0
            pending = list(first)
            while produced < max_tokens:
                token = pending.pop(0) if pending else next_token(sequence)
                sequence.append(token)
                produced += 1
                if token in stop_ids and not params.ignore_eos:
                    yield [token], True, "stop"
                    return
                yield [token], produced >= max_tokens, "length" if produced >= max_tokens else None
        return steps
