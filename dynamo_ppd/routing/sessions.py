"""Conversation sessions: which decode worker holds a conversation, in etcd, with a local cache.

- `SessionRecord` is the one schema of a session (msgpack in etcd, one key per session under
  ``{prefix}/sessions/``), with an etcd lease as its idle TTL, refreshed on every turn.
- `SessionTable` (pure, no I/O) is the local cache: records by id in LRU order, bounded
  (``--max-sessions``), plus an index of each session's *whole* recorded history, so a prompt that
  resends a history (no ``x-dynamo-session-id``) finds its session, and only its own.
- `EtcdSessions` keeps the table in sync with etcd (a paged initial load, then a watch, so every
  router replica sees every session), settles the first-turn race between replicas with a
  transaction (the first writer wins, the other adopts its record), reads a header's session
  through from etcd when the local table misses it, and replaces leases that are gone. If etcd
  goes away, routing continues from the local table (logged once); changes made meanwhile are
  written back and the table reloaded when etcd returns, and on shutdown.

When does a prompt continue a recorded history?
    Only when the whole history (prompt + output of the session's last turn, ``context_tokens``
    tokens) is a prefix of the prompt, token for token. A record keeps two hashes of its history:
    ``history_hash``, the prefix id (`engine.blocks.prefix_chain`) of its last full block (``None``
    with no full block), and ``history_digest``, that id hashed with the tokens after the last
    full block (the partial tail). A prompt matches when its own prefix id at that block equals
    ``history_hash`` and its tokens at the same offsets hash to ``history_digest``. Matching the
    last full block alone is not enough: with a shared 320-token system prompt and a short first
    exchange, a history's full blocks can all be system prompt, identical for every user, and
    user B's first request became turn 2 of user A. The tail (A's own message and answer) tells
    them apart; histories identical token for token are the same conversation as far as any
    router can tell. Among matches the longest history wins. The prefix ids are CPython's
    int-tuple hashes (what the residency index already computes for the prompt, so the lookup
    adds no hashing of full blocks): stable across processes and CPython >= 3.8; a replica on
    another interpreter would only miss sessions (routed by residency), never merge them.

Who may match whom (so no request can change another conversation's record):
    - a request without a header matches only sessions without one (``auto-...`` ids);
    - a request with header ``X`` matches ``X``'s record if its prompt continues that history,
      else a fork of ``X`` (``X#...``, see below) whose history it continues, else nothing.
    Index entries are sets of session ids, and a session removes only its own id (two sessions
    with the same history, or a record replaced by its next turn, never take another's entry).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..engine.blocks import ROOT

log = logging.getLogger("dynamo_ppd.routing.sessions")

MAX_SESSION_ID_BYTES = 256  # longer ids get HTTP 400 (10 kB ones were stored once)
AUTO_PREFIX = "auto-"  # ids of sessions without a header
FORK_SEPARATOR = "#"  # X#... : a conversation sent under X whose prompt did not continue X's history
DEFAULT_MAX_SESSIONS = 100_000
LOAD_PAGE = 1000  # records per etcd range request on load (gRPC's 4 MiB limit broke one get)
SAVE_WAIT_S = 0.5  # how long a turn's end waits for its etcd write before leaving it in the background
# A healthy etcd is probed (one status call, ~2.5 ms of CPU here) only if no other call succeeded
# this long: while turns are being recorded, their own calls show it is there.
PROBE_AFTER_S = 1.0

# A turn's write refreshes its session's lease only when this replica last granted or refreshed
# that lease more than this share of the TTL ago (else the put alone: one etcd call, not two, for
# the turns of a conversation that come in quick succession). So a session lives between 0.9 and
# 1.0 TTL after its last turn.
REFRESH_AFTER_TTL_FRACTION = 0.1
STOP_WAIT_S = 2.0  # how long stop() waits for its tasks, and for the etcd client to close
# Write-behind (`record_later`, the endpoint picker's): a turn's record reaches etcd with the
# next batch, at most this long after it was routed, all the batch's records in one transaction
# (etcd's default --max-txn-ops is 128), under one lease per `LEASE_BUCKET_S` (granted with the
# session TTL plus the bucket, so a session lives between TTL and TTL + bucket after its last
# turn) instead of a lease and a refresh per session: one etcd call per batch, not one or two per turn.
FLUSH_EVERY_S = 0.02
MAX_TXN_OPS = 128
LEASE_BUCKET_S = 60.0

class SessionRecord(msgspec.Struct, forbid_unknown_fields=True):
    session_id: str
    decode_worker: int | None = None
    prefill_worker: int | None = None
    turn: int = 0  # turns completed
    context_tokens: int = 0  # prompt + output tokens of the last completed turn
    history_hash: int | None = None  # prefix id of the history's last full block
    last_access: float = 0.0  # unix time
    history_digest: int | None = None  # the whole history: history_hash and the tokens after it


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionRecord)


def encode(record: SessionRecord) -> bytes:
    return _encoder.encode(record)


def decode(data: bytes) -> SessionRecord:
    return _decoder.decode(data)


def check_session_id(session_id: str | None) -> None:
    """A client's session id must be short: raise `InvalidArgument` (HTTP 400) otherwise."""
    if session_id is not None and len(session_id.encode()) > MAX_SESSION_ID_BYTES:
        from dynamo.llm.exceptions import InvalidArgument

        raise InvalidArgument(f"x-dynamo-session-id is {len(session_id.encode())} bytes; "
                              f"the limit is {MAX_SESSION_ID_BYTES}")


