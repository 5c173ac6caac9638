"""The benchmark client: plays a manifest against an OpenAI endpoint, one asyncio task per
conversation, streaming chat completions with the real history (the assistant's actual replies go
back in the next turn), ``x-dynamo-session-id`` per conversation and a fixed output length per
turn (``max_tokens`` with ``ignore_eos``).

Per request it records the turn, TTFT, the gaps between tokens, end-to-end time and success (an
error or an answer not complete within `CHAT_TIMEOUT_S` is a failure, and the conversation then
sends no further turn, as the paper's client; `dynamo_ppd.sim.outcome` has the definitions), and
how late the client itself sent it against the schedule (``lag_s``): an overloaded client must not
pass for a slow server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import msgspec

from ..sim.outcome import CHAT_TIMEOUT_S
from .manifest import Manifest, ManifestConversation


class RequestResult(msgspec.Struct, frozen=True):
    conversation_id: str
    turn: int  # 1-based
    scheduled_s: float  # when the manifest says it should be sent (from the run's start)
    sent_s: float
    lag_s: float  # sent - scheduled (client overload shows here)
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    token_gaps_s: list[float]  # between consecutive streamed tokens
    ok: bool
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return sum(self.token_gaps_s) / len(self.token_gaps_s) if self.token_gaps_s else None


class TokenText:
    """User messages of a given token count: words that are one token each in the local model's
    vocabulary, or short plain words (about one token each) for any other model."""

    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)
        try:
            from tokenizers import Tokenizer

            from .. import model

            directory = model.default_model_dir()
            info = model.load_model_info(directory)
            tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
            low, high = info.generation_token_range
            self.words = [tok.decode([i]) for i in range(low, min(high, low + 2000))]
            self.joiner = ""
        except Exception:  # noqa: BLE001 (no local model directory: plain words)
            self.words = [f" w{i}" for i in range(2000)]
            self.joiner = ""

    def __call__(self, tokens: int) -> str:
        return self.joiner.join(self.rng.choices(self.words, k=max(1, tokens))).strip()


async def chat_stream(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                      session: str, annotations: tuple[str, ...] = (),
                      ) -> tuple[float | None, float | None, list[float], str, str | None]:
    """(TTFT, e2e, token gaps, text, error) of one streamed chat completion."""
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}
    if annotations:
        body["nvext"] = {"annotations": list(annotations)}
    sent = time.monotonic()
    stamps: list[float] = []
    text = ""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=CHAT_TIMEOUT_S,
                                 headers={"x-dynamo-session-id": session}) as response:
            if response.status_code != 200:
                return None, None, [], "", f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return None, None, [], text, str(chunk["error"])[:200]
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        stamps.append(time.monotonic())
                        text += content
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        return None, None, [], text, f"{type(exc).__name__}: {exc}"[:200]
    if not stamps:
        return None, None, [], text, "no tokens"
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - sent, time.monotonic() - sent, gaps, text, None


async def run_manifest(url: str, manifest: Manifest, model: str | None = None, seed: int = 0,
                       on_result: Callable[[RequestResult], None] | None = None,
                       max_connections: int = 512) -> list[RequestResult]:
    """Play the manifest against ``url`` (OpenAI base URL); return every request's result."""
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(limits=limits, timeout=CHAT_TIMEOUT_S) as client:
        if model is None:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        text = TokenText(seed)
        results: list[RequestResult] = []
        start = time.monotonic()

        async def conversation(conv: ManifestConversation) -> None:
            session = f"bench-{seed}-{conv.conversation_id}-{time.time_ns()}"
            messages: list[dict] = []
            due = conv.arrival_s
            for index, turn in enumerate(conv.turns, start=1):
                if index > 1:
                    due = time.monotonic() - start + turn.think_time_s
                await asyncio.sleep(max(0.0, start + due - time.monotonic()))
                content = turn.user_text if turn.user_text is not None else text(turn.user_tokens or 1)
                messages.append({"role": "user", "content": content})
                sent = time.monotonic() - start
                ttft, e2e, gaps, reply, error = await chat_stream(client, url, model, messages,
                                                                  turn.max_tokens, session)
                ok = error is None and e2e is not None and e2e <= CHAT_TIMEOUT_S
                result = RequestResult(conv.conversation_id, index, due, sent, sent - due, ttft, e2e,
                                       len(gaps) + 1 if ttft is not None else 0, gaps, ok, error)
                results.append(result)
                if on_result:
                    on_result(result)
                if not ok:
                    return  # a failed turn ends its conversation (the paper's client does so too)
                messages.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(conversation(c) for c in manifest.conversations))
    return results
