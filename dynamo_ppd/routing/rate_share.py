"""The request rate of all router replicas together: each replica publishes its own sliding-window
rate on NATS (subject ``ppd.<namespace>.router-rate``, once a second, with its router id) and
reads the policy's table at its own rate plus the fresh rates of the others. With N replicas
behind one frontend each sees about 1/N of the load; the table's QPS axis is the whole graph's.

`SharedRate` (pure) holds the peers' last reports; `RatePublisher` is the NATS adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import msgspec

from ..policy.qps import SlidingWindowRate
from ..runtime import stop_task

log = logging.getLogger("dynamo_ppd.routing.rate_share")

PUBLISH_EVERY_S = 1.0
FRESH_S = 3.0  # a replica not heard from for this long is gone (stopped, or cut off)


def rate_subject(namespace: str) -> str:
    return f"ppd.{namespace}.router-rate"


class RateReport(msgspec.Struct, forbid_unknown_fields=False):
    router_id: str
    rate: float  # requests per second over its sliding window


class SharedRate:
    """This replica's `SlidingWindowRate` (``record``) plus its peers' reports (``rate``: the sum
    of all fresh ones). Same interface as `SlidingWindowRate`, so the router reads it as before."""

    def __init__(self, local: SlidingWindowRate, router_id: str | None = None, fresh_s: float = FRESH_S):
        self.local = local
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.fresh_s = fresh_s
        self._peers: dict[str, tuple[float, float]] = {}  # router id -> (rate, received at)

    def record(self, now: float) -> None:
        self.local.record(now)

    def local_rate(self, now: float) -> float:
        return self.local.rate(now)

    def peer_report(self, report: RateReport, now: float) -> None:
        if report.router_id != self.router_id:
            self._peers[report.router_id] = (max(0.0, report.rate), now)

    def peers(self, now: float) -> dict[str, float]:
        for router_id in [r for r, (_, at) in self._peers.items() if now - at > self.fresh_s]:
            del self._peers[router_id]
        return {r: rate for r, (rate, _) in self._peers.items()}

    def rate(self, now: float) -> float:
        return self.local.rate(now) + sum(self.peers(now).values())


class RatePublisher:
    """Publishes this replica's rate every second and applies the others' (NATS core pub/sub:
    a lost report only makes a peer's rate a second older)."""

    def __init__(self, shared: SharedRate, namespace: str, on_publish=None):
        self.shared = shared
        self.subject = rate_subject(namespace)
        self._on_publish = on_publish  # e.g. metrics: (local rate, shared rate)
        self._nats: Any = None
        self._task: asyncio.Task | None = None
        self._sub: Any = None

    async def start(self, nats_client) -> None:
        self._nats = nats_client

        async def on_report(msg) -> None:
            try:
                self.shared.peer_report(msgspec.json.decode(msg.data, type=RateReport), time.monotonic())
            except msgspec.DecodeError:
                log.debug("ignoring a malformed router-rate report")

        self._sub = await nats_client.subscribe(self.subject, cb=on_report)
        self._task = asyncio.get_running_loop().create_task(self._publish(), name="router-rate")

    async def stop(self) -> None:
        await stop_task(self._task)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 (the connection is closing anyway)
                pass

    async def _publish(self) -> None:
        while True:
            now = time.monotonic()
            local = self.shared.local_rate(now)
            try:
                await self._nats.publish(self.subject, msgspec.json.encode(
                    RateReport(self.shared.router_id, local)))
            except Exception as exc:  # noqa: BLE001 (NATS away: peers see us go stale, then fresh again)
                log.debug("could not publish the router rate: %s", exc)
            if self._on_publish is not None:
                self._on_publish(local, self.shared.rate(now))
            await asyncio.sleep(PUBLISH_EVERY_S)
