"""Conversation sessions: which decode worker holds a conversation, in etcd, with a local cache.

- `SessionRecord` is the one schema of a session (msgpack in etcd, one key per session under
  ``{prefix}/sessions/``), with an etcd lease as its idle TTL, refreshed on every turn.
- `SessionTable` (pure) is the local cache: records by id, plus an index from the hash of the
  last full block of each session's known history to the session, so a prompt that only resends
  the history (no ``x-dynamo-session-id``) finds its session by its longest known prefix.
- `EtcdSessions` keeps the table in sync with etcd (initial load, then a watch, so every router
  replica sees every session) and settles the first-turn race between replicas with a
  transaction: the first writer wins and the other adopts its record. If etcd goes away, routing
  continues from the local table (logged once); changes made meanwhile are written back and the
  table reloaded when etcd returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

log = logging.getLogger("dynamo_ppd.router.sessions")


class SessionRecord(msgspec.Struct, forbid_unknown_fields=True):
    session_id: str
    decode_worker: int | None = None
    prefill_worker: int | None = None
    turn: int = 0  # turns completed
    context_tokens: int = 0  # prompt + output tokens of the last completed turn
    history_hash: int | None = None  # chained hash of the history's last full block
    last_access: float = 0.0  # unix time


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionRecord)


def encode(record: SessionRecord) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes) -> SessionRecord:
    return _decoder.decode(data)


class SessionTable:
    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._by_history: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._records.get(session_id)

    def put(self, record: SessionRecord) -> None:
        old = self._records.get(record.session_id)
        if old is not None and old.history_hash is not None:
            self._by_history.pop(old.history_hash, None)
        self._records[record.session_id] = record
        if record.history_hash is not None:
            self._by_history[record.history_hash] = record.session_id

    def remove(self, session_id: str) -> None:
        old = self._records.pop(session_id, None)
        if old is not None and old.history_hash is not None:
            self._by_history.pop(old.history_hash, None)

    def find_by_prefix(self, prompt_block_hashes: list[int]) -> SessionRecord | None:
        """The session whose known history is the longest prefix of the prompt."""
        for h in reversed(prompt_block_hashes):
            session_id = self._by_history.get(h)
            if session_id is not None:
                return self._records.get(session_id)
        return None

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop sessions idle for longer than the TTL (etcd does it with leases; this is for the
        local table while etcd is away). Returns how many were dropped."""
        stale = [r.session_id for r in self._records.values() if now - r.last_access > ttl_s]
        for session_id in stale:
            self.remove(session_id)
        return len(stale)

    def records(self) -> list[SessionRecord]:
        return list(self._records.values())


