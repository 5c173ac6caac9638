"""The virtual-clock cluster simulator: workload, handoff, routes, contention, determinism, CLI."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from dynamo_ppd.cli.sim import add_arguments, main
from dynamo_ppd.engine import load_profile
from dynamo_ppd.sim.assignment import DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill
from dynamo_ppd.sim.cluster import Cluster, parse_config
from dynamo_ppd.sim.conversation import (
    TEMPLATE_TOKENS,
    ChatTemplate,
    Conversation,
    ConversationPrompts,
    Turn,
    synthetic_workload,
)
from dynamo_ppd.sim.routing import fraction_router, local_router, pd_router, replica_router
from dynamo_ppd.sim.run import RequestRecord, SimResult, simulate

pytestmark = pytest.mark.unit

PROFILE = load_profile()
KV_BYTES = PROFILE.model.kv_bytes_per_token
BLOCK = PROFILE.engine.block_size


def run(config: str, conversations: list[Conversation], router, **kwargs) -> SimResult:
    until_s = kwargs.pop("until_s", None)
    return simulate(Cluster.from_config(PROFILE, config, **kwargs), conversations, router, until_s=until_s)


def by_turn(result: SimResult, turn: int) -> list[RequestRecord]:
    return [r for r in result.records if r.turn == turn]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def light_load(seed: int = 0) -> list[Conversation]:
    """Conversations far enough apart that they hardly ever overlap."""
    return synthetic_workload(0.5, 10.0, (1024, 32), (128, 32), turns=2, seed=seed)


# -- workload ------------------------------------------------------------------------------------

def test_synthetic_workload_is_poisson_within_duration_and_seeded():
    conversations = synthetic_workload(20.0, 10.0, (512, 64), (64, 32), turns=3, think_time_s=0.5, seed=7)
    assert 140 <= len(conversations) <= 260  # 200 expected
    arrivals = [c.arrival_s for c in conversations]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 10.0
    assert conversations[0].turns == [Turn(512, 64), Turn(64, 32, 0.5), Turn(64, 32, 0.5)]
    assert conversations == synthetic_workload(20.0, 10.0, (512, 64), (64, 32), turns=3,
                                               think_time_s=0.5, seed=7)
    assert conversations != synthetic_workload(20.0, 10.0, (512, 64), (64, 32), turns=3,
                                               think_time_s=0.5, seed=8)


def test_prompts_extend_the_history_exactly():
    prompts = ConversationPrompts(Conversation("c", 0.0, [Turn(100, 8), Turn(20, 8)]))
    first, new1 = prompts.next_prompt(Turn(100, 8))
    assert len(first) == new1 == 1 + 4 + 100
    assert all(2000 <= t < 8000 for t in first[5:])
    prompts.record_output([1500, 1501, 1502])
    second, new2 = prompts.next_prompt(Turn(20, 8))
    assert second[:len(first) + 3] == first + [1500, 1501, 1502]
    assert new2 == TEMPLATE_TOKENS + 20 and len(second) == len(first) + 3 + new2
    again = ConversationPrompts(Conversation("c", 0.0, []))
    assert again.next_prompt(Turn(100, 8))[0] == first  # seeded per conversation


def test_a_live_chat_templates_tokens_surround_every_message_and_the_history_still_extends():
    template = ChatTemplate(first_prefix=7, next_prefix=7, suffix=10)
    prompts = ConversationPrompts(Conversation("c", 0.0, [], template=template))
    first, new1 = prompts.next_prompt(Turn(100, 8))
    assert len(first) == new1 == 7 + 100 + 10
    assert all(2000 <= t < 8000 for t in first[7:107]) and all(t < 1000 for t in first[:7] + first[107:])
    prompts.record_output([1500, 1501, 1502])
    second, new2 = prompts.next_prompt(Turn(20, 8))
    assert second[:len(first) + 3] == first + [1500, 1501, 1502]  # the previous turn's KV still matches
    assert new2 == 7 + 20 + 10 and len(second) == len(first) + 3 + new2
    plain = ConversationPrompts(Conversation("c", 0.0, []))
    assert first[7:107] == plain.next_prompt(Turn(100, 8))[0][5:]  # the same user tokens


# -- determinism and the handoff -------------------------------------------------------------------

def test_same_seed_same_records():
    work = synthetic_workload(8.0, 3.0, (1024, 64), (128, 64), turns=3, seed=3)
    first = run("1P3D", work, fraction_router(0.5, seed=1), seed=5)
    second = run("1P3D", work, fraction_router(0.5, seed=1), seed=5)
    assert first.records == second.records and len(first.records) == 3 * len(work)
    assert first.simulated_s == second.simulated_s
    other = synthetic_workload(8.0, 3.0, (1024, 64), (128, 64), turns=3, seed=4)
    assert run("1P3D", other, fraction_router(0.5, seed=1), seed=5).records != first.records


def test_pd_charges_a_transfer_and_local_does_not():
    work = light_load()
    pd = run("1P3D", work, pd_router)
    assert {r.route for r in pd.records} == {"via_prefill"}
    for r in pd.records:
        assert r.prefill_worker == "P0" and r.decode_worker.startswith("D")
        assert r.transfer_bytes == r.prompt_tokens * KV_BYTES and r.transfer_s > 0
    local = run("1P3D", work, local_router)
    for r in by_turn(local, 2):
        assert r.route == "decode_local" and r.prefill_worker is None
        assert r.transfer_bytes == 0 and r.transfer_s == 0.0
    for r in by_turn(local, 1):
        assert r.route == "via_prefill" and r.transfer_bytes > 0


def test_sessions_are_sticky_and_turns_follow_the_engine_output():
    result = run("1P3D", light_load(), pd_router)
    first = {r.conversation_id: r for r in by_turn(result, 1)}
    for r in by_turn(result, 2):
        prev = first[r.conversation_id]
        assert r.decode_worker == prev.decode_worker
        assert r.prompt_tokens == prev.prompt_tokens + prev.output_tokens + TEMPLATE_TOKENS + 128
        assert r.new_tokens == TEMPLATE_TOKENS + 128
        assert r.arrival_s == pytest.approx(prev.finished_s)  # think time 0: closed loop
        # P still holds turn 1's prompt (never the response): it reports reusing those blocks.
        assert r.cached_tokens == prev.prompt_tokens // BLOCK * BLOCK
        assert r.output_tokens == 32 and r.tpot_s is not None and r.tpot_s > 0


def test_decode_local_reuses_the_history_and_beats_pd_under_light_load():
    work = light_load()
    local, pd = run("1P3D", work, local_router), run("1P3D", work, pd_router)
    first = {r.conversation_id: r for r in by_turn(local, 1)}
    for r in by_turn(local, 2):
        history = first[r.conversation_id].prompt_tokens + first[r.conversation_id].output_tokens
        assert history - BLOCK < r.cached_tokens <= history  # all full blocks of prompt+output
    local_ttft = mean([r.ttft_s for r in by_turn(local, 2)])
    pd_ttft = mean([r.ttft_s for r in by_turn(pd, 2)])
    assert local_ttft < pd_ttft
    assert mean([r.ttft_s for r in by_turn(local, 1)]) == pytest.approx(
        mean([r.ttft_s for r in by_turn(pd, 1)]))


def test_single_output_token_has_no_tpot():
    result = run("1P1D", [Conversation("one", 0.0, [Turn(64, 1)])], pd_router)
    (record,) = result.records
    assert record.output_tokens == 1 and record.tpot_s is None
    assert record.first_token_s == record.finished_s


# -- the link ------------------------------------------------------------------------------------

def test_simultaneous_transfers_queue_on_one_prefill_link():
    big = [Turn(4000, 4)]  # two prompts fit one 8192-token iteration: both are ready together
    slow = {"link_bandwidth_bytes_s": 10e9}
    alone = run("1P2D", [Conversation("a", 0.0, big)], pd_router, **slow).records[0]
    pair = run("1P2D", [Conversation("a", 0.0, big), Conversation("b", 0.0, big)], pd_router, **slow)
    first, second = sorted(pair.records, key=lambda r: r.transfer_s)
    assert {first.decode_worker, second.decode_worker} == {"D0", "D1"}  # spread over D
    send_s = first.prompt_tokens * KV_BYTES / 10e9
    assert first.transfer_s == pytest.approx(alone.transfer_s)
    assert first.transfer_s == pytest.approx(send_s + PROFILE.transfer.transfer_setup_s)
    assert second.transfer_s == pytest.approx(2 * first.transfer_s)  # waited for the first
    assert second.ttft_s > first.ttft_s + 0.9 * send_s


def test_slower_link_raises_pd_turn2_ttft_but_not_local():
    work = light_load(seed=2)
    slow = {"link_bandwidth_bytes_s": 2e9}
    pd_fast, pd_slow = run("1P3D", work, pd_router), run("1P3D", work, pd_router, **slow)
    local_fast, local_slow = run("1P3D", work, local_router), run("1P3D", work, local_router, **slow)

    def turn2(result: SimResult) -> float:
        return mean([r.ttft_s for r in by_turn(result, 2)])

    prompt = mean([r.prompt_tokens for r in by_turn(pd_slow, 2)])
    extra_send_s = prompt * KV_BYTES * (1 / 2e9 - 1 / PROFILE.transfer.link_bandwidth_bytes_s)
    assert turn2(pd_slow) - turn2(pd_fast) > 0.9 * extra_send_s
    assert turn2(local_slow) == pytest.approx(turn2(local_fast), rel=0.02)


# -- routes and routers --------------------------------------------------------------------------

@pytest.mark.parametrize("route, wrong", [
    (ViaPrefill("P9", "D0"), "'P9'"),
    (ViaPrefill("P0", "P0"), "'P0' as a decode worker"),
    (DecodeLocal("D7"), "'D7'"),
    (Replica("A0"), "replica workers are: none"),
    ("D0", "not a ViaPrefill, DecodeLocal or Replica"),
])
def test_router_cannot_pick_a_nonexistent_worker(route, wrong):
    with pytest.raises(RoutingError, match=wrong):
        run("1P3D", [Conversation("c", 0.0, [Turn(64, 4)])], lambda features, view: route)


def test_router_sees_only_what_a_real_router_knows():
    seen: list[SimRequestFeatures] = []

    def spy(features, view):
        seen.append(features)
        assert view.session_decode(features.conversation_id) == features.decode_worker
        assert view.link_backlog_s("P0") >= 0.0
        return local_router(features, view)

    run("1P3D", [Conversation("c", 0.0, [Turn(200, 16), Turn(40, 16), Turn(40, 16)])], spy)
    one, two, three = seen
    assert (one.turn, one.decode_worker, one.cached_on_decode, one.now) == (1, None, 0, 0.0)
    assert one.new_tokens == one.prompt_tokens == 205
    assert two.turn == 2 and two.decode_worker is not None and two.new_tokens == TEMPLATE_TOKENS + 40
    assert two.prompt_tokens == 205 + 16 + TEMPLATE_TOKENS + 40 and two.now > 0
    assert two.cached_on_decode == (205 + 16 - 1) // BLOCK * BLOCK  # the last token has no KV yet
    assert three.cached_on_decode > two.cached_on_decode


def test_fraction_router_is_deterministic_and_spans_pd_to_local():
    work = synthetic_workload(4.0, 5.0, (256, 16), (64, 16), turns=3, seed=4)
    half = run("1P3D", work, fraction_router(0.5, seed=9))
    later = [r.route for r in half.records if r.turn > 1]
    assert 0.3 < later.count("decode_local") / len(later) < 0.7
    assert half.records == run("1P3D", work, fraction_router(0.5, seed=9)).records
    assert {r.route for r in run("1P3D", work, fraction_router(0.0)).records} == {"via_prefill"}
    assert all(r.route == "decode_local" for r in run("1P3D", work, fraction_router(1.0)).records
               if r.turn > 1)
    with pytest.raises(ValueError):
        fraction_router(1.5)


def test_replica_router_follows_the_cached_prefix():
    work = synthetic_workload(3.0, 4.0, (512, 16), (64, 16), turns=3, seed=1)
    result = run("4R", work, replica_router)
    assert {r.route for r in result.records} == {"aggregated"}
    assert len({r.decode_worker for r in by_turn(result, 1)}) == 4  # new conversations spread
    home = {r.conversation_id: r.decode_worker for r in by_turn(result, 1)}
    for r in result.records:
        assert r.decode_worker == home[r.conversation_id] and r.transfer_bytes == 0
        if r.turn > 1:
            assert r.cached_tokens >= r.prompt_tokens - r.new_tokens - BLOCK
    with pytest.raises(RoutingError, match="aggregated"):
        run("1P1D", work, replica_router)


def test_until_stops_the_clock():
    work = synthetic_workload(10.0, 2.0, (1024, 128), (128, 128), seed=0)
    result = run("1P3D", work, pd_router, until_s=1.0)
    assert result.simulated_s == 1.0 and result.unfinished > 0
    assert all(r.finished_s <= 1.0 for r in result.records)


def test_parse_config():
    assert parse_config("1P3D") == (1, 3, 0)
    assert parse_config("4r") == (0, 0, 4)
    assert parse_config("1P2D1R") == (1, 2, 1)
    for bad in ("", "3X", "2P", "P1D1", "0R"):
        with pytest.raises(ValueError):
            parse_config(bad)


# -- CLI -----------------------------------------------------------------------------------------

def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="dynamo-ppd sim run")
    add_arguments(parser)
    return main(parser.parse_args(list(argv)))


def test_cli_prints_a_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = cli("--config", "2P2D", "--router", "fraction", "--local-fraction", "0.5", "--rate", "4",
               "--duration", "2", "--turns", "3", "--first-turn", "512,32", "--follow-up", "64,32",
               "--think-time", "0.2", "--link-bandwidth", "50", "--seed", "1", "--json", str(out))
    assert code == 0
    text = capsys.readouterr().out
    assert "turns 2+" in text and "simulated s per wall s" in text and "no timeout" in text
    document = json.loads(out.read_text())
    outcome = document["summary"]["outcome"]
    assert outcome["total_requests"] == len(document["records"]) + len(document["in_flight"]) > 0
    assert outcome["success_rate"] == 100.0 and outcome["turn2"]["count"] > 0
    assert document["settings"]["config"] == "2P2D"
    assert {r["route"] for r in document["records"]} <= {"via_prefill", "decode_local"}


def test_cli_timeout_fails_late_turns_and_ends_their_conversations(capsys):
    assert cli("--config", "1P1D", "--rate", "4", "--duration", "2", "--first-turn", "1024,400",
               "--timeout", "1") == 0
    text = capsys.readouterr().out
    assert "success 0.0%" in text and "(1 s timeout)" in text and "timeout" in text
    assert re.search(r"turns 2\+ +0/0 ", text)  # no follow-up was sent


def test_cli_runs_ppd_on_a_named_workload(tmp_path, capsys):
    # The done-when, on a shorter arrival window: PPD as the router runs it by default.
    out = tmp_path / "sim.json"
    assert cli("--router", "ppd", "--config", "1P3D", "--workload", "wildchat", "--qps", "4",
               "--duration", "3", "--json", str(out)) == 0
    text = capsys.readouterr().out
    assert "router ppd (weights 1,1; the profile's cost model)" in text
    assert "workload wildchat" in text and "(30 s timeout)" in text and "turns 2+" in text
    document = json.loads(out.read_text())
    assert document["summary"]["outcome"]["turn2"]["count"] > 0
    assert {r["route"] for r in document["records"]} <= {"via_prefill", "decode_local"}


def test_cli_ppd_decides_from_the_cost_model_unless_a_table_is_asked_for(capsys):
    assert cli("--router", "ppd", "--config", "1P3D", "--weights", "1,3", "--qps", "2",
               "--duration", "1") == 0
    assert "router ppd (weights 1,3; the profile's cost model)" in capsys.readouterr().out
    # auto: the shipped table where one ships, the cost model where none does (1P1D).
    assert cli("--router", "ppd", "--config", "1P3D", "--table", "auto", "--rate", "2",
               "--duration", "1") == 0
    assert "table h100-llama3.1-8b-1p3d.json" in capsys.readouterr().out
    assert cli("--router", "ppd", "--config", "1P1D", "--table", "auto", "--rate", "2",
               "--duration", "1") == 0
    assert "the profile's cost model" in capsys.readouterr().out


def test_cli_runs_every_peer_policy_of_sim_compare(capsys):
    from dynamo_ppd.sim.peers import PEER_ROUTERS, REPLICA_PEERS

    for name in PEER_ROUTERS:
        config = "4R" if name in REPLICA_PEERS else "1P3D"
        assert cli("--router", name, "--config", config, "--qps", "2", "--duration", "1") == 0, name
        assert f"router {name}" in capsys.readouterr().out


def test_cli_rate_is_qps():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--rate", "3"]).qps == parser.parse_args(["--qps", "3"]).qps == 3.0


def test_cli_refuses_synthetic_shape_with_a_named_workload(capsys):
    assert cli("--workload", "wildchat", "--turns", "3") == 2
    err = capsys.readouterr().err
    assert "--turns" in err and "--workload" in err and len(err.strip().splitlines()) == 1
    assert cli("--workload", "no-such-workload") == 2
    assert "known workloads" in capsys.readouterr().err
    assert cli("--router", "ppd", "--weights", "1,3", "--table", "/no/such/table.json") == 2
    with pytest.raises(SystemExit):
        cli("--weights", "1")


def test_cli_rejects_bad_settings(capsys):
    assert cli("--config", "3X") == 2
    assert "dynamo-ppd: error" in capsys.readouterr().err
    assert cli("--config", "4R", "--router", "pd") == 2
    with pytest.raises(SystemExit):
        cli("--first-turn", "1024")
    with pytest.raises(SystemExit):
        cli("--timeout", "0")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert all(action.help for action in parser._actions)
