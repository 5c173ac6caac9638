"""The router's decision (`router.planner`), called on views built here: no router, no processes,
no patching. Workers: prefill P=1, decode D1=11 and D2=12, aggregated R=5; a 2048-token
follow-up of a 2000-token history."""

from __future__ import annotations

import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.policy.decision import (
    Decision,
    Mode,
    Policy,
    PolicyConfig,
    ProfilePredictor,
    Route,
    WorkerLoad,
)
from dynamo_ppd.policy.placement import Routed
from dynamo_ppd.routing.planner import (
    NoWorkers,
    SessionView,
    TurnView,
    WorkersView,
    follow_up_turn,
    plan,
    rehome,
    served_home,
)
from dynamo_ppd.routing.sessions import SessionRecord

pytestmark = pytest.mark.unit

P, D1, D2, R = 1, 11, 12, 5
PROMPT, HISTORY = 2048, 2000
TURN = TurnView(prompt_tokens=PROMPT, expected_output_tokens=128, qps=1.0)


def policy(mode: Mode = Mode.LOCAL) -> Policy:
    return Policy(PolicyConfig(mode=mode), ProfilePredictor(load_profile()) if mode is Mode.PPD else None)


def follow_up(decode: int | None = D1, session: str = "s", turn: int = 2) -> SessionView:
    record = SessionRecord(session, decode_worker=decode, prefill_worker=P, turn=turn - 1,
                           context_tokens=HISTORY)
    return SessionView(session, turn, record)


def cluster(cached: dict[int, int] | None = None, busy: dict[int, int] | None = None,
            prefill=(P,), decode=(D1, D2), replica=()) -> WorkersView:
    """``cached``: leading prompt tokens per worker; ``busy``: requests in flight per worker
    (this router's and as reported)."""
    busy = busy or {}
    workers = [*prefill, *decode, *replica]
    return WorkersView(prefill, decode, replica, cached_tokens=cached or {},
                   loads={w: WorkerLoad(inflight_requests=busy.get(w, 0), decode_requests=busy.get(w, 0))
                          for w in workers},
                   routed={w: Routed(requests=busy.get(w, 0)) for w in workers})


HELD = {D1: 1984}  # D1 holds the history's full blocks


def test_a_new_conversation_goes_through_prefill_to_the_least_loaded_decode_worker_and_is_claimed():
    decided = plan(policy(), SessionView("s", 1), cluster(busy={D1: 2}), TURN)
    assert decided.decision == Decision(Route.VIA_PREFILL, "first_turn")
    assert (decided.prefill, decided.decode) == (P, D2)
    assert decided.claim and not decided.rehome and not decided.moved and not decided.residency_miss


def test_a_follow_up_stays_decode_local_on_its_session_worker():
    decided = plan(policy(Mode.LOCAL), follow_up(), cluster(HELD, busy={D1: 3}), TURN)
    assert decided.decision == Decision(Route.DECODE_LOCAL, "local_mode")
    assert decided.decode == D1 and not decided.claim and not decided.rehome
    assert decided.features is not None and decided.features.cached_on_decode == 1984


def test_a_follow_up_via_prefill_keeps_its_worker_unless_that_one_is_clearly_hotter():
    decided = plan(policy(Mode.PD), follow_up(), cluster(HELD, busy={D1: 3}), TURN)
    assert decided.decision == Decision(Route.VIA_PREFILL, "pd_mode")
    assert (decided.prefill, decided.decode, decided.moved) == (P, D1, False)
    hot = plan(policy(Mode.PD), follow_up(), cluster(HELD, busy={D1: 20}), TURN)
    assert (hot.decode, hot.moved) == (D2, True)  # its KV comes by transfer anyway


def test_the_ppd_score_decides_on_the_views_it_is_given():
    decided = plan(policy(Mode.PPD), follow_up(), cluster(HELD), TURN)
    assert decided.decision.route is Route.DECODE_LOCAL and decided.decision.score is not None
    assert decided.decision.score > 0  # appending 64 tokens beats re-prefilling 2048


