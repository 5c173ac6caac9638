"""The residency index recovers: event-id gaps and orphan stores ask for a rebuild, a rebuild from a
worker's dump replaces its view (phantoms gone, orphans placed), workers that leave are forgotten;
and the adapter (kv_sync) schedules rebuilds, forgets workers and reports silent ones."""

from __future__ import annotations

import asyncio
import json

import pytest

from dynamo_ppd.engine.blocks import prefix_chain
from dynamo_ppd.routing import kv_sync
from dynamo_ppd.routing.kv_sync import KvSync, SilenceWatch
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.residency import Residency

pytestmark = pytest.mark.unit

TOKENS = [101, 102, 103, 104, 105, 106]  # token hashes of six consecutive blocks
CHAIN = prefix_chain(TOKENS)


def stored(event_id: int, first: int, last: int, parent: int | None = None) -> dict:
    """Blocks ``first..last`` (block id = 1000 + index) stored under ``parent``."""
    blocks = [{"block_hash": 1000 + i, "tokens_hash": TOKENS[i]} for i in range(first, last + 1)]
    return {"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}


def removed(event_id: int, *indices: int) -> dict:
    return {"event_id": event_id, "data": {"removed": {"block_hashes": [1000 + i for i in indices]}}}


def test_consecutive_events_need_no_rebuild():
    r = Residency(32)
    r.apply(7, stored(0, 0, 2))
    r.apply(7, stored(1, 3, 5, parent=1002))
    assert r.held_blocks(7, CHAIN) == 6
    assert r.take_resync_requests() == {} and r.gaps == r.orphans == 0


def test_a_gap_in_event_ids_asks_for_a_rebuild_and_still_applies():
    r = Residency(32)
    r.apply(7, stored(0, 0, 2))
    r.apply(7, stored(5, 3, 5, parent=1002))  # events 1-4 were lost
    assert r.gaps == 1 and r.take_resync_requests() == {7: "gap"}
    assert r.held_blocks(7, CHAIN) == 6
    r.apply(7, removed(2, 5))  # ids going back: a restarted count or reordering
    assert r.take_resync_requests() == {7: "reordered"}


def test_event_ids_are_counted_per_data_parallel_rank():
    r = Residency(32)
    r.apply(7, stored(0, 0, 2), dp_rank=0)
    r.apply(7, removed(0, 9), dp_rank=1)  # rank 1's own count starts at 0 too
    r.apply(7, stored(1, 3, 5, parent=1002), dp_rank=0)
    assert r.take_resync_requests() == {}


def test_an_orphan_store_is_never_silently_final():
    r = Residency(32)
    r.apply(7, stored(10, 3, 5, parent=1002))  # its parent was stored before we subscribed
    assert r.orphans == 1 and r.take_resync_requests() == {7: "orphan"}
    assert r.held_blocks(7, CHAIN) == 0 and r.unresolved_orphans(7) == 3
    # The worker's dump has the parent chain (and the orphan, as Dynamo's indexer got it too).
    assert r.replace_worker(7, [stored(0, 3, 5, parent=1002), stored(0, 0, 2)]) == 0
    assert r.held_blocks(7, CHAIN) == 6


def test_an_orphan_that_arrives_while_the_dump_is_taken_is_replayed_and_placed():
    r = Residency(32)
    since = r.mark()  # the rebuild is asked for
    r.apply(7, stored(10, 3, 5, parent=1002))
    assert r.replace_worker(7, [stored(0, 0, 2)], since) == 0
    assert r.held_blocks(7, CHAIN) == 6


def test_a_dump_replaces_the_view_and_the_events_received_meanwhile_are_replayed():
    r = Residency(32)
    r.apply(7, stored(0, 0, 5))
    # While we were away (say, a NATS outage), blocks 4-5 were evicted: the dump no longer has them.
    dump = [stored(0, 1, 3, parent=1000), stored(0, 0, 0)]  # any order: parents are found first
    since = r.mark()
    assert r.replace_worker(7, dump, since) == 0
    assert r.held_blocks(7, CHAIN) == 4  # no phantom blocks 4-5 (the old event is not replayed)
    # An event that reached us while the dump was taken is not lost (replayed over it) ...
    r.apply(7, removed(1, 3))
    r.apply(7, stored(2, 3, 3, parent=1002))
    r.apply(7, removed(3, 3))
    r.replace_worker(7, dump, since)
    assert r.held_blocks(7, CHAIN) == 3  # in stream order: the last event on block 3 wins
    # ... and replaying what the dump already holds is idempotent (no double counts).
    r.replace_worker(7, [*dump, stored(0, 3, 3, parent=1002)], since)
    assert r.held_blocks(7, CHAIN) == 3
    r.apply(7, removed(4, 2))
    assert r.held_blocks(7, CHAIN) == 2


def test_a_dump_without_the_parent_leaves_the_orphan_reported():
    r = Residency(32)
    since = r.mark()
    r.apply(7, stored(3, 4, 5, parent=1003))
    assert r.replace_worker(7, [stored(0, 0, 1)], since) == 2  # block 1003 is nowhere: unknown
    assert r.held_blocks(7, CHAIN) == 2


def test_forget_worker_drops_everything():
    r = Residency(32)
    r.apply(7, stored(4, 0, 5))
    r.apply(7, stored(6, 0, 0))
    r.forget_worker(7)
    assert r.held_blocks(7, CHAIN) == 0 and not r.has_events(7)
    r.apply(7, stored(0, 0, 1))  # a fresh count (as from a new publisher): not a step back
    assert r.take_resync_requests() == {}


def test_silence_watch_reports_once_and_clears_when_heard():
    watch = SilenceWatch(after_s=10)
    assert watch.observe(5, 0.0, busy=False, has_state=False) is None  # idle: nothing to say
    assert watch.observe(5, 1.0, busy=True, has_state=False) is None
    assert watch.observe(5, 10.5, busy=False, has_state=False) is None  # busy since 1.0: 9.5 s
    assert watch.observe(5, 11.0, busy=False, has_state=False) == "silent"
    assert watch.observe(5, 30.0, busy=True, has_state=False) is None  # said once
    assert watch.observe(5, 31.0, busy=True, has_state=True) == "heard" and not watch.silent


class FakeClient:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def instance_ids(self) -> list[int]:
        return list(self.ids)


class FakeSource:
    """Stands for Dynamo's KvRouter: its dump_events() as a JSON string of router events."""

    def __init__(self, events: list[dict]):
        self.events = events
        self.dumps = 0

    async def dump_events(self) -> str:
        self.dumps += 1
        return json.dumps(self.events)


def test_kv_sync_rebuilds_at_start_on_orphans_and_forgets_gone_workers(monkeypatch):
    monkeypatch.setattr(kv_sync, "FIRST_DELAY_S", {})
    monkeypatch.setattr(kv_sync, "DEFAULT_FIRST_DELAY_S", 0.0)
    monkeypatch.setattr(kv_sync, "CONFIRM_DELAY_S", 0.0)
    monkeypatch.setattr(kv_sync, "RETRY_DELAYS_S", (0.0,))
    monkeypatch.setattr(kv_sync, "DUMP_REUSE_S", 0.0)

    async def scenario():
        residency, metrics = Residency(32), RoutingMetrics()
        decode = FakeClient([7, 8])
        sync = KvSync(None, residency, metrics, "workers", {"decode": "backend"}, {"decode": decode},
                      busy=lambda w: w == 8, silent_after_s=0.0)
        source = FakeSource([{"worker_id": 7, "event": stored(0, 0, 2)},
                             {"worker_id": 9, "event": stored(0, 0, 5)}])
        sync._sources = {"backend": source}
        sync.poll(0.0)  # first poll: both workers rebuilt ("start")
        await asyncio.sleep(0.05)
        assert residency.held_blocks(7, CHAIN) == 3 and residency.held_blocks(9, CHAIN) == 0
        # Worker 8 serves turns, publishes nothing, and its local indexer holds nothing: silent.
        assert sync.silence.silent == {8}
        assert metrics.kv_silent_workers._value.get() == 1
        # An orphan (its parent is in the worker's tree by now) triggers a rebuild that places it.
        source.events += [{"worker_id": 7, "event": stored(0, 3, 3, parent=1002)},
                          {"worker_id": 7, "event": stored(0, 4, 5, parent=1003)}]
        residency.apply(7, stored(11, 4, 5, parent=1003))
        sync._drain()
        await asyncio.sleep(0.05)
        assert residency.held_blocks(7, CHAIN) == 6
        assert metrics.residency_orphans._value.get() == 1
        assert metrics.residency_resyncs.labels("orphan")._value.get() == 1
        assert metrics.residency_resyncs.labels("start")._value.get() == 2
        # Worker 7 leaves discovery: forgotten at the next poll; worker 9 appears: rebuilt.
        decode.ids = [8, 9]
        sync.poll(1.0)
        assert residency.held_blocks(7, CHAIN) == 0 and not residency.has_events(7)
        await asyncio.sleep(0.05)
        assert residency.held_blocks(9, CHAIN) == 6
        assert metrics.residency_resyncs.labels("discovered")._value.get() == 1
        # NATS reconnected: every known worker is rebuilt (what was published meanwhile is lost).
        sync.reconnected()
        await asyncio.sleep(0.05)
        assert metrics.residency_resyncs.labels("nats_reconnect")._value.get() == 2
        await sync.stop()

    asyncio.run(scenario())


def test_a_rebuild_asked_for_while_one_runs_is_not_lost(monkeypatch):
    monkeypatch.setattr(kv_sync, "FIRST_DELAY_S", {})
    monkeypatch.setattr(kv_sync, "DEFAULT_FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(kv_sync, "CONFIRM_DELAY_S", 0.0)
    monkeypatch.setattr(kv_sync, "DUMP_REUSE_S", 0.0)

    async def scenario():
        residency, metrics = Residency(32), RoutingMetrics()
        sync = KvSync(None, residency, metrics, "workers", {"decode": "backend"},
                      {"decode": FakeClient([7])}, busy=lambda w: False)
        source = FakeSource([{"worker_id": 7, "event": stored(0, 0, 2)}])
        sync._sources = {"backend": source}
        sync.request(7, "gap")
        sync.request(7, "orphan")  # arrives while the first rebuild runs
        await asyncio.sleep(0.1)
        assert metrics.residency_resyncs.labels("gap")._value.get() == 1
        assert metrics.residency_resyncs.labels("orphan")._value.get() == 1
        await sync.stop()

    asyncio.run(scenario())


def test_without_recovery_live_events_are_the_only_source():
    """--no-residency-recovery: no Dynamo indexer is made (`start` does not import one), the KV
    events are still subscribed, and a gap asks for no rebuild (the view keeps what events said)."""

    class FakeEvents:  # `KvEventThread`'s signature
        made: list[FakeEvents] = []

        def __init__(self, url, subjects, apply, on_reconnect):
            self.url, self.subjects = url, subjects
            FakeEvents.made.append(self)

        def start(self):
            pass

        def stop(self):
            pass

    async def scenario():
        residency, metrics = Residency(32), RoutingMetrics()
        sync = KvSync(None, residency, metrics, "workers", {"prefill": "prefill", "decode": "backend"},
                      {"decode": FakeClient([7])}, busy=lambda w: False, recovery=False,
                      event_source=FakeEvents)
        await sync.start("nats://127.0.0.1:4222")
        assert sync._sources == {}
        [events] = FakeEvents.made
        assert events.url == "nats://127.0.0.1:4222"
        assert sorted(events.subjects) == sorted(
            f"namespace.workers.component.{c}.endpoint.generate.kv-events" for c in ("prefill", "backend"))
        residency.apply(7, stored(0, 0, 2))
        residency.apply(7, stored(5, 3, 5, parent=1002))  # a gap: events 1-4 lost
        sync._drain()
        assert sync._pending == {} and residency.held_blocks(7, CHAIN) == 6
        assert metrics.residency_gaps._value.get() == 1  # still counted
        await sync.stop()

    asyncio.run(scenario())
