"""Server-sent events a client cannot parse, taken out of a stream as it is relayed.

Dynamo 1.6.1's frontend opens the stream of every request its conditional disaggregation sends
straight to a decode worker with an event that has a name and a comment but no ``data`` line::

    event: x-bypass-remote-prefill
    : true

(``lib/llm/src/kv_router/prefill_router.rs``: ``Annotated::from_annotation(BYPASS_REMOTE_PREFILL_
ANNOTATION, &true)`` chained before the decode stream; ``lib/llm/src/http/service/openai.rs``
``EventConverter`` writes an annotation's ``event`` and ``comment`` and no data). PPD's decode-local
follow-ups are exactly those requests. openai-python (3.57.0 to 3.63.0 at least) parses every event's
data as JSON and raises ``JSONDecodeError`` on it (openai-python #2722). A migrated answer goes
through that stage again, so such an event may also come in the middle of a stream.

By the SSE specification (WHATWG HTML, "event stream interpretation": *if the data buffer is an
empty string, set the data buffer and the event type buffer to the empty string and return*), an
event without data is never dispatched. Dropping it therefore changes nothing a conforming client
sees, and spares every client that is not. Comment-only blocks (keep-alives) carry no field and
are kept: clients skip them already.

`DatalessEventFilter` is incremental and pure (bytes in, bytes out): a piece that ends on an
event boundary and holds no field line without data passes through untouched, without parsing.
"""

from __future__ import annotations

import re

# An event ends at a blank line; the spec allows CRLF, LF or CR line ends.
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
# Field lines that make an event a dispatch candidate without data (`event:`, `id:`, `retry:`).
_NON_DATA_FIELD = re.compile(rb"(?:^|[\r\n])(?:event|id|retry)(?::|[\r\n]|$)")
_FIELD_NAMES = (b"event", b"id", b"retry")
_FIELD_STARTS = tuple(end + name for end in (b"\n", b"\r") for name in _FIELD_NAMES)


def _may_name_a_field(piece: bytes) -> bool:
    """A quick superset of `_NON_DATA_FIELD.search` (a few ``in`` tests, no regex): whether a line
    of ``piece`` may start with a field other than data."""
    return (piece.startswith(_FIELD_NAMES) or b"\nevent" in piece or b"\nid" in piece
            or b"\nretry" in piece or (b"\r" in piece and any(start in piece for start in _FIELD_STARTS)))


def _has_data(event: bytes) -> bool:
    for line in event.splitlines():
        if line == b"data" or line.startswith(b"data:"):
            return True
    return False


class DatalessEventFilter:
    """Feed the body's pieces in order (`feed`), then `end`; the concatenated outputs are the body
    less its events that have a field but no data. ``dropped`` counts those events."""

    def __init__(self) -> None:
        self._pending = b""  # the start of an event whose end has not arrived yet
        self.dropped = 0

    def feed(self, piece: bytes) -> bytes:
        if not self._pending and piece.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")) \
                and not _may_name_a_field(piece):
            return piece  # whole events, none named without data: the usual case, not parsed
        data = self._pending + piece
        out = []
        start = 0
        for match in _BOUNDARY.finditer(data):
            event = data[start:match.end()]
            start = match.end()
            if _NON_DATA_FIELD.search(event) and not _has_data(event):
                self.dropped += 1
                continue
            out.append(event)
        self._pending = data[start:]
        return b"".join(out)

    def end(self) -> bytes:
        """What is left at the end of the body (an unterminated last event is never dispatched by
        a conforming client; it is passed on as it came, so a client sees what the server sent)."""
        rest, self._pending = self._pending, b""
        return rest


def is_event_stream(headers: list[tuple[str, str]]) -> bool:
    """Whether a response's (lower-cased) headers say its body is an event stream."""
    return any(name == "content-type" and value.split(";", 1)[0].strip().lower() == "text/event-stream"
               for name, value in headers)
