"""Client conformance (issue 48, item 2): the clients people run, unmodified, through the graphs'
one endpoint, on every route a turn takes.

Graphs, each started once for the module (`served`): ``ppd`` (gateway -> endpoint picker ->
Dynamo's frontend), ``ppd-relay`` (frontend -> relay router), ``pd`` (Dynamo's own prefill ->
decode handoff) and ``ppd-mode-pd`` (the ``ppd`` graph with the picker in ``--mode pd``, so that its
follow-ups go through the prefill worker). Every conversation has a first turn (through the prefill
worker) and a follow-up under the same ``x-dynamo-session-id`` with the history sent back: on
``ppd`` and ``ppd-relay`` it runs decode-local on the decode worker holding the history, on ``pd``
and ``ppd-mode-pd`` it goes through the prefill worker. The decode workers' own counts of what they
served by route (and the picker's or relay router's ``ppd_decisions_total``) check that each turn
took the route it should.

Clients: the `openai` SDK (chat completions and completions streamed with and without
``stream_options.include_usage`` and not streamed, the Responses API streamed and not; sync
``OpenAI`` and ``AsyncOpenAI``), the `anthropic` SDK (``messages.create``, ``messages.stream``
both to ``get_final_message`` and event by event, a tool loop with ``tool_use`` / ``tool_result``
follow-ups, extended ``thinking``), ``curl -N`` where a curl is installed (skipped otherwise), and
one raw stream per API read byte for byte (`httpx.stream`) and checked against the SSE
specification and its API's event grammar (`tests/sse_grammar.py`), and aiperf (multi-turn
streamed chat, from its own venv `.aiperf`, which `.ci/run` makes; skipped without it).

What Dynamo 1.6.1's frontend answers that a client should know (seen on all four graphs unless
said): ``thinking`` is accepted (200) and ignored: no thinking block comes back, and neither
Anthropic's ``budget_tokens >= 1024`` nor ``budget_tokens < max_tokens`` is checked; the Responses
and Messages streams end with an unnamed ``data: [DONE]`` neither API defines (both SDKs step over
it; the grammar checks accept it at the very end only); the Responses API ends with
``response.incomplete`` (the simulated model always runs to ``max_output_tokens``), so the openai
SDK's ``responses.stream(...).get_final_response()`` would raise for want of
``response.completed``; on ``ppd-relay`` the frontend's ``nvext.worker_id`` names the relay router
as both prefill and decode worker; a Messages stream's ``message_start`` reports the prompt's
``input_tokens`` without the chat template (``count_tokens``' figure), its ``message_delta`` the
real count.

The frontend opens the chat-completions and completions streams of a decode-local follow-up of
the ``ppd`` graph (its conditional disaggregation's bypass) with an event that has no data,
``event: x-bypass-remote-prefill`` / ``: true``, on which openai-python raises JSONDecodeError. The
gateway drops such events (`dynamo_ppd/sse.py`); the tests here do not step around them:
where one reaches the client, the SDKs' streamed chat and completions tests, the raw chat and
completions streams and curl's chat fail (11 tests on ``ppd``). The Responses and Messages
streams never carried one, nor did any stream of the other graphs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import sse_grammar

from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.launcher import Deployment
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.worker.handler import SERVED_METRIC

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SESSION = "x-dynamo-session-id"
MAX_TOKENS = 8
KV_EVENTS_S = 0.3  # between turns: the decode worker's KV events reach the router
WORKER_ID = {"nvext": {"extra_fields": ["worker_id"]}}
TOOLS = [{"name": "read_file", "description": "Read a file of the repository", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
ANTHROPIC_BLOCKS = {"text", "thinking", "redacted_thinking", "tool_use"}


@dataclass(frozen=True)
class Route:
    """A graph as these tests run it, and the route its follow-ups take."""

    id: str
    graph: str
    follow_up: str  # "decode_local" or "via_prefill"
    decider: str | None  # the metrics label of the process counting decisions
    extra_args: dict[str, list[str]] = field(default_factory=dict)


ROUTES = [Route("ppd", "ppd", "decode_local", "picker"),
          Route("ppd-relay", "ppd-relay", "decode_local", "router"),
          Route("pd", "pd", "via_prefill", None),
          Route("ppd-mode-pd", "ppd", "via_prefill", "picker", {"picker": ["--mode", "pd"]})]


@dataclass
class Served:
    route: Route
    dep: Deployment
    scraper: httpx.Client  # one connection pool for the metrics pages (a client per GET costs ~30 ms)

    @property
    def model(self) -> str:
        return self.dep.model_name

    @property
    def base_url(self) -> str:
        return self.dep.base_url


@pytest.fixture(scope="module", params=ROUTES, ids=lambda r: r.id)
def served(request, model_dir, tmp_path_factory):
    route: Route = request.param
    dep = start(ServeOptions(graph=route.graph, http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), model_dir=model_dir,
                             run_dir=tmp_path_factory.mktemp(route.id) / "run",
                             extra_args=route.extra_args), log=lambda _m: None)
    try:
        with httpx.Client(timeout=10) as scraper:
            yield Served(route, dep, scraper)
    finally:
        dep.stop()


# On ``ppd-mode-pd`` (the picker's own via-prefill follow-ups) the chat tests and the raw streams
# run; its streams are the frontend's prefill-then-decode ones, which every client meets on ``pd``.
ON_PPD_MODE_PD = ("test_openai_chat_sync", "test_openai_chat_async", "test_raw_stream_is_well_formed")


@pytest.fixture(autouse=True)
def _fewer_on_ppd_mode_pd(request):
    if "served" in request.fixturenames and request.node.originalname not in ON_PPD_MODE_PD:
        if request.getfixturevalue("served").route.id == "ppd-mode-pd":
            pytest.skip("on ppd-mode-pd only the chat and raw-stream tests run (its streams are pd's)")


# -- the routes turns took ----------------------------------------------------------------------

def _label(sample: str, name: str) -> str:
    return sample.split(f'{name}="', 1)[1].split('"', 1)[0]


def _snapshot(s: Served) -> dict[str, float]:
    """The decode workers' requests served by route (``served:ROUTE``, their own counter) and the
    picker's or relay router's ``ppd_decisions_total`` (``decided:ROUTE:TURN``)."""
    pages = [("served", f"http://127.0.0.1:{p.env['DYN_SYSTEM_PORT']}/metrics")
             for p in s.dep.workers if p.label.startswith("decode")]
    pages += [("decided", url) for label, url in s.dep.metrics_urls.items()
              if s.route.decider and label.startswith(s.route.decider)]
    counts: dict[str, float] = {}
    for kind, url in pages:
        for line in s.scraper.get(url).text.splitlines():
            if kind == "served" and line.startswith(SERVED_METRIC + "{"):
                key = f"served:{_label(line, 'route')}"
            elif kind == "decided" and line.startswith("ppd_decisions_total{"):
                key = f"decided:{_label(line, 'route')}:{_label(line, 'turn')}"
            else:
                continue
            counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


class Routes:
    """What the decode workers served (and the picker or router decided) from here on."""

    def __init__(self, s: Served):
        self.s = s
        self.before = _snapshot(s)

    def grew(self) -> dict[str, float]:
        after = _snapshot(self.s)
        return {k: v - self.before.get(k, 0) for k, v in after.items() if v != self.before.get(k, 0)}

    def expect(self, first: int, follow_ups: int, timeout_s: float = 5.0) -> None:
        """``first`` first turns went through the prefill worker, ``follow_ups`` follow-ups took
        the graph's follow-up route. (A worker counts a request once it has ended there, which
        may come a moment after the client read its last byte: polled.)"""
        follow = self.s.route.follow_up
        want = {"served:via_prefill": first + (follow_ups if follow == "via_prefill" else 0),
                "served:decode_local": follow_ups if follow == "decode_local" else 0}
        if self.s.route.decider:
            want |= {"decided:via_prefill:first": first, f"decided:{follow}:follow_up": follow_ups}
        want = {k: v for k, v in want.items() if v}
        deadline = time.monotonic() + timeout_s
        while True:
            grew = self.grew()
            if grew == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert grew == want, f"on {self.s.route.id}: counted {grew}, expected {want}"


@contextmanager
def _turn(s: Served, turn: int):
    """A client's failure named by the turn and route it met it on (the traceback stays)."""
    route = "first turn, via prefill" if turn == 0 else f"follow-up {turn}, {s.route.follow_up}"
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{s.route.id}, {route}: {exc}") from exc
    except Exception as exc:
        raise AssertionError(f"{s.route.id}, {route}: the client raised {type(exc).__name__}: {exc}") from exc


