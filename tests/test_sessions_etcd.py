"""The session table against a real etcd: a paged load of more sessions than one gRPC message
holds, leases replaced when they are gone, read-through, flush on stop, LRU eviction in etcd."""

from __future__ import annotations

import asyncio
import time

import aetcd
import pytest

from dynamo_ppd.launch.launcher import wait_ready
from dynamo_ppd.launch.process import free_port, stop_all
from dynamo_ppd.launch.servers import etcd_process
from dynamo_ppd.routing.sessions import EtcdSessions, SessionRecord, encode
from dynamo_ppd.routing.sessions import decode as decode_value

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def etcd_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sessions-etcd")
    port = free_port()
    proc = etcd_process(port, tmp / "data", tmp / "etcd.log")
    proc.start()
    wait_ready([proc], log=lambda _message: None)  # LaunchError if it exits or is not up in 20 s
    yield f"http://127.0.0.1:{port}"
    stop_all([proc])


def client_for(url: str) -> aetcd.Client:
    port = int(url.rsplit(":", 1)[1])
    return aetcd.Client(host="127.0.0.1", port=port, timeout=10)


def test_more_sessions_than_one_grpc_message_holds_are_all_loaded(etcd_url):
    count = 20_000  # ~470 bytes each: ~9 MB, past gRPC's 4 MiB (one unpaginated range failed)

    async def run():
        async with client_for(etcd_url) as client:
            tx = client.transactions
            for start in range(0, count, 100):
                await client.transaction(compare=[], success=[
                    tx.put(f"big/sessions/{i:0200d}".encode(),
                           encode(SessionRecord(f"{i:0200d}", decode_worker=i, turn=1, context_tokens=900,
                                                history_hash=i, history_digest=i, last_access=float(i))))
                    for i in range(start, min(count, start + 100))], failure=[])
        sessions = EtcdSessions(etcd_url, prefix="big", max_sessions=50_000)
        await sessions.start()
        try:
            assert sessions.healthy and len(sessions.table) == count
            assert sessions.get(f"{count - 1:0200d}").decode_worker == count - 1
        finally:
            await sessions.stop()

    asyncio.run(run())


def test_a_revoked_lease_is_replaced_and_the_record_written_again(etcd_url):
    async def run():
        sessions = EtcdSessions(etcd_url, prefix="lease", ttl_s=60)
        await sessions.start()
        try:
            await sessions.save(SessionRecord("s1", decode_worker=1, turn=1))
            old = sessions._leases["s1"]
            async with client_for(etcd_url) as client:
                await client.revoke_lease(old)  # behind the router's back: the key goes with it
                assert (await client.refresh_lease(old)).TTL == 0  # aetcd: no error, TTL 0
                await asyncio.sleep(0.2)  # the watch delivers the delete
                await sessions.save(SessionRecord("s1", decode_worker=1, turn=2))
                found = await client.get(b"lease/sessions/s1")
                assert found is not None and found.lease != old
                assert (await client.get_lease_info(found.lease)).TTL > 0
            assert sessions.healthy
            # The wedge: the lease died while etcd was away (no delete event reached us), and
            # the write-back on resync retried the dead lease forever.
            sessions._set_health(False)
            for task in [t for t in sessions._tasks if t.get_name() == "etcd-watch"]:
                task.cancel()
                sessions._tasks.remove(task)
            await sessions.save(SessionRecord("s1", decode_worker=1, turn=3))  # dirty
            async with client_for(etcd_url) as client:
                await client.revoke_lease(sessions._leases["s1"])
                await sessions._resync()
                found = await client.get(b"lease/sessions/s1")
                assert found is not None and (await client.get_lease_info(found.lease)).TTL > 0
            assert sessions.healthy and sessions.get("s1").turn == 3
        finally:
            await sessions.stop()

    asyncio.run(run())


