"""The benchmark client: plays a manifest against an OpenAI endpoint, one asyncio task per
conversation, streaming chat completions with the real history (the assistant's actual replies go
back in the next turn), ``x-dynamo-session-id`` per conversation and a fixed output length per
turn (``max_tokens`` with ``ignore_eos``).

Per request it records the turn, TTFT, the gaps between tokens, end-to-end time and success (an
error or an answer not complete within `CHAT_TIMEOUT_S` is a failure, and the conversation then
sends no further turn, as the paper's client; `dynamo_ppd.sim.outcome` has the definitions), and
how late the client itself sent it against the schedule (``lag_s``): an overloaded client must not
pass for a slow server.

Time dilation (``dilation`` N > 1): the simulated workers run N times slower (their ``--speedup
1/N``), so every process around them (frontend, router, this client) does the same work N times
more slowly in model terms and its overheads weigh 1/N as much. The client then stretches the
schedule (arrivals, think times, the timeout) by N and divides every time it measures by N:
results are in model seconds, comparable with an undilated run and with the virtual clock.

A ``horizon_s`` (model seconds from the start) cuts the run: no turn due after it is sent, and
the requests still running then are cancelled and marked ``cut`` (left out of the figures, as
the simulator's run cut at the same time leaves its in-flight turns out).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import msgspec

from ..sim.outcome import CHAT_TIMEOUT_S
from ..workloads.manifest import Manifest, ManifestConversation


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
    cut: bool = False  # still running when the run was cut at its horizon (not a failure)

    @property
    def tpot_s(self) -> float | None:
        """First to last token over the tokens after the first (the usage's count: a chunk may
        carry several tokens)."""
        if not self.token_gaps_s or self.output_tokens < 2:
            return None
        return sum(self.token_gaps_s) / (self.output_tokens - 1)


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


class ChatStream:
    """One streamed chat completion as it arrived; times are ``time.monotonic()``."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.stamps: list[float] = []  # each content chunk's arrival
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None  # the last usage the stream reported
        self.http_error: str | None = None  # "HTTP 503: b'...'" (the head of the body)
        self.error_chunk: str | None = None  # the error a data chunk carried
        self.error_line = False  # an "event: error" line came
        self.failure: str | None = None  # the connection failed or timed out, or a line was not JSON
        # The workers that served it, when the request asked (``nvext.extra_fields: ["worker_id"]``):
        # Dynamo's ``nvext.worker_id`` (``decode_worker_id``, and ``prefill_worker_id`` via prefill).
        self.worker_ids: dict | None = None
        self.ended = sent

    @property
    def ttft_s(self) -> float | None:
        return self.stamps[0] - self.sent if self.stamps else None


APIS = ("chat", "messages")  # what the client speaks: chat completions, the Anthropic Messages API
_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


def _messages_event(chunk: dict, out: ChatStream) -> None:
    """One event of an Anthropic Messages stream, as Dynamo's frontend sends them
    (``content_block_delta`` text, ``message_delta`` with the stop reason and the output usage)."""
    kind = chunk.get("type")
    if kind == "content_block_delta":
        text = (chunk.get("delta") or {}).get("text")
        if text:
            out.stamps.append(time.monotonic())
            out.text += text
    elif kind == "message_delta":
        usage = chunk.get("usage") or {}
        if isinstance(usage.get("output_tokens"), int):
            out.usage = {**(out.usage or {}), "completion_tokens": usage["output_tokens"]}
        out.finish_reason = (chunk.get("delta") or {}).get("stop_reason") or out.finish_reason
    elif kind == "message_start":
        usage = (chunk.get("message") or {}).get("usage") or {}
        if isinstance(usage.get("input_tokens"), int):
            cached = usage.get("cache_read_input_tokens") or 0
            out.usage = {**(out.usage or {}), "prompt_tokens": usage["input_tokens"] + cached}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, session: str, timeout_s: float,
                      stop_at_error: bool = True, body_chars: int = 200, api: str = "chat") -> ChatStream:
    """POST ``body`` (``"stream": True``) to ``url``'s chat completions (``api`` "messages": the
    Anthropic Messages API) with the session header and read the server-sent events to the end
    (or, with ``stop_at_error``, to the first error chunk). An HTTP error, a failed connection or a
    garbled line is recorded, not raised."""
    out = ChatStream(time.monotonic())
    try:
        async with client.stream("POST", f"{url}{_PATHS[api]}", json=body, timeout=timeout_s,
                                 headers={"x-dynamo-session-id": session}) as response:
            if response.status_code != 200:
                out.http_error = f"HTTP {response.status_code}: {(await response.aread())[:body_chars]!r}"
                out.ended = time.monotonic()
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    out.error_line = out.error_line or line.startswith("event: error")
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error_chunk = str(chunk["error"])
                    if stop_at_error:
                        break
                    continue
                if api == "messages":
                    _messages_event(chunk, out)
                    continue
                out.usage = chunk.get("usage") or out.usage
                nvext = chunk.get("nvext")
                if isinstance(nvext, dict) and isinstance(nvext.get("worker_id"), dict):
                    out.worker_ids = nvext["worker_id"]
                for choice in chunk.get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        out.stamps.append(time.monotonic())
                        out.text += content
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
        out.failure = f"{type(exc).__name__}: {exc}"[:200]
    out.ended = time.monotonic()
    return out