def _worker(obj) -> dict | None:
    """The workers Dynamo's frontend says served a response (``nvext.worker_id``), if it says."""
    nvext = (getattr(obj, "model_extra", None) or {}).get("nvext") or {}
    return nvext.get("worker_id")


def _check_workers(s: Served, first: dict | None, follow: dict | None, record: Callable) -> None:
    record("worker_id", {"first": first, "follow_up": follow})
    assert first and follow, f"no nvext.worker_id: first {first}, follow-up {follow}"
    if s.route.graph == "ppd-relay":  # the frontend's one "worker" is the relay router
        assert first["prefill_worker_id"] == first["decode_worker_id"] == follow["decode_worker_id"]
        return
    assert "prefill_worker_id" in first and "decode_worker_id" in first, first
    if s.route.follow_up == "decode_local":
        assert "prefill_worker_id" not in follow, follow
        assert follow["decode_worker_id"] == first["decode_worker_id"], (first, follow)
    else:
        assert "prefill_worker_id" in follow and "decode_worker_id" in follow, follow


@pytest.fixture
def record(record_property, request):
    """Keep what a client met (JUnit properties; printed, seen with ``-s``)."""
    def keep(name: str, value) -> None:
        record_property(name, value)
        print(f"{request.node.name}: {name} = {value}")
    return keep