class EtcdSessions:
    """The session table backed by etcd (aetcd client)."""

    def __init__(self, etcd_url: str, prefix: str = "ppd", ttl_s: float = 3600.0,
                 on_health: Callable[[bool], None] | None = None):
        from urllib.parse import urlparse

        parsed = urlparse(etcd_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 2379
        self.prefix = f"{prefix}/sessions/".encode()
        self.ttl_s = ttl_s
        self.table = SessionTable()
        self.healthy = False
        self._on_health = on_health
        self._client: Any = None
        self._leases: dict[str, int] = {}
        self._dirty: set[str] = set()  # changed while etcd was away
        self._tasks: list[asyncio.Task] = []
        self._warned = False

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        import aetcd

        self._client = aetcd.Client(host=self.host, port=self.port, timeout=2)
        try:
            await self._resync()
        except Exception as exc:  # noqa: BLE001 (start routing anyway; the monitor retries)
            self._set_health(False, exc)
        self._tasks.append(asyncio.get_running_loop().create_task(self._monitor(), name="etcd-monitor"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._client is not None:
            await self._client.close()

    # -- reads (local, never block on etcd) -----------------------------------------------------
    def get(self, session_id: str) -> SessionRecord | None:
        return self.table.get(session_id)

    def find_by_prefix(self, prompt_block_hashes: list[int]) -> SessionRecord | None:
        return self.table.find_by_prefix(prompt_block_hashes)

    # -- writes ----------------------------------------------------------------------------------
    async def claim(self, record: SessionRecord) -> SessionRecord:
        """Create a new session unless another replica already did; return the winning record."""
        self.table.put(record)
        if not self.healthy:
            self._dirty.add(record.session_id)
            return record
        key = self.prefix + record.session_id.encode()
        try:
            lease = await self._client.lease(int(self.ttl_s))
            tx = self._client.transactions
            won, responses = await self._client.transaction(
                compare=[tx.version(key) == 0],
                success=[tx.put(key, encode(record), lease.id)],
                failure=[tx.get(key)])
        except Exception as exc:  # noqa: BLE001
            self._set_health(False, exc)
            self._dirty.add(record.session_id)
            return record
        if won:
            self._leases[record.session_id] = lease.id
            return record
        await self._client.revoke_lease(lease.id)
        winner = decode(responses[0][0][0])
        self.table.put(winner)
        return winner

    async def save(self, record: SessionRecord) -> None:
        """Write a session after a turn, refreshing its idle TTL."""
        self.table.put(record)
        if not self.healthy:
            self._dirty.add(record.session_id)
            return
        try:
            await self._write(record)
        except Exception as exc:  # noqa: BLE001
            self._set_health(False, exc)
            self._dirty.add(record.session_id)

    async def _write(self, record: SessionRecord) -> None:
        lease = self._leases.get(record.session_id)
        if lease is not None:
            try:
                await self._client.refresh_lease(lease)
            except Exception:  # noqa: BLE001 (expired or revoked: take a new one)
                lease = None
        if lease is None:
            lease = (await self._client.lease(int(self.ttl_s))).id
            self._leases[record.session_id] = lease
        await self._client.put(self.prefix + record.session_id.encode(), encode(record), lease)

    # -- sync ------------------------------------------------------------------------------------
    async def _resync(self) -> None:
        """Write back what changed while etcd was away, reload everything, then watch."""
        for session_id in list(self._dirty):
            record = self.table.get(session_id)
            if record is not None:
                await self._write(record)
            self._dirty.discard(session_id)
        result = await self._client.get_prefix(self.prefix)
        fresh = SessionTable()
        for kv in result:
            try:
                record = decode(kv.value)
            except msgspec.DecodeError:
                log.warning("ignoring malformed session record at %r", kv.key)
                continue
            fresh.put(record)
            self._leases.setdefault(record.session_id, kv.lease)
        self.table = fresh
        revision = result.header.revision if result.header else None
        self._set_health(True)
        self._tasks.append(asyncio.get_running_loop().create_task(
            self._watch(revision + 1 if revision else None), name="etcd-watch"))

    async def _watch(self, start_revision: int | None) -> None:
        import aetcd

        try:
            async for event in await self._client.watch_prefix(self.prefix, start_revision=start_revision):
                session_id = event.kv.key[len(self.prefix):].decode()
                if event.kind == aetcd.EventKind.DELETE:
                    if session_id not in self._dirty:
                        self.table.remove(session_id)
                        self._leases.pop(session_id, None)
                    continue
                try:
                    self.table.put(decode(event.kv.value))
                except msgspec.DecodeError:
                    continue
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._set_health(False, exc)

    async def _monitor(self) -> None:
        """Every second: expire idle sessions locally; while unhealthy, try to get etcd back."""
        while True:
            await asyncio.sleep(1.0)
            self.table.expire(time.time(), self.ttl_s)
            if self.healthy:
                try:
                    await self._client.status()
                except Exception as exc:  # noqa: BLE001
                    self._set_health(False, exc)
                continue
            try:
                for task in [t for t in self._tasks if t.get_name() == "etcd-watch"]:
                    task.cancel()
                    self._tasks.remove(task)
                await self._resync()
                log.warning("etcd is back: %d sessions resynchronised", len(self.table))
                self._warned = False
            except Exception:  # noqa: BLE001 (still away; try again in a second)
                pass

    def _set_health(self, healthy: bool, exc: Exception | None = None) -> None:
        if not healthy and not self._warned:
            log.warning("etcd unavailable (%s): routing continues from the local session cache", exc)
            self._warned = True
        self.healthy = healthy
        if self._on_health:
            self._on_health(healthy)
