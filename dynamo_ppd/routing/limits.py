"""Request limits the router checks before any worker does work.

A prompt longer than the model's context window, or a prompt plus ``max_tokens`` beyond it, or a
prompt no decode worker's KV cache can hold, would reach a worker, run for seconds (a 150k-word
message: 2.9 s here) and come back as a 500; a 200,000-token ``max_tokens`` would run for minutes.
The router answers such a request with HTTP 400 naming the limit instead, as vLLM answers
"This model's maximum context length is N tokens".

- `RequestLimits` (pure): the limits and the check.
- `WorkerCards` (adapter): each decode worker's KV capacity, read from the model cards Dynamo
  workers register in etcd (``v1/mdc/{namespace}/{component}/{endpoint}/{instance}``: its
  ``runtime_config.total_kv_blocks`` times ``kv_cache_block_size``, and its ``context_length``).
  Real ``dynamo.trtllm`` workers fill in both; with another discovery backend (Kubernetes) the
  cards are not in etcd and only the model directory's context window is checked.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dynamo_ppd.routing.limits")


@dataclass
class RequestLimits:
    context_window: int | None = None  # the model's max_position_embeddings (model directory)
    decode_capacity_tokens: dict[int, int] = field(default_factory=dict)  # per decode instance
    decode_context_tokens: dict[int, int] = field(default_factory=dict)  # per decode instance

    def window(self) -> int | None:
        """The tightest context window: the model's, or a decode worker's card if smaller."""
        windows = [w for w in [self.context_window, *self.decode_context_tokens.values()] if w]
        return min(windows) if windows else None

    def check(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """None when the request fits; else the client's error message (HTTP 400)."""
        window = self.window()
        if window is not None:
            wanted = prompt_tokens + (max_tokens or 0)
            if prompt_tokens > window or wanted > window:
                return (f"This model's maximum context length is {window} tokens. However, you "
                        f"requested {wanted} tokens ({prompt_tokens} in the messages, "
                        f"{max_tokens or 0} in the completion). Please reduce the length of the "
                        "messages or completion.")
        if self.decode_capacity_tokens:
            largest = max(self.decode_capacity_tokens.values())
            if prompt_tokens > largest:
                return (f"The prompt has {prompt_tokens} tokens, more than any decode worker's KV "
                        f"cache holds ({largest} tokens). Please reduce the length of the messages.")
        return None


    def prompt_refused(self, prompt_tokens: int) -> bool:
        """Whether Dynamo's frontend (or, past its KV, the worker) refuses this prompt outright:
        as long as the context window or longer (the token budget dynamo.trtllm registers,
        ``reject_prompt_overflow``; `worker.limits`), or more than any decode worker holds. A
        prompt that fits with a ``max_tokens`` that does not is served, its output cut to fit."""
        window = self.window()
        if window is not None and prompt_tokens >= window:
            return True
        return bool(self.decode_capacity_tokens) and prompt_tokens > max(self.decode_capacity_tokens.values())


def read_context_window(model_dir) -> int | None:
    """``max_position_embeddings`` of the model directory's config.json (None if absent)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def parse_card(data: bytes) -> tuple[int, int | None, int | None] | None:
    """(instance id, KV capacity in tokens, context length) from one etcd model-card value."""
    try:
        card = json.loads(data)
        body = card["card_json"]
        runtime = body.get("runtime_config") or {}
        blocks, block_size = runtime.get("total_kv_blocks"), body.get("kv_cache_block_size")
        capacity = blocks * block_size if blocks and block_size else None
        return int(card["instance_id"]), capacity, body.get("context_length") or None
    except (ValueError, KeyError, TypeError):
        return None


class WorkerCards:
    """Keeps `RequestLimits.decode_*` up to date from the decode workers' model cards in etcd
    (every ``interval_s``; workers come and go). Best effort: etcd away keeps the last view."""

    def __init__(self, limits: RequestLimits, etcd_url: str, namespace: str, component: str,
                 endpoint: str = "generate", interval_s: float = 5.0):
        from urllib.parse import urlparse

        parsed = urlparse(etcd_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 2379
        self.prefix = f"v1/mdc/{namespace}/{component}/{endpoint}/".encode()
        self.limits = limits
        self.interval_s = interval_s
        self._client: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import aetcd

        self._client = aetcd.Client(host=self.host, port=self.port, timeout=2)
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="worker-cards")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._client is not None:
            await self._client.close()

    async def refresh(self) -> None:
        try:
            found = await self._client.get_prefix(self.prefix)
        except Exception as exc:  # noqa: BLE001 (a missed refresh only delays a capacity change)
            log.debug("could not read the decode workers' model cards: %s", exc)
            return
        capacity, context = {}, {}
        for kv in found:
            parsed = parse_card(kv.value)
            if parsed is None:
                continue
            instance, tokens, window = parsed
            if tokens:
                capacity[instance] = tokens
            if window:
                context[instance] = window
        self.limits.decode_capacity_tokens = capacity
        self.limits.decode_context_tokens = context

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()
