"""Server-sent events as a client reads them, and the event grammars of the APIs the graphs serve
(`tests/test_clients_e2e.py`). Pure: bytes in, findings out; no I/O.

`parse` follows the WHATWG HTML specification's *event stream interpretation* (section 9.2.6):
the body is UTF-8 (one leading BOM dropped); lines end in CRLF, LF or CR; a line starting with
``:`` is a comment; ``field: value`` (one space after the colon dropped) or a bare ``field`` line
sets ``event``, ``data`` (appended, lines joined by LF), ``id`` (unless it holds NUL) or ``retry``
(ASCII digits only); other fields are ignored; a blank line dispatches the event, unless its data
buffer is empty, in which case the event is dropped unseen; text after the last blank line is
never dispatched.

A conforming client therefore never sees an event that has fields but no ``data`` line, but the
clients people run are not all conforming: openai-python dispatches such an event with empty data
and fails on ``json.loads("")``. So `framing_problems` counts every block that carries a field and
no data as a failure (Dynamo 1.6.1's ``event: x-bypass-remote-prefill`` / ``: true`` is one);
a block of comments only (a keep-alive) carries no field and is fine.

The grammars (each returns a list of problems, empty when the stream is well formed; each
includes `framing_problems`):

- `openai_problems` (chat completions, completions): every event has data and no ``event:`` name;
  each data is one JSON object of the API's ``object`` (``chat.completion.chunk`` /
  ``text_completion``) with one ``id``, except the last, which is exactly ``[DONE]``; no error
  object; with ``include_usage`` only the last JSON chunk carries ``usage`` (and no choices),
  without it none does.
- `responses_problems` (``/v1/responses``): each event's name equals its data's ``type``; the
  first is ``response.created``, the last a terminal one (``response.completed``, or
  ``response.incomplete`` / ``response.failed``, which the Responses API ends with when it stops
  early: the simulated model always runs to ``max_output_tokens``), which appears once;
  ``sequence_number`` strictly increases where present.
- `messages_problems` (Anthropic ``/v1/messages``): each event's name equals its data's ``type``;
  the order is ``message_start``, then per content block ``content_block_start``,
  ``content_block_delta``\\*, ``content_block_stop`` (indexes 0, 1, 2, ...; each delta of its
  block's kind), then ``message_delta``\\+, ``message_stop``; ``ping`` anywhere; an ``error`` event
  is a problem.

``allow_done``: Dynamo 1.6.1's frontend ends its Responses and Anthropic streams, too, with an
unnamed ``data: [DONE]``, which neither API defines (both SDKs step over it: openai-python stops at
it, anthropic-python skips unnamed events). With ``allow_done`` one such event after the terminal
event is accepted; without it, it is a problem like any other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_LINE = re.compile(r"\r\n|\r|\n")

RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
OPENAI_OBJECTS = {"chat": "chat.completion.chunk", "completions": "text_completion"}
# The delta types an Anthropic content block of each type takes.
BLOCK_DELTAS = {"text": {"text_delta"}, "tool_use": {"input_json_delta"},
                "thinking": {"thinking_delta", "signature_delta"}, "redacted_thinking": set()}


@dataclass
class Event:
    """One block of the stream (the lines up to a blank line) that carries at least one field."""

    event: str | None = None  # the `event` field as sent (None: none; the type is then "message")
    data: str | None = None  # None: no `data` line at all, so a conforming client drops it
    id: str | None = None
    retry: int | None = None
    comments: list[str] = field(default_factory=list)
    fields: list[tuple[str, str]] = field(default_factory=list)  # every field line, in order

    @property
    def type(self) -> str:
        return self.event or "message"

    @property
    def dispatched(self) -> bool:
        return self.data is not None

    def json(self):
        return json.loads(self.data or "")

    def describe(self) -> str:
        lines = [f"{name}: {value}" for name, value in self.fields] + [f":{c}" for c in self.comments]
        return " / ".join(lines)


@dataclass
class Stream:
    events: list[Event]  # every block with a field, dispatched or not, in order
    keepalives: int  # blocks of comments only
    tail: str  # text after the last blank line (never dispatched)
    problems: list[str]  # what is wrong with the bytes themselves (encoding)

    @property
    def dispatched(self) -> list[Event]:
        """The events a conforming client sees."""
        return [e for e in self.events if e.dispatched]

    def summary(self) -> list[str]:
        """One short line per block, for failure messages."""
        out = []
        for e in self.events:
            data = e.data if e.data is None or len(e.data) <= 60 else e.data[:57] + "..."
            out.append(f"event={e.event!r} data={data!r}" + (f" comments={e.comments}" if e.comments else ""))
        return out


def parse(body: bytes | str) -> Stream:
    problems: list[str] = []
    if isinstance(body, bytes):
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"not UTF-8: {exc}")
            text = body.decode("utf-8", "replace")
    else:
        text = body
    if text.startswith("\ufeff"):
        text = text[1:]
    events: list[Event] = []
    keepalives = 0
    current = Event()
    has_field = has_comment = False
    pieces = _LINE.split(text)
    # The last piece is what follows the last line end: part of a line that never ended.
    lines, rest = pieces[:-1], pieces[-1]
    consumed_to = 0  # index into lines of the first line of the block in progress
    for i, line in enumerate(lines):
        if line == "":
            if has_field:
                events.append(current)
            elif has_comment:
                keepalives += 1
            current, has_field, has_comment = Event(), False, False
            consumed_to = i + 1
            continue
        if line.startswith(":"):
            current.comments.append(line[1:])
            has_comment = True
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        current.fields.append((name, value))
        has_field = True
        if name == "event":
            current.event = value
        elif name == "data":
            current.data = value if current.data is None else f"{current.data}\n{value}"
        elif name == "id":
            if "\0" not in value:
                current.id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                current.retry = int(value)
    tail_lines = lines[consumed_to:] + ([rest] if rest else [])
    return Stream(events, keepalives, "\n".join(tail_lines), problems)


def framing_problems(stream: Stream) -> list[str]:
    """What a client of any API would trip on: events with no data, an unterminated end."""
    problems = list(stream.problems)
    for n, e in enumerate(stream.events):
        if not e.dispatched:
            problems.append(f"event {n} has no data (a conforming client drops it, openai-python "
                            f"fails on it): {e.describe()!r}")
        unknown = [name for name, _ in e.fields if name not in ("event", "data", "id", "retry")]
        if unknown:
            problems.append(f"event {n} has fields no client reads: {unknown}")
    if stream.tail.strip():
        problems.append(f"the stream ends inside an event (never dispatched): {stream.tail[:200]!r}")
    if not stream.events:
        problems.append("no events at all")
    return problems


def _json_object(e: Event, n: int, problems: list[str]) -> dict | None:
    try:
        data = e.json()
    except ValueError:
        problems.append(f"event {n}: data is not JSON: {e.data!r:.200}")
        return None
    if not isinstance(data, dict):
        problems.append(f"event {n}: data is not a JSON object: {e.data!r:.200}")
        return None
    return data


def _split_done(events: list[Event], allow_done: bool, problems: list[str]) -> list[Event]:
    """The events before an accepted trailing unnamed ``[DONE]``."""
    if allow_done and events and events[-1].event is None and events[-1].data == "[DONE]":
        events = events[:-1]
    for n, e in enumerate(events):
        if e.data == "[DONE]":
            problems.append(f"event {n}: a [DONE] this API does not define" +
                            ("" if allow_done else " (allow_done not given)") +
                            (" (not at the end)" if n != len(events) - 1 else ""))
    return events


def openai_problems(stream: Stream, api: str, *, include_usage: bool) -> list[str]:
    """Chat completions (``api="chat"``) or completions (``"completions"``) streams."""
    problems = framing_problems(stream)
    events = stream.dispatched
    named = [(n, e.event) for n, e in enumerate(stream.events) if e.event is not None]
    if named:
        problems.append(f"named events, which the API never sends: {named}")
    if not events or events[-1].data != "[DONE]":
        problems.append("the stream does not end with data: [DONE]")
    body = events[:-1] if events and events[-1].data == "[DONE]" else events
    chunks: list[dict] = []
    for n, e in enumerate(body):
        if e.data == "[DONE]":
            problems.append(f"event {n}: [DONE] before the end")
            continue
        data = _json_object(e, n, problems)
        if data is None:
            continue
        if "error" in data:
            problems.append(f"event {n}: an error: {data['error']!r:.200}")
        if data.get("object") != OPENAI_OBJECTS[api]:
            problems.append(f"event {n}: object {data.get('object')!r}, not {OPENAI_OBJECTS[api]!r}")
        if not isinstance(data.get("choices"), list):
            problems.append(f"event {n}: no choices list")
        chunks.append(data)
    if not chunks:
        problems.append("no JSON chunk")
        return problems
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1:
        problems.append(f"the chunks carry {len(ids)} ids: {sorted(map(str, ids))[:4]}")
    with_usage = [n for n, c in enumerate(chunks) if c.get("usage")]
    if include_usage:
        if with_usage != [len(chunks) - 1]:
            problems.append(f"include_usage: usage in chunks {with_usage} of {len(chunks)}, "
                            "expected in the last only")
        elif chunks[-1].get("choices"):
            problems.append("include_usage: the usage chunk carries choices")
    elif with_usage:
        problems.append(f"usage in chunks {with_usage} without include_usage")
    return problems


def responses_problems(stream: Stream, *, allow_done: bool = False) -> list[str]:
    problems = framing_problems(stream)
    events = _split_done(stream.dispatched, allow_done, problems)
    datas: list[dict] = []
    for n, e in enumerate(events):
        if e.data == "[DONE]":
            continue
        data = _json_object(e, n, problems)
        if data is None:
            continue
        if e.event is None:
            problems.append(f"event {n}: unnamed (its data's type is {data.get('type')!r})")
        elif e.event != data.get("type"):
            problems.append(f"event {n}: named {e.event!r}, its data's type is {data.get('type')!r}")
        datas.append(data)
    types = [d.get("type") for d in datas]
    if not types or types[0] != "response.created":
        problems.append(f"does not start with response.created: {types[:3]}")
    if not types or types[-1] not in RESPONSES_TERMINAL:
        problems.append(f"does not end with a terminal event {RESPONSES_TERMINAL}: {types[-3:]}")
    terminals = [t for t in types if t in RESPONSES_TERMINAL]
    if len(terminals) > 1:
        problems.append(f"{len(terminals)} terminal events: {terminals}")
    if "error" in types:
        problems.append("an error event")
    numbers = [d["sequence_number"] for d in datas if "sequence_number" in d]
    if any(b <= a for a, b in zip(numbers, numbers[1:], strict=False)):
        problems.append(f"sequence_number does not increase: {numbers}")
    if types and types[0] == "response.created" and types[-1] in RESPONSES_TERMINAL:
        first, last = datas[0].get("response") or {}, datas[-1].get("response") or {}
        if first.get("id") != last.get("id"):
            problems.append(f"response id {first.get('id')!r} at the start, {last.get('id')!r} at the end")
    return problems


def messages_problems(stream: Stream, *, allow_done: bool = False) -> list[str]:
    problems = framing_problems(stream)
    events = _split_done(stream.dispatched, allow_done, problems)
    state = "start"  # start -> blocks <-> in_block; blocks -> delta -> stopped
    next_index, block_type = 0, None
    for n, e in enumerate(events):
        if e.data == "[DONE]":
            continue
        data = _json_object(e, n, problems)
        if data is None:
            continue
        kind = data.get("type")
        if e.event != kind:
            problems.append(f"event {n}: named {e.event!r}, its data's type is {kind!r}")
        if kind == "ping":
            continue
        if kind == "error":
            problems.append(f"event {n}: an error: {data.get('error')!r:.200}")
            continue
        index = data.get("index")
        if state == "start" and kind == "message_start":
            state = "blocks"
        elif state == "blocks" and kind == "content_block_start":
            block_type = (data.get("content_block") or {}).get("type")
            if index != next_index:
                problems.append(f"event {n}: content_block_start index {index}, expected {next_index}")
            if block_type not in BLOCK_DELTAS:
                problems.append(f"event {n}: a content block of type {block_type!r}")
            state = "in_block"
        elif state == "in_block" and kind == "content_block_delta":
            delta_type = (data.get("delta") or {}).get("type")
            if index != next_index:
                problems.append(f"event {n}: content_block_delta index {index} in block {next_index}")
            if delta_type not in BLOCK_DELTAS.get(block_type or "", set()):
                problems.append(f"event {n}: a {delta_type!r} in a {block_type!r} block")
        elif state == "in_block" and kind == "content_block_stop":
            if index != next_index:
                problems.append(f"event {n}: content_block_stop index {index} in block {next_index}")
            next_index += 1
            state = "blocks"
        elif state in ("blocks", "delta") and kind == "message_delta":
            state = "delta"
        elif state == "delta" and kind == "message_stop":
            state = "stopped"
        else:
            problems.append(f"event {n}: {kind!r} where {state!r} expects "
                            + {"start": "message_start", "blocks": "content_block_start or message_delta",
                               "in_block": "content_block_delta or content_block_stop",
                               "delta": "message_delta or message_stop",
                               "stopped": "nothing more"}[state])
    if state != "stopped":
        problems.append(f"the stream stops in state {state!r}, before message_stop")
    return problems


# -- what the grammars leave to the tests: the text a stream carries --------------------------

def openai_text(stream: Stream, api: str) -> str:
    out = []
    for e in stream.dispatched:
        if e.data == "[DONE]":
            continue
        try:
            data = e.json()
        except ValueError:
            continue
        for choice in data.get("choices") or []:
            out.append((choice.get("delta") or {}).get("content") or "" if api == "chat"
                       else choice.get("text") or "")
    return "".join(out)


def responses_text(stream: Stream) -> str:
    return "".join(e.json().get("delta", "") for e in stream.dispatched
                   if e.event == "response.output_text.delta")


def messages_text(stream: Stream) -> str:
    return "".join((e.json().get("delta") or {}).get("text", "") for e in stream.dispatched
                   if e.event == "content_block_delta")