def test_a_gone_decode_worker_rehomes_the_turn_through_prefill():
    decided = plan(policy(Mode.LOCAL), follow_up(decode=13), cluster(HELD, busy={D1: 1}), TURN)
    assert decided.decision == Decision(Route.VIA_PREFILL, "no_decode_worker")
    assert (decided.prefill, decided.decode) == (P, D2) and decided.rehome and not decided.claim


def test_a_gone_prefill_worker_makes_the_turn_decode_local():
    decided = plan(policy(Mode.PD), follow_up(), cluster(HELD, prefill=()), TURN)
    assert decided.decision == Decision(Route.DECODE_LOCAL, "no_prefill_worker")
    assert (decided.prefill, decided.decode) == (None, D1)


def test_an_evicted_history_goes_through_prefill_and_counts_a_residency_miss():
    decided = plan(policy(Mode.LOCAL), follow_up(), cluster({D1: 320}), TURN)
    assert decided.decision == Decision(Route.VIA_PREFILL, "history_evicted")
    assert decided.residency_miss and decided.decode == D1


def test_a_fork_is_routed_by_residency_and_claimed_under_its_own_id():
    fork = SessionView("s#1f2e", 3)  # no record: a follow-up of whatever history a worker holds
    decided = plan(policy(Mode.LOCAL), fork, cluster({D1: 64, D2: 1984}), TURN)
    assert decided.decision == Decision(Route.DECODE_LOCAL, "local_mode")
    assert decided.decode == D2 and decided.claim and not decided.rehome
    nowhere = plan(policy(Mode.LOCAL), fork, cluster(), TURN)  # no worker holds any of it
    assert nowhere.decision == Decision(Route.VIA_PREFILL, "no_decode_worker") and nowhere.claim


def test_a_forced_route_applies_to_follow_ups_with_a_session_worker():
    forced = TurnView(PROMPT, 128, forced=Route.DECODE_LOCAL)
    assert plan(policy(Mode.PD), follow_up(), cluster(HELD), forced).decision == Decision(
        Route.DECODE_LOCAL, "forced")
    assert plan(policy(Mode.PD), SessionView("s", 1), cluster(), forced).decision.reason == "first_turn"


def test_no_decode_worker_is_a_503():
    with pytest.raises(NoWorkers, match="no decode worker"):
        plan(policy(), SessionView("s", 1), cluster(decode=()), TURN)


def test_hybrid_places_new_conversations_on_the_least_loaded_and_keeps_replica_sessions():
    workers = cluster(replica=(R,))
    new = plan(policy(Mode.PPD), SessionView("h", 1), workers, TURN)
    assert (new.decision, new.decode, new.prefill, new.claim) == (
        Decision(Route.REPLICA, "hybrid_new_conversation"), R, None, True)
    kept = plan(policy(Mode.PPD), follow_up(decode=R, session="h"), workers, TURN)
    assert (kept.decision, kept.decode, kept.claim) == (Decision(Route.REPLICA, "replica_session"), R, False)
    busy = plan(policy(Mode.LOCAL), SessionView("o", 1), cluster(busy={R: 3}, replica=(R,)), TURN)
    assert (busy.decision.route, busy.decode, busy.prefill) == (Route.VIA_PREFILL, D1, P)
    on_decode = plan(policy(Mode.LOCAL), follow_up(), cluster(HELD, replica=(R,)), TURN)
    assert (on_decode.decision.route, on_decode.decode) == (Route.DECODE_LOCAL, D1)


def test_replica_mode_picks_the_replica_holding_most_of_the_prompt_then_the_least_busy():
    replicas = (R, 6)
    decided = plan(policy(Mode.REPLICA), SessionView("s", 1),
                   cluster({6: 512}, prefill=(), decode=(), replica=replicas), TURN, replica_mode=True)
    assert (decided.decision, decided.decode, decided.claim) == (
        Decision(Route.REPLICA, "replica_mode"), 6, False)
    tie = plan(policy(Mode.REPLICA), SessionView("s", 1), cluster(busy={R: 1}, prefill=(), decode=(),
                                                                  replica=replicas), TURN, replica_mode=True)
    assert tie.decode == 6
    with pytest.raises(NoWorkers, match="aggregated"):
        plan(policy(Mode.REPLICA), SessionView("s", 1), cluster(), TURN, replica_mode=True)


