"""The prefill -> decode handoff: what a prefill worker returns and a decode worker receives.

Dynamo's frontend (and our router) copy the prefill worker's ``disaggregated_params`` verbatim
into ``prefill_result.disaggregated_params`` of the decode request. TensorRT-LLM puts its
``DisaggregatedParams`` there (``request_type``, ``first_gen_tokens``, ``ctx_request_id``,
``opaque_state``, ``disagg_request_id``, ...); we keep those field names and their types (the two
ids are ints: TensorRT-LLM's executor request ids, and dynamo.trtllm 1.6.1's prefill handler always
sets ``disagg_request_id``), and put our transfer handle, a `TransferHandle`, base64-encoded
msgpack, in ``opaque_state`` where TensorRT-LLM keeps its cache-transceiver state.

The handoff itself, as both the live worker (`dynamo_ppd.worker`) and the simulated cluster
(`dynamo_ppd.sim.cluster`) run it: `prefill_leg` on P, `ship_prompt_kv` on P's link when P's
token is out, `decode_leg` on D, which emits P's token once the KV has landed.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import msgspec

from .cost import TransferLink
from .scheduler import EngineRequest, RequestKind

BYPASS_REMOTE_PREFILL_ANNOTATION = "x-bypass-remote-prefill"  # dynamo.trtllm's constant
# Ours: ``x-ppd-route:via_prefill`` or ``x-ppd-route:decode_local`` on a follow-up forces its route
# (obeyed only by a router started with --allow-forced-route; the live table build sends it).
FORCED_ROUTE_ANNOTATION = "x-ppd-route:"
DECODE_NEEDS_PARAMS_ERROR = "Disaggregated params are required for decode mode"  # TRT-LLM's text


class TransferHandle(msgspec.Struct, forbid_unknown_fields=True):
    """Names one KV transfer out of a prefill worker."""

    transfer_id: str  # the prefill request's id
    source_worker: int  # the prefill worker's instance id
    prompt_tokens: int
    num_bytes: int
    kv_ready_at: float  # model-clock time at which the last byte has arrived at the decode worker
    link_queue_s: float  # time the transfer waited behind others on the prefill worker's link


class HandoffError(ValueError):
    pass


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferHandle)


def numeric_request_id(transfer_id: str) -> int:
    """A positive 63-bit int naming the transfer, where TensorRT-LLM has an int request id."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "big") >> 1


def pack_params(handle: TransferHandle, first_token: int) -> dict[str, Any]:
    request_id = numeric_request_id(handle.transfer_id)
    return {
        "request_type": "context_only",
        "first_gen_tokens": [first_token],
        "ctx_request_id": request_id,
        "opaque_state": base64.b64encode(_encoder.encode(handle)).decode(),
        "disagg_request_id": request_id,  # both legs' request id in TensorRT-LLM
    }


def unpack_params(params: dict[str, Any]) -> tuple[TransferHandle, int]:
    """(handle, first token) from ``prefill_result.disaggregated_params``; HandoffError if bad."""
    try:
        handle = _decoder.decode(base64.b64decode(params["opaque_state"]))
        first_token = int(params["first_gen_tokens"][0])
    except (KeyError, IndexError, TypeError, ValueError, msgspec.DecodeError) as exc:
        raise HandoffError(f"malformed disaggregated_params from the prefill worker: {exc}") from exc
    return handle, first_token


def prefill_leg(request_id: str, prompt: list[int], prompt_hashes: list[int] | None = None) -> EngineRequest:
    """P's half: the prompt as ``context_only``, one token out (the one it hands to D)."""
    return EngineRequest(request_id, prompt, 1, RequestKind.CONTEXT_ONLY, prompt_hashes=prompt_hashes)


def ship_prompt_kv(link: TransferLink, prompt_tokens: int, kv_bytes_per_token: int,
                   ready_at: float) -> tuple[int, float, float]:
    """Queue the KV of the whole prompt on P's link, ready at ``ready_at`` (TensorRT-LLM ships
    every block, including those the decode worker may already hold): (bytes, start, landed)."""
    num_bytes = prompt_tokens * kv_bytes_per_token
    start, landed = link.schedule(num_bytes, ready_at)
    return num_bytes, start, landed


def decode_leg(request_id: str, prompt: list[int], max_tokens: int, first_token: int,
               kv_ready_at: float, prompt_hashes: list[int] | None = None) -> EngineRequest:
    """D's half: the prompt as ``generation_only``; P's token is emitted once the KV has landed
    (``kv_ready_at``), then decoding goes on from it."""
    return EngineRequest(request_id, prompt, max_tokens, RequestKind.GENERATION_ONLY,
                         first_token=first_token, kv_ready_at=kv_ready_at, prompt_hashes=prompt_hashes)
