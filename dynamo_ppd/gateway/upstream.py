"""Forwarding to the upstream: HTTP/1.1 keep-alive connections pooled per endpoint (``ip:port``),
one request at a time on each, and the response relayed to the client as it arrives (`http`).

A pooled connection the upstream closed while idle shows up only when it is used; a request that
fails on a reused connection before any response byte came back is sent once more on a fresh
connection (what a client cannot tell from a connection that was new). An upstream that cannot be
reached, or fails before answering, gets the client a 502 with an OpenAI-style JSON error.

The status the client gets is told to ``on_response`` as soon as it is known, before any of the
body goes out: the upstream's status line and headers, or the gateway's own 502 (the ext_proc
response phase, `extproc.ResponsePhase`). Or it is asked of ``ask``, awaited before the response
goes on (the response phase in the ordinary mode, with mode overrides allowed), whose answer may
be a tap for the body: each piece of it is awaited there before it goes to the client.

An event stream loses its events without data on the way (`sse`: Dynamo's bypass annotation,
which no conforming client dispatches and openai-python fails on)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..apis import api_of
from ..sse import DatalessEventFilter, is_event_stream
from .args import parse_endpoint
from .http import (
    MAX_HEAD_BYTES,
    Headers,
    client_response_head,
    encode_request,
    read_response_head,
    relay_body,
    simple_response,
)

log = logging.getLogger("dynamo_ppd.gateway")

# Told the response's status, headers and whether no body follows; must not block.
OnResponse = Callable[[int, Headers, bool], None]
# Each piece of the body and whether it is the last; awaited before it goes on; never raises.
BodyTap = Callable[[bytes, bool], Awaitable[None]]
# Asked with the response's status, headers and whether no body follows, before the response goes
# on; answers with a tap for the body, or None; never raises.
AskResponse = Callable[[int, Headers, bool], Awaitable[BodyTap | None]]
BAD_GATEWAY_HEADERS: Headers = [("content-type", "application/json")]


@dataclass
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


def bad_gateway(message: str, close: bool, target: str = "") -> bytes:
    """The gateway's own 502, in the shape of the request's API (`apis`)."""
    return simple_response(502, BAD_GATEWAY_HEADERS, api_of(target).error_body(502, message), close)


def _tell(on_response: OnResponse | None, status: int, headers: Headers, end_of_stream: bool) -> None:
    """Tell ``on_response`` the status; a failure there is logged, never the client's problem."""
    if on_response is None:
        return
    try:
        on_response(status, headers, end_of_stream)
    except Exception as exc:  # noqa: BLE001 (observing the response must not break it)
        log.debug("response status not reported: %s", str(exc) or type(exc).__name__)


class UpstreamPool:
    def __init__(self, connect_timeout_s: float = 5.0, max_idle: int = 256,
                 on_events_dropped: Callable[[int], None] | None = None):
        self.on_events_dropped = on_events_dropped  # told how many events a stream lost (`sse`)
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[str, list[Connection]] = defaultdict(list)

    def _take_idle(self, endpoint: str) -> Connection | None:
        idle = self._idle[endpoint]
        while idle:
            conn = idle.pop()  # most recently used first: the least likely to have timed out
            if conn.usable:
                return conn
            conn.close()
        return None

    def _give_back(self, endpoint: str, conn: Connection) -> None:
        if conn.usable and len(self._idle[endpoint]) < self.max_idle:
            self._idle[endpoint].append(conn)
        else:
            conn.close()

    async def _connect(self, endpoint: str) -> Connection:
        host, port = parse_endpoint(endpoint)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES),
                                                self.connect_timeout_s)
        return Connection(reader, writer)

    async def forward(self, endpoint: str, method: str, target: str, headers: Headers, body: bytes,
                      client: asyncio.StreamWriter, close_client: bool,
                      on_response: OnResponse | None = None,
                      ask: AskResponse | None = None) -> tuple[str, bool]:
        """Send the request to ``endpoint`` and relay its response to ``client``. Returns the
        outcome (``ok``, ``bad_gateway``, ``client_gone``) and whether the client connection stays
        open. ``on_response`` learns the status first, or ``ask`` is asked it (module doc)."""
        payload = encode_request(method, target, headers, body)
        while True:
            conn = self._take_idle(endpoint)
            reused = conn is not None
            if conn is None:
                try:
                    conn = await self._connect(endpoint)
                except (OSError, ValueError, asyncio.TimeoutError) as exc:
                    reason = f"upstream {endpoint} unreachable: {str(exc) or type(exc).__name__}"
                    return await self._fail(client, reason, close_client, on_response, ask, target)
            try:
                conn.writer.write(payload)
                await conn.writer.drain()
                head = await read_response_head(conn.reader)
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                conn.close()
                if reused:
                    continue  # the idle connection was dead: the upstream never saw the request
                reason = str(exc) or type(exc).__name__
                return await self._fail(client, f"upstream {endpoint} failed: {reason}", close_client,
                                        on_response, ask, target)

        framing = head.body_framing(method)
        _tell(on_response, head.status, head.headers, framing == "none")
        tap = await ask(head.status, head.headers, framing == "none") if ask is not None else None
        keep_client = not close_client and framing != "close"
        try:
            client.write(client_response_head(head, close=not keep_client))
            await client.drain()
            events = DatalessEventFilter() if is_event_stream(head.headers) else None
            try:
                await relay_body(framing, head, conn.reader, client, tap, events)
            finally:
                if events is not None and events.dropped and self.on_events_dropped is not None:
                    self.on_events_dropped(events.dropped)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            conn.close()
            if client.is_closing():
                return "client_gone", False
            log.warning("upstream %s broke off its answer: %s", endpoint, str(exc) or type(exc).__name__)
            return "bad_gateway", False  # the answer is cut: closing tells the client so
        except asyncio.CancelledError:
            conn.close()
            raise
        if head.close or framing == "close":
            conn.close()
        else:
            self._give_back(endpoint, conn)
        return "ok", keep_client

    async def _fail(self, client: asyncio.StreamWriter, message: str, close_client: bool,
                    on_response: OnResponse | None = None,
                    ask: AskResponse | None = None, target: str = "") -> tuple[str, bool]:
        log.warning("%s", message)
        _tell(on_response, 502, BAD_GATEWAY_HEADERS, False)
        if ask is not None:
            await ask(502, BAD_GATEWAY_HEADERS, False)  # its body, the gateway's own, is not sent
        try:
            client.write(bad_gateway(message, close_client, target))
            await client.drain()
        except OSError:
            return "client_gone", False
        return "bad_gateway", not close_client

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
