"""Sending one request to workers over Dynamo's request plane, the ways Dynamo's frontend does.

- via prefill: the preprocessed request goes to the prefill worker with ``max_tokens = 1``; its
  ``disaggregated_params`` and ``prompt_tokens_details`` become the decode request's
  ``prefill_result``; the decode worker's stream is the answer (brief §4).
- decode-local: the request goes to the decode worker with the ``x-bypass-remote-prefill``
  annotation (Dynamo's conditional-disaggregation contract): an append-prefill there.
- replica: the request goes unchanged to an aggregated worker.

The incoming request context is passed down, so a client that goes away cancels the work.

Errors come back from Dynamo's request plane as plain exceptions whose text starts with the kind
(seen with Dynamo 1.6.1: ``ValueError('InvalidRequest: ValueError: ...')`` when the worker's
handler rejects the request, ``ValueError('Unavailable: Stream ended before generation
completed')`` when the worker dies mid-answer, ``Exception('Unavailable: TCP connection to ...
failed')`` when it is gone). A rejection is the request's fault (`WorkerRejected`: the client's
4xx, never retried); anything else is the worker's (`WorkerFailed`: retried elsewhere, mid-answer
too, by the router's migration).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION


class WorkerFailed(Exception):
    """A worker could not be reached or broke off (``started``: after some of the answer)."""

    def __init__(self, worker: int, cause: Exception, started: bool = False):
        super().__init__(f"worker {worker:x}: {cause}")
        self.worker = worker
        self.started = started


class WorkerRejected(Exception):
    """The worker refused the request itself (its validation): the client's error, not retried."""

    def __init__(self, worker: int, cause: Exception):
        message = str(cause)
        for prefix in ("InvalidRequest:", "InvalidArgument:", "ValueError:"):
            message = message.removeprefix(prefix).strip()
        super().__init__(message or "the worker rejected the request")
        self.worker = worker


_REJECTED = ("InvalidRequest", "InvalidArgument")


def classify(worker: int, exc: Exception, started: bool = False) -> Exception:
    """The exception a worker's error becomes: `WorkerRejected` or `WorkerFailed`."""
    if isinstance(exc, WorkerFailed | WorkerRejected):
        return exc
    if str(exc).startswith(_REJECTED) or type(exc).__name__ == "InvalidArgument":
        return WorkerRejected(worker, exc)
    return WorkerFailed(worker, exc, started)


async def _open(client, request: dict, worker: int, context) -> AsyncIterator[dict]:
    try:
        if context is not None:
            return await client.direct(request, worker, annotated=False, context=context)
        return await client.direct(request, worker, annotated=False)
    except Exception as exc:  # noqa: BLE001 (connection errors come in several Dynamo types)
        raise classify(worker, exc) from exc


async def prefill_then_decode(prefill_client, decode_client, request: dict[str, Any], prefill: int,
                              decode: Callable[[], Awaitable[int]], context,
                              prefill_done: Callable[[], None] = lambda: None) -> AsyncIterator[dict]:
    """``decode`` is asked for the decode worker only once the prefill is done, so whatever
    settles it (a new session's etcd claim) overlaps with the prefill. ``prefill_done`` is called
    once the prefill leg is over, however it ended (the prefill worker's load is released then)."""
    prefill_request = copy.deepcopy(request)
    prefill_request.setdefault("stop_conditions", {})["max_tokens"] = 1
    params, details = None, None
    try:
        async for chunk in await _open(prefill_client, prefill_request, prefill, context):
            if isinstance(chunk.get("finish_reason"), dict) and "error" in chunk["finish_reason"]:
                yield chunk  # the prefill worker refused the request: the client gets its error
                return
            params = chunk.get("disaggregated_params") or params
            usage = chunk.get("completion_usage") or {}
            details = usage.get("prompt_tokens_details") or details
    except Exception as exc:  # noqa: BLE001
        raise classify(prefill, exc) from exc
    finally:
        prefill_done()
    if params is None:
        raise WorkerFailed(prefill, RuntimeError("prefill worker returned no disaggregated_params"))
    decode_request = dict(request)
    decode_request["prefill_result"] = {"disaggregated_params": params, "prompt_tokens_details": details}
    async for chunk in _stream(decode_client, decode_request, await decode(), context):
        yield chunk


async def decode_local(decode_client, request: dict[str, Any], decode: int, context) -> AsyncIterator[dict]:
    local_request = dict(request)
    local_request["annotations"] = [*request.get("annotations", []), BYPASS_REMOTE_PREFILL_ANNOTATION]
    async for chunk in _stream(decode_client, local_request, decode, context):
        yield chunk


async def replica(client, request: dict[str, Any], worker: int, context) -> AsyncIterator[dict]:
    async for chunk in _stream(client, request, worker, context):
        yield chunk


async def _stream(client, request: dict, worker: int, context) -> AsyncIterator[dict]:
    """Relay a worker's stream; its errors become `WorkerRejected` or `WorkerFailed` (with
    ``started`` once a chunk went out, so the router can continue the answer elsewhere)."""
    started = False
    try:
        async for chunk in await _open(client, request, worker, context):
            started = True
            yield chunk
    except Exception as exc:  # noqa: BLE001
        raise classify(worker, exc, started) from exc
