"""Command line and typed config of the local gateway (`python -m dynamo_ppd.gateway`).

`GatewayConfig` is what the gateway runs on; it has working defaults and checks itself
(`validate()`), so tests and benchmarks build one directly and only the command line goes through
`parse_args`. A bad flag ends the process with exit code 2 and one line on stderr that says what
is wrong and how to fix it (argparse's usage block is left out: it hides the one line that
matters)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import NoReturn

BODY_MODES = ("full-duplex", "buffered")
PROG = "python -m dynamo_ppd.gateway"


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError with a readable reason otherwise. IPv6 hosts are
    written in brackets (``[::1]:8001``), as in a URL."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:8001)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"{text!r}: port {number} is outside 1-65535")
    return host, number


@dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens, where it forwards, and which endpoint pickers it asks."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests read `Gateway.port` after start)
    upstream: str = "127.0.0.1:8001"  # the default destination (Dynamo's OpenAI frontend)
    pickers: tuple[str, ...] = ()  # ext_proc servers (EPPs); empty: pure pass-through
    picker_timeout_ms: float = 1000.0  # per awaited ext_proc message, as Envoy's message_timeout
    body_mode: str = "full-duplex"  # the request body's ext_proc mode: full-duplex or buffered
    metrics_port: int | None = None  # Prometheus /metrics on this port when set
    # Tell the picker each routed response's status (ext_proc response headers, observability
    # mode: never waited for): a 5xx for a turn pinned to a prefill worker that is gone makes the
    # picker leave that worker out at once instead of when Dynamo's discovery drops it.
    response_headers: bool = True
    # Envoy's allow_mode_override: the response headers go out in the ordinary mode (answered
    # before the response goes on), and a mode_override in the picker's answer is honoured: the
    # picker asks this way for the bodies of the answers it watches (`extproc`, step 5).
    allow_mode_override: bool = False
    # How long a picker that failed is left out before it is tried again (a restarted replica is
    # back in use after this), like an outlier ejection; not a flag, tests shorten it.
    picker_retry_after_s: float = 5.0
    # Failures in a row that leave a picker out (Envoy outlier detection's
    # consecutive_local_origin_failure, default 5): one slow request does not.
    picker_eject_after: int = 5
    max_body_bytes: int = 64 << 20  # a larger request body is refused with 413
    upstream_connect_timeout_s: float = 5.0
    max_idle_per_upstream: int = 256  # pooled keep-alive connections kept per endpoint

    def validate(self) -> GatewayConfig:
        """Raise ValueError naming the setting and the fix; return self so calls chain."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is outside 0-65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port} is outside 0-65535")
        try:
            parse_endpoint(self.upstream)
        except ValueError as exc:
            raise ValueError(f"--upstream: {exc}") from None
        for address in self.pickers:
            try:
                parse_endpoint(address)
            except ValueError as exc:
                raise ValueError(f"--picker: {exc}; give HOST:PORT[,HOST:PORT...]") from None
        if len(set(self.pickers)) != len(self.pickers):
            raise ValueError(f"--picker lists an address twice ({','.join(self.pickers)}); list each once")
        if not self.picker_timeout_ms > 0:
            raise ValueError(f"--picker-timeout-ms must be positive, not {self.picker_timeout_ms:g}")
        if self.allow_mode_override and not self.response_headers:
            raise ValueError("--allow-mode-override needs the response header phase (the picker's answer "
                             "to the response headers carries the override): drop --no-response-headers")
        if self.body_mode not in BODY_MODES:
            raise ValueError(f"--body-mode {self.body_mode!r}: choose {' or '.join(BODY_MODES)}")
        if not self.picker_retry_after_s >= 0:
            raise ValueError("picker_retry_after_s must not be negative")
        if self.picker_eject_after < 1:
            raise ValueError(f"--picker-eject-after {self.picker_eject_after} must be at least 1")
        if self.max_body_bytes < 1 or self.max_idle_per_upstream < 0:
            raise ValueError("max_body_bytes must be positive and max_idle_per_upstream not negative")
        return self

    @property
    def picker_timeout_s(self) -> float:
        return self.picker_timeout_ms / 1000.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its error as one line (no usage block), exit code 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _pickers(text: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} names no address; give HOST:PORT[,HOST:PORT...]")
    for item in items:
        try:
            parse_endpoint(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}; give HOST:PORT[,HOST:PORT...]") from None
    return items