def test_a_turn_soon_after_the_last_refreshes_no_lease_and_a_late_one_does(etcd_url, monkeypatch):
    """One etcd call per turn while the lease is fresh (this replica granted or refreshed it less
    than 10% of the TTL ago), put + refresh after that; a fresh lease revoked behind our back
    (no watch event: the put is the first to find out) is still replaced."""
    from dynamo_ppd.routing import sessions as sessions_module

    async def run():
        sessions = EtcdSessions(etcd_url, prefix="fresh", ttl_s=60)
        await sessions.start()
        refreshes = []
        real_refresh = sessions._client.refresh_lease

        async def counted(lease):
            refreshes.append(lease)
            return await real_refresh(lease)

        sessions._client.refresh_lease = counted
        try:
            won = await sessions.claim(SessionRecord("s1", decode_worker=1))
            assert won.decode_worker == 1
            lease = sessions._leases["s1"]
            await sessions.save(SessionRecord("s1", decode_worker=1, turn=1))
            await sessions.save(SessionRecord("s1", decode_worker=1, turn=2))
            assert refreshes == []  # granted a moment ago
            monkeypatch.setattr(sessions_module, "REFRESH_AFTER_TTL_FRACTION", 0.0)
            await sessions.save(SessionRecord("s1", decode_worker=1, turn=3))
            assert refreshes == [lease]
            monkeypatch.setattr(sessions_module, "REFRESH_AFTER_TTL_FRACTION", 0.1)
            for task in [t for t in sessions._tasks if t.get_name() == "etcd-watch"]:
                task.cancel()  # no delete event will tell us
                sessions._tasks.remove(task)
            async with client_for(etcd_url) as client:
                await client.revoke_lease(lease)
                await sessions.save(SessionRecord("s1", decode_worker=1, turn=4))
                found = await client.get(b"fresh/sessions/s1")
                assert found is not None and found.lease != lease
                assert (await client.get_lease_info(found.lease)).TTL > 0
                assert decode_value(found.value).turn == 4
        finally:
            await sessions.stop()

    asyncio.run(run())


def test_another_replica_reads_a_record_through_before_its_watch_and_stop_flushes(etcd_url):
    async def run():
        a = EtcdSessions(etcd_url, prefix="replicas")
        b = EtcdSessions(etcd_url, prefix="replicas")
        await a.start()
        await b.start()
        try:
            await a.commit(SessionRecord("conv", decode_worker=7, turn=3))
            # In etcd when commit returns: a linearizable get finds it, watch or not.
            b.table.remove("conv")
            assert (await b.read_through("conv")).turn == 3
            await a.commit(SessionRecord("late", decode_worker=8, turn=1), wait_s=0)  # still pending
        finally:
            await a.stop()  # flushes the pending write
            await b.stop()
        async with client_for(etcd_url) as client:
            assert await client.get(b"replicas/sessions/late") is not None

    asyncio.run(run())


def test_sessions_past_the_bound_are_evicted_from_etcd_too(etcd_url):
    async def run():
        evicted = []
        sessions = EtcdSessions(etcd_url, prefix="bound", max_sessions=2,
                                on_evict=lambda: evicted.append(1))
        await sessions.start()
        try:
            for i in range(3):
                await sessions.commit(SessionRecord(f"s{i}", decode_worker=i, turn=1,
                                                    last_access=time.time()))
            await sessions.flush()
            async with client_for(etcd_url) as client:
                keys = sorted(kv.key for kv in await client.get_prefix(b"bound/sessions/"))
            assert keys == [b"bound/sessions/s1", b"bound/sessions/s2"] and evicted == [1]
        finally:
            await sessions.stop()

    asyncio.run(run())


def test_a_follow_up_on_a_replica_that_has_not_seen_the_record_yet_is_routed_right(etcd_url):
    """Two routers on one etcd; the second one's watch lags (stopped here): the follow-up it gets
    right after the first turn's answer still goes to the conversation's decode worker as turn 2
    (the record was in etcd before the answer ended, and a header miss reads it through)."""
    import dataclasses

    from test_router_dispatch import hold, make_router, turn

    async def run():
        routers = [make_router() for _ in range(2)]
        for router in routers:
            router.config = dataclasses.replace(router.config, session_prefix="race")
            router.sessions = EtcdSessions(etcd_url, prefix="race")
            await router.sessions.start()
        a, b = routers
        try:
            for task in [t for t in b.sessions._tasks if t.get_name() == "etcd-watch"]:
                task.cancel()  # b hears nothing more from etcd's watch
            first = list(range(2000, 2300))
            out = await turn(a, first, session="raced")
            decode = a.clients["decode"].sent[-1][0]
            hold(b, decode, first + out)
            await turn(b, first + out + [7, 8, 9], session="raced")
            worker, request = b.clients["decode"].sent[-1]
            assert worker == decode and "prefill_result" not in request  # decode-local, right worker
            assert b.sessions.get("raced").turn == 2 and b.clients["prefill"].sent == []
        finally:
            for router in routers:
                await router.sessions.stop()

    asyncio.run(run())


