"""The KV link presets, the serving stack's fixed costs in the simulated cluster, and the paper
authors' proxy placement (configs like 1P_2D_1pD)."""

from __future__ import annotations

import collections

import msgspec
import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.engine.profile import LINK_PRESETS, ProfileError, StackCosts, link_preset
from dynamo_ppd.sim import Cluster, Conversation, Turn, simulate
from dynamo_ppd.sim.assignment import DecodeLocal, Replica, ViaPrefill
from dynamo_ppd.sim.routing import (
    local_router,
    paper_proxy_router,
    parse_paper_config,
    pd_router,
    replica_router,
)

pytestmark = pytest.mark.unit

PROFILE = load_profile()


def ttfts(profile, config: str, router, turns, **kwargs) -> list[float]:
    cluster = Cluster.from_config(profile, config, **kwargs)
    result = simulate(cluster, [Conversation("c", 0.0, list(turns))], router)
    return [r.ttft_s for r in sorted(result.records, key=lambda r: r.turn)]


def test_link_presets_set_the_transfer_time():
    conversation = [Conversation("c", 0.0, [Turn(2000, 4)])]
    for name, link in LINK_PRESETS.items():
        cluster = Cluster.from_config(PROFILE, "1P1D", link=link)
        record = simulate(cluster, conversation, pd_router).records[0]
        assert record.transfer_s == pytest.approx(
            link.transfer_setup_s + record.prompt_tokens * PROFILE.model.kv_bytes_per_token
            / link.link_bandwidth_bytes_s), name
    # Cross-node is the slower link: fewer bytes per second and a larger fixed cost.
    intra, cross = LINK_PRESETS["intra-node"], LINK_PRESETS["cross-node"]
    assert cross.link_bandwidth_bytes_s < intra.link_bandwidth_bytes_s
    assert cross.transfer_setup_s >= intra.transfer_setup_s
    with pytest.raises(ProfileError, match="intra-node"):
        link_preset("infiniband")


def test_stack_costs_add_exactly_where_the_stack_pays_them():
    costs = StackCosts(request_overhead_s=0.020, handoff_overhead_s=0.050, decode_local_overhead_s=0.007)
    costly = msgspec.structs.replace(PROFILE, stack=costs)
    two_turns = (Turn(500, 8), Turn(100, 8))
    # Replica: the request overhead only, on every turn.
    base = ttfts(PROFILE, "1R", replica_router, two_turns)
    paid = ttfts(costly, "1R", replica_router, two_turns)
    assert [p - b for p, b in zip(paid, base, strict=True)] == pytest.approx([0.020, 0.020])
    # Via prefill: the request overhead plus the handoff, on every turn.
    base, paid = ttfts(PROFILE, "1P1D", pd_router, two_turns), ttfts(costly, "1P1D", pd_router, two_turns)
    assert [p - b for p, b in zip(paid, base, strict=True)] == pytest.approx([0.070, 0.070])
    # Decode-local follow-up: the request overhead plus the decode-local cost.
    base = ttfts(PROFILE, "1P1D", local_router, two_turns)
    paid = ttfts(costly, "1P1D", local_router, two_turns)
    assert [p - b for p, b in zip(paid, base, strict=True)] == pytest.approx([0.070, 0.027])


def test_the_paper_stack_profile_loads_with_its_fitted_costs():
    paper = load_profile("h100-llama3.1-8b-vllm-paper")
    assert paper.hardware == PROFILE.hardware and paper.model == PROFILE.model  # physical terms shared
    assert paper.stack.request_overhead_s > 0 and paper.stack.handoff_overhead_s > 0
    assert PROFILE.stack == StackCosts()  # the TensorRT-LLM profile models no stack


@pytest.mark.parametrize("name, counts, cluster", [
    ("1P_3D", (1, 3, 0, 0), "1P3D"), ("1P_2D_1pD", (1, 2, 1, 0), "1P3D"), ("4R", (0, 0, 0, 4), "4R"),
    ("1R_1P_1D_1pD", (1, 1, 1, 1), "1P2D1R"), ("3P_1pD", (3, 0, 1, 0), "3P1D"),
])
def test_paper_config_names_parse(name, counts, cluster):
    config = parse_paper_config(name)
    assert (config.prefill, config.decode, config.prefill_capable_decode, config.replicas) == counts
    assert config.cluster_config == cluster


