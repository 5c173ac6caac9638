"""The workers' latest forward-pass metrics (load reports), read when a decision needs them.

Workers publish a report every engine iteration: about 0.4 per relayed token on the relay
benchmark's load, each one parsed in Python by nats-py (then msgpack-decoded twice) when the
router subscribed itself, while a decision reads only the latest one per worker. Dynamo's
`FpmEventSubscriber` in tracking mode keeps that latest report per worker in Rust, so Python now
decodes a report only when a decision reads it (and once per new report). Every router replica
pays this per report, whatever share of the tokens it relays, so it is also what kept replicas'
CPU per token above a single router's.

The reports are the same dicts as before (the payload the worker published). Keyed by worker id
only, as before; a worker with several data-parallel ranks is read at its lowest rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec

log = logging.getLogger("dynamo_ppd.routing")


class LoadReports:
    """``get(worker)``: the worker's latest report, or ``default``. Reports come from the trackers
    (`track`), or are set directly (``reports[worker] = report``: NATS fallback, tests)."""

    def __init__(self) -> None:
        self._set: dict[int, dict] = {}
        self._trackers: list[Any] = []
        self._decoded: dict[int, tuple[bytes, dict]] = {}  # worker -> (raw report, decoded)

    def track(self, tracker: Any) -> None:
        """A started `FpmEventSubscriber` (``start_tracking()`` called)."""
        self._trackers.append(tracker)

    def __setitem__(self, worker: int, report: dict) -> None:
        self._set[worker] = report

    def get(self, worker: int, default: dict | None = None) -> dict | None:
        found = self.latest([worker])[worker]
        return default if found is None else found

    def latest(self, workers: Iterable[int]) -> dict[int, dict | None]:
        """Each worker's latest report (None: none yet), reading every tracker once: a read
        crosses into Rust and copies every tracked worker's report, and a decision wants the
        reports of all its workers at once."""
        out: dict[int, dict | None] = {w: self._set.get(w) for w in workers}
        wanted = {str(w): w for w, report in out.items() if report is None}
        if not wanted:
            return out
        found: dict[int, tuple[int, bytes]] = {}  # worker -> (lowest rank seen, its raw report)
        for tracker in self._trackers:
            for (wid, rank), raw in tracker.get_recent_stats().items():
                worker = wanted.get(wid)
                if worker is not None and (worker not in found or rank < found[worker][0]):
                    found[worker] = (rank, raw)
        for worker, (_, raw) in found.items():
            out[worker] = self._decode(worker, raw)
        return out

    def _decode(self, worker: int, raw: bytes) -> dict | None:
        cached = self._decoded.get(worker)
        if cached is not None and cached[0] == raw:
            return cached[1]
        try:
            report = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:  # a malformed report only costs freshness
            return cached[1] if cached else None
        self._decoded[worker] = (raw, report)
        return report

    async def on_nats_message(self, msg) -> None:
        """The fallback without a tracker: every report over NATS, parsed here."""
        try:
            report = msgspec.msgpack.decode(msgspec.msgpack.decode(msg.data)["payload"])
            self[int(report["worker_id"])] = report
        except Exception:  # noqa: BLE001 (a malformed report only costs freshness)
            log.debug("ignoring a malformed forward-pass-metrics message")

    def shutdown(self) -> None:
        for tracker in self._trackers:
            try:
                tracker.shutdown()
            except Exception as exc:  # noqa: BLE001 (stopping anyway)
                log.debug("forward-pass-metrics tracker shutdown: %s", exc)
        self._trackers.clear()