def _opening(tag: str) -> str:
    # The tag first: no two conversations share a prefix (a KV block) on any worker.
    return f"[{tag}] Tell me about the harbour, its ships and its tides. " * 12


def _session(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _openai(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def _async_openai(s: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def _anthropic(s: Served, session: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.base_url, api_key="none", max_retries=0, timeout=60,
                               default_headers={SESSION: session})


# -- the openai SDK: chat completions and completions --------------------------------------------

VARIANTS = ["stream_usage", "stream", "not_streamed"]


def _chunks_text(chunks: list, variant: str, api: str) -> tuple[str, dict | None]:
    """The text of a stream's chunks, its usage where asked for (in the last chunk, no choices)."""
    assert chunks, "an empty stream"
    if variant == "stream_usage":
        last = chunks[-1]
        assert last.usage is not None and last.usage.completion_tokens > 0, last
        assert last.choices == [], last
        assert all(c.usage is None for c in chunks[:-1]), [c.usage for c in chunks]
    else:
        assert all(c.usage is None for c in chunks), [c.usage for c in chunks]
    text = "".join((c.choices[0].delta.content or "") if api == "chat" else c.choices[0].text
                   for c in chunks if c.choices)
    return text, next((w for c in chunks if (w := _worker(c))), None)


def _chat_kwargs(s: Served, messages: list[dict], session: str, variant: str) -> dict:
    kwargs = {"model": s.model, "messages": messages, "max_tokens": MAX_TOKENS,
              "extra_headers": {SESSION: session}, "extra_body": WORKER_ID}
    if variant != "not_streamed":
        kwargs["stream"] = True
    if variant == "stream_usage":
        kwargs["stream_options"] = {"include_usage": True}
    return kwargs


def _completions_kwargs(s: Served, prompt: str, session: str, variant: str) -> dict:
    kwargs = {"model": s.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
              "extra_headers": {SESSION: session}, "extra_body": WORKER_ID}
    if variant != "not_streamed":
        kwargs["stream"] = True
    if variant == "stream_usage":
        kwargs["stream_options"] = {"include_usage": True}
    return kwargs


def _answer(response, api: str) -> tuple[str, dict | None]:
    assert response.usage is not None and response.usage.completion_tokens > 0, response
    choice = response.choices[0]
    return (choice.message.content if api == "chat" else choice.text) or "", _worker(response)


@pytest.mark.parametrize("variant", VARIANTS)
def test_openai_chat_sync(served, variant, record):
    routes, session = Routes(served), _session(f"chat-sync-{variant}")
    messages = [{"role": "user", "content": _opening(f"chat-sync-{variant}")}]
    workers = []
    with _openai(served) as client:
        for turn in range(2):
            if turn:
                time.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                response = client.chat.completions.create(**_chat_kwargs(served, messages, session, variant))
                text, worker = (_answer(response, "chat") if variant == "not_streamed"
                                else _chunks_text(list(response), variant, "chat"))
                assert text, "no content"
            workers.append(worker)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)
    _check_workers(served, *workers, record)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_openai_chat_async(served, variant, record):
    routes, session = Routes(served), _session(f"chat-async-{variant}")
    messages = [{"role": "user", "content": _opening(f"chat-async-{variant}")}]
    workers = []
    async with _async_openai(served) as client:
        for turn in range(2):
            if turn:
                await asyncio.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                kwargs = _chat_kwargs(served, messages, session, variant)
                response = await client.chat.completions.create(**kwargs)
                text, worker = (_answer(response, "chat") if variant == "not_streamed"
                                else _chunks_text([c async for c in response], variant, "chat"))
                assert text, "no content"
            workers.append(worker)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)
    _check_workers(served, *workers, record)


@pytest.mark.parametrize("variant", VARIANTS)
def test_openai_completions_sync(served, variant, record):
    routes, session = Routes(served), _session(f"completions-sync-{variant}")
    prompt = _opening(f"completions-sync-{variant}")
    workers = []
    with _openai(served) as client:
        for turn in range(2):
            if turn:
                time.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                response = client.completions.create(**_completions_kwargs(served, prompt, session, variant))
                text, worker = (_answer(response, "completions") if variant == "not_streamed"
                                else _chunks_text(list(response), variant, "completions"))
                assert text, "no content"
            workers.append(worker)
            prompt += f"{text}\n\nAnd then?\n"
    routes.expect(first=1, follow_ups=1)
    _check_workers(served, *workers, record)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_openai_completions_async(served, variant, record):
    routes, session = Routes(served), _session(f"completions-async-{variant}")
    prompt = _opening(f"completions-async-{variant}")
    workers = []
    async with _async_openai(served) as client:
        for turn in range(2):
            if turn:
                await asyncio.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                kwargs = _completions_kwargs(served, prompt, session, variant)
                response = await client.completions.create(**kwargs)
                text, worker = (_answer(response, "completions") if variant == "not_streamed"
                                else _chunks_text([c async for c in response], variant, "completions"))
                assert text, "no content"
            workers.append(worker)
            prompt += f"{text}\n\nAnd then?\n"
    routes.expect(first=1, follow_ups=1)
    _check_workers(served, *workers, record)


# -- the openai SDK: the Responses API -----------------------------------------------------------

def _responses_kwargs(s: Served, items: list, session: str, stream: bool) -> dict:
    return {"model": s.model, "input": items, "max_output_tokens": MAX_TOKENS, "stream": stream,
            "extra_headers": {SESSION: session}}


def _responses_text(events: list) -> str:
    types = [e.type for e in events]
    assert types[0] == "response.created", types
    # The simulated model always stops at max_output_tokens: the Responses API says incomplete.
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert events[-1].response.status == types[-1].removeprefix("response."), events[-1]
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _response_text(response) -> str:
    assert response.status in ("completed", "incomplete"), response
    return response.output_text


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "not_streamed"])
def test_openai_responses_sync(served, stream):
    routes, session = Routes(served), _session("responses-sync")
    items: list = [{"role": "user", "content": _opening(f"responses-sync-{stream}")}]
    with _openai(served) as client:
        for turn in range(2):
            if turn:
                time.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                response = client.responses.create(**_responses_kwargs(served, items, session, stream))
                text = _responses_text(list(response)) if stream else _response_text(response)
                assert text, "no content"
            items += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "not_streamed"])
