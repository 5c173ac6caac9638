"""Peers' P/D policies (dynamo_ppd/sim/peers.py): each decision on hand-built cluster states
reproduces its source's rule at the thresholds, and every peer runs a small paper point end to end."""

from __future__ import annotations

import pytest

from dynamo_ppd.engine import LoadSnapshot, load_profile
from dynamo_ppd.paper.protocol import run_protocol
from dynamo_ppd.sim.assignment import DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill
from dynamo_ppd.sim.peers import (
    PEER_ROUTERS,
    REPLICA_PEERS,
    DynamoConditionalDisagg,
    DynamoKvRouter,
    LlmdPrefixPd,
    VllmRouter,
    dynamo_worker_logit,
    llmd_prefix_decides_pd,
    make_peer_router,
)
from dynamo_ppd.sim.routing import make_router

pytestmark = pytest.mark.unit

BS = 32


def load(**fields: int) -> LoadSnapshot:
    base = dict(waiting_requests=0, waiting_prompt_tokens=0, awaiting_kv_requests=0, awaiting_kv_tokens=0,
                prefill_requests=0, prefill_tokens_remaining=0, decode_requests=0, decode_kv_tokens=0,
                kv_used_blocks=0, kv_active_blocks=0, kv_reserved_blocks=0, kv_capacity_blocks=10_000)
    base.update(fields)
    return LoadSnapshot(**base)


