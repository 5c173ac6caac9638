"""Sending one request to workers over Dynamo's request plane, the ways Dynamo's frontend does.

- via prefill: the preprocessed request goes to the prefill worker with ``max_tokens = 1``; its
  ``disaggregated_params`` and ``prompt_tokens_details`` become the decode request's
  ``prefill_result``; the decode worker's stream is the answer.
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

import asyncio
from collections import deque
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


def prefill_leg_request(request: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill worker gets it, as Dynamo's frontend sends it: ``max_tokens = 1``.
    A shallow copy: only the stop conditions differ (a deep copy of a 300-token request cost ~70 us
    of TTFT per turn here); nothing here or in the bindings mutates the rest."""
    return {**request, "stop_conditions": {**(request.get("stop_conditions") or {}), "max_tokens": 1}}


def with_prefill_result(request: dict[str, Any], params: Any, details: Any) -> dict[str, Any]:
    """The decode worker's request after a remote prefill: the prefill's ``disaggregated_params``
    and ``prompt_tokens_details`` as its ``prefill_result``."""
    return {**request, "prefill_result": {"disaggregated_params": params, "prompt_tokens_details": details}}


async def prefill_then_decode(prefill_client, decode_client, request: dict[str, Any], prefill: int,
                              decode: Callable[[], Awaitable[int]], context,
                              prefill_sent: Callable[[], None] = lambda: None,
                              prefill_done: Callable[[], None] = lambda: None,
                              coalesce: bool = True) -> AsyncIterator[dict]:
    """``decode`` is asked for the decode worker only once the prefill is done, so whatever
    settles it (a new session's etcd claim, started by ``prefill_sent`` once the prefill worker
    has the request) overlaps with the prefill. ``prefill_done`` is called once the prefill leg is
    over, however it ended (the prefill worker's load is released then)."""
    params, details = None, None
    try:
        stream = await _open(prefill_client, prefill_leg_request(request), prefill, context)
        prefill_sent()
        async for chunk in stream:
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
    decode_request = with_prefill_result(request, params, details)
    async for chunk in _stream(decode_client, decode_request, await decode(), context, coalesce):
        yield chunk


def decode_local(decode_client, request: dict[str, Any], decode: int, context,
                 coalesce: bool = True, sent: Callable[[], None] = lambda: None) -> AsyncIterator[dict]:
    """``sent`` is called once the decode worker has the request."""
    local_request = dict(request)
    local_request["annotations"] = [*request.get("annotations", []), BYPASS_REMOTE_PREFILL_ANNOTATION]
    return _stream(decode_client, local_request, decode, context, coalesce, sent)


def replica(client, request: dict[str, Any], worker: int, context,
            coalesce: bool = True) -> AsyncIterator[dict]:
    return _stream(client, request, worker, context, coalesce)


async def _stream(client, request: dict, worker: int, context, coalesce: bool = True,
                  sent: Callable[[], None] = lambda: None) -> AsyncIterator[dict]:
    """Relay a worker's stream; its errors become `WorkerRejected` or `WorkerFailed` (with
    ``started`` once a chunk went out, so the router can continue the answer elsewhere).
    ``coalesce``: chunks already waiting go out as one (`coalesced`). ``sent``: called once the
    worker has the request."""
    started = False
    try:
        stream = await _open(client, request, worker, context)
        sent()
        async for chunk in (coalesced(stream) if coalesce else stream):
            started = True
            yield chunk
    except Exception as exc:  # noqa: BLE001
        raise classify(worker, exc, started) from exc


# Keys a plain token chunk has (the simulated and TensorRT-LLM workers' mid-answer chunks), and
# those the last chunk of a run may add (the answer's end). Anything else (log probs, a prefill's
# disaggregated_params, an error) is never merged, so no field is lost or reordered.
_PLAIN = frozenset({"token_ids", "index"})
_LAST = _PLAIN | {"finish_reason", "completion_usage", "engine_data"}


def mergeable(head: dict, chunk: dict) -> bool:
    """``chunk`` may be folded into ``head``: head is plain tokens, chunk is tokens or the
    answer's (non-error) end, both for the same choice."""
    return (head.keys() <= _PLAIN and chunk.keys() <= _LAST and head.get("index") == chunk.get("index")
            and not isinstance(chunk.get("finish_reason"), dict))


def merge_waiting(waiting: deque[dict]) -> dict:
    """The first waiting chunk with every mergeable one after it folded in (their tokens in order;
    the last one's end fields); the rest stay waiting."""
    head = waiting.popleft()
    if not waiting or not mergeable(head, waiting[0]):
        return head
    tokens = list(head.get("token_ids") or [])
    while waiting and mergeable(head, waiting[0]):
        head = waiting.popleft()
        tokens.extend(head.get("token_ids") or [])
        if head.keys() > _PLAIN:
            break  # the answer's end: nothing may follow it in the same chunk
    return {**head, "token_ids": tokens}


async def coalesced(stream: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The worker's chunks, with those that are already waiting when the next one is asked for
    merged into one (`merge_waiting`); a chunk is never held back to wait for another.

    Each chunk crossing Dynamo's Python bindings costs a hop each way (a Rust future resolved on
    the event loop coming in, a Python generator step driven from Rust going out, then the
    frontend's work per chunk). Incoming chunks cannot be batched with the 1.6.1 bindings (one
    item per ``__anext__``), but outgoing ones can: a pump task drains the worker's stream into a
    queue while the consumer is busy, and the consumer takes everything queued at once. Idle, every
    chunk goes out alone as soon as it arrives; saturated, the router sends fewer, larger chunks
    and spends less per token, which is when it matters."""
    loop = asyncio.get_running_loop()
    waiting: deque[dict] = deque()
    wake: asyncio.Future | None = None
    failure: BaseException | None = None
    ended = False

    async def pump() -> None:
        nonlocal failure, ended
        try:
            async for chunk in stream:
                waiting.append(chunk)
                if wake is not None and not wake.done():
                    wake.set_result(None)
        except Exception as exc:  # noqa: BLE001 (re-raised in the consumer, after what came before)
            failure = exc
        finally:
            ended = True
            if wake is not None and not wake.done():
                wake.set_result(None)

    task = loop.create_task(pump())
    try:
        while True:
            if waiting:
                yield merge_waiting(waiting)
            elif ended:
                if failure is not None:
                    raise failure
                return
            else:
                wake = loop.create_future()
                await wake
                wake = None
    finally:
        if not task.done():
            task.cancel()  # the consumer went away (the client cancelled): stop reading the worker