def _endpoint(text: str) -> str:
    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number in 0-65535")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog=PROG,
        description="A local stand-in for an Envoy gateway with the ext_proc filter set up as the "
        "Gateway API Inference Extension sets it up: each request is shown to an endpoint picker "
        "(EPP) over Envoy's ext_proc gRPC protocol, its header and body mutations applied, and the "
        "request forwarded to the endpoint it names (x-gateway-destination-endpoint), else to "
        "--upstream. Without --picker it only forwards.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default=GatewayConfig.host, help="address to listen on")
    p.add_argument("--port", type=_port, default=GatewayConfig.port,
                   help="HTTP port to listen on (0: any free port)")
    p.add_argument("--upstream", type=_endpoint, default=GatewayConfig.upstream,
                   help="HOST:PORT of the default destination (Dynamo's OpenAI HTTP frontend): used "
                   "when the picker names none, when it fails (fail open) and without --picker")
    p.add_argument("--picker", type=_pickers, default=None,
                   help="HOST:PORT[,HOST:PORT...] of the endpoint picker replicas (ext_proc gRPC "
                   "servers); tried in turn from a round-robin start; none given: pass-through")
    p.add_argument("--picker-timeout-ms", type=float, default=GatewayConfig.picker_timeout_ms,
                   help="how long to wait for each ext_proc answer before the picker counts as "
                   "failed (Envoy's message_timeout); when all fail the request goes to --upstream")
    p.add_argument("--body-mode", choices=BODY_MODES, default=GatewayConfig.body_mode,
                   help="how the request body is sent to the picker: full-duplex "
                   "(FULL_DUPLEX_STREAMED, what the Inference Extension configures) or buffered "
                   "(BUFFERED: one message, after the picker answered the headers)")
    p.add_argument("--response-headers", action=argparse.BooleanOptionalAction,
                   default=GatewayConfig.response_headers,
                   help="after forwarding a routed request, send the picker the response's status and "
                   "headers on the same ext_proc stream (response_header_mode SEND, without waiting "
                   "for an answer, as Envoy's observability mode), so that a 5xx for a turn pinned to "
                   "a prefill worker that is gone takes that worker out of the picker's plans at once")
    p.add_argument("--allow-mode-override", action="store_true",
                   help="as Envoy's ext_proc allow_mode_override: send the response headers in the "
                   "ordinary mode (the response waits for the picker's answer, up to "
                   "--picker-timeout-ms) and honour a mode_override in that answer; the picker asks "
                   "this way for the body of each answer it watches for its TTFT and TPOT "
                   "(response_body_mode STREAMED: each body piece to the picker and answered before it "
                   "goes to the client)")
    p.add_argument("--picker-eject-after", type=int, default=GatewayConfig.picker_eject_after,
                   help="failures in a row (timeouts, errors) after which a picker replica is left "
                   "out for 5 s, as Envoy's outlier detection (consecutive_local_origin_failure) "
                   "does: a request that fails on one picker goes on to the next, or to --upstream")
    p.add_argument("--max-body-mb", type=float, default=GatewayConfig.max_body_bytes / (1 << 20),
                   help="a request body larger than this many MiB is answered 413 without reaching "
                   "the picker or the frontend")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics (ppd_gateway_*) on this port; none: no metrics server")
    return p


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    config = GatewayConfig(host=a.host, port=a.port, upstream=a.upstream, pickers=tuple(a.picker or ()),
                           picker_timeout_ms=a.picker_timeout_ms, body_mode=a.body_mode,
                           metrics_port=a.metrics_port, response_headers=a.response_headers,
                           allow_mode_override=a.allow_mode_override,
                           picker_eject_after=a.picker_eject_after,
                           max_body_bytes=max(1, int(a.max_body_mb * (1 << 20))))
    try:
        return config.validate()
    except ValueError as exc:
        parser.error(str(exc))
