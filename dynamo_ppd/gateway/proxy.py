"""The gateway server: an asyncio HTTP/1.1 server that, per request, makes the ext_proc callout
(when pickers are configured), applies what the picker said, and forwards the request to the
endpoint it picked (`upstream`), relaying the answer back as it streams.

Per request, as an Envoy Gateway with the Inference Extension's ext_proc filter does it:

1. Read the request (head, then the whole body; Envoy answers ``Expect: 100-continue`` itself,
   so does this gateway) and build Envoy's header map (`headers.envoy_headers`).
2. With pickers: `extproc.PickerPool.callout`. An immediate response goes to the client and
   nothing is forwarded; no picker answering means fail open: the request goes unchanged to
   --upstream (GAIE ``failureMode: FailOpen``). Without pickers: no callout at all.
3. The destination: ``x-gateway-destination-endpoint`` after mutation, else the ``envoy.lb``
   dynamic metadata, else --upstream (`headers.destination`).
4. Forward with a Content-Length for the (maybe replaced) body; relay the answer. A routed
   request's ext_proc stream is still open (unless --no-response-headers): the answer's status
   and headers go to the picker as they arrive, not waited for (`extproc.ResponsePhase`), and
   the stream is closed however the forwarding ends. With --allow-mode-override they are waited
   for, and the body goes through the picker when its answer asks for it (a mode override).

Client connections are kept alive between requests (HTTP/1.1 rules). `Gateway` is the in-process
API (`start`/`stop`/`port`); `serve` runs one until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from contextlib import suppress

from ..apis import OTHER, api_of
from .args import GatewayConfig
from .extproc import PickerPool, ResponsePhase
from .headers import destination, envoy_headers, upstream_request_parts
from .http import (
    MAX_HEAD_BYTES,
    Headers,
    HttpError,
    RequestHead,
    read_body,
    read_request_head,
    simple_response,
)
from .metrics import GatewayMetrics
from .upstream import AskResponse, BodyTap, UpstreamPool

log = logging.getLogger("dynamo_ppd.gateway")


class Gateway:
    """One gateway: `await start()` binds the port (config.port 0: any free one, see `port`),
    `await stop()` closes it, cuts the connections and releases the pickers' channels."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.config = config.validate()
        self.metrics = metrics or GatewayMetrics()
        self.pickers = (PickerPool(config.pickers, config.body_mode, config.picker_timeout_s,
                                   config.picker_retry_after_s, response_headers=config.response_headers,
                                   eject_after=config.picker_eject_after, on_failure=self._picker_failed)
                        if config.pickers else None)
        self.upstreams = UpstreamPool(config.upstream_connect_timeout_s, config.max_idle_per_upstream,
                                      on_events_dropped=self.metrics.sse_events_dropped.inc)
        self.metrics_port: int | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._port: int | None = None
        self.accepted = 0  # client connections accepted so far (keep-alive shows as fewer)

    @property
    def port(self) -> int:
        """The port it listens on (the one picked when config.port is 0); kept after stop."""
        if self._port is None:
            raise RuntimeError("the gateway is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def describe(self) -> str:
        pickers = ",".join(self.config.pickers) if self.config.pickers else "none (pass-through)"
        response = ", response headers" if self.config.pickers and self.config.response_headers else ""
        if response and self.config.allow_mode_override:
            response += " (mode override allowed)"
        text = (f"gateway on {self.url} -> upstream {self.config.upstream}, picker {pickers} "
                f"(mode {self.config.body_mode}{response}, timeout {self.config.picker_timeout_ms:g} ms)")
        if self.metrics_port is not None:
            text += f", metrics on :{self.metrics_port}"
        return text

    async def start(self) -> None:
        """Bind and serve; OSError naming the flag when a port cannot be had."""
        host = self.config.host
        try:
            self._server = await asyncio.start_server(self._serve_client, host, self.config.port,
                                                      limit=MAX_HEAD_BYTES, backlog=1024)
        except OSError as exc:
            raise OSError(f"--port: cannot listen on {host}:{self.config.port}: {exc.strerror}") from exc
        self._port = int(self._server.sockets[0].getsockname()[1])
        if self.config.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(self.config.metrics_port, host)
            except OSError as exc:
                raise OSError(f"--metrics-port: cannot listen on {host}:{self.config.metrics_port}: "
                              f"{exc.strerror}") from exc

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self.upstreams.close()
        if self.pickers is not None:
            await self.pickers.close()
        self.metrics.stop()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # the gateway is stopping
        except Exception:  # a bug must cost one connection, not the gateway
            log.exception("connection handler failed")
        finally:
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve the connection's next request; True when the connection stays open for another."""
        head: RequestHead | None = None
        try:
            head = await read_request_head(reader)
            if head is None:
                return False
            if head.expects_continue and head.has_body:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await read_body(reader, head, self.config.max_body_bytes)
        except HttpError as exc:
            # The stream's framing may be lost after a bad request: answer and close.
            self.metrics.requests.labels("bad_request").inc()
            api = api_of(head.target) if head is not None else OTHER  # the error in its API's shape
            writer.write(simple_response(exc.status, [("content-type", "application/json")],
                                         api.error_body(exc.status, str(exc)), close=True))
            with suppress(OSError):
                await writer.drain()
            return False
        outcome, keep = await self.handle(head, body, writer)
        self.metrics.requests.labels(outcome).inc()
        return keep

    async def handle(self, head: RequestHead, body: bytes, client: asyncio.StreamWriter) -> tuple[str, bool]:
        """Callout, then forward (module doc); the outcome and whether the client stays."""
        close = not head.keep_alive
        headers = envoy_headers(head, str(uuid.uuid4()))
        outcome, endpoint = "passthrough", self.config.upstream
        response: ResponsePhase | None = None
        if self.pickers is not None:
            result = await self.pickers.callout(headers, body)
            if result is None:
                outcome = "fail_open"
                self.metrics.fail_open.inc()
            else:
                self.metrics.picker_callout_seconds.observe(result.seconds)
                if result.immediate is not None:
                    reply = result.immediate
                    self.metrics.immediate_responses.labels(str(reply.status)).inc()
                    client.write(simple_response(reply.status, reply.headers, reply.body, close))
                    try:
                        await client.drain()
                    except OSError:
                        return "client_gone", False
                    return "immediate", not close
                outcome, headers, body = "routed", result.headers, result.body
                endpoint = destination(headers, result.metadata) or self.config.upstream
                response = result.response
        ask: AskResponse | None = None
        if response is not None and self.config.allow_mode_override:
            ask = self._asking(response)
        try:
            method, target, upstream_headers = upstream_request_parts(headers)
            forwarded, keep = await self.upstreams.forward(
                endpoint, method, target, upstream_headers, body, client, close,
                on_response=response.report if response is not None and ask is None else None, ask=ask)
        finally:
            if response is not None:
                response.close()  # no status came (cancelled, an error): close the stream anyway
        if forwarded == "bad_gateway":
            self.metrics.upstream_errors.inc()
        return (outcome if forwarded == "ok" else forwarded), keep


    def _picker_failed(self, ejected: bool) -> None:
        self.metrics.picker_failures.inc()
        if ejected:
            self.metrics.picker_ejections.inc()

    def _asking(self, response: ResponsePhase) -> AskResponse:
        """`ResponsePhase.ask`, counting the bodies the picker asks for."""
        async def ask(status: int, headers: Headers, end_of_stream: bool) -> BodyTap | None:
            tap = await response.ask(status, headers, end_of_stream)
            if tap is not None:
                self.metrics.response_bodies.inc()
            return tap
        return ask


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None) -> None:
    """Run a gateway until ``stop`` is set or the process gets SIGTERM or SIGINT."""
    gateway = Gateway(config)
    try:
        await gateway.start()
    except BaseException:
        await gateway.stop()  # e.g. the metrics port was taken after the HTTP port was bound
        raise
    log.info("%s", gateway.describe())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await gateway.stop()
        log.info("gateway stopped")
