"""Bad input at volume: malformed, oversized and adversarial requests for the four APIs a graph
serves (chat completions, completions, responses, Anthropic messages), sent through its gateway
while well-formed conversations run beside them.

`bad_requests(seed, count, model)` is pure and deterministic: each request starts from a valid
body of one API and takes one to three mutations from a fixed catalogue (`MUTATIONS`: broken
syntax, wrong types, values out of range, unknown fields and roles, orphan tool results, huge
values, deep nesting, odd headers). `run` sends them with a bounded concurrency beside
``--conversations`` streamed multi-turn chats, and reports what a client and an operator would
see: the statuses, any 5xx (with its body), the gateway's picker failures and ejections, the
graph's processes that restarted or left, and the well-formed turns that failed or were cut.

    uv run python -m dynamo_ppd.bench.bad_input --url http://127.0.0.1:8000 --count 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class BadRequest:
    api: str
    path: str
    body: bytes
    headers: dict[str, str]
    mutations: tuple[str, ...]


def _base(api: str, model: str, rng: random.Random) -> dict[str, Any]:
    text = " ".join(rng.choice(("harbour", "tide", "ship", "gull", "rope", "quay")) for _ in range(12))
    if api == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    if api == "completions":
        return {"model": model, "prompt": text, "max_tokens": 8}
    if api == "responses":
        return {"model": model, "input": text, "max_output_tokens": 8}
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


def _prompt_key(api: str) -> str:
    return {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}[api]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# Each mutation: (name, function(body dict, api, rng) -> dict | bytes | None). A dict is encoded as
# JSON; bytes are sent as they are; None leaves the body unchanged (a header-only mutation).
Mutation = Callable[[dict, str, random.Random], "dict | bytes | None"]


def _set(key: str, value: Any) -> Mutation:
    def mutate(body: dict, api: str, rng: random.Random) -> dict:
        body[key] = value
        return body
    return mutate


def _drop(key: str | None) -> Mutation:
    def mutate(body: dict, api: str, rng: random.Random) -> dict:
        body.pop(key or _prompt_key(api), None)
        return body
    return mutate


def _prompt(value: Callable[[random.Random], Any]) -> Mutation:
    def mutate(body: dict, api: str, rng: random.Random) -> dict:
        body[_prompt_key(api)] = value(rng)
        return body
    return mutate


def _message(message: Callable[[random.Random], Any]) -> Mutation:
    def mutate(body: dict, api: str, rng: random.Random) -> dict:
        key = _prompt_key(api)
        if isinstance(body.get(key), list):
            body[key] = [*body[key], message(rng)]
        else:
            body[key] = [message(rng)]
        return body
    return mutate


def _bytes(value: bytes) -> Mutation:
    return lambda body, api, rng: value


def _max_tokens(value: Any) -> Mutation:
    def mutate(body: dict, api: str, rng: random.Random) -> dict:
        body["max_output_tokens" if api == "responses" else "max_tokens"] = value
        return body
    return mutate


def _over_context(api: str) -> Any:
    text = "word " * 140_000  # ~140K tokens with the Llama 3 tokenizer: over its 131,072-token context
    return [{"role": "user", "content": text}] if api in ("chat", "messages") else text


def _big_text(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.choice((100_000, 400_000))))


MUTATIONS: dict[str, Mutation] = {
    "empty_body": _bytes(b""),
    "not_json": _bytes(b"{this is not json"),
    "truncated_json": _bytes(b'{"model": "m", "messages": [{"role": "user", "content": "hi'),
    "json_array": _bytes(b"[1, 2, 3]"),
    "json_string": _bytes(b'"hello"'),
    "json_null": _bytes(b"null"),
    "deep_nesting": lambda body, api, rng: ('{"model": "m", "x": ' + _deep(rng.choice((500, 5000, 50000)))
                                            + "}").encode(),
    "invalid_utf8": lambda body, api, rng: json.dumps(body).encode()[:-1] + b', "z": "\xff\xfe\xc3"}',
    "nan_literal": lambda body, api, rng: json.dumps(body).encode()[:-1] + b', "temperature": NaN}',
    "huge_number": lambda body, api, rng: json.dumps(body).encode()[:-1] + b', "temperature": 1e400}',
    "duplicate_keys": lambda body, api, rng: json.dumps(body).encode()[:-1] + b', "model": 7}',
    "bom_prefix": lambda body, api, rng: b"\xef\xbb\xbf" + json.dumps(body).encode(),
    "no_model": _drop("model"),
    "model_number": _set("model", 42),
    "unknown_model": _set("model", "no-such-model"),
    "no_prompt": _drop(None),
    "prompt_number": _prompt(lambda rng: 12345),
    "prompt_object": _prompt(lambda rng: {"role": "user"}),
    "prompt_empty_list": _prompt(lambda rng: []),
    "prompt_list_of_numbers": _prompt(lambda rng: [rng.randrange(-5, 300_000) for _ in range(5)]),
    "message_no_role": _message(lambda rng: {"content": "hi"}),
    "message_unknown_role": _message(lambda rng: {"role": "wizard", "content": "hi"}),
    "message_content_number": _message(lambda rng: {"role": "user", "content": 3.5}),
    "message_unknown_part": _message(lambda rng: {"role": "user", "content": [{"type": "hologram", "x": 1}]}),
    "message_not_object": _message(lambda rng: "just a string"),
    "orphan_tool_result": _message(lambda rng: {"role": "tool", "tool_call_id": "call_x", "content": "42"}),
    "orphan_anthropic_tool_result": _message(lambda rng: {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_missing", "content": "42"}]}),
    "max_tokens_string": _max_tokens("eight"),
    "max_tokens_negative": _max_tokens(-3),
    "max_tokens_zero": _max_tokens(0),
    "max_tokens_float": _max_tokens(7.5),
    "max_tokens_huge": _max_tokens(10**9),
    "max_tokens_bool": _max_tokens(True),
    "temperature_string": _set("temperature", "hot"),
    "temperature_out_of_range": _set("temperature", 99.0),
    "top_p_negative": _set("top_p", -1),
    "n_many": _set("n", 64),
    "stream_string": _set("stream", "yes"),
    "stream_options_wrong": _set("stream_options", "all"),
    "tools_malformed": _set("tools", [{"type": "function"}]),
    "tool_choice_unknown": _set("tool_choice", {"type": "function", "function": {"name": "nope"}}),
    "stop_huge": _set("stop", ["x" * 10_000] * 4),
    "nvext_token_data_strings": _set("nvext", {"token_data": ["a", "b"]}),
    "nvext_token_data_out_of_vocab": _set("nvext", {"token_data": [10**9, -1]}),
    "nvext_pins": _set("nvext", {"backend_instance_id": 1, "annotations": ["x-bypass-remote-prefill"]}),
    "unknown_field": _set("flux_capacitor", {"gigawatts": 1.21}),
    "previous_response_id": _set("previous_response_id", "resp_does_not_exist"),
    "system_number": _set("system", 7),
    "thinking_bad": _set("thinking", {"type": "enabled", "budget_tokens": -1}),
    "many_messages": _prompt(lambda rng: [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"}
                                          for i in range(rng.choice((1001, 5001)))]),
    "big_prompt": _prompt(lambda rng: [{"role": "user", "content": _big_text(rng)}]),
    "over_context": lambda body, api, rng: {**body, _prompt_key(api): _over_context(api)},
    "unicode_prompt": _prompt(lambda rng: [{"role": "user", "content": "\u202e\u0000\ud7ff\U0001f600" * 50}]),
    # Header-only mutations (the body stays valid).
    "content_type_text": lambda body, api, rng: None,
    "session_header_huge": lambda body, api, rng: None,
    "session_header_unicode": lambda body, api, rng: None,
}
HEADER_MUTATIONS = {
    "content_type_text": {"content-type": "text/plain"},
    "session_header_huge": {"x-dynamo-session-id": "s" * 8000},
    "session_header_unicode": {"x-dynamo-session-id": "s\u00e9ssion-\u00fc"},
}


def bad_requests(seed: int, count: int, model: str) -> list[BadRequest]:
    """``count`` bad requests, the same ones for the same seed (see the module docstring)."""
    rng = random.Random(seed)
    names = sorted(MUTATIONS)
    out = []
    for i in range(count):
        api = sorted(PATHS)[i % len(PATHS)]
        body: dict | bytes = _base(api, model, rng)
        headers = {"content-type": "application/json"}
        chosen = tuple(rng.sample(names, rng.choice((1, 1, 2, 3))))
        for name in chosen:
            if isinstance(body, bytes):
                break  # already broken beyond JSON: later mutations have nothing to act on
            result = MUTATIONS[name](body, api, rng)
            if result is not None:
                body = result
            header = HEADER_MUTATIONS.get(name)
            if header:
                headers.update(header)
        payload = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        out.append(BadRequest(api, PATHS[api], payload, headers, chosen))
    return out


@dataclass
class Report:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[dict] = field(default_factory=list)  # 5xx: api, mutations, status, body
    transport_errors: list[str] = field(default_factory=list)
    turns: int = 0
    turns_failed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def by_status(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))}


def _header_safe(headers: dict[str, str]) -> dict[str, str]:
    # httpx sends header values as ASCII by default; non-ASCII ones go as UTF-8 bytes.
    return {k: (v if v.isascii() else v.encode()) for k, v in headers.items()}  # type: ignore[misc]


async def _send_bad(client, url: str, requests: list[BadRequest], report: Report, concurrency: int,
                    progress: Callable[[int], None]) -> None:
    import httpx

    queue: asyncio.Queue[BadRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)

    async def worker() -> None:
        while not queue.empty():
            r = queue.get_nowait()
            try:
                response = await client.post(url + r.path, content=r.body, headers=_header_safe(r.headers))
                status: int | str = response.status_code
                if response.status_code >= 500:
                    report.server_errors.append({"api": r.api, "mutations": list(r.mutations),
                                                 "status": response.status_code, "body": response.text[:300]})
            except (httpx.HTTPError, UnicodeError) as exc:
                status = type(exc).__name__
                what = f"{r.api} {list(r.mutations)}: {type(exc).__name__} {exc}"
                report.transport_errors.append(what[:300])
            report.statuses[status] += 1
            report.sent += 1
            progress(report.sent)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _conversations(url: str, model: str, count: int, turns: int, stop: asyncio.Event,
                         report: Report) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> None:
        round_ = 0
        while not stop.is_set():
            opening = f"Conversation {i}.{round_}: tell me of the harbour. " * 8
            messages: list[Any] = [{"role": "user", "content": opening}]
            for turn in range(turns):
                text, finished = "", None
                try:
                    stream = await client.chat.completions.create(
                        model=model, messages=messages, max_tokens=16, stream=True,
                        stream_options={"include_usage": True},
                        extra_headers={"x-dynamo-session-id": f"fuzz-{i}-{round_}"})
                    async for chunk in stream:
                        for choice in chunk.choices:
                            text += choice.delta.content or ""
                            finished = choice.finish_reason or finished
                except Exception as exc:  # noqa: BLE001 (any failure is what this counts)
                    report.turns_failed.append(f"conversation {i}.{round_} turn {turn + 1}: "
                                               f"{type(exc).__name__}: {exc}"[:300])
                    break
                report.turns += 1
                if not text or finished is None:
                    report.turns_failed.append(f"conversation {i}.{round_} turn {turn + 1}: cut "
                                               f"(text {len(text)} chars, finish_reason {finished})")
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
                await asyncio.sleep(0.3)
            round_ += 1

    await asyncio.gather(*(one(i) for i in range(count)))


async def run(url: str, model: str, count: int, seed: int = 0, concurrency: int = 8, conversations: int = 4,
              turns: int = 3, progress: Callable[[int], None] = lambda sent: None) -> Report:
    """Send ``count`` bad requests beside ``conversations`` well-formed ones (module doc)."""
    import httpx

    report = Report()
    stop = asyncio.Event()
    started = time.monotonic()
    chats = asyncio.create_task(_conversations(url, model, conversations, turns, stop, report))
    try:
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await _send_bad(client, url, bad_requests(seed, count, model), report, concurrency, progress)
    finally:
        stop.set()
        await chats
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the graph's gateway (no /v1)")
    p.add_argument("--model", default=None, help="the served model (default: the first of /v1/models)")
    p.add_argument("--count", type=int, default=2000, help="bad requests to send")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed (same seed, same requests)")
    p.add_argument("--concurrency", type=int, default=8, help="bad requests in flight at once")
    p.add_argument("--conversations", type=int, default=4,
                   help="well-formed streamed conversations running beside them, round after round")
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args(argv)
    if a.count < 1 or a.concurrency < 1 or a.conversations < 0:
        p.error("--count and --concurrency must be at least 1, --conversations not negative")
    import httpx
    try:
        model = a.model or httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"bad_input: cannot read the served model from {a.url}/v1/models ({exc}); "
              "is the graph up? pass --model", file=sys.stderr)
        return 2

    def progress(sent: int) -> None:
        if sent % 250 == 0 or sent == a.count:
            print(f"  {sent}/{a.count} bad requests sent", file=sys.stderr, flush=True)

    report = asyncio.run(run(a.url, model, a.count, a.seed, a.concurrency, a.conversations,
                             progress=progress))
    summary = {"sent": report.sent, "seconds": round(report.seconds, 1), "statuses": report.by_status(),
               "server_errors": report.server_errors, "transport_errors": report.transport_errors,
               "well_formed_turns": report.turns, "well_formed_turns_failed": report.turns_failed}
    print(json.dumps(summary, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if not (report.server_errors or report.transport_errors or report.turns_failed) else 1


if __name__ == "__main__":
    sys.exit(main())
