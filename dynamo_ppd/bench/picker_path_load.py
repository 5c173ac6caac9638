"""The load of `dynamo-ppd bench picker` (`picker_path`): the requests it sends, as Envoy's
ext_proc filter presents them to the picker (first turns of fresh words; follow-ups that continue
conversations served for real in a warm-up), the driver that sends them (open loop at a rate, or
closed loop at a concurrency) and times them, and the meter of the processes' CPU.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from .client import TokenText
from .cpu import machine_busy_s, own_cpu_s, process_cpu_s, thread_cpu_s
from .picker_path_report import CpuUse, Outcome

FIRST_TURNS = {"first-0.5k": 500, "first-2k": 2000, "first-8k": 8000, "first-32k": 32000,
               "first-100k": 100000}  # kind -> user tokens
# Agent traffic over /v1/messages, as Claude Code sends it (issue 41): a system prompt and tool
# schemas every session shares, then a tool loop whose steps append a reply with a tool call and
# a tool result (TraceLab's medians: a ~214-token reply, an ~875-token append).
AGENT_FOLLOW_UP = "agent-follow-up-100k"  # a tool loop's next step on a ~100K-token context
AGENT_FIRST_TURN = "agent-first-20k"  # a new session's first request sharing the 20K-token prompt
AGENT_KINDS = (AGENT_FOLLOW_UP, AGENT_FIRST_TURN)
AGENT_SYSTEM_TOKENS = 20_000  # the shared system prompt (the tools' schemas add ~400)
AGENT_CONTEXT_TOKENS = 100_000
AGENT_TASK_TOKENS = 300  # a session's own first user message
AGENT_REPLY_TOKENS = 214
AGENT_RESULT_TOKENS = 875
AGENT_SESSIONS = 4  # tool loops taking turns in the follow-up kind
AGENT_STEPS_MAX = 8  # a loop grown this many steps past its primed history starts again from there
AGENT_SESSION_HEADER = "x-claude-code-session-id"  # Claude Code's (picker/route.py AGENT_SESSION_HEADERS)
MAX_TOKENS = 64  # each routed request's max_tokens (the picker checks it and charges loads by it)
WARMUP_TURNS = ((1000, 32), (900, 32))  # the warm-up conversations' (user tokens, reply tokens)
WARMUP_CONCURRENCY = 32
FOLLOW_UP_WORDS = 32  # a follow-up's new user message
ASSISTANT_WORDS = 8  # the short assistant message between two follow-ups of one conversation
# Prompt tokens of a chat, estimated from its messages' (one-token) words: the Llama-3 template
# around the first message and the generation prompt (~17), then ~9 more per message; checked
# against the picker's own tokenizer in tests/test_bench_picker_path.py.
FIRST_MESSAGE_TOKENS = 17
MESSAGE_TOKENS = 9
DEADLINE_GRACE_S = 5.0  # after a point's last send, requests unanswered this long count as failed
CALLOUT_TIMEOUT_S = 60.0  # per awaited answer (Envoy's message_timeout); the deadline comes first
QUIET_CORES = 0.15  # between points: wait until the picker is back under this (its backlog done)
SETTLE_MAX_S = 15.0


# --- what is sent --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PickRequest:
    """One request as Envoy's ext_proc filter would present it to the picker."""

    headers: list[tuple[str, str]]
    body: bytes
    group: str  # its conversation: follow-ups of one conversation are resampled together
    prompt_tokens: int  # estimated (`estimated_prompt_tokens`)


def estimated_prompt_tokens(message_tokens: list[int]) -> int:
    """The prompt tokens of a chat whose messages hold these many (one-token) words."""
    return FIRST_MESSAGE_TOKENS + sum(message_tokens) + MESSAGE_TOKENS * (len(message_tokens) - 1)


def envoy_request_headers(session_id: str, body_length: int, path: str = "/v1/chat/completions",
                          session_header: str = "x-dynamo-session-id") -> list[tuple[str, str]]:
    """The header map Envoy's connection manager shows an ext_proc server for a POST of an OpenAI
    chat (or another API's body to ``path``) (`gateway.headers.envoy_headers`, as the local
    gateway builds it)."""
    from ..gateway.headers import envoy_headers
    from ..gateway.http import RequestHead

    head = RequestHead("POST", path, "HTTP/1.1",
                       [("host", "127.0.0.1"), ("content-type", "application/json"),
                        ("content-length", str(body_length)), (session_header, session_id)],
                       content_length=body_length)
    return envoy_headers(head, str(uuid.uuid4()))