async def test_openai_responses_async(served, stream):
    routes, session = Routes(served), _session("responses-async")
    items: list = [{"role": "user", "content": _opening(f"responses-async-{stream}")}]
    async with _async_openai(served) as client:
        for turn in range(2):
            if turn:
                await asyncio.sleep(KV_EVENTS_S)
            with _turn(served, turn):
                response = await client.responses.create(**_responses_kwargs(served, items, session, stream))
                text = _responses_text([e async for e in response]) if stream else _response_text(response)
                assert text, "no content"
            items += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)


# -- the anthropic SDK ---------------------------------------------------------------------------

def _message_text(message) -> str:
    assert message.type == "message" and message.role == "assistant", message
    assert {block.type for block in message.content} <= ANTHROPIC_BLOCKS, message.content
    assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), message
    assert message.usage.output_tokens > 0, message.usage
    return "".join(block.text for block in message.content if block.type == "text")


def _streamed_message(client: anthropic.Anthropic, kwargs: dict, event_by_event: bool):
    with client.messages.stream(**kwargs) as stream:
        if not event_by_event:
            return stream.get_final_message()
        events = list(stream)
        message = stream.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop", types
    assert "content_block_delta" in types and "message_delta" in types, types
    text = "".join(e.text for e in events if e.type == "text")  # the SDK's own text events
    assert text == _message_text(message), (text, message)
    return message