def tail_digest(anchor: int | None, tail: Sequence[int]) -> int:
    """Hash of a history's tokens after its last full block, chained to that block's prefix id
    (a tuple of ints: the same in every process, unlike a hash of bytes, which is salted)."""
    return hash((anchor or ROOT, len(tail), tuple(tail)))


def history_hashes(chain: list[int], tokens: list[int], block_size: int) -> tuple[int | None, int]:
    """(history_hash, history_digest) of a history, given its full blocks' prefix ids."""
    full = len(tokens) // block_size
    anchor = chain[full - 1] if full else None
    return anchor, tail_digest(anchor, tokens[full * block_size:])


def is_fork_of(session_id: str, header_id: str) -> bool:
    return session_id.startswith(header_id + FORK_SEPARATOR)


class SessionTable:
    """Records by id (least recently used first) and the index of their whole histories."""

    def __init__(self, block_size: int = 32, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 on_evict: Callable[[SessionRecord], None] | None = None):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.on_evict = on_evict
        self.evicted = 0
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()
        # (history_hash or root, tail length, digest) -> session ids (insertion order: last = newest)
        self._index: dict[tuple[int, int, int], dict[str, None]] = {}
        self._tails: dict[int, Counter[int]] = {}  # anchor -> tail lengths indexed under it

    def __len__(self) -> int:
        return len(self._records)

    def get(self, session_id: str) -> SessionRecord | None:
        record = self._records.get(session_id)
        if record is not None:
            self._records.move_to_end(session_id)
        return record

    def put(self, record: SessionRecord) -> None:
        old = self._records.pop(record.session_id, None)
        if old is not None:
            self._unindex(old)
        self._records[record.session_id] = record
        self._index_record(record)
        while len(self._records) > self.max_sessions:
            _, evicted = self._records.popitem(last=False)
            self._unindex(evicted)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(evicted)

    def remove(self, session_id: str) -> SessionRecord | None:
        old = self._records.pop(session_id, None)
        if old is not None:
            self._unindex(old)
        return old

    def continues(self, record: SessionRecord, chain: list[int], tokens: Sequence[int]) -> bool:
        """Whether the prompt (its tokens and their full blocks' prefix ids) continues the record's
        whole history. A record with no history yet (a claimed first turn) is continued by any."""
        if record.context_tokens == 0:
            return True
        if record.history_digest is None or len(tokens) < record.context_tokens:
            return False
        full, tail = divmod(record.context_tokens, self.block_size)
        if full > len(chain):
            return False
        anchor = chain[full - 1] if full else None
        if anchor != record.history_hash:
            return False
        start = full * self.block_size
        return tail_digest(anchor, tokens[start:start + tail]) == record.history_digest

    def find_by_prefix(self, chain: list[int], tokens: Sequence[int],
                       accept: Callable[[str], bool] | None = None) -> SessionRecord | None:
        """The session (among those ``accept`` allows; default: those without a header) whose
        whole history is the longest prefix of the prompt."""
        accept = accept or (lambda session_id: session_id.startswith(AUTO_PREFIX))
        bs = self.block_size
        for full in range(min(len(chain), len(tokens) // bs), -1, -1):
            anchor = chain[full - 1] if full else ROOT
            tails = self._tails.get(anchor)
            if not tails:
                continue
            start = full * bs
            for tail in sorted(tails, reverse=True):
                if start + tail > len(tokens):
                    continue
                ids = self._index.get((anchor, tail, tail_digest(anchor, tokens[start:start + tail])))
                for session_id in reversed(ids or ()):
                    if accept(session_id):
                        return self._records[session_id]
        return None

    def expire(self, now: float, ttl_s: float) -> int:
        """Drop sessions idle for longer than the TTL (etcd does it with leases; this is for the
        local table while etcd is away). Returns how many were dropped. Scans from the least
        recently used and stops at the first fresh one (called every second: no full scan of
        100k records each time; one used later but idle longer waits for the next turn or LRU)."""
        stale = []
        for record in self._records.values():
            if now - record.last_access <= ttl_s:
                break
            stale.append(record.session_id)
        for session_id in stale:
            self.remove(session_id)
        return len(stale)

    def records(self) -> list[SessionRecord]:
        return list(self._records.values())

    def _key(self, record: SessionRecord) -> tuple[int, int, int] | None:
        if record.history_digest is None or record.context_tokens == 0:
            return None
        return (record.history_hash or ROOT, record.context_tokens % self.block_size,
                record.history_digest)

    def _index_record(self, record: SessionRecord) -> None:
        key = self._key(record)
        if key is None:
            return
        ids = self._index.setdefault(key, {})
        ids.pop(record.session_id, None)
        ids[record.session_id] = None
        self._tails.setdefault(key[0], Counter())[key[1]] += 1

    def _unindex(self, record: SessionRecord) -> None:
        """Remove this session's own index entry (never another session's)."""
        key = self._key(record)
        ids = self._index.get(key) if key is not None else None
        if key is None or ids is None or record.session_id not in ids:
            return
        del ids[record.session_id]
        if not ids:
            del self._index[key]
        tails = self._tails[key[0]]
        tails[key[1]] -= 1
        if tails[key[1]] <= 0:
            del tails[key[1]]
            if not tails:
                del self._tails[key[0]]


class EtcdSessions:
    """The session table backed by etcd (aetcd client)."""

    def __init__(self, etcd_url: str, prefix: str = "ppd", ttl_s: float = 3600.0,
                 on_health: Callable[[bool], None] | None = None, block_size: int = 32,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, on_evict: Callable[[], None] | None = None):
        from urllib.parse import urlparse

        parsed = urlparse(etcd_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 2379
        self.prefix = f"{prefix}/sessions/".encode()
        self.ttl_s = ttl_s
        self.block_size, self.max_sessions = block_size, max_sessions
        self.table = self._new_table()
        self.healthy = False
        self._on_health = on_health
        self._on_evict = on_evict
        self._client: Any = None
        self._leases: dict[str, int] = {}
        # session -> (its lease, when this replica last granted or refreshed that lease)
        self._refreshed: dict[str, tuple[int, float]] = {}
        self._dirty: set[str] = set()  # changed while etcd was away (or a write failed)
        self._pending: set[asyncio.Task] = set()  # writes and deletes in the background
        self._tasks: list[asyncio.Task] = []
        self._warned = False
        self._last_ok = 0.0  # monotonic time of the last etcd call that succeeded (watch events too)
        self._queued: dict[str, SessionRecord] = {}  # write-behind: records for the next batch
        self._flusher: asyncio.Task | None = None
        self._bucket: tuple[int, float] | None = None  # the batches' shared lease, when granted
        self._shared_leases: set[int] = set()  # bucket leases this replica granted (never revoked)
        # Values this replica wrote, by session, until their watch event comes back: the echo of
        # one's own write is skipped before it is decoded and indexed again.
        self._echo: dict[str, bytes] = {}

    def _new_table(self) -> SessionTable:
        return SessionTable(self.block_size, self.max_sessions, on_evict=self._evicted)

    # -- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        import aetcd

        self._client = aetcd.Client(host=self.host, port=self.port, timeout=2)
        try:
            await self._resync()
        except Exception as exc:  # noqa: BLE001 (start routing anyway; the monitor retries)
            self._set_health(False, exc)
        self._tasks.append(asyncio.get_running_loop().create_task(self._monitor(), name="etcd-monitor"))

    async def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Stop syncing; first flush what is pending (background writes, and the sessions changed
        while etcd was away), so a rolling restart loses no turn."""
        for task in self._tasks:
            task.cancel()
        # Bounded: aetcd's watcher can sit on a watch it is still creating or cancelling, and a
        # router that never stops blocks a rolling restart.
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
        try:
            await asyncio.wait_for(self.flush(), flush_timeout_s)
        except Exception as exc:  # noqa: BLE001 (etcd away at shutdown: nothing more to do)
            log.warning("could not flush %d session writes on shutdown: %s", len(self._dirty), exc)
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.close(), STOP_WAIT_S)
            except Exception as exc:  # noqa: BLE001 (closing is best effort)
                log.warning("etcd client did not close cleanly: %s", exc)

    async def flush(self) -> None:
        """Wait for the background writes, then write the dirty sessions."""
        if self._queued and (self._flusher is None or self._flusher.done()):
            self._flusher = self._background(self._flush_queued(delay_s=0.0))
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        if self._client is None or not self._dirty:
            return
        await self._write_dirty()

    # -- reads (local; `read_through` is the one that asks etcd) ---------------------------------
    def get(self, session_id: str) -> SessionRecord | None:
        return self.table.get(session_id)

    def find_by_prefix(self, chain: list[int], tokens: Sequence[int],
                       accept: Callable[[str], bool] | None = None) -> SessionRecord | None:
        return self.table.find_by_prefix(chain, tokens, accept)

    async def read_through(self, session_id: str) -> SessionRecord | None:
        """A session the local table does not know, from etcd (one linearizable get): another
        replica may have recorded it a moment ago, before its watch event reached us."""
        if not self.healthy or self._client is None:
            return None
        try:
            found = await self._client.get(self.prefix + session_id.encode())
        except Exception as exc:  # noqa: BLE001
            self._set_health(False, exc)
            return None
        self._last_ok = time.monotonic()
        if found is None:
            return None
        try:
            record = decode(found.value)
        except msgspec.DecodeError:
            return None
        if found.lease:
            self._leases.setdefault(record.session_id, found.lease)
        self.table.put(record)
        return record

    # -- writes ----------------------------------------------------------------------------------
    async def claim(self, record: SessionRecord) -> SessionRecord:
        """Create a new session unless another replica already did; return the winning record."""
        if self._kept_local(record):
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
            self._sync_later(record, exc)
            return record
        self._last_ok = time.monotonic()
        if won:
            self._leases[record.session_id] = lease.id
            self._refreshed[record.session_id] = (lease.id, time.monotonic())
            return record
        await self._client.revoke_lease(lease.id)
        winner = decode(responses[0][0][0])
        self.table.put(winner)
        return winner

    async def save(self, record: SessionRecord) -> None:
        """Write a session after a turn, refreshing its idle TTL."""
        if self._kept_local(record):
            return
        try:
            await self._write(record)
            self._last_ok = time.monotonic()
        except Exception as exc:  # noqa: BLE001
            self._sync_later(record, exc)

    async def commit(self, record: SessionRecord, wait_s: float = SAVE_WAIT_S) -> None:
        """A turn's record: in the local table now, and in etcd before this returns unless etcd
        takes longer than ``wait_s`` (then the write finishes in the background, and `stop`
        flushes it). The caller holds the answer's end until then, so a follow-up the client
        sends to another replica finds the record there (by `read_through`)."""
        self.table.put(record)
        task = self._background(self.save(record))
        await asyncio.wait({task}, timeout=wait_s)

    def record_later(self, record: SessionRecord) -> None:
        """A turn's record, write-behind: in the local table now, in etcd with the next batch
        (within `FLUSH_EVERY_S`), nothing awaited. For a shell that records a turn as it routes
        it, when the follow-up comes seconds later (the endpoint picker); `stop` flushes it."""
        if self._kept_local(record):
            return
        self._queued[record.session_id] = record  # a later turn of the same session replaces it
        if self._flusher is None or self._flusher.done():
            self._flusher = self._background(self._flush_queued())

    async def _flush_queued(self, delay_s: float = FLUSH_EVERY_S) -> None:
        await asyncio.sleep(delay_s)
        while self._queued:
            batch = list(self._queued.values())[:MAX_TXN_OPS]
            for record in batch:
                del self._queued[record.session_id]
            try:
                await self._put_batch(batch)
                self._last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 (etcd away: the resync writes them)
                for record in batch:
                    self._sync_later(record, exc)

    async def _put_batch(self, batch: list[SessionRecord]) -> None:
        """One transaction putting every record under the current bucket lease (a new one when
        the bucket is over or its lease is gone)."""
        for attempt in (1, 2):
            lease = await self._bucket_lease(renew=attempt == 2)
            tx = self._client.transactions
            values = [(record, encode(record)) for record in batch]
            for record, value in values:  # before the call: the watch may deliver before it returns
                self._echo[record.session_id] = value
            try:
                await self._client.transaction(
                    compare=[], success=[tx.put(self.prefix + r.session_id.encode(), v, lease)
                                         for r, v in values], failure=[])
            except Exception as exc:
                for record, _ in values:
                    self._echo.pop(record.session_id, None)
                if attempt == 1 and _lease_gone(exc):
                    continue
                raise
            for record, _ in values:
                self._leases[record.session_id] = lease
                self._refreshed.pop(record.session_id, None)
            return

    async def _bucket_lease(self, renew: bool = False) -> int:
        now = time.monotonic()
        if renew or self._bucket is None or now - self._bucket[1] > LEASE_BUCKET_S:
            lease = (await self._client.lease(int(self.ttl_s + LEASE_BUCKET_S))).id
            self._bucket = (lease, now)
            self._shared_leases.add(lease)
        return self._bucket[0]

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _write_dirty(self) -> None:
        """Write every session changed while etcd was away (one that was since evicted is dropped)."""
        for session_id in list(self._dirty):
            record = self.table.get(session_id)
            if record is not None:
                await self._write(record)
            self._dirty.discard(session_id)

    async def _write(self, record: SessionRecord) -> None:
        """Put the record under its lease, refreshing the lease at the same time unless this
        replica did so lately (`_fresh`); a lease that is gone (expired, or revoked behind our
        back: its refresh answers TTL 0 without raising, and a put under it fails) is replaced by
        a new one, never retried forever."""
        key, value = self.prefix + record.session_id.encode(), encode(record)
        lease = self._leases.get(record.session_id)
        if lease and self._fresh(record.session_id, lease):
            try:
                await self._client.put(key, value, lease)
                return
            except Exception as exc:  # noqa: BLE001
                if not _lease_gone(exc):
                    raise
        elif lease:
            outcomes: tuple[Any, Any] = await asyncio.gather(self._client.put(key, value, lease),
                                                       self._client.refresh_lease(lease),
                                                       return_exceptions=True)
            put, refresh = outcomes
            if not isinstance(put, BaseException) and not isinstance(refresh, BaseException) \
                    and refresh is not None and refresh.TTL > 0:
                self._refreshed[record.session_id] = (lease, time.monotonic())
                return
            for outcome in (put, refresh):
                if isinstance(outcome, BaseException) and not _lease_gone(outcome):
                    raise outcome
        new = (await self._client.lease(int(self.ttl_s))).id
        self._leases[record.session_id] = new
        self._refreshed[record.session_id] = (new, time.monotonic())
        await self._client.put(key, value, new)

    def _fresh(self, session_id: str, lease: int) -> bool:
        """This replica granted or refreshed ``lease`` recently (`REFRESH_AFTER_TTL_FRACTION`)."""
        refreshed = self._refreshed.get(session_id)
        return (refreshed is not None and refreshed[0] == lease
                and time.monotonic() - refreshed[1] < self.ttl_s * REFRESH_AFTER_TTL_FRACTION)

    def _evicted(self, record: SessionRecord) -> None:
        """The table dropped its least recently used session: drop it from etcd too, so etcd
        stays bounded as well (other replicas follow through their watch)."""
        if self._on_evict is not None:
            self._on_evict()
        self._dirty.discard(record.session_id)
        self._queued.pop(record.session_id, None)
        self._echo.pop(record.session_id, None)
        lease = self._leases.pop(record.session_id, None)
        granted = self._refreshed.pop(record.session_id, None)
        if lease is not None and (granted is None or granted[0] != lease or lease in self._shared_leases):
            # Not a lease this replica granted for this session alone (a batch's, or another
            # replica's that may be one too): revoking it would take other sessions' keys along.
            lease = None
        if self.healthy and self._client is not None:
            try:
                self._background(self._delete(record.session_id, lease))
            except RuntimeError:  # no running loop (a table filled outside the router)
                pass

    async def _delete(self, session_id: str, lease: int | None) -> None:
        try:
            if lease:
                await self._client.revoke_lease(lease)  # its key goes with it
            else:
                await self._client.delete(self.prefix + session_id.encode())
        except Exception:  # noqa: BLE001 (gone already, or etcd away: its lease expires anyway)
            pass

    # -- sync ------------------------------------------------------------------------------------
    async def _load(self) -> tuple[list[Any], int]:
        """All session key-values, in pages of `LOAD_PAGE` at one revision (a single range of
        everything breaks past ~16k sessions on gRPC's 4 MiB message limit)."""
        from aetcd import rpc, utils

        await self._client.connect()
        start, end = self.prefix, utils.prefix_range_end(self.prefix)
        kvs: list[Any] = []
        revision = 0
        while True:
            response = await self._client.kvstub.Range(
                rpc.RangeRequest(key=start, range_end=end, limit=LOAD_PAGE, revision=revision),
                timeout=self._client._timeout, metadata=self._client.metadata)
            revision = revision or response.header.revision
            kvs.extend(response.kvs)
            if not response.more or not response.kvs:
                return kvs, revision
            start = response.kvs[-1].key + b"\x00"  # the next key after the page's last

    async def _resync(self) -> None:
        """Write back what changed while etcd was away, reload everything, then watch."""
        await self._write_dirty()
        kvs, revision = await self._load()
        records = []
        for kv in kvs:
            try:
                record = decode(kv.value)
            except msgspec.DecodeError:
                log.warning("ignoring malformed session record at %r", kv.key)
                continue
            records.append(record)
            if kv.lease:
                self._leases.setdefault(record.session_id, kv.lease)
        records.sort(key=lambda r: r.last_access)  # LRU order: past --max-sessions, the oldest go
        self.table = self._new_table()
        self._set_health(True)
        for record in records:
            self.table.put(record)
        self._tasks.append(asyncio.get_running_loop().create_task(
            self._watch(revision + 1 if revision else None), name="etcd-watch"))

    async def _watch(self, start_revision: int | None) -> None:
        import aetcd

        try:
            async for event in await self._client.watch_prefix(self.prefix, start_revision=start_revision):
                self._last_ok = time.monotonic()
                session_id = event.kv.key[len(self.prefix):].decode()
                if event.kind != aetcd.EventKind.DELETE and self._echo.get(session_id) == event.kv.value:
                    del self._echo[session_id]  # our own batched write: the table has it
                    continue
                if event.kind == aetcd.EventKind.DELETE:
                    if session_id not in self._dirty:
                        self.table.remove(session_id)
                        self._leases.pop(session_id, None)
                        self._refreshed.pop(session_id, None)
                    continue
                try:
                    record = decode(event.kv.value)
                except msgspec.DecodeError:
                    continue
                local = self.table.get(record.session_id)
                if local is not None and record.turn < local.turn:
                    continue  # the echo of an older write: the local table is ahead
                self.table.put(record)
                if event.kv.lease:
                    self._leases[record.session_id] = event.kv.lease
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._set_health(False, exc)

    async def _monitor(self) -> None:
        """Every second: expire idle sessions locally; probe a healthy etcd that no call has
        reached for `PROBE_AFTER_S`; while unhealthy, try to get etcd back."""
        while True:
            await asyncio.sleep(1.0)
            self.table.expire(time.time(), self.ttl_s)
            if self.healthy:
                if time.monotonic() - self._last_ok < PROBE_AFTER_S:
                    continue
                try:
                    await self._client.status()
                    self._last_ok = time.monotonic()
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

    def _kept_local(self, record: SessionRecord) -> bool:
        """Put the record in the local table; True, and marked for the resync, while etcd is away
        (the write to etcd then waits)."""
        self.table.put(record)
        if self.healthy:
            return False
        self._sync_later(record)
        return True

    def _sync_later(self, record: SessionRecord, exc: Exception | None = None) -> None:
        """etcd is away (or a write to it just failed with ``exc``): the record stays in the local
        table, marked for the resync that follows etcd's return."""
        if exc is not None:
            self._set_health(False, exc)
        self._dirty.add(record.session_id)

    def _set_health(self, healthy: bool, exc: Exception | None = None) -> None:
        if not healthy and not self._warned:
            log.warning("etcd unavailable (%s): routing continues from the local session cache", exc)
            self._warned = True
        self.healthy = healthy
        if self._on_health:
            self._on_health(healthy)


def _lease_gone(exc: BaseException) -> bool:
    """etcd's answer to a put or keep-alive under a lease that expired or was revoked."""
    return "lease not found" in str(exc).lower()