def chat_body(model: str, messages: list[dict], max_tokens: int,
              annotations: tuple[str, ...] | list[str] = (), worker_ids: bool = False) -> dict:
    """A streamed chat request of exactly ``max_tokens`` (``ignore_eos``) that reports its usage
    (and, with ``worker_ids``, the workers that served it: `ChatStream.worker_ids`)."""
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "stream_options": {"include_usage": True}}
    nvext: dict = {}
    if annotations:
        nvext["annotations"] = list(annotations)
    if worker_ids:
        nvext["extra_fields"] = ["worker_id"]
    if nvext:
        body["nvext"] = nvext
    return body


def messages_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """The same turn as an Anthropic Messages request: system messages as ``system``. The API has
    no ``ignore_eos``: the simulated workers answer ``max_tokens`` tokens whatever they sample,
    real ones may stop sooner (the results count the tokens that came)."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                  "messages": [m for m in messages if m["role"] != "system"]}
    if system:
        body["system"] = system
    return body


async def chat_stream(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                      session: str, annotations: tuple[str, ...] = (), timeout_s: float = CHAT_TIMEOUT_S,
                      usage: dict | None = None, api: str = "chat",
                      ) -> tuple[float | None, float | None, list[float], str, str | None]:
    """(TTFT, e2e, gaps between content chunks, text, error) of one streamed chat completion (or
    Anthropic message, ``api``), in wall seconds; the stream's usage (token counts) goes into
    ``usage`` when given."""
    body = (messages_body(model, messages, max_tokens) if api == "messages"
            else chat_body(model, messages, max_tokens, annotations))
    out = await stream_chat(client, url, body, session, timeout_s, api=api)
    if usage is not None and out.usage:
        usage.update(out.usage)
    if out.http_error is not None:
        return None, None, [], "", out.http_error
    if out.error_chunk is not None:
        return None, None, [], out.text, out.error_chunk[:200]
    if out.failure is not None:
        return None, None, [], out.text, out.failure
    if not out.stamps:
        return None, None, [], out.text, "no tokens"
    gaps = [b - a for a, b in zip(out.stamps, out.stamps[1:], strict=False)]
    return out.ttft_s, out.ended - out.sent, gaps, out.text, None


async def run_manifest(url: str, manifest: Manifest, model: str | None = None, seed: int = 0,
                       on_result: Callable[[RequestResult], None] | None = None,
                       max_connections: int = 512, dilation: float = 1.0,
                       horizon_s: float | None = None, api: str = "chat") -> list[RequestResult]:
    """Play the manifest against ``url`` (OpenAI base URL); return every request's result. With
    ``dilation`` N the schedule runs N times slower and the times recorded are divided by N (the
    workers must run at ``--speedup 1/N``); ``horizon_s`` cuts the run (model seconds); ``api``:
    chat completions, or "messages", the Anthropic Messages API (`APIS`)."""
    if not dilation > 0:
        raise ValueError(f"dilation must be positive, not {dilation}")
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}; choose one of {', '.join(APIS)}")
    url = url.rstrip("/")
    n = dilation
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(limits=limits, timeout=CHAT_TIMEOUT_S * n) as client:
        if model is None:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        text = TokenText(seed)
        # An agent workload's system prompt, the same for every conversation (the simulator's twin
        # draws as many shared ids: `sim.conversation.shared_prefix`).
        shared = manifest.header.shared_prefix_tokens if manifest.header else 0
        system = [{"role": "system", "content": TokenText(seed + 1_000_003)(shared)}] if shared else []
        results: list[RequestResult] = []
        start = time.monotonic()

        def now() -> float:  # model seconds since the start
            return (time.monotonic() - start) / n

        def record(result: RequestResult) -> None:
            results.append(result)
            if on_result:
                on_result(result)

        async def conversation(conv: ManifestConversation) -> None:
            session = f"bench-{seed}-{conv.conversation_id}-{time.time_ns()}"
            messages: list[dict] = list(system)
            due = conv.arrival_s
            for index, turn in enumerate(conv.turns, start=1):
                if index > 1:
                    due = now() + turn.think_time_s
                if horizon_s is not None and due > horizon_s:
                    return  # the run is cut before this turn is due
                await asyncio.sleep(max(0.0, start + due * n - time.monotonic()))
                content = turn.user_text if turn.user_text is not None else text(turn.user_tokens or 1)
                messages.append({"role": "user", "content": content})
                sent = now()
                usage: dict = {}
                try:
                    ttft, e2e, gaps, reply, error = await chat_stream(
                        client, url, model, messages, turn.max_tokens, session, timeout_s=CHAT_TIMEOUT_S * n,
                        usage=usage, api=api)
                except asyncio.CancelledError:  # the horizon: in flight, neither success nor failure
                    record(RequestResult(conv.conversation_id, index, due, sent, sent - due, None, None,
                                         0, [], False, None, cut=True))
                    raise
                ttft, e2e = (None if ttft is None else ttft / n), (None if e2e is None else e2e / n)
                ok = error is None and e2e is not None and e2e <= CHAT_TIMEOUT_S
                tokens = 0 if ttft is None else max(len(gaps) + 1, int(usage.get("completion_tokens") or 0))
                record(RequestResult(conv.conversation_id, index, due, sent, sent - due, ttft, e2e, tokens,
                                     [g / n for g in gaps], ok, error))
                if not ok:
                    return  # a failed turn ends its conversation (the paper's client does so too)
                messages.append({"role": "assistant", "content": reply})

        tasks = [asyncio.create_task(conversation(c)) for c in manifest.conversations]
        if tasks:
            timeout = None if horizon_s is None else max(0.0, start + horizon_s * n - time.monotonic())
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return results