@pytest.mark.parametrize("how", ["create", "stream_final_message", "stream_events"])
def test_anthropic_messages(served, how):
    routes, session = Routes(served), _session(f"anthropic-{how}")
    messages: list[dict] = [{"role": "user", "content": _opening(f"anthropic-{how}")}]
    with _anthropic(served, session) as client:
        for turn in range(2):
            if turn:
                time.sleep(KV_EVENTS_S)
            kwargs = {"model": served.model, "max_tokens": MAX_TOKENS, "messages": messages}
            with _turn(served, turn):
                message = (client.messages.create(**kwargs) if how == "create"
                           else _streamed_message(client, kwargs, how == "stream_events"))
                text = _message_text(message)
                assert text, "no content"
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)


def test_anthropic_tool_use_and_tool_results(served):
    """A Claude Code-like loop: the task, then tool calls answered by tool results, streamed and
    not in turn (the simulated model writes no tool call itself: the history carries them)."""
    routes, session = Routes(served), _session("anthropic-tools")
    messages: list[dict] = [{"role": "user", "content": _opening("anthropic-tools")}]
    with _anthropic(served, session) as client:
        for step in range(3):
            if step:
                time.sleep(KV_EVENTS_S)
            kwargs = {"model": served.model, "max_tokens": MAX_TOKENS, "system": "Use the tools.",
                      "tools": TOOLS, "messages": messages}
            with _turn(served, step):
                message = (_streamed_message(client, kwargs, event_by_event=True) if step % 2
                           else client.messages.create(**kwargs))
                text = _message_text(message)
                assert text, "no content"
            call, result = f"toolu_{step:02d}", f"def parse_{step}(rows): return rows"
            messages += [{"role": "assistant", "content": [
                              {"type": "text", "text": text},
                              {"type": "tool_use", "id": call, "name": "read_file",
                               "input": {"path": f"src/tides_{step}.py"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": call,
                              "content": [{"type": "text", "text": result}]}]}]
    routes.expect(first=1, follow_ups=2)


def test_anthropic_extended_thinking(served, record):
    """``thinking`` as Claude Code sends it, and a follow-up carrying the thinking blocks back.
    Dynamo 1.6.1 accepts it (200) and ignores it: text blocks only, and no check of the budget
    (Anthropic's API wants 1024 <= budget_tokens < max_tokens; this asks 1024 of 16 tokens, to keep
    the answer short). Were it refused, the SDK would have to raise a clean BadRequestError."""
    routes, session = Routes(served), _session("anthropic-thinking")
    messages: list[dict] = [{"role": "user", "content": _opening("anthropic-thinking")}]
    with _anthropic(served, session) as client:
        for turn in range(2):
            if turn:
                time.sleep(KV_EVENTS_S)
            kwargs = {"model": served.model, "max_tokens": 16, "messages": messages,
                      "thinking": {"type": "enabled", "budget_tokens": 1024}}
            with _turn(served, turn):
                try:
                    message = (client.messages.create(**kwargs) if turn == 0
                               else _streamed_message(client, kwargs, event_by_event=True))
                except anthropic.BadRequestError as refused:  # a clean refusal, in Anthropic's shape
                    record("thinking", f"refused: {refused.status_code} {refused.body}")
                    assert refused.body["type"] == "error", refused.body
                    assert refused.body["error"]["type"] == "invalid_request_error", refused.body
                    return
                record("thinking_blocks", [block.type for block in message.content])
                text = _message_text(message)
                assert text, "no content"
            thought = [b.model_dump() for b in message.content if b.type in ("thinking", "redacted_thinking")]
            # Back as Claude Code sends it: the thinking blocks (made up when none came), the text.
            thought = thought or [{"type": "thinking", "thinking": "The harbour.", "signature": "sig-0"}]
            messages += [{"role": "assistant", "content": [*thought, {"type": "text", "text": text}]},
                         {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)


# -- raw streams: the SSE specification and each API's grammar ------------------------------------

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
             "responses": "/v1/responses", "messages": "/v1/messages"}


def _raw_body(s: Served, api: str, history: list, prompt: str) -> dict:
    body: dict = {"model": s.model, "stream": True}
    if api == "chat":
        body |= {"messages": history, "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True},
                 **WORKER_ID}
    elif api == "completions":
        body |= {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True}}
    elif api == "responses":
        body |= {"input": history, "max_output_tokens": MAX_TOKENS}
    else:
        body |= {"messages": history, "max_tokens": MAX_TOKENS}
    return body