def chat_request(model: str, messages: list[dict], session_id: str, group: str,
                 message_tokens: list[int]) -> PickRequest:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                       "stream": True}).encode()
    return PickRequest(envoy_request_headers(session_id, len(body)), body, group,
                       estimated_prompt_tokens(message_tokens))


class FirstTurns:
    """First turns of ``tokens`` user tokens: fresh random words and a fresh session id each."""

    def __init__(self, kind: str, tokens: int, model: str, text: TokenText):
        self.kind, self.tokens, self.model, self.text = kind, tokens, model, text
        self.made = 0

    def next(self) -> PickRequest:
        self.made += 1
        session = f"picker-path-{self.kind}-{self.made}-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": self.text(self.tokens)}]
        return chat_request(self.model, messages, session, session, [self.tokens])


@dataclass
class Conversation:
    """A warm-up conversation as the follow-ups continue it."""

    session_id: str
    messages: list[dict]
    message_tokens: list[int]  # each message's words (a reply's: its completion tokens)
    follow_ups: int = 0


class FollowUps:
    """Follow-ups, the conversations taking turns; each continues its conversation's last request."""

    def __init__(self, conversations: list[Conversation], model: str, text: TokenText):
        if not conversations:
            raise ValueError("follow-ups need at least one warm-up conversation")
        self.conversations, self.model, self.text = conversations, model, text
        self._next = 0

    def next(self) -> PickRequest:
        conv = self.conversations[self._next]
        self._next = (self._next + 1) % len(self.conversations)
        if conv.follow_ups:  # the answer to its previous follow-up, then the new question
            conv.messages.append({"role": "assistant", "content": self.text(ASSISTANT_WORDS)})
            conv.message_tokens.append(ASSISTANT_WORDS)
        conv.messages.append({"role": "user", "content": self.text(FOLLOW_UP_WORDS)})
        conv.message_tokens.append(FOLLOW_UP_WORDS)
        conv.follow_ups += 1
        return chat_request(self.model, conv.messages, conv.session_id, conv.session_id, conv.message_tokens)


