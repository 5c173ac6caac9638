"""The chaos client: plays a manifest like the benchmark's client (bench/client.py: one asyncio task
per conversation, real history, ``x-dynamo-session-id``, ``max_tokens`` with ``ignore_eos``; its
`stream_chat` reads each answer) but records what a fault can break in each answer: the
``finish_reason``, the token count against ``max_tokens``, error events, the usage's
``cached_tokens``, and the workers that served it (Dynamo's ``nvext.worker_id``, asked for with
``nvext.extra_fields``: decode-local or not, and on which decode worker, report.py).

A failed turn ends its conversation (there is no answer to put in the history); a truncated one
goes on with the partial answer, as a user who saw half a reply would still type the next message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from ..bench.client import TokenText, chat_body, stream_chat
from ..sim.outcome import CHAOS_TIMEOUT_S
from ..workloads.manifest import Manifest, ManifestConversation
from .report import TurnRecord


class _Answer:
    def __init__(self) -> None:
        self.text = ""
        self.chunks = 0  # content chunks (a fallback token count when no usage arrives)
        self.ttft: float | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.error: str | None = None
        self.worker_ids: dict = {}


async def chat_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                    max_tokens: int, session: str) -> tuple[_Answer, float]:
    """One streamed chat completion, read to its end even past an error event (a fault may
    break a stream that still finishes); returns the answer and its end-to-end time."""
    out = await stream_chat(client, url, chat_body(model, messages, max_tokens, worker_ids=True), session,
                            CHAOS_TIMEOUT_S, stop_at_error=False, body_chars=160)
    answer = _Answer()
    answer.text, answer.chunks, answer.ttft = out.text, len(out.stamps), out.ttft_s
    answer.finish_reason, answer.usage = out.finish_reason, out.usage
    answer.worker_ids = out.worker_ids or {}
    if out.error_chunk is not None:
        answer.error = f"error event: {out.error_chunk[:160]}"
    elif out.error_line:
        answer.error = "error event"
    answer.error = out.http_error or out.failure or answer.error
    return answer, out.ended - out.sent


def turn_status(answer: _Answer, max_tokens: int, e2e_s: float) -> tuple[str, int]:
    """("ok" | "failed" | "truncated", output tokens)."""
    usage = answer.usage or {}
    tokens = int(usage.get("completion_tokens") or answer.chunks)
    if answer.ttft is None:
        return "failed", 0
    if answer.error or e2e_s > CHAOS_TIMEOUT_S or answer.finish_reason is None or tokens < max_tokens:
        return "truncated", tokens
    return "ok", tokens


async def play(url: str, manifest: Manifest, t0: float, seed: int = 0,
               on_record: Callable[[TurnRecord], None] | None = None,
               stop_sending_s: float | None = None, system_tokens: int = 0) -> list[TurnRecord]:
    """Play ``manifest`` against ``url``; times are from ``t0`` (time.monotonic()). No turn is sent
    after ``stop_sending_s`` (the run's end), so a long conversation cannot stretch it.
    ``system_tokens``: every conversation opens with the same system prompt of about this many
    tokens (users of one application sharing its instructions)."""
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    records: list[TurnRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=CHAOS_TIMEOUT_S) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        text = TokenText(seed)
        system = [{"role": "system", "content": TokenText(seed + 1)(system_tokens)}] if system_tokens else []

        async def conversation(conv: ManifestConversation) -> None:
            session = f"chaos-{seed}-{conv.conversation_id}-{time.time_ns()}"
            messages: list[dict] = list(system)
            due = conv.arrival_s
            prev_prompt: int | None = None
            for index, turn in enumerate(conv.turns, start=1):
                if index > 1:
                    due = time.monotonic() - t0 + turn.think_time_s
                if stop_sending_s is not None and due > stop_sending_s:
                    return
                await asyncio.sleep(max(0.0, t0 + due - time.monotonic()))
                content = turn.user_text if turn.user_text is not None else text(turn.user_tokens or 1)
                messages.append({"role": "user", "content": content})
                sent = time.monotonic() - t0
                answer, e2e = await chat_turn(client, url, model, messages, turn.max_tokens, session)
                status, tokens = turn_status(answer, turn.max_tokens, e2e)
                usage = answer.usage or {}
                details = usage.get("prompt_tokens_details") or {}
                record = TurnRecord(
                    conv.conversation_id, index, round(sent, 4), status, turn.max_tokens, tokens,
                    answer.ttft, e2e if status != "failed" else None, answer.finish_reason,
                    usage.get("prompt_tokens"), details.get("cached_tokens"),
                    prev_prompt if index > 1 else None, answer.error,
                    answer.worker_ids.get("decode_worker_id"), answer.worker_ids.get("prefill_worker_id"))
                records.append(record)
                if on_record:
                    on_record(record)
                if status == "failed":
                    return
                prev_prompt = usage.get("prompt_tokens")
                messages.append({"role": "assistant", "content": answer.text})

        await asyncio.gather(*(conversation(c) for c in manifest.conversations))
    return records