def _grammar(api: str, body: bytes) -> tuple[list[str], str, sse_grammar.Stream]:
    stream = sse_grammar.parse(body)
    if api in ("chat", "completions"):
        return (sse_grammar.openai_problems(stream, api, include_usage=True),
                sse_grammar.openai_text(stream, api), stream)
    if api == "responses":
        return (sse_grammar.responses_problems(stream, allow_done=True),
                sse_grammar.responses_text(stream), stream)
    return (sse_grammar.messages_problems(stream, allow_done=True),
            sse_grammar.messages_text(stream), stream)


@pytest.mark.parametrize("api", list(API_PATHS))
def test_raw_stream_is_well_formed(served, api, record):
    """One conversation per API, each turn's bytes as they came: both turns are checked, then
    every problem found is reported at once."""
    routes, session = Routes(served), _session(f"raw-{api}")
    opening = _opening(f"raw-{api}")
    history: list = [{"role": "user", "content": opening}]
    prompt = opening
    found = {}
    with httpx.Client(timeout=60) as client:
        for turn in ("first", "follow_up"):
            if turn != "first":
                time.sleep(KV_EVENTS_S)
            with client.stream("POST", f"{served.base_url}{API_PATHS[api]}", headers={SESSION: session},
                               json=_raw_body(served, api, history, prompt)) as response:
                raw = response.read()
            assert response.status_code == 200, (turn, response.status_code, raw[:500])
            assert response.headers["content-type"].startswith("text/event-stream"), response.headers
            problems, text, stream = _grammar(api, raw)
            record(f"events_{turn}", stream.summary()[:3] + ["..."] + stream.summary()[-2:])
            if problems:
                found[turn] = problems
            assert text, (turn, raw[:500])
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
            prompt += f"{text}\n\nAnd then?\n"
    routes.expect(first=1, follow_ups=1)
    assert not found, f"{api} on {served.route.id}: {json.dumps(found, indent=1)}"


