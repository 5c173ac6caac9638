"""The session table (pure): whole-history matching, who may match whom, owner-only index
removal, the LRU bound; and the router's session lookup in process (forks, the id bound)."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_ppd.engine.blocks import prefix_chain
from dynamo_ppd.routing.sessions import (
    MAX_SESSION_ID_BYTES,
    SessionRecord,
    SessionTable,
    check_session_id,
    history_hashes,
)

BS = 32


def chain_of(tokens: list[int]) -> list[int]:
    """Prefix ids of the tokens' full blocks (a block's 'token hash' here: its tokens' tuple)."""
    return prefix_chain([hash(tuple(tokens[i:i + BS])) for i in range(0, len(tokens) // BS * BS, BS)])


def record(session_id: str, history: list[int], decode: int = 1, turn: int = 1) -> SessionRecord:
    anchor, digest = history_hashes(chain_of(history), history, BS)
    return SessionRecord(session_id, decode_worker=decode, turn=turn, context_tokens=len(history),
                         history_hash=anchor, history_digest=digest)


def find(table: SessionTable, prompt: list[int], **kw) -> str | None:
    found = table.find_by_prefix(chain_of(prompt), prompt, **kw)
    return found.session_id if found else None


SYSTEM = list(range(1000, 1000 + 10 * BS))  # a shared 320-token system prompt: ten full blocks


@pytest.mark.unit
def test_a_shared_system_prompt_never_merges_two_users():
    # A's history: the system prompt, then a short exchange (its only full blocks are shared).
    a_history = SYSTEM + [1, 2, 3, 4, 5, 6, 7]
    table = SessionTable(BS)
    table.put(record("auto-a", a_history))
    b_first = SYSTEM + [9, 9, 9, 9, 9, 9, 9, 9, 9]
    assert find(table, b_first) is None  # B's first request is not turn 2 of A
    assert find(table, a_history + [50, 51, 52]) == "auto-a"  # A's own follow-up still matches


@pytest.mark.unit
def test_the_longest_whole_history_wins_and_a_next_turn_replaces_its_own_entry():
    table = SessionTable(BS)
    short = SYSTEM + list(range(5000, 5040))
    long = short + list(range(6000, 6100))
    table.put(record("auto-short", short, decode=1))
    table.put(record("auto-long", long, decode=2))
    assert find(table, long + [7]) == "auto-long"
    assert find(table, short + [7]) == "auto-short"
    assert find(table, short[:-1]) is None  # a prompt shorter than the history does not continue it
    longer = long + list(range(7000, 7050))
    table.put(record("auto-long", longer, decode=2, turn=2))  # its next turn
    assert find(table, long + [7]) == "auto-short"  # its old entry is gone, only its own
    assert find(table, longer + [1]) == "auto-long"


@pytest.mark.unit
def test_index_entries_are_removed_only_by_their_owner():
    table = SessionTable(BS)
    same = SYSTEM + [1, 2, 3]
    table.put(record("auto-a", same, decode=1))
    table.put(record("auto-b", same, decode=2))  # identical history: indistinguishable
    assert find(table, same + [4]) == "auto-b"  # the newest of the two
    table.remove("auto-b")
    assert find(table, same + [4]) == "auto-a"  # B's removal left A's entry alone
    table.put(record("auto-b", same + [4, 5, 6], decode=2, turn=2))
    table.put(record("auto-b", same + [4, 5, 6, 7, 8], decode=2, turn=3))
    assert find(table, same + [9]) == "auto-a"


@pytest.mark.unit
def test_header_sessions_and_forks_are_matched_only_within_their_id():
    table = SessionTable(BS)
    history = SYSTEM + list(range(3000, 3050))
    table.put(record("alice", history))
    assert find(table, history + [1]) is None  # a headerless prompt never joins a header session
    table.put(record("alice#f1", SYSTEM + [8, 8, 8]))
    assert find(table, SYSTEM + [8, 8, 8, 1], accept=lambda s: s.startswith("alice#")) == "alice#f1"
    assert find(table, SYSTEM + [8, 8, 8, 1], accept=lambda s: s.startswith("bob#")) is None


@pytest.mark.unit
def test_continues_needs_the_whole_history():
    table = SessionTable(BS)
    history = SYSTEM + [1, 2, 3, 4]
    r = record("alice", history)
    assert table.continues(r, chain_of(history + [5]), history + [5])
    other = SYSTEM + [1, 2, 3, 9, 5]  # same full blocks, another tail
    assert not table.continues(r, chain_of(other), other)
    assert not table.continues(r, chain_of(history[:-1]), history[:-1])
    assert table.continues(SessionRecord("claimed"), [], [1])  # no history yet: any prompt


@pytest.mark.unit
def test_the_table_is_bounded_least_recently_used_first():
    evicted = []
    table = SessionTable(BS, max_sessions=3, on_evict=evicted.append)
    for i in range(3):
        table.put(record(f"auto-{i}", SYSTEM + [i]))
    table.get("auto-0")  # used: now the most recent
    table.put(record("auto-3", SYSTEM + [3]))
    assert [r.session_id for r in evicted] == ["auto-1"] and table.evicted == 1
    assert len(table) == 3 and table.get("auto-1") is None
    assert find(table, SYSTEM + [1, 0]) is None  # its index entry went with it
    assert find(table, SYSTEM + [0, 0]) == "auto-0"
    assert table.expire(now=10_000.0, ttl_s=60) == 3 and len(table) == 0  # all idle since t=0


@pytest.mark.e2e  # fresh Python processes, each with its own hash seed
def test_history_hashes_are_the_same_in_every_process():
    """Replicas compare each other's records: no salted (str/bytes) hashing may enter them."""
    import os
    import subprocess
    import sys

    history = SYSTEM + [1, 2, 3]
    code = ("from dynamo_ppd.engine.blocks import prefix_chain;"
            "from dynamo_ppd.routing.sessions import history_hashes;"
            f"h={history!r};c=prefix_chain([hash(tuple(h[i:i+32])) for i in range(0, len(h)//32*32, 32)]);"
            "print(history_hashes(c, h, 32))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{history_hashes(chain_of(history), history, BS)}\n"}


@pytest.mark.unit
def test_session_ids_are_bounded():
    from dynamo.llm.exceptions import InvalidArgument

    check_session_id("x" * MAX_SESSION_ID_BYTES)
    check_session_id(None)
    with pytest.raises(InvalidArgument, match="limit is 256"):
        check_session_id("x" * 10_000)


# -- the router's lookup, in process (scripted workers, no etcd) ---------------------------------
@pytest.mark.unit
def test_a_turn_that_does_not_continue_its_session_is_a_fork_and_leaves_the_owner_alone():
    from test_router_dispatch import D1, D2, hold, make_router, turn

    async def run():
        router = make_router()
        owner = list(range(2000, 2300))
        out = await turn(router, owner, session="alice")
        owner_decode = router.sessions.get("alice").decode_worker
        hold(router, owner_decode, owner + out)
        before = router.sessions.get("alice")
        # Another conversation under alice's id; the other decode worker holds its prefix.
        spoof = list(range(7000, 7300))
        other_decode = D2 if owner_decode == D1 else D1
        hold(router, other_decode, spoof)
        await turn(router, spoof + [1, 2, 3], session="alice")
        worker, request = router.clients["decode"].sent[-1]
        assert worker == other_decode  # routed by residency, decode-local there
        assert request["annotations"] == ["x-bypass-remote-prefill"]
        assert router.sessions.get("alice") == before  # the owner's record is untouched
        forks = [r for r in router.sessions.table.records() if r.session_id.startswith("alice#")]
        assert len(forks) == 1 and forks[0].decode_worker == other_decode
        # The owner's next turn still matches and runs on the owner's decode worker.
        await turn(router, owner + out + [5, 6, 7], session="alice")
        assert router.clients["decode"].sent[-1][0] == owner_decode
        assert router.sessions.get("alice").turn == 2
        assert router.metrics.session_forks._value.get() == 1

    asyncio.run(run())


@pytest.mark.unit
def test_a_long_session_id_is_a_400_before_any_work():
    from dynamo.llm.exceptions import InvalidArgument
    from test_router_dispatch import make_router, turn

    async def run():
        router = make_router()
        with pytest.raises(InvalidArgument, match="x-dynamo-session-id"):
            await turn(router, list(range(2000, 2100)), session="s" * 10_000)
        assert router.clients["prefill"].sent == [] and router.clients["decode"].sent == []
        assert len(router.sessions.table) == 0
        # Counted as the picker counts it: a client's bad request.
        assert router.metrics.errors.labels("bad_request")._value.get() == 1

    asyncio.run(run())


@pytest.mark.unit
def test_with_etcd_away_a_header_miss_is_routed_by_residency():
    """A follow-up whose previous turn another replica recorded while etcd was away: this
    replica has no record, but the decode worker holding most of its prompt takes it."""
    from test_router_dispatch import hold, make_router, turn

    async def run():
        a, b = make_router(), make_router()  # never started: etcd is away for both
        first = list(range(2000, 2300))
        out = await turn(a, first, session="outage")
        decode = a.clients["decode"].sent[-1][0]
        hold(b, decode, first + out)
        await turn(b, first + out + [1, 2, 3], session="outage")
        worker, request = b.clients["decode"].sent[-1]
        assert worker == decode and "prefill_result" not in request and b.sessions.get("outage").turn == 2
        await turn(b, list(range(5000, 5100)), session="new-one")  # nobody holds it: a first turn
        assert b.sessions.get("new-one").turn == 1 and len(b.clients["prefill"].sent) == 1

    asyncio.run(run())


@pytest.mark.unit
def test_the_request_rate_is_the_sum_of_the_replicas_fresh_rates():
    from dynamo_ppd.policy.qps import SlidingWindowRate
    from dynamo_ppd.routing.rate_share import RateReport, SharedRate

    mine = SharedRate(SlidingWindowRate(window_s=10.0), router_id="r1", fresh_s=3.0)
    for i in range(40):
        mine.record(90.25 + i * 0.5)  # 2 requests/s over the last 10 s
    assert mine.rate(110.0) == pytest.approx(2.0)
    mine.peer_report(RateReport("r2", 3.0), now=109.0)
    mine.peer_report(RateReport("r1", 99.0), now=109.0)  # its own report, echoed back: ignored
    assert mine.rate(110.0) == pytest.approx(5.0)
    assert mine.rate(112.5) == pytest.approx(mine.local_rate(112.5))  # r2 went stale