def test_rehome_after_a_failure_keeps_a_live_decode_worker_and_asks_the_policy_again():
    via = Decision(Route.VIA_PREFILL, "first_turn")
    # Only the prefill worker failed: the same decode worker, decode-local with no prefill left.
    alone = rehome(policy(Mode.PD), follow_up(), via, D1, cluster(HELD, prefill=()), TURN)
    assert (alone.decision, alone.decode, alone.prefill, alone.rehome) == (
        Decision(Route.DECODE_LOCAL, "rehome_no_prefill_worker"), D1, None, True)
    # The decode worker failed: the least loaded one left, and the policy's route to it (which
    # holds none of the history, so through the prefill worker whatever the mode).
    moved = rehome(policy(Mode.LOCAL), follow_up(), via, D1, cluster(decode=(D2,)), TURN)
    assert (moved.decision, moved.decode, moved.prefill) == (
        Decision(Route.VIA_PREFILL, "rehome_history_evicted"), D2, P)
    kept = rehome(policy(Mode.LOCAL), follow_up(), via, D1, cluster(HELD), TURN)  # the prefill leg failed
    assert (kept.decision, kept.decode, kept.prefill) == (
        Decision(Route.DECODE_LOCAL, "rehome_local_mode"), D1, P)
    with pytest.raises(NoWorkers, match="no decode worker"):
        rehome(policy(Mode.PD), follow_up(), via, D1, cluster(decode=()), TURN)
    replica = Decision(Route.REPLICA, "replica_session")
    left = cluster(busy={7: 2}, replica=(7, 8))  # R failed
    again = rehome(policy(Mode.PPD), follow_up(decode=R), replica, R, left, TURN)
    assert (again.decision, again.decode) == (replica, 8)
    with pytest.raises(NoWorkers, match="aggregated"):
        rehome(policy(Mode.PPD), follow_up(decode=R), replica, R, cluster(), TURN)


def test_without_etcd_a_header_is_a_follow_up_when_a_decode_worker_holds_most_of_the_prompt():
    assert follow_up_turn({D1: 1984, D2: 0}, PROMPT, 0.5) == 2
    assert follow_up_turn({D1: 640}, PROMPT, 0.5) == 1
    assert follow_up_turn({}, PROMPT, 0.5) == 1


def test_a_session_served_elsewhere_is_homed_where_its_history_is():
    # Behind the endpoint picker the frontend picks the decode worker of a turn it does not pin:
    # the session recorded D1, but D2 holds the history, so D2 served it.
    record = follow_up(decode=D1).record
    assert record is not None
    assert served_home(record, cluster({D1: 0, D2: 1984})) == D2
    assert served_home(record, cluster({D1: 1984, D2: 1984})) == D1  # a tie keeps the record's
    assert served_home(record, cluster({D1: 64, D2: 32})) == D1
    assert served_home(record, cluster({D2: 1984}, decode=(D2,))) == D1  # gone: the plan re-homes it


def test_an_unseen_session_id_is_read_from_etcd_only_when_a_decode_worker_holds_its_prompt():
    """A first turn (no decode worker holds much of its prompt) skips the etcd read; a prompt a
    decode worker holds may be another replica's follow-up whose record is on its way: read it."""
    import asyncio

    from dynamo_ppd.bench import decisions

    router, histories = decisions.build(1, 640, "local")
    reads: list[str] = []

    async def read_through(session_id: str):
        reads.append(session_id)
        return None

    router.sessions.read_through = read_through  # type: ignore[method-assign]
    fresh = [7] * 700  # held by nobody
    for tokens, session in ((fresh, "new-one"), (histories[0] + [9] * 32, "another-replicas")):
        request = {"token_ids": tokens, "stop_conditions": {"max_tokens": 8},
                   "agent_context": {"session_id": session}}
        asyncio.run(router.plan_turn(request, tokens))
    assert reads == ["another-replicas"]
