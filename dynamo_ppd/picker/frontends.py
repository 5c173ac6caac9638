"""The Dynamo frontends the picker names as a request's destination.

GAIE's gateways send a request to the ``ip:port`` the picker names in
``x-gateway-destination-endpoint`` (Envoy's ORIGINAL_DST cluster: an address, never a name), and
that endpoint must be one of the InferencePool's pods. GAIE's own EPP learns the pool's pods by
watching the InferencePool and its pods through the Kubernetes API; the picker learns the same set
without an API client or RBAC: the chart gives it a headless Service whose selector is the pool's,
and a headless Service's name resolves to the IPs of its ready pods. So each ``--frontend`` entry
is ``ip:port`` (fixed) or ``name:port`` (resolved now and every ``refresh_s`` after). A gateway
that sends the pool's endpoints with each request (the protocol's subset hint; kgateway does,
Istio does not) is obeyed instead.

A name that stops resolving keeps its last addresses (a DNS hiccup must not empty the pool); a
name that never resolved contributes nothing, and with no frontend at all the picker refuses
requests with a 503 until one appears.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger("dynamo_ppd.picker")

Resolver = Callable[[str], Awaitable[list[str]]]


def split_endpoint(entry: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) -> (host, port); ValueError when it is not one."""
    host, _, port = entry.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} is not host:port (e.g. 127.0.0.1:8000 or frontend.ns.svc:8000)")
    return host, int(port)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), in the resolver's order, once each."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Frontends:
    """The destinations, round robin (see the module docstring)."""

    def __init__(self, entries: Sequence[str], refresh_s: float = 5.0,
                 resolve: Resolver = resolve_addresses):
        if not entries:
            raise ValueError("the picker needs at least one frontend (ip:port or name:port)")
        self.refresh_s = refresh_s
        self._resolve = resolve
        self._fixed: list[str] = []
        self._named: dict[tuple[str, int], list[str]] = {}  # (name, port) -> last ip:port list
        for entry in entries:
            host, port = split_endpoint(entry)
            if _is_address(host):
                self._fixed.append(_join(host, port))
            else:
                self._named[(host, port)] = []
        self._turn = 0
        self._task: asyncio.Task | None = None

    @property
    def names(self) -> list[str]:
        return [f"{host}:{port}" for host, port in self._named]

    def endpoints(self) -> list[str]:
        """The frontends known now: the fixed ones, then each name's last addresses."""
        named = [e for addresses in self._named.values() for e in addresses]
        return list(dict.fromkeys(self._fixed + named))

    def next(self, subset: Sequence[str] | None = None) -> str | None:
        """The next frontend, round robin; None while none is known. ``subset``: the endpoints
        the gateway allows for this request (GAIE's ``x-gateway-destination-endpoint-subset``,
        the pool's pods as the gateway sees them): the pick is one of them, whatever the names
        resolve to, and None when it is empty."""
        endpoints = list(subset) if subset is not None else self.endpoints()
        if not endpoints:
            return None
        self._turn += 1
        return endpoints[self._turn % len(endpoints)]

    async def refresh(self) -> None:
        """Resolve every name once; a name that fails keeps what it had."""
        for (host, port), previous in self._named.items():
            try:
                addresses = sorted(await self._resolve(host))
            except OSError as exc:
                log.warning("frontend %s:%d does not resolve (%s); keeping %d known address(es)",
                            host, port, exc, len(previous))
                continue
            found = [_join(a, port) for a in addresses]
            if found != previous:
                log.info("frontend %s:%d -> %s", host, port, ",".join(found) or "(none)")
            if found or not previous:
                self._named[(host, port)] = found

    async def start(self) -> None:
        """The first resolution, then a refresh every ``refresh_s`` while names are given."""
        if not self._named:
            return
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