class AgentTurns:
    """Agent requests over ``/v1/messages`` (`AGENT_KINDS`), every session sharing one system
    prompt and tool list. ``agent-first-20k``: each request a new session's first (its own task),
    so after the first only the task is new to the picker. ``agent-follow-up-100k``:
    `AGENT_SESSIONS` tool loops grown to ~`AGENT_CONTEXT_TOKENS` (`prime` sends each one's turn
    before, unmeasured, as the picker would have seen it), taking turns; each request adds a step
    (a reply with a tool call, its result) to its loop, so the picker has seen all of it but
    the last step. A loop `AGENT_STEPS_MAX` steps past its primed history goes back to it (a new
    branch of the same session, as a retried step is), so the contexts stay near
    `AGENT_CONTEXT_TOKENS` however many requests a point sends."""

    def __init__(self, kind: str, model: str, text: TokenText):
        self.kind, self.model, self.text = kind, model, text
        self.system = text(AGENT_SYSTEM_TOKENS)
        self.tools = [{"name": f"tool_{k}", "description": text(24),
                       "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
                      for k in range(8)]
        self.made = 0
        self.loops: list[tuple[str, list[dict]]] = []
        self.primed_length = 0  # messages in each loop as primed
        if kind == AGENT_FOLLOW_UP:
            steps = (AGENT_CONTEXT_TOKENS - AGENT_SYSTEM_TOKENS - AGENT_TASK_TOKENS) // (
                AGENT_REPLY_TOKENS + AGENT_RESULT_TOKENS + 2 * MESSAGE_TOKENS)
            for i in range(AGENT_SESSIONS):
                messages = [{"role": "user", "content": text(AGENT_TASK_TOKENS)}]
                for _ in range(steps - 1):
                    self._step(messages)
                self.loops.append((f"picker-path-agent-{i}-{uuid.uuid4().hex[:8]}", messages))
            self.primed_length = len(self.loops[0][1])

    @property
    def tokens(self) -> int:
        """About the prompt tokens of this kind's requests."""
        if self.kind == AGENT_FOLLOW_UP:
            return AGENT_CONTEXT_TOKENS
        return AGENT_SYSTEM_TOKENS + AGENT_TASK_TOKENS

    def _step(self, messages: list[dict]) -> None:
        self.made += 1
        call = f"toolu_{self.made:06d}"
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": self.text(AGENT_REPLY_TOKENS)},
            {"type": "tool_use", "id": call, "name": "tool_0", "input": {"path": f"src/{self.made}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call, "content": self.text(AGENT_RESULT_TOKENS)}]})

    def _request(self, session_id: str, messages: list[dict]) -> PickRequest:
        body = json.dumps({"model": self.model, "max_tokens": MAX_TOKENS, "stream": True,
                           "system": self.system, "tools": self.tools, "messages": messages}).encode()
        headers = envoy_request_headers(session_id, len(body), "/v1/messages", AGENT_SESSION_HEADER)
        return PickRequest(headers, body, session_id, self.tokens)

    def prime(self) -> list[PickRequest]:
        """What the picker sees before the measured requests: the shared prompt once (the first
        session's first request), or each loop as it stood a step ago."""
        if self.kind == AGENT_FIRST_TURN:
            return [self.next()]
        return [self._request(session_id, list(messages)) for session_id, messages in self.loops]

    def next(self) -> PickRequest:
        if self.kind == AGENT_FIRST_TURN:
            self.made += 1
            session = f"picker-path-agent-first-{self.made}-{uuid.uuid4().hex[:8]}"
            return self._request(session, [{"role": "user", "content": self.text(AGENT_TASK_TOKENS)}])
        session_id, messages = self.loops[self.made % len(self.loops)]
        if len(messages) >= self.primed_length + 2 * AGENT_STEPS_MAX:
            del messages[self.primed_length:]
        self._step(messages)
        return self._request(session_id, list(messages))


async def warm_up(dep, count: int, text: TokenText, seed: int) -> list[Conversation]:
    """``count`` two-turn conversations through the gateway (`WARMUP_TURNS`), served for real."""
    import httpx

    from .client import chat_stream

    gate = asyncio.Semaphore(WARMUP_CONCURRENCY)
    failures: list[str] = []

    async def conversation(client: httpx.AsyncClient, i: int) -> Conversation | None:
        conv = Conversation(f"picker-path-{seed}-{i}", [], [])
        async with gate:
            for user_tokens, reply_tokens in WARMUP_TURNS:
                conv.messages.append({"role": "user", "content": text(user_tokens)})
                conv.message_tokens.append(user_tokens)
                usage: dict = {}
                _, _, _, reply, error = await chat_stream(client, dep.base_url, dep.model_name, conv.messages,
                                                          reply_tokens, conv.session_id, usage=usage)
                if error is not None:
                    failures.append(error)
                    return None
                conv.messages.append({"role": "assistant", "content": reply})
                conv.message_tokens.append(int(usage.get("completion_tokens") or reply_tokens))
        return conv

    limits = httpx.Limits(max_connections=WARMUP_CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        done = await asyncio.gather(*(conversation(client, i) for i in range(count)))
    conversations = [c for c in done if c is not None]
    if len(conversations) < count / 2:
        raise RuntimeError(f"warm-up: {len(failures)} of {count} conversations failed, e.g. {failures[:1]}")
    return conversations


# --- the driver ----------------------------------------------------------------------------------

class Driver:
    """Sends `PickRequest`s to the picker over ext_proc and times them (one grpc.aio channel, as
    one Envoy worker thread holds one HTTP/2 connection to its ext_proc cluster)."""

    def __init__(self, address: str):
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

        from ..gateway.extproc import CHANNEL_OPTIONS

        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = external_processor_pb2_grpc.ExternalProcessorStub(self.channel)
        self.closing: set[asyncio.Task] = set()  # streams half-closed, ending in the picker's time

    async def send(self, request: PickRequest) -> tuple[float, dict[str, float] | None, str | None]:
        """(round trip us, the picker's timings, error): error "HTTP <status>: <body>" for a refusal."""
        from ..gateway.extproc import PickerError, process
        from ..picker.extproc import TIMING_NAMESPACE

        try:
            result = await process(self.stub, request.headers, request.body, "full-duplex", CALLOUT_TIMEOUT_S,
                                   self.closing)
        except PickerError as exc:
            return 0.0, None, str(exc)
        if result.immediate is not None:
            body = result.immediate.body[:300].decode("utf-8", "replace")
            return result.seconds * 1e6, None, f"HTTP {result.immediate.status}: {body}"
        return result.seconds * 1e6, result.metadata.get(TIMING_NAMESPACE), None

    async def _timed(self, request: PickRequest, start: float, due: float, out: list, index: int) -> None:
        sent = time.perf_counter()
        round_trip, timings, error = await self.send(request)
        out[index] = Outcome(request.group, due - start, sent - due, time.perf_counter() - start, round_trip,
                             timings, request.prompt_tokens, error)

    async def open_loop(self, requests: list[PickRequest], rate: float) -> list[Outcome]:
        """Send request i at i/rate s from the start, answered or not; those unanswered
        `DEADLINE_GRACE_S` after the last send are cancelled and count as failed."""
        out: list = [None] * len(requests)
        tasks = []
        start = time.perf_counter() + 0.01
        dues = [start + i / rate for i in range(len(requests))]
        for i, (request, due) in enumerate(zip(requests, dues, strict=True)):
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # ~1 ms timers: at high rates a few leave together
            tasks.append(asyncio.create_task(self._timed(request, start, due, out, i)))
        await self._finish(tasks)
        return self._outcomes(requests, out, start, dues)

    async def closed_loop(self, requests: list[PickRequest], concurrency: int) -> list[Outcome]:
        """``concurrency`` requests in flight: each answer sends the next request at once."""
        out: list = [None] * len(requests)
        queue = iter(range(len(requests)))
        start = time.perf_counter()

        async def slot() -> None:
            for i in queue:
                await self._timed(requests[i], start, time.perf_counter(), out, i)

        await self._finish([asyncio.create_task(slot()) for _ in range(concurrency)], deadline=False)
        return self._outcomes(requests, out, start, [start] * len(requests))

    async def _finish(self, tasks: list[asyncio.Task], deadline: bool = True) -> None:
        _, pending = await asyncio.wait(tasks, timeout=DEADLINE_GRACE_S if deadline else None)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _outcomes(requests: list[PickRequest], out: list, start: float, dues: list[float]) -> list[Outcome]:
        """Each request's outcome; one cancelled unanswered is a failure."""
        now = time.perf_counter() - start
        return [o if o is not None else Outcome(r.group, due - start, 0.0, now, 0.0, None, r.prompt_tokens,
                                                "unanswered at the point's deadline")
                for r, o, due in zip(requests, out, dues, strict=True)]

    async def drain(self) -> None:
        """Wait for the half-closed streams to end (the picker closes them)."""
        if self.closing:
            await asyncio.wait(list(self.closing), timeout=10)

    async def close(self) -> None:
        await self.drain()
        for task in list(self.closing):
            task.cancel()
        await self.channel.close()


DRIVER, MACHINE, WALL = "driver", "machine", "wall"  # `Meter`'s readings beside the graph's labels


@dataclass
class Meter:
    """CPU of the picker, the driver, each process of the graph and the machine between `start`
    and `stop`. ``pids``: the graph's processes by label (the picker's is ``picker``)."""

    pids: dict[str, int]
    _begin: dict[str, float] = field(default_factory=dict)
    _threads_begin: dict[str, float] = field(default_factory=dict)

    @property
    def picker_pid(self) -> int:
        return self.pids["picker"]

    def _read(self) -> dict[str, float]:
        out = {label: _cpu_or_zero(pid) for label, pid in self.pids.items()}
        out.update({DRIVER: own_cpu_s(), MACHINE: machine_busy_s(), WALL: time.monotonic()})
        return out

    def start(self) -> None:
        self._threads_begin = thread_cpu_s(self.picker_pid)
        self._begin = self._read()

    def stop(self, picks: int, picker_idle_cores: float = 0.0) -> CpuUse:
        end, threads = self._read(), thread_cpu_s(self.picker_pid)
        used = {k: end[k] - self._begin[k] for k in end}
        by_thread = {name: cpu - self._threads_begin.get(name, 0.0) for name, cpu in threads.items()}
        graph = {k: v for k, v in used.items() if k not in (DRIVER, MACHINE, WALL)}
        return CpuUse(used["picker"], used[DRIVER], used[MACHINE], used[WALL], picks, graph,
                      picker_idle_cores, by_thread)



def _cpu_or_zero(pid: int) -> float:
    try:
        return process_cpu_s(pid)
    except OSError:  # a process that exited: its CPU is no longer counted
        return 0.0


async def idle_cores(pid: int, seconds: float = 2.0) -> float:
    """The picker's CPU with no requests (its event subscriptions and timers), in cores."""
    before = process_cpu_s(pid)
    await asyncio.sleep(seconds)
    return (process_cpu_s(pid) - before) / seconds


async def settle(picker_pid: int) -> None:
    """Wait until the picker has worked off what a point left it (CPU under `QUIET_CORES`)."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        before = process_cpu_s(picker_pid)
        await asyncio.sleep(0.5)
        if (process_cpu_s(picker_pid) - before) / 0.5 < QUIET_CORES:
            return
