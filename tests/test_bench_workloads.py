"""The benchmark's manifest format and workload generators: generators are deterministic and
have the data sets' shape, and a manifest survives a file round trip, validates with errors that
name line and field, rescales to a target rate and converts to the simulator's conversations."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from dynamo_ppd.sim import conversation as sim
from dynamo_ppd.workloads import generators as wl
from dynamo_ppd.workloads.manifest import (
    Manifest,
    ManifestConversation,
    ManifestError,
    ManifestHeader,
    ManifestTurn,
    context_tokens,
    from_sim,
    load_manifest,
    parse_manifest,
    save_manifest,
    scale_arrivals,
    to_sim,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def sharegpt() -> Manifest:
    return wl.sharegpt_like(100.0, 50.0, seed=1)  # ~5,000 conversations


@pytest.fixture(scope="module")
def wildchat() -> Manifest:
    return wl.wildchat_like(200.0, 50.0, seed=1)  # ~10,000 conversations


def near(value: float, target: float, rel: float = 0.15) -> bool:
    return abs(value - target) <= rel * target


@pytest.mark.parametrize("name", ["sharegpt", "wildchat", "large_huge_paste", "long-context", "turns-4"])
def test_generators_are_deterministic_for_a_seed(name):
    a = wl.make_workload(name, 5.0, 20.0, seed=3)
    assert a == wl.make_workload(name, 5.0, 20.0, seed=3)
    b = wl.make_workload(name, 5.0, 20.0, seed=4)
    assert [c.arrival_s for c in a.conversations] != [c.arrival_s for c in b.conversations]
    if name in ("sharegpt", "wildchat"):
        assert [c.turns for c in a.conversations[:20]] != [c.turns for c in b.conversations[:20]]
    assert a.header is not None and a.header.workload == name and a.header.seed == 3


def test_contents_do_not_depend_on_rate_and_arrivals_are_poisson():
    slow, fast = wl.sharegpt_like(1.0, 100.0, seed=2), wl.sharegpt_like(4.0, 100.0, seed=2)
    n = min(len(slow.conversations), len(fast.conversations))
    assert [c.turns for c in slow.conversations[:n]] == [c.turns for c in fast.conversations[:n]]
    arrivals = [c.arrival_s for c in wl.make_workload("turns-2", 20.0, 100.0).conversations]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 100.0
    assert near(len(arrivals), 2000, 0.1)
    gaps = np.diff(arrivals)
    assert near(float(np.mean(gaps)), 0.05, 0.1) and near(float(np.std(gaps)), 0.05, 0.15)  # exponential


def test_the_18_paper_workloads_have_the_authors_sizes_and_names():
    names = list(wl.PAPER_WORKLOADS)
    assert len(names) == len(set(names)) == 18
    assert names[0] == "small_tiny" and names[-1] == "large_huge_paste"
    assert wl.PAPER_WORKLOADS["small_tiny"] == ((128, 128), (16, 32))
    assert wl.PAPER_WORKLOADS["large_very_long_gen"] == ((1024, 1024), (64, 1024))
    assert wl.PAPER_WORKLOADS["small_big_paste"] == ((128, 128), (512, 64))
    assert wl.PAPER_WORKLOADS["large_huge_paste"] == ((1024, 1024), (1024, 32))
    assert wl.PAPER_QPS == (0.5, 1, 2, 4, 6, 8, 10, 12, 16, 20)
    for name, (first, follow) in wl.PAPER_WORKLOADS.items():
        m = wl.make_workload(name, 4.0, 10.0, seed=1)
        assert m.header is not None and m.header.workload == name and m.header.protocol == wl.paper_protocol()
        plan = [(*first, 0.0), (*follow, 0.0)]
        assert m.conversations and all(
            [(t.user_tokens, t.max_tokens, t.think_time_s) for t in c.turns] == plan for c in m.conversations)


def test_paper_arrivals_are_the_authors_process():
    # int(qps * 10) draws, kept below 10 s: never more than qps * 10, on average
    # E[min(Poisson(qps * 10), qps * 10)] (8.75 at 1 conv/s), not a plain Poisson count.
    counts = [len(wl.paper_arrivals(1.0, seed)) for seed in range(2000)]
    assert max(counts) == 10 and abs(float(np.mean(counts)) - 8.75) < 0.15
    assert all(len(wl.paper_arrivals(0.5, seed)) <= 5 for seed in range(200))
    a = wl.paper_arrivals(20.0, 3)
    assert a == sorted(a) and 0 < a[0] and a[-1] < wl.PAPER_ARRIVAL_WINDOW_S and len(a) <= 200
    assert a == wl.paper_arrivals(20.0, 3) != wl.paper_arrivals(20.0, 4)
    with pytest.raises(ValueError):
        wl.paper_arrivals(0.0, 1)


def test_paper_workload_is_the_simulators_conversations():
    convs = wl.paper_workload("small_mid_paste", 2.0, seed=5)
    m = wl.paper_manifest("small_mid_paste", 2.0, seed=5)
    assert convs == to_sim(m) and [c.arrival_s for c in convs] == wl.paper_arrivals(2.0, 5)
    assert all(c.turns == [sim.Turn(128, 128), sim.Turn(256, 64)] and c.seed == 5 for c in convs)
    with pytest.raises(wl.UnknownWorkload, match="small_tiny"):
        wl.paper_workload("syn-a-in32-out512", 1.0)


def test_paper_protocol_survives_a_file_round_trip_and_a_rescale(tmp_path):
    m = wl.paper_manifest("large_tiny", 4.0, seed=2)
    save_manifest(m, tmp_path / "p.jsonl")
    assert load_manifest(tmp_path / "p.jsonl") == m
    header = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    assert header["version"] == 2 and header["protocol"] == {
        "arrival": "paper-poisson", "arrival_window_s": 10.0, "turns": 2, "request_timeout_s": 120.0,
        "kill_after_s": 600.0, "max_connections": 50}
    slow = scale_arrivals(m, 2.0)
    assert slow.header is not None and slow.header.protocol is not None
    assert slow.header.protocol.arrival_window_s == pytest.approx(slow.header.duration_s)
    assert slow.header.protocol.request_timeout_s == 120.0


def test_long_context_and_turn_scaling():
    lc = wl.make_workload("long-context", 10.0, 2.0)
    assert lc.conversations and all(
        [(t.user_tokens, t.max_tokens) for t in c.turns] == [(10_000, 100)] + [(100, 100)] * 4
        for c in lc.conversations)
    for n in (2, 4, 8, 16):
        m = wl.make_workload(f"turns-{n}", 10.0, 2.0)
        assert m.conversations and all(len(c.turns) == n for c in m.conversations)
        assert m.conversations[0].turns[0].user_tokens == 512
        assert all(t.user_tokens == 256 and t.max_tokens == 128 for t in m.conversations[0].turns[1:])


def test_sharegpt_like_matches_the_data_sets_shape(sharegpt):
    convs = sharegpt.conversations
    assert 4500 < len(convs) < 5500
    counts = np.array([len(c.turns) for c in convs])
    targets = {1: 25, 2: 18, 3: 15, 4: 14, 5: 10, 6: 7}
    for k, share in targets.items():
        assert abs(100 * np.mean(counts == k) - share) <= 2, k
    assert abs(100 * np.mean(counts >= 7) - 11) <= 2 and counts.max() <= 12
    assert abs(counts.mean() - 3.5) < 0.15
    first = [c.turns[0].user_tokens for c in convs]
    later = [t.user_tokens for c in convs for t in c.turns[1:]]
    replies = [t.max_tokens for c in convs for t in c.turns]
    for values, targets_q in ((first, {50: 24, 90: 432}), (later, {50: 16, 90: 86}),
                              (replies, {50: 255, 90: 549, 99: 769})):
        for q, target in targets_q.items():
            assert near(float(np.percentile(values, q)), target), (q, target)
    assert min(first + later + replies) >= 1
    think = [t.think_time_s for c in convs for t in c.turns[1:]]
    assert near(float(np.mean(think)), 1.0, 0.1) and all(c.turns[0].think_time_s == 0 for c in convs)


def test_wildchat_like_matches_the_data_sets_shape(wildchat, sharegpt):
    convs = wildchat.conversations
    counts = np.array([len(c.turns) for c in convs])
    assert abs(counts.mean() - 2.5) <= 0.3
    assert abs(100 * np.mean(counts > 10) - 3.7) <= 1.5
    p90_context = float(np.percentile([context_tokens(c) for c in convs], 90))
    assert near(p90_context, 5115), p90_context
    ws, ss = wildchat.summary(), sharegpt.summary()  # longer messages than ShareGPT
    assert ws["user_tokens_p50"] > ss["user_tokens_p50"] and ws["output_tokens_p50"] > ss["output_tokens_p50"]


def test_truncated_lognormal_fit():
    d = wl.TruncatedLogNormal(median=100, p90=400, cap=1000)
    assert d.quantile(0.5) == pytest.approx(100) and d.quantile(0.9) == pytest.approx(400)
    assert d.quantile(1.0) == pytest.approx(1000)


def test_unknown_workload_lists_the_names():
    with pytest.raises(KeyError) as err:
        wl.make_workload("nope", 1.0, 1.0)
    assert isinstance(err.value, wl.UnknownWorkload)
    assert "sharegpt" in str(err.value) and "small_tiny" in str(err.value)
    expected = {"long-context", "sharegpt", "wildchat", *wl.PAPER_WORKLOADS,
                *(f"turns-{n}" for n in range(2, 17))}
    assert expected <= set(wl.WORKLOADS)


def _sample_manifest() -> Manifest:
    return Manifest(ManifestHeader(workload="mixed", seed=7, description="two kinds of turn"), [
        ManifestConversation("x", 1.5, [ManifestTurn(10, user_text="Hello there, who are you?"),
                                        ManifestTurn(20, user_tokens=5, think_time_s=0.25)]),
        ManifestConversation("y", 0.25, [ManifestTurn(3, user_tokens=4)]),
    ])


def test_manifest_round_trip_and_sorting(tmp_path):
    m = _sample_manifest()
    assert [c.conversation_id for c in m.conversations] == ["y", "x"]  # sorted by arrival
    path = tmp_path / "m.jsonl"
    save_manifest(m, path)
    assert load_manifest(path) == m
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["manifest"] == "dynamo-ppd" and len(lines) == 3
    assert "user_text" not in lines[1] and "think_time_s" not in lines[1]  # defaults omitted
    path.write_text("\n".join([lines[2], "", lines[1]]) + "\n")  # no header, unsorted, a blank line
    loaded = load_manifest(path)
    assert loaded.header is None and loaded.conversations == m.conversations
    big = wl.wildchat_like(5.0, 10.0, seed=1)
    save_manifest(big, path)
    assert load_manifest(path) == big


GOOD = '{"conversation_id": "c%d", "arrival_s": 0.5, "turns": [{"user_tokens": 3, "max_tokens": 4}]}'


@pytest.mark.parametrize("bad, line, expected", [
    ('{"conversation_id": "b", "arrival_s": 1, "turns": [{"user_tokens": 3, "max_tokens": 4}, '
     '{"user_tokens": 3, "max_tokens": 0}]}', 3, "turns[1].max_tokens: Expected int >= 1"),
    ('{"conversation_id": "b", "arrival_s": 1, "turns": [{"user_tokens": 3, "user_text": "hi", '
     '"max_tokens": 4}]}', 3, "turns[0]: exactly one of user_tokens and user_text must be set (got both)"),
    ('{"conversation_id": "b", "arrival_s": 1, "turns": [{"max_tokens": 4}]}', 3,
     "turns[0]: exactly one of user_tokens and user_text must be set (got neither)"),
    ('{"conversation_id": "b", "arrival_s": 1, "turns": [{"user_tokens": 3, "max_tokens": 4, "temp": 1}]}', 3,
     "turns[0].temp: unknown field"),
    ('{"conversation_id": "b", "arrival_s": 1, "turns": []}', 3, "turns: Expected array of length >= 1"),
    ('{"conversation_id": "b", "arrival_s": -1, "turns": [{"user_tokens": 3, "max_tokens": 4}]}', 3,
     "arrival_s: Expected float >= 0.0"),
    ('{"conversation_id": "b", "turns": [{"user_tokens": 3, "max_tokens": 4}]}', 3,
     "arrival_s: missing required field"),
    (GOOD % 1, 3, "conversation_id: duplicate id 'c1' (first on line 2)"),
    ('{"conversation_id": "b", ', 3, "invalid JSON"),
    ('{"manifest": "dynamo-ppd", "version": 1}', 3, "a header is only allowed on the first line"),
])
def test_validation_errors_name_line_and_field(tmp_path, bad, line, expected):
    path = tmp_path / "manifest.jsonl"
    path.write_text("\n".join(['{"manifest": "dynamo-ppd", "version": 1, "workload": "t"}', GOOD % 1, bad]))
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    assert str(err.value) == f"{path} line {line}: {expected}" or (
        expected == "invalid JSON" and str(err.value).startswith(f"{path} line {line}: invalid JSON"))


@pytest.mark.parametrize("header, expected", [
    ('{"manifest": "dynamo-ppd", "version": 3}', "version: unsupported manifest version 3"),
    ('{"manifest": "dynamo-ppd", "version": 1, "protocol": {"turns": 2}}',
     "protocol: not in manifest version 1"),
    ('{"manifest": "dynamo-ppd", "version": 2, "protocol": {"turns": 0}}',
     "protocol.turns: Expected int >= 1"),
    ('{"manifest": "dynamo-ppd", "version": 2, "protocol": {"arrival": "burst"}}',
     "protocol.arrival: Invalid enum value 'burst'"),
    ('{"manifest": "other", "version": 1}', "manifest: expected 'dynamo-ppd'"),
    ('{"manifest": "dynamo-ppd", "version": 1, "owner": "me"}', "owner: unknown field"),
    ('{"manifest": "dynamo-ppd", "version": "1"}', "version: Expected int, got str"),
])
def test_header_errors(header, expected):
    with pytest.raises(ManifestError, match=r"^m\.jsonl line 1: " + expected.replace(".", r"\.")):
        parse_manifest([header, GOOD % 1], source="m.jsonl")


def test_duplicate_ids_rejected_in_code_too():
    turn = [ManifestTurn(1, user_tokens=1)]
    with pytest.raises(ManifestError, match="duplicate"):
        Manifest(None, [ManifestConversation("a", 0, turn), ManifestConversation("a", 1, turn)])


def test_scale_arrivals_hits_the_target_rate():
    m = wl.make_workload("sharegpt", 2.0, 30.0, seed=5)
    for rate in (0.5, 1.0, 7.0, 20.0):
        scaled = scale_arrivals(m, rate)
        arrivals = [c.arrival_s for c in scaled.conversations]
        assert len(arrivals) / arrivals[-1] == pytest.approx(rate)
        assert scaled.summary()["rate_conv_per_s"] == pytest.approx(rate)
        ratios = [a / b.arrival_s for a, b in zip(arrivals, m.conversations, strict=True)]
        assert max(ratios) == pytest.approx(min(ratios))  # one factor: order and relative gaps kept
        assert [c.turns for c in scaled.conversations] == [c.turns for c in m.conversations]
        assert scaled.header is not None and scaled.header.rate_conv_per_s == rate
    with pytest.raises(ValueError):
        scale_arrivals(m, 0)


def test_to_sim_and_back():
    m = _sample_manifest()
    convs = to_sim(m)
    assert convs == [
        sim.Conversation("y", 0.25, [sim.Turn(4, 3, 0.0)], seed=7),
        sim.Conversation("x", 1.5, [sim.Turn(5, 10, 0.0), sim.Turn(5, 20, 0.25)], seed=7),
    ]
    assert to_sim(m, count_tokens=len)[1].turns[0].user_tokens == len("Hello there, who are you?")
    generated = wl.make_workload("turns-4", 5.0, 10.0)
    assert from_sim(to_sim(generated), generated.header) == generated
    ref = sim.synthetic_workload(3.0, 10.0, first_turn=(512, 128), follow_up=(32, 512), seed=4)
    assert to_sim(from_sim(ref, ManifestHeader(seed=4))) == ref


def test_summary():
    s = _sample_manifest().summary()
    assert s["conversations"] == 2 and s["turns"] == 3 and s["mean_turns"] == 1.5
    assert s["user_tokens_p50"] == 5 and s["output_tokens_p90"] == pytest.approx(18)
    assert s["span_s"] == 1.5 and s["workload"] == "mixed"
    assert Manifest().summary()["conversations"] == 0


def test_load_sharegpt(tmp_path):
    data = [
        {"id": "a", "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "What is KV cache?"},
            {"from": "gpt", "value": "It stores keys and values " * 10},
            {"from": "human", "value": "And PD?"},
            {"from": "gpt", "value": "Prefill and decode split."},
            {"from": "human", "value": "unanswered"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},  # no human turn: dropped
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"},
                                      {"from": "gpt", "value": "out of order"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    m = wl.load_sharegpt(path, rate_conv_per_s=2.0, seed=1)
    assert [c.conversation_id for c in m.conversations] == ["a", "a#2", "c"]
    a = m.conversations[0]
    assert [(t.user_text, t.max_tokens) for t in a.turns] == [("What is KV cache?", 65), ("And PD?", 5)]
    assert len(m.conversations[1].turns) == 1
    assert [c.turns[0].user_text for c in wl.load_sharegpt(path, tokenizer_count=len,
                                                             max_conversations=1).conversations] == [
        "What is KV cache?"]
    assert wl.load_sharegpt(path, tokenizer_count=len).conversations[2].turns[0].max_tokens == 1
    save_manifest(m, tmp_path / "m.jsonl")
    assert load_manifest(tmp_path / "m.jsonl") == m
    assert msgspec.json.encode(to_sim(m)[0].turns[0]) == (
        b'{"user_tokens":4,"max_tokens":65,"think_time_s":0.0}')