class FakeView:
    """A hand-built cluster state: what each worker's load, in-flight count and cached prefix
    (tokens, whole blocks) are."""

    def __init__(self, prefill: int = 1, decode: int = 3, replica: int = 0,
                 cached: dict[str, int] | None = None, loads: dict[str, LoadSnapshot] | None = None,
                 inflight: dict[str, int] | None = None):
        self.prefill_workers = [f"P{i}" for i in range(prefill)]
        self.decode_workers = [f"D{i}" for i in range(decode)]
        self.replica_workers = [f"A{i}" for i in range(replica)]
        self.block_size = BS
        self.cached = cached or {}
        self.loads = loads or {}
        self.inflights = inflight or {}

    def load(self, worker: str) -> LoadSnapshot:
        return self.loads.get(worker, load())

    def inflight(self, worker: str) -> int:
        return self.inflights.get(worker, 0)

    def cached_prefix_tokens(self, worker: str, tokens: list[int]) -> int:
        return min(self.cached.get(worker, 0), len(tokens)) // BS * BS

    def prompt_hashes(self, tokens: list[int]) -> list[int]:
        return [hash((tokens[0], i)) for i in range(len(tokens) // BS)]  # chained: first token + depth


def turn(prompt: int, turn_no: int = 2, decode_worker: str | None = "D1") -> SimRequestFeatures:
    return SimRequestFeatures("c0", turn_no, prompt, prompt, 64, decode_worker, 0, 0.0, list(range(prompt)))


# -- Dynamo conditional disaggregation ----------------------------------------------------------

def test_isl_bounding_follow_up_decode_local_when_short_uncached_via_prefill_when_long():
    router = make_peer_router("dynamo-isl-bounding")
    # 3000-token prompt, 2912 of it (91 blocks) cached on D1: eff_isl 88 < 2048, ratio 0.03 < 0.7.
    assert router(turn(3000), FakeView(cached={"D1": 2912})) == DecodeLocal("D1")
    # 2500 uncached of 3000 (500 cached -> 480 in whole blocks): eff_isl 2520, not < 2048.
    assert router(turn(3000), FakeView(cached={"D1": 500})) == ViaPrefill("P0", "D1")


def test_isl_bounding_thresholds_are_strict_and_ratio_bounded():
    policy = DynamoConditionalDisagg("isl_bounding")
    assert not policy.isl_bounding_bypasses(4096, 2048)  # eff_isl == 2048 (ratio 0.5): strict <
    assert policy.isl_bounding_bypasses(4096, 2080)  # eff_isl 2016
    assert not policy.isl_bounding_bypasses(200, 0)  # short but uncached: ratio 1.0
    assert policy.isl_bounding_bypasses(1000, 896)  # Dynamo's own test: 1000, 14 x 64 cached
    assert not policy.isl_bounding_bypasses(1000, 300)  # ratio exactly 0.7: strict <
    assert policy.isl_bounding_bypasses(0, 0)  # empty prompt: ratio 0
    # Turn 1 of a new conversation: nothing cached anywhere -> remote prefill.
    assert isinstance(make_peer_router("dynamo-isl-bounding")(turn(500, 1, None), FakeView()), ViaPrefill)


def test_prefill_load_flips_with_the_prefill_workers_busy_state():
    router = make_peer_router("dynamo-prefill-load")  # 0.5 x 8192 = 4096 tokens
    calm = FakeView(cached={"D1": 2912}, loads={"P0": load(waiting_prompt_tokens=4096)})
    busy = FakeView(cached={"D1": 2912},
                    loads={"P0": load(waiting_prompt_tokens=3000, prefill_tokens_remaining=1097)})
    # prefill_load ignores the ISL: a well-cached follow-up still goes via prefill while P is calm.
    assert router(turn(3000), calm) == ViaPrefill("P0", "D1")
    assert router(turn(3000), busy) == DecodeLocal("D1")
    # ... and it bypasses turn 1 too when P is busy (the policy runs on every request).
    assert isinstance(router(turn(500, 1, None), busy), DecodeLocal)


def test_isl_or_load_bypasses_on_either_gate():
    router = make_peer_router("dynamo-isl-or-load-ours")
    busy_p = {"P0": load(waiting_prompt_tokens=5000)}
    assert router(turn(3000), FakeView(cached={"D1": 2912})) == DecodeLocal("D1")  # ISL gate
    assert router(turn(3000), FakeView(cached={"D1": 500})) == ViaPrefill("P0", "D1")  # neither
    assert router(turn(3000), FakeView(cached={"D1": 500}, loads=busy_p)) == DecodeLocal("D1")  # load gate


def test_busy_threshold_scales_with_the_profiles_batched_tokens():
    profile = load_profile()
    router = make_peer_router("dynamo-prefill-load", profile=profile)
    line = 0.5 * profile.engine.max_num_tokens
    at = FakeView(loads={"P0": load(waiting_prompt_tokens=int(line))})
    over = FakeView(loads={"P0": load(waiting_prompt_tokens=int(line) + 1)})
    assert isinstance(router(turn(3000), at), ViaPrefill)
    assert isinstance(router(turn(3000), over), DecodeLocal)


def test_load_policies_need_a_busy_threshold():
    with pytest.raises(ValueError, match="needs prefill_busy_threshold"):
        DynamoConditionalDisagg("isl_or_load")
    with pytest.raises(ValueError, match="unknown conditional-disagg policy"):
        DynamoConditionalDisagg("cache_or_load", prefill_busy_threshold=0.5)


def test_decode_candidate_is_the_kv_routers_choice_not_the_session_worker():
    """The worker holding the prefix wins on overlap unless its load outweighs it: then the
    request's cache is elsewhere, eff_isl is the whole prompt, and it goes via prefill."""
    router = make_peer_router("dynamo-isl-bounding")
    features = turn(3000)
    cached_light = FakeView(cached={"D1": 2912})
    assert router(features, cached_light) == DecodeLocal("D1")
    heavy = FakeView(cached={"D1": 2912}, loads={"D1": load(kv_active_blocks=500)})
    route = router(features, heavy)
    assert isinstance(route, ViaPrefill) and route.decode in ("D0", "D2")
    # The logit itself: (active + isl)/bs - overlap_blocks + potential decode blocks.
    assert dynamo_worker_logit(heavy, "D1", features, track_active_blocks=True) == \
        pytest.approx(3000 / BS - 91 + 500 + 94)
    assert dynamo_worker_logit(heavy, "D0", features, track_active_blocks=False) == pytest.approx(3000 / BS)


def test_conditional_disagg_needs_disaggregated_workers():
    with pytest.raises(RoutingError, match="needs prefill and decode"):
        make_peer_router("dynamo-isl-or-load")(turn(100), FakeView(prefill=0, decode=0, replica=2))


# -- Dynamo KV router over aggregated workers --------------------------------------------------

def test_dynamo_kv_agg_prefers_overlap_until_load_outweighs_it():
    router = DynamoKvRouter()
    assert router(turn(3000), FakeView(0, 0, 4, cached={"A2": 2912})) == Replica("A2")
    loaded = FakeView(0, 0, 4, cached={"A2": 2912}, loads={"A2": load(waiting_prompt_tokens=4000)})
    assert router(turn(3000), loaded) != Replica("A2")  # 125 blocks of queued prefill > 91 cached
    with pytest.raises(RoutingError, match="aggregated workers"):
        router(turn(100), FakeView())


# -- llm-d ----------------------------------------------------------------------------------------

def test_llmd_decider_flips_at_its_threshold():
    assert not llmd_prefix_decides_pd(1000, 992, 16)  # 8 uncached < 16: decode only
    assert llmd_prefix_decides_pd(1000, 984, 16)  # 16 uncached: not < 16 -> P/D
    assert not llmd_prefix_decides_pd(10, 0, 16)  # input shorter than the threshold
    assert llmd_prefix_decides_pd(1000, 1000, 0)  # the plugin's default 0: always P/D
    router = LlmdPrefixPd(16)
    assert router(turn(1000), FakeView(cached={"D1": 992})) == DecodeLocal("D1")
    assert isinstance(router(turn(1000), FakeView(cached={"D1": 960})), ViaPrefill)
    with pytest.raises(ValueError, match="cannot be negative"):
        LlmdPrefixPd(-1)


def test_llmd_decode_profile_weighs_prefix_twice_the_queue():
    router = LlmdPrefixPd(16)
    # D1 holds the whole prompt but has the longest queue: 2 x 1.0 + 0 beats 2 x 0 + 1.
    busy_cached = FakeView(cached={"D1": 1024}, loads={"D1": load(waiting_requests=5)})
    assert router(turn(1024), busy_cached) == DecodeLocal("D1")
    # A third of the prompt cached (2 x 0.33 + 0) loses to an empty queue (0 + 1).
    third = FakeView(cached={"D1": 352}, loads={"D1": load(waiting_requests=5)})
    assert router(turn(1024), third).decode in ("D0", "D2")


# -- vLLM router ------------------------------------------------------------------------------------

def test_vllm_router_always_prefills_remotely_and_follows_its_tree():
    router = VllmRouter()
    view = FakeView()
    first = router(turn(1000, 1, None), view)
    assert isinstance(first, ViaPrefill) and first.decode == "D0"  # empty trees: smallest = first
    second = router(turn(1000), view)  # same prefix: match 992/1000 > 0.3 -> the same decode worker
    assert second == first
    fresh = SimRequestFeatures("c1", 1, 1000, 1000, 64, None, 0, 0.0, list(range(5000, 6000)))
    assert router(fresh, view).decode == "D1"  # no match: the smallest tree (D0's holds c0)


def test_vllm_router_balances_when_imbalanced():
    router = VllmRouter()
    view = FakeView()
    router(turn(1000, 1, None), view)  # D0's tree holds the prompt
    skewed = FakeView(inflight={"D0": 100, "D1": 10, "D2": 30})  # 90 > 64 and 100 > 1.5 x 10
    assert router(turn(1000), skewed).decode == "D1"


# -- registry and end to end -----------------------------------------------------------------------

def test_make_router_resolves_every_peer_and_rejects_unknown_names():
    for name, factory in PEER_ROUTERS.items():
        assert callable(make_router(name))
        assert factory() is not factory()  # a fresh router each call, with no arguments too
    with pytest.raises(ValueError, match="dynamo-isl-bounding"):
        make_router("no-such-router")
    with pytest.raises(ValueError, match="unknown peer router"):
        make_peer_router("no-such-router")


@pytest.mark.parametrize("name", sorted(PEER_ROUTERS))
def test_every_peer_serves_a_paper_point(name):
    profile = load_profile()
    config = "4R" if name in REPLICA_PEERS else "1P3D"
    result = run_protocol(profile, config, make_peer_router(name, profile=profile), "small_mid_bal", 2.0)
    outcome = result.outcome()
    assert outcome.total_requests > 0
    assert outcome.success_rate == pytest.approx(100.0)
    routes = {r.route for r in result.records}
    if name == "vllm-router":
        assert routes == {"via_prefill"}
    if name == "dynamo-kv-agg":
        assert routes == {"aggregated"}
