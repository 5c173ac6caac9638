"""HTTP/1.1 framing for the gateway, on asyncio streams: read a client's request (head, then a
body framed by Content-Length or chunked transfer coding), write a request upstream, and relay an
upstream response to the client as its bytes arrive, never parsing it past the framing.

Header names are lower-cased on the way in, as Envoy's HTTP/1 codec does, and header values are
kept as latin-1 text so any byte survives the round trip unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

from ..sse import DatalessEventFilter

Headers = list[tuple[str, str]]  # (lower-cased name, value), in order, repeats allowed

MAX_HEAD_BYTES = 64 << 10
RELAY_CHUNK = 64 << 10
# Connection-specific headers: they describe one hop and are never relayed (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                        "upgrade", "trailer", "expect"})
_RESPONSE_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})


class HttpError(Exception):
    """A request the gateway refuses, with the status it answers."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class RequestHead:
    method: str
    target: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: Headers
    chunked: bool = False
    content_length: int | None = None

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for v in values(self.headers, "connection") for t in v.split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    @property
    def expects_continue(self) -> bool:
        return any(v.strip().lower() == "100-continue" for v in values(self.headers, "expect"))


@dataclass
class ResponseHead:
    status: int
    reason: str
    headers: Headers
    chunked: bool = False
    content_length: int | None = None
    close: bool = False  # the upstream closes the connection after this response

    def body_framing(self, method: str) -> str:
        """How the body ends: none, length, chunked or close (RFC 9112 6.3)."""
        if method == "HEAD" or self.status in (204, 304) or 100 <= self.status < 200:
            return "none"
        if self.chunked:
            return "chunked"
        if self.content_length is not None:
            return "length" if self.content_length else "none"
        return "close"


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def values(headers: Headers, name: str) -> list[str]:
    return [v for k, v in headers if k == name]


def first(headers: Headers, name: str) -> str | None:
    for k, v in headers:
        if k == name:
            return v
    return None


