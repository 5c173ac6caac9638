"""One placement for the live router and the simulator (`dynamo_ppd.policy.placement`): its rules,
and one request placed identically by both from the same state."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_router_dispatch import FakeClient, hold

from dynamo_ppd.engine import load_profile
from dynamo_ppd.engine.blocks import dynamo_block_hasher
from dynamo_ppd.engine.scheduler import LoadSnapshot
from dynamo_ppd.policy.decision import Decision, Mode, Policy, PolicyConfig, Route, WorkerLoad
from dynamo_ppd.policy.placement import (
    ClusterState,
    Routed,
    TurnRequest,
    pick_decode,
    pick_prefill,
    place,
)
from dynamo_ppd.policy.simulate import PolicyRouter, cluster_state
from dynamo_ppd.relay.router import PpdRouter, Turn
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.sim import Cluster, SimRequestFeatures
from dynamo_ppd.sim.assignment import DecodeLocal, ViaPrefill
from dynamo_ppd.sim.cluster import ClusterRequest
from dynamo_ppd.sim.routing import least_loaded_decode, least_loaded_prefill

pytestmark = pytest.mark.unit


def state(prefill=("P0", "P1"), decode=("D0", "D1"), loads=None, routed=None,
          cached=None) -> ClusterState[str]:
    return ClusterState(list(prefill), list(decode), loads or {}, routed or {}, cached or {})


def turn(turn=2, prompt=3000, session="D0", history=2900, out=128) -> TurnRequest[str]:
    return TurnRequest(decision_key=f"s:{turn}", turn=turn, prompt_tokens=prompt, expected_output_tokens=out,
                       session_decode=session, history_tokens=history, qps=1.0)


def policy(mode: Mode) -> Policy:
    return Policy(PolicyConfig(mode=mode), None)


# -- the rules -----------------------------------------------------------------------------------

def test_prefill_weighs_the_tokens_a_worker_holds_against_its_queue():
    # P1 holds 2000 of the prompt's 3000 tokens: 1000 to compute against P0's 3000.
    held = state(cached={"P1": 2000})
    assert pick_prefill(["P0", "P1"], 3000, held) == ("P1", 2000)
    # ...unless what is routed there and not yet prefilled outweighs it (1000 + 2500 > 3000).
    busy = state(cached={"P1": 2000}, routed={"P1": Routed(prefill_tokens=2500)})
    assert pick_prefill(["P0", "P1"], 3000, busy) == ("P0", 0)
    # Equal work: the lowest id; no prefill worker: none.
    assert pick_prefill(["P1", "P0"], 3000, state()) == ("P0", 0)
    assert pick_prefill([], 3000, state()) == (None, 0)


def test_decode_goes_to_the_fewest_requests_then_the_least_context_then_the_least_held_kv():
    routed = {"D0": Routed(requests=2, context_tokens=100), "D1": Routed(requests=1, context_tokens=9000),
              "D2": Routed(requests=1, context_tokens=500)}
    assert pick_decode(["D0", "D1", "D2"], state(routed=routed)) == "D2"
    assert pick_decode(["D1", "D0"], state()) == "D0"
    # An idle fleet: new sessions go where the least history is held, not all to the lowest id.
    idle = ClusterState(["P0"], ["D0", "D1", "D2"], {}, {}, {},
                        resident_tokens={"D0": 6400, "D1": 0, "D2": 320})
    assert pick_decode(["D0", "D1", "D2"], idle) == "D1"
    with pytest.raises(ValueError, match="no decode worker"):
        pick_decode([], state())


def test_a_worker_reporting_work_this_router_did_not_send_gets_no_new_conversation():
    # D0 runs 64 long decodes another router (or a background job) sent: its report says so.
    hot = ClusterState(["P0"], ["D0", "D1"], {"D0": WorkerLoad(decode_requests=64)},
                       {"D0": Routed(), "D1": Routed(requests=1, context_tokens=500)}, {})
    assert pick_decode(["D0", "D1"], hot) == "D1"


def test_a_new_conversation_goes_through_the_chosen_prefill_worker_to_the_least_loaded_decode():
    s = state(routed={"D0": Routed(requests=3)}, cached={"P1": 64})
    placed = place(policy(Mode.LOCAL), s, turn(turn=1, session=None, history=0))
    assert (placed.prefill, placed.decode) == ("P1", "D1")
    assert placed.decision == Decision(Route.VIA_PREFILL, "first_turn") and not placed.moved


def test_a_via_prefill_follow_up_leaves_a_hot_session_worker_and_a_local_one_stays():
    hot = WorkerLoad(decode_requests=20)
    s = state(loads={"D0": hot}, routed={"D0": Routed(requests=20)}, cached={"D0": 2900})
    pd = place(policy(Mode.PD), s, turn())
    assert (pd.decision.route, pd.decode, pd.moved) == (Route.VIA_PREFILL, "D1", True)
    local = place(policy(Mode.LOCAL), s, turn())
    assert (local.decision.route, local.decode, local.moved) == (Route.DECODE_LOCAL, "D0", False)
    # Not clearly hotter (20 vs 12 + max(8, 6)): a via-prefill turn keeps its worker.
    warm = state(loads={"D0": hot, "D1": WorkerLoad(decode_requests=12)}, cached={"D0": 2900})
    assert place(policy(Mode.PD), warm, turn()).decode == "D0"


def test_forced_routes_evicted_histories_and_no_prefill_worker():
    s = state(cached={"D0": 2900})
    assert place(policy(Mode.PD), s, turn(), forced=Route.DECODE_LOCAL).decision == Decision(
        Route.DECODE_LOCAL, "forced")
    # A new conversation is never forced (nothing is cached anywhere).
    assert place(policy(Mode.PD), s, turn(turn=1, session=None), forced=Route.DECODE_LOCAL).decision.reason \
        == "first_turn"
    evicted = place(policy(Mode.LOCAL), state(cached={"D0": 300}), turn())
    assert evicted.decision == Decision(Route.VIA_PREFILL, "history_evicted")
    alone = place(policy(Mode.PD), state(prefill=()), turn())
    assert alone.prefill is None and alone.decision == Decision(Route.DECODE_LOCAL, "no_prefill_worker")


def test_the_features_are_the_chosen_workers():
    loads = {"P1": WorkerLoad(pending_prefill_tokens=10), "D0": WorkerLoad(decode_requests=5),
             "D1": WorkerLoad(decode_requests=1)}
    placed = place(policy(Mode.LOCAL), state(loads=loads, cached={"P1": 3000, "D0": 2900},
                                             routed={"D0": Routed(requests=5)}), turn())
    f = placed.features
    assert (f.cached_on_prefill, f.cached_on_decode, f.prefill_load, f.decode_load, f.best_decode_load) == (
        3000, 2900, loads["P1"], loads["D0"], loads["D1"])
    assert f.has_session_decode and f.turn == 2 and f.qps == 1.0 and f.expected_output_tokens == 128


# -- the router and the simulator place a request identically from the same state -------------

PROFILE = load_profile()
IDS = {"P0": 1, "P1": 2, "D0": 11, "D1": 12}  # simulator name -> the router's instance id
NAMES = {v: k for k, v in IDS.items()}
HOT = 12  # other conversations decoding on the session's worker


def report_of(load: LoadSnapshot) -> dict:
    """The forward-pass metrics a live worker in this state publishes (`worker/handler.py`)."""
    return {"scheduled_requests": {"num_decode_requests": load.decode_requests,
                                   "sum_decode_kv_tokens": load.decode_kv_tokens,
                                   "sum_prefill_tokens": load.prefill_tokens_remaining},
            "queued_requests": {"num_decode_requests": load.awaiting_kv_requests, "sum_decode_kv_tokens": 0,
                                "sum_prefill_tokens": load.waiting_prompt_tokens}}


def simulated_state(first: list[int]) -> tuple[Cluster, list[int]]:
    """2P2D: conversation "s" ran turn 1 through P1 to D0 (both now hold its prompt, D0 its
    answer too), and HOT other conversations are decoding on D0. Returns the turn-1 answer."""
    cluster = Cluster.from_config(PROFILE, "2P2D")
    done: list[ClusterRequest] = []

    def send(request_id: str, prompt: list[int], max_tokens: int, route) -> None:
        hashes = cluster.prompt_hashes(prompt)
        cluster.dispatch(ClusterRequest(request_id, request_id.split("/")[0], prompt, hashes, max_tokens,
                                        cluster.now, route, done.append))

    send("s/1", first, 33, ViaPrefill("P1", "D0"))
    cluster.run()
    assert done and done[0].serving is not None
    answer = list(done[0].serving.output)
    for i in range(HOT):
        send(f"h{i}/1", list(range(10_000 + 100 * i, 10_064 + 100 * i)), 4000, DecodeLocal("D0"))
    cluster.run(until_s=cluster.now + 0.05)
    assert cluster.view.load("D0").decode_requests == HOT
    return cluster, answer


async def routed_by_router(args: list[str], first: list[int], answer: list[int], follow_up: list[int],
                           cluster: Cluster) -> tuple[PpdRouter, Turn]:
    """The live router (in process) fed what it would know of the simulated state: the session's
    record of turn 1, the KV events of what P1 and D0 stored, its own counts of the HOT requests
    it routed to D0, and each worker's latest forward-pass metrics; then it plans turn 2."""
    config = parse_args(args)
    router = PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                       clients={"prefill": FakeClient([IDS["P0"], IDS["P1"]], "prefill"),
                                "decode": FakeClient([IDS["D0"], IDS["D1"]], "decode")})
    turn1 = Turn(session_id="s", turn=1, prompt_tokens=len(first),
                  local_hashes=dynamo_block_hasher()(first, 32), chained=None, prefill=IDS["P1"],
                  decode=IDS["D0"])
    await router.record_turn(turn1, first, answer)
    hold(router, IDS["P1"], first)
    hold(router, IDS["D0"], first + answer)
    for _ in range(HOT):  # what it counted when it routed them (their max_tokens 4000)
        router.loads.add_decode(IDS["D0"], 64, 4000)
    for name, worker in IDS.items():
        router.reports[worker] = report_of(cluster.view.load(name))
    router.rate.record(time.monotonic())  # as `generate` does before planning
    request = {"token_ids": follow_up, "stop_conditions": {"max_tokens": 128},
               "agent_context": {"session_id": "s"}}
    return router, await router.plan_turn(request, follow_up)


