"""What the endpoint picker learns from an answer it routed: the follow-up's TTFT and TPOT, taken
from the response body the gateway streams through it, for the policy's online correction
(`routing.state.Routing.observe_outcome`, the same call the relay router makes for every answer
it relays).

The picker sees an answer only through ext_proc. When the response headers of a routed request
come in (`Picker.watch`), it decides whether to watch this answer: a follow-up the policy learns
from (`Routing.learns_from`), answered 200 as a stream (``text/event-stream``; a non-streamed
answer arrives whole at its end, so its TTFT is unknown: not watched), and drawn with
probability ``--observe-share``. It answers those headers with ``mode_override``
``response_body_mode: STREAMED`` (the others with NONE), so a gateway that allows mode overrides
sends this answer's body and no other's: a gRPC message in and one out per chunk, some 200 us of
the picker's CPU per token watched (`DEFAULT_OBSERVE_SHARE`), hence the small default share.
A gateway that streams every body through the picker anyway (GAIE's: FULL_DUPLEX_STREAMED, where
Envoy ignores overrides) has every follow-up watched: the picker echoes those chunks whatever it
does, and reading one by its bytes costs ~2 us (a 250-byte chunk, `AnswerWatch.chunk`).

`AnswerWatch` reads each chunk by its bytes only, never as JSON: TTFT is from the pick (the route
going out) to the first chunk carrying a token (``"content":"x``, ``"text":"x``, ``"delta":"x``: a
non-empty string, in any of the four APIs' streams); TPOT is from that chunk to the last one
carrying a token, over the completion tokens less one. Those come from the stream's usage (the last
chunk holding ``"usage":{``, parsed once at the end; Dynamo's frontend sends it last when a chat
client asks for ``stream_options.include_usage``, and always on the agent APIs), else they are the
SSE events counted in the chunks that carried tokens. An answer that ends
without its end of stream (cut, cancelled) teaches nothing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..routing.state import Routing, Turn

# The share of the follow-ups' answers watched (`Picker.watch`, ``--observe-share``). Each watched
# answer costs the picker a gRPC message in and out per chunk: on this 2-core VM, the syn-a load of
# `python -m dynamo_ppd.bench.relay` (2 conv/s, 80% of the tokens in follow-ups) cost the picker
# 245 and 273 us of CPU per answer token with every follow-up watched against 73 and 77 with none
# (~230 us per watched token), so 0.01 adds ~2 us a token, within the runs' noise.
DEFAULT_OBSERVE_SHARE = 0.01
# A token's text in a chunk, a non-empty JSON string: chat completions' delta content
# (reasoning_content too), completions' text, the Anthropic API's text_delta ``"text"``, the
# Responses API's ``response.output_text.delta`` ``"delta"``.
TOKEN = re.compile(rb'(?:content|text|delta)":"[^"]')
USAGE = b'"usage":{'
EVENT = b"data:"


def completion_tokens(chunk: bytes) -> int | None:
    """The completion tokens of the SSE event in ``chunk`` that carries a usage object: chat's
    ``usage.completion_tokens``, the Anthropic API's ``usage.output_tokens`` (``message_delta``),
    the Responses API's ``response.usage.output_tokens`` (``response.completed``)."""
    for line in chunk.split(b"\n"):
        if USAGE in line and line.startswith(EVENT):
            try:
                event = json.loads(line[len(EVENT):])
                usage = event.get("usage") or (event.get("response") or {}).get("usage") or {}
            except (ValueError, AttributeError):
                return None
            tokens = (usage.get("completion_tokens", usage.get("output_tokens"))
                      if isinstance(usage, dict) else None)
            return tokens if isinstance(tokens, int) and tokens >= 0 else None
    return None


class AnswerWatch:
    """One watched answer (see the module docstring): `chunk` per response body piece, in order;
    the last one (``end_of_stream``) hands TTFT and TPOT to ``routing.observe_outcome``."""

    __slots__ = ("routing", "turn", "picked_at", "clock", "first_at", "last_at", "events", "usage",
                 "done")

    def __init__(self, routing: Routing, turn: Turn, picked_at: float,
                 clock: Callable[[], float] = time.monotonic):
        self.routing = routing
        self.turn = turn
        self.picked_at = picked_at  # when the route went out (the clock's time)
        self.clock = clock
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.events = 0  # SSE events in the chunks that carried tokens (tokens, without a usage)
        self.usage: bytes | None = None  # the chunk carrying the usage
        self.done = False

    def chunk(self, body: bytes, end_of_stream: bool) -> None:
        if self.done:
            return
        if body:
            if TOKEN.search(body) is not None:
                now = self.clock()
                if self.first_at is None:
                    self.first_at = now
                self.last_at = now
                self.events += body.count(EVENT)
            if USAGE in body:
                self.usage = body
        if end_of_stream:
            self.finish()

    def finish(self) -> None:
        """The answer is whole: tell the routing state what it took (nothing if no token came)."""
        self.done = True
        if self.first_at is None or self.last_at is None:
            return
        tokens = completion_tokens(self.usage) if self.usage is not None else None
        if tokens is None:
            tokens = self.events
        tpot = (self.last_at - self.first_at) / (tokens - 1) if tokens > 1 else None
        self.routing.observe_outcome(self.turn, self.first_at - self.picked_at, tpot)