def _parse_headers(lines: list[bytes]) -> Headers:
    out: Headers = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete header line folding is not accepted")
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, f"malformed header line {line[:80]!r}")
        out.append((name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")))
    return out


def _framing(headers: Headers) -> tuple[bool, int | None]:
    """(chunked, content length) from the headers; chunked wins over a Content-Length."""
    codings = [t.strip().lower() for v in values(headers, "transfer-encoding") for t in v.split(",")]
    codings = [c for c in codings if c]
    if codings:
        if codings[-1] != "chunked":
            raise HttpError(400, f"transfer coding {codings[-1]!r} is not supported; send chunked")
        return True, None
    lengths = {v.strip() for v in values(headers, "content-length")}
    if not lengths:
        return False, None
    if len(lengths) > 1 or not next(iter(lengths)).isdigit():
        raise HttpError(400, f"bad Content-Length {sorted(lengths)}")
    return False, int(next(iter(lengths)))


async def _read_head(reader: asyncio.StreamReader) -> list[bytes] | None:
    """The head's lines (start line first), None on a clean end of stream before any byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise HttpError(400, "connection closed inside the message head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(431, "message head too large") from None
    # A client may send stray CRLFs between requests (RFC 9112 2.2): skip them.
    lines = raw.lstrip(b"\r\n").split(b"\r\n")[:-2]
    return lines or None


async def read_request_head(reader: asyncio.StreamReader) -> RequestHead | None:
    """The next request's head from a client connection; None when the client closed it between
    requests. Raises HttpError on a malformed head."""
    lines = await _read_head(reader)
    if lines is None:
        return None
    parts = lines[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(505, f"{version} is not supported")
    headers = _parse_headers(lines[1:])
    chunked, length = _framing(headers)
    return RequestHead(method, target, version, headers, chunked, length)


async def read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    """A chunked body, decoded (trailers are read and dropped)."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(400, f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailer fields: the gateway does not forward request trailers
            return b"".join(parts)
        total += size
        if total > limit:
            raise HttpError(413, f"request body over {limit} bytes")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError(400, "chunk not followed by CRLF")


async def read_body(reader: asyncio.StreamReader, head: RequestHead, limit: int) -> bytes:
    """The request's body, whole (the gateway, like the EPP, needs all of it to decide)."""
    try:
        if head.chunked:
            return await read_chunked(reader, limit)
        if head.content_length:
            if head.content_length > limit:
                raise HttpError(413, f"request body of {head.content_length} bytes is over {limit}")
            return await reader.readexactly(head.content_length)
    except asyncio.IncompleteReadError:
        raise HttpError(400, "connection closed inside the request body") from None
    except asyncio.LimitOverrunError:
        raise HttpError(400, "chunk size line too long") from None
    return b""


def encode_head(start_line: str, headers: Headers) -> bytes:
    lines = [start_line, *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def encode_request(method: str, target: str, headers: Headers, body: bytes) -> bytes:
    """An HTTP/1.1 request upstream: ``headers`` minus hop-by-hop fields and any length, then a
    Content-Length for the body (the body may have been replaced; never chunked upstream)."""
    out = [(k, v) for k, v in headers if k not in HOP_BY_HOP and k != "content-length"]
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS", "TRACE"):
        out.append(("content-length", str(len(body))))
    return encode_head(f"{method} {target} HTTP/1.1", out) + body


async def read_response_head(reader: asyncio.StreamReader) -> ResponseHead:
    """The upstream's final response head (interim 1xx responses other than 101 are skipped).
    Raises ConnectionError when the upstream closed before a whole head arrived."""
    while True:
        try:
            lines = await _read_head(reader)
        except HttpError as exc:
            raise ConnectionError(f"bad response head from upstream: {exc}") from None
        if lines is None:
            raise ConnectionError("upstream closed the connection before answering")
        parts = lines[0].decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ConnectionError(f"malformed status line from upstream {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200 and status != 101:
            continue
        try:
            headers = _parse_headers(lines[1:])
            chunked, length = _framing(headers)
        except HttpError as exc:
            raise ConnectionError(f"bad response head from upstream: {exc}") from None
        tokens = {t.strip().lower() for v in values(headers, "connection") for t in v.split(",")}
        close = "close" in tokens or (parts[0] == "HTTP/1.0" and "keep-alive" not in tokens)
        return ResponseHead(status, parts[2] if len(parts) > 2 else "", headers, chunked, length, close)


def client_response_head(head: ResponseHead, close: bool) -> bytes:
    """The head relayed to the client: the upstream's status and headers minus this hop's
    connection fields; Transfer-Encoding and Content-Length kept, since the body goes out framed
    exactly as it came in."""
    drop = _RESPONSE_HOP | ({"content-length"} if head.chunked else set())  # chunked wins (RFC 9112 6.3)
    keep = {"transfer-encoding"} if head.chunked else set()
    headers = [(k, v) for k, v in head.headers if k not in drop or k in keep]
    headers.append(("connection", "close" if close else "keep-alive"))
    return encode_head(f"HTTP/1.1 {head.status} {head.reason or reason_phrase(head.status)}", headers)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


async def relay_body(framing: str, head: ResponseHead, upstream: asyncio.StreamReader,
                     client: asyncio.StreamWriter,
                     tap: Callable[[bytes, bool], Awaitable[None]] | None = None,
                     events: DatalessEventFilter | None = None) -> None:
    """Copy the response body from the upstream to the client as it arrives: each chunk of a
    chunked body is written (as-is, size line included) and flushed as soon as it is whole, so an
    SSE event reaches the client when the upstream sends it. Raises IncompleteReadError when the
    upstream ends early and ConnectionError when the client goes away. ``tap``: awaited with each
    piece of the body's content (a chunk's data without its framing) and whether it is the last
    (an empty last piece when the end carries no data), before the piece goes to the client.
    ``events``: an event stream's filter (`sse.DatalessEventFilter`); a chunked body is then
    re-chunked around what it keeps (a length-framed body is relayed as it is)."""
    if framing == "length":
        remaining = head.content_length or 0
        while remaining:
            data = await upstream.read(min(remaining, RELAY_CHUNK))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            if tap is not None:
                await tap(data, not remaining)
            client.write(data)
            await client.drain()
    elif framing == "chunked":
        while True:
            line = await upstream.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ConnectionError(f"bad chunk size line from upstream {line[:40]!r}") from None
            if size == 0:
                trailer = [line]
                while (field_line := await upstream.readuntil(b"\r\n")) != b"\r\n":
                    trailer.append(field_line)
                trailer.append(b"\r\n")
                if tap is not None:
                    await tap(b"", True)
                if events is not None:
                    client.write(_chunk(events.end()))
                client.write(b"".join(trailer))
                await client.drain()
                return
            chunk = await upstream.readexactly(size + 2)
            if tap is not None:
                await tap(chunk[:-2], False)
            client.write(line + chunk if events is None else _chunk(events.feed(chunk[:-2])))
            await client.drain()
    elif framing == "close":
        while data := await upstream.read(RELAY_CHUNK):
            if tap is not None:
                await tap(data, False)
            client.write(data if events is None else events.feed(data))
            await client.drain()
        if tap is not None:
            await tap(b"", True)
        if events is not None:
            client.write(events.end())
            await client.drain()


def simple_response(status: int, headers: Headers, body: bytes, close: bool) -> bytes:
    """A whole response the gateway makes itself (errors, a picker's immediate response)."""
    out = [(k, v) for k, v in headers if k not in HOP_BY_HOP and k != "content-length"]
    out += [("content-length", str(len(body))), ("connection", "close" if close else "keep-alive")]
    return encode_head(f"HTTP/1.1 {status} {reason_phrase(status)}", out) + body