# -- curl ----------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine (CI images may lack it)")
@pytest.mark.parametrize("api", ["chat", "messages"])
def test_curl_streams(served, api, tmp_path):
    curl = shutil.which("curl") or "curl"
    routes, session = Routes(served), _session(f"curl-{api}")
    history: list = [{"role": "user", "content": _opening(f"curl-{api}")}]
    found = {}
    for turn in ("first", "follow_up"):
        if turn != "first":
            time.sleep(KV_EVENTS_S)
        headers = tmp_path / f"{turn}.headers"
        done = subprocess.run(
            [curl, "-sS", "-N", "-D", str(headers), "-H", "content-type: application/json",
             "-H", f"{SESSION}: {session}", "--data-binary", "@-", f"{served.base_url}{API_PATHS[api]}"],
            input=json.dumps(_raw_body(served, api, history, "")).encode(), capture_output=True, timeout=60)
        assert done.returncode == 0, (turn, done.returncode, done.stderr)
        status = headers.read_text().split("\r\n", 1)[0]
        assert status.split()[1] == "200", (turn, status, done.stdout[:500])
        problems, text, _ = _grammar(api, done.stdout)
        if problems:
            found[turn] = problems
        assert text, (turn, done.stdout[:500])
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    routes.expect(first=1, follow_ups=1)
    assert not found, f"curl {api} on {served.route.id}: {json.dumps(found, indent=1)}"


# -- aiperf, NVIDIA's benchmark client (its own venv) ---------------------------------------------

AIPERF_VENV = Path(__file__).parent.parent / ".aiperf"  # made by .ci/run (the README says how)


def _aiperf() -> str | None:
    found = os.environ.get("AIPERF") or (AIPERF_VENV / "bin" / "aiperf")
    return str(found) if Path(found).exists() else None


@pytest.mark.skipif(_aiperf() is None, reason="aiperf is not installed: uv venv .aiperf -p python3 && "
                    "uv pip install -p .aiperf aiperf==0.13.0 (or AIPERF=/path/to/aiperf)")
def test_aiperf_multi_turn_streamed_conversations(served, model_dir, tmp_path, record):
    # 6 conversations of 3 turns, streamed chat, each under its own session header: aiperf sends
    # each turn the history back, as a chat client does, and reports what it could not parse.
    routes = Routes(served)
    out = tmp_path / "aiperf"
    done = subprocess.run(
        [_aiperf(), "profile", "--model-names", served.model, "--url", served.base_url,
         "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model_dir),
         "--conversation-num", "6", "--conversation-turn-mean", "3", "--conversation-turn-stddev", "0",
         "--request-count", "18", "--concurrency", "3", "--prompt-input-tokens-mean", "200",
         "--prompt-output-tokens-mean", str(MAX_TOKENS), "--session-header", SESSION,
         "--output-artifact-dir", str(out), "--ui-type", "none"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    record("aiperf", {k: report[k] for k in ("request_count", "error_request_count") if k in report})
    assert report["request_count"]["avg"] == 18 and not report.get("error_request_count")
    assert report["time_to_first_token"]["avg"] > 0
    routes.expect(first=6, follow_ups=12)