@pytest.mark.parametrize("args", [["--mode", "pd"], ["--mode", "local"], ["--mode", "ppd", "--table", "none"],
                                  ["--mode", "ppd", "--table", "auto"]], ids=" ".join)
def test_router_and_simulator_place_a_request_identically(args):
    first = list(range(2000, 2320))  # 10 blocks
    cluster, answer = simulated_state(first)
    follow_up = first + answer + list(range(3000, 3040))
    router, plan = asyncio.run(routed_by_router(args, first, answer, follow_up, cluster))

    view = cluster.view
    sim_policy = build_policy(parse_args(args))
    sim_policy.set_table(router.policy.table)  # the table the router picked for 2P2D (auto), or none
    f = SimRequestFeatures(conversation_id="s", turn=2, prompt_tokens=len(follow_up),
                    new_tokens=len(follow_up) - len(first) - len(answer), max_tokens=128,
                    decode_worker=view.session_decode("s"),
                    cached_on_decode=view.cached_prefix_tokens("D0", follow_up), now=cluster.now,
                    token_ids=follow_up)
    placed = PolicyRouter(sim_policy).place(f, view)

    assert (NAMES[plan.prefill], NAMES[plan.decode]) == (placed.prefill, placed.decode)
    assert plan.decision == placed.decision  # route, reason, score and predictions
    # The state is one where the plain built-in rule differs: P1 holds turn 1's prompt, and P0
    # wins the least-loaded tie by its id.
    assert placed.prefill == "P1" and least_loaded_prefill(view) == "P0"
    assert placed.features.cached_on_prefill == len(first)
    assert placed.features.cached_on_decode == (len(first) + len(answer)) // 32 * 32
    assert least_loaded_decode(view) == "D1"
    if args[1] == "pd":  # through a prefill worker: the hot session worker is left for D1
        assert (placed.decision.route, placed.decode, placed.moved) == (Route.VIA_PREFILL, "D1", True)
        assert router.metrics.session_moves._value.get() == 1
    if args[1] == "local":
        assert (placed.decision.route, placed.decode) == (Route.DECODE_LOCAL, "D0")
    if args[-1] == "auto":
        assert placed.decision.cell is not None  # decided from the shipped 2P2D table