def test_a_healthy_etcd_is_probed_only_when_no_other_call_reached_it_lately(etcd_url):
    """The monitor's status call (~2.5 ms of CPU each) is skipped while turns' writes succeed, and
    made again once they stop, so an etcd that goes quiet is still checked every second or two."""
    async def run():
        sessions = EtcdSessions(etcd_url, prefix="probe", ttl_s=60)
        await sessions.start()
        probes = 0
        status = sessions._client.status

        async def counted():
            nonlocal probes
            probes += 1
            return await status()

        sessions._client.status = counted
        try:
            for turn in range(1, 16):  # 3 s of turns, one every 0.2 s
                await sessions.save(SessionRecord("s1", decode_worker=1, turn=turn))
                await asyncio.sleep(0.2)
            assert probes == 0
            await asyncio.sleep(3.5)  # no calls now: the monitor probes again
            assert probes >= 1 and sessions.healthy
        finally:
            await sessions.stop()

    asyncio.run(run())


def test_write_behind_batches_turns_into_one_transaction_under_a_shared_lease(etcd_url):
    """`record_later` (the picker's): the table has the record at once; etcd gets a batch's
    records in one transaction under one lease that outlives the session TTL; another replica
    sees them through its watch; this replica skips the echo of its own writes; evicting one
    batched session deletes its key only (the shared lease is never revoked); stop flushes what
    is still queued."""

    async def run():
        writer = EtcdSessions(etcd_url, prefix="behind", ttl_s=60, max_sessions=20)
        reader = EtcdSessions(etcd_url, prefix="behind", ttl_s=60)
        await writer.start()
        await reader.start()
        transactions = []
        real_transaction = writer._client.transaction

        async def counted(*args, **kwargs):
            transactions.append(len(kwargs["success"]))
            return await real_transaction(*args, **kwargs)

        writer._client.transaction = counted
        try:
            for i in range(10):
                writer.record_later(SessionRecord(f"s{i}", decode_worker=i, turn=1))
            writer.record_later(SessionRecord("s3", decode_worker=3, turn=2))  # replaces s3's turn 1
            assert writer.get("s3").turn == 2 and transactions == []  # local now, etcd later
            await asyncio.sleep(0.3)
            assert transactions == [10]
            async with client_for(etcd_url) as client:
                found = [await client.get(f"behind/sessions/s{i}".encode()) for i in range(10)]
                assert all(f is not None for f in found)
                assert len({f.lease for f in found}) == 1
                assert (await client.get_lease_info(found[0].lease)).TTL > 60
                assert decode_value(found[3].value).turn == 2
            assert reader.get("s3") is not None and reader.get("s3").turn == 2
            assert writer._echo == {}  # every echo came back and was skipped
            # Eviction: 11 more sessions past --max-sessions 20 evict the oldest (s0) alone.
            for i in range(10, 21):
                writer.record_later(SessionRecord(f"s{i}", decode_worker=i, turn=1))
            await asyncio.sleep(0.3)
            async with client_for(etcd_url) as client:
                assert await client.get(b"behind/sessions/s0") is None
                assert await client.get(b"behind/sessions/s1") is not None
            writer.record_later(SessionRecord("last", decode_worker=1, turn=1))
        finally:
            await writer.stop()  # flushes "last", still queued
            await reader.stop()
        async with client_for(etcd_url) as client:
            assert await client.get(b"behind/sessions/last") is not None

    asyncio.run(run())


def test_write_behind_while_etcd_is_away_is_written_on_its_return(etcd_url):
    async def run():
        sessions = EtcdSessions(etcd_url, prefix="behind-away", ttl_s=60)
        await sessions.start()
        try:
            sessions._set_health(False)
            sessions.record_later(SessionRecord("s1", decode_worker=1, turn=1))
            assert sessions.get("s1") is not None and "s1" in sessions._dirty
            for task in [t for t in sessions._tasks if t.get_name() == "etcd-watch"]:
                task.cancel()
                sessions._tasks.remove(task)
            await sessions._resync()
            async with client_for(etcd_url) as client:
                found = await client.get(b"behind-away/sessions/s1")
                assert found is not None and decode_value(found.value).turn == 1
        finally:
            await sessions.stop()

    asyncio.run(run())