@pytest.mark.parametrize("bad", ["1P_3X", "1P3D", "3D", "1P_1P_2D", "0P_0D"])
def test_bad_paper_config_names_are_refused_with_the_expected_form(bad):
    with pytest.raises(ValueError, match="1P_3D|come together"):
        parse_paper_config(bad)


def test_paper_proxy_places_conversations_as_the_authors_proxy():
    config = parse_paper_config("1R_1P_1D_1pD")  # workers P0, D0 (D), D1 (pD), A0 (R)
    cluster = Cluster.from_config(PROFILE, config.cluster_config)
    router = paper_proxy_router(config, seed=3)
    conversations = [Conversation(f"c{i:03d}", i * 0.05, [Turn(64, 4), Turn(32, 4)]) for i in range(150)]
    result = simulate(cluster, conversations, router)
    by_conversation = collections.defaultdict(dict)
    for record in result.records:
        by_conversation[record.conversation_id][record.turn] = record
    kinds = collections.Counter()
    for turns in by_conversation.values():
        first, second = turns[1], turns[2]
        assert first.decode_worker == second.decode_worker  # sessions stay where they started
        if first.route == "aggregated":
            kinds["R"] += 1
            assert second.route == "aggregated"
        elif first.decode_worker == "D1":  # pD: the follow-up prefills on the decode worker
            kinds["pD"] += 1
            assert (first.route, second.route) == ("via_prefill", "decode_local")
        else:  # D: every turn through the prefill worker
            kinds["D"] += 1
            assert (first.route, second.route) == ("via_prefill", "via_prefill")
    # One slot each, no load signal: a third each, give or take the draw.
    assert all(35 <= kinds[k] <= 65 for k in ("R", "pD", "D")), kinds
    # The same seed places the same conversations the same way.
    again = paper_proxy_router(config, seed=3)
    from dynamo_ppd.sim.assignment import SimRequestFeatures
    features = SimRequestFeatures("c007", 1, 10, 10, 4, None, 0, 0.0, [])
    assert router(features, cluster.view) == again(features, cluster.view)
    assert isinstance(router(features, cluster.view), (Replica, ViaPrefill, DecodeLocal))


def test_a_history_sent_as_text_is_prefilled_again_past_the_previous_prompt():
    def second_turn(history_as_text: bool):
        conversation = Conversation("c", 0.0, [Turn(300, 200), Turn(40, 4)], history_as_text=history_as_text)
        records = simulate(Cluster.from_config(PROFILE, "1R"), [conversation], replica_router).records
        return next(r for r in records if r.turn == 2)

    tokens, text = second_turn(False), second_turn(True)
    assert tokens.prompt_tokens == text.prompt_tokens  # same sizes, other ids for the output
    block = PROFILE.engine.block_size
    first_prompt = 1 + 4 + 300
    assert text.cached_tokens == first_prompt // block * block  # only turn 1's prompt matches
    assert tokens.cached_tokens > first_prompt + 150  # the output's blocks match as well
    assert text.ttft_s > tokens.ttft_s


def test_the_client_pool_queues_conversations_and_their_wait_counts_in_ttft():
    # Four conversations at once, two connections: the last two start when the first two end.
    conversations = [Conversation(f"c{i}", 0.0, [Turn(100, 50), Turn(20, 50)]) for i in range(4)]
    pooled = simulate(Cluster.from_config(PROFILE, "2R"), conversations, replica_router, max_connections=2)
    free = simulate(Cluster.from_config(PROFILE, "2R"), conversations, replica_router)
    ended = {c: max(r.finished_s for r in pooled.records if r.conversation_id == c) for c in ("c0", "c1")}
    later = [r for r in pooled.records if r.conversation_id in ("c2", "c3") and r.turn == 1]
    assert len(later) == 2
    for record in later:
        assert record.arrival_s == 0.0  # sent at arrival: the wait is the client's, inside TTFT
        assert record.ttft_s > min(ended.values())
    assert max(r.ttft_s for r in pooled.records if r.turn == 1) > 2 * max(
        r.ttft_s for r in free.records if r.turn == 1)
    # A deadline that passes while waiting for a connection fails the turn; nothing is lost.
    timed = simulate(Cluster.from_config(PROFILE, "1R"), conversations, replica_router, max_connections=1,
                     timeout_s=0.5)
    outcome = timed.outcome()
    assert outcome.total_requests >= 4 and outcome.failed >= 3