def test_router_and_simulator_count_what_they_routed_alike_and_place_a_new_conversation_alike():
    """A new conversation goes to the decode worker with the fewest requests routed there, then
    the fewest context tokens *routed* (the prompts, as the live router counts them), not the
    most KV (which grows as the worker answers): the simulator once ranked by its engines' KV,
    and its twin of a live run sent conversations to other workers (docs/bench/dilation.md)."""
    cluster = Cluster.from_config(PROFILE, "1P2D")
    done: list[ClusterRequest] = []

    def send(request_id: str, prompt: list[int], route) -> None:
        cluster.dispatch(ClusterRequest(request_id, request_id, prompt, cluster.prompt_hashes(prompt), 4000,
                                        cluster.now, route, done.append))

    send("a", list(range(1000, 1064)), DecodeLocal("D0"))  # a short prompt, answered for a while
    cluster.run(until_s=1.0)
    send("b", list(range(2000, 2150)), DecodeLocal("D1"))  # a longer one, just started
    cluster.run(until_s=cluster.now + 0.02)
    view = cluster.view
    assert not done and view.load("D0").decode_kv_tokens > view.load("D1").decode_kv_tokens + 50

    ids = {"P0": 1, "D0": 11, "D1": 12}
    config = parse_args(["--mode", "pd"])
    router = PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                       clients={"prefill": FakeClient([ids["P0"]], "prefill"),
                                "decode": FakeClient([ids["D0"], ids["D1"]], "decode")})
    for name, prompt in (("D0", 64), ("D1", 150)):  # what the router counted when it routed a and b
        router.loads.add_decode(ids[name], prompt, 4000)
    for name, worker in ids.items():
        router.reports[worker] = report_of(view.load(name))
    state = cluster_state(view, [])
    for name, worker in ids.items():
        assert state.routed[name] == router.loads.routed(worker), name
        assert state.loads[name] == router.loads.of(worker, router.reports.get(worker)), name

    new = list(range(5000, 5040))
    router.rate.record(time.monotonic())
    plan = asyncio.run(router.plan_turn({"token_ids": new, "stop_conditions": {"max_tokens": 128}}, new))
    f = SimRequestFeatures(conversation_id="c", turn=1, prompt_tokens=len(new), new_tokens=len(new),
                           max_tokens=128, decode_worker=None, cached_on_decode=0, now=cluster.now,
                           token_ids=new)
    placed = PolicyRouter(build_policy(config)).place(f, view)
    assert placed.decode == {v: k for k, v in ids.items()}[plan.decode] == "D0"

    # A prefill leg: the live router charges the prefill worker the whole prompt until the leg
    # ends, and counts the request on its decode worker from the moment it routes it.
    send("c", new, ViaPrefill("P0", "D1"))
    state = cluster_state(view, [])
    assert state.routed["P0"] == Routed(prefill_tokens=len(new))
    assert state.routed["D1"] == Routed(requests=2, context_tokens=150 + len(new), inverse_outputs=2 / 4000)
    cluster.run()
    assert all(view.inflight_prompt_tokens(w) == 0 and view.inflight(w) == 0 for w in ids)


def test_the_live_router_places_a_new_conversation_on_an_idle_fleet_where_the_least_kv_is_held():
    """Nothing in flight anywhere: the residency index's held blocks decide, as `kv_used_blocks`
    does in the simulator (`cluster_state`), not the lowest instance id."""
    ids = {"P0": 1, "D0": 11, "D1": 12}
    config = parse_args(["--mode", "pd"])
    router = PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                       clients={"prefill": FakeClient([ids["P0"]], "prefill"),
                                "decode": FakeClient([ids["D0"], ids["D1"]], "decode")})
    blocks = [{"block_hash": 500 + i, "tokens_hash": 9000 + i} for i in range(10)]
    stored = {"stored": {"parent_hash": None, "blocks": blocks}}
    router.residency.apply(ids["D0"], {"event_id": 1, "data": stored})
    new = list(range(5000, 5040))
    plan = asyncio.run(router.plan_turn({"token_ids": new, "stop_conditions": {"max_tokens": 128}}, new))
    assert plan.decode == ids["D1"]
