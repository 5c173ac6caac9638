"""`sim compare`'s load sweeps: the three workloads where disaggregation should pay (their shape
and determinism), the figures a sweep point adds (throughput per GPU, P50/P99 with paired
bootstrap replicates), how saturation is found, and the report section, end to end in process."""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import Future

import msgspec
import pytest

from dynamo_ppd.cli import main as cli_main
from dynamo_ppd.sim import conversation as sim
from dynamo_ppd.sim.run import InFlightTurn, RequestRecord, SimResult
from dynamo_ppd.studies import policies, saturation, sweep_report
from dynamo_ppd.studies.policy_points import (
    BOOTSTRAP_RESAMPLES,
    PolicyPoint,
    gpu_count,
    paired_ratio,
    sweep_figures,
    tokens_per_sec_per_gpu,
)
from dynamo_ppd.workloads import generators as wl
from dynamo_ppd.workloads.manifest import context_tokens, dump_manifest

pytestmark = pytest.mark.unit

SWEPT = ("long-context", "many-turn", "agent-32k", "coding-agent")


# -- the workloads -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SWEPT)
def test_swept_workloads_are_named_workloads_deterministic_for_a_seed(name):
    a = wl.make_workload(name, 2.0, 20.0, seed=5)
    assert a.header is not None and a.header.workload == name and a.conversations
    assert dump_manifest(a) == dump_manifest(wl.make_workload(name, 2.0, 20.0, seed=5))
    b = wl.make_workload(name, 2.0, 20.0, seed=6)
    assert [c.arrival_s for c in a.conversations] != [c.arrival_s for c in b.conversations]
    if name != "long-context":  # fixed sizes: only the arrivals depend on the seed
        assert [c.turns for c in a.conversations[:10]] != [c.turns for c in b.conversations[:10]]
    # Contents do not depend on the rate, and arrivals scale with it: the same first conversations
    # at every rung of a sweep.
    fast = wl.make_workload(name, 4.0, 10.0, seed=5)
    assert [c.turns for c in fast.conversations] == [c.turns for c in a.conversations]
    assert [2 * c.arrival_s for c in fast.conversations] == pytest.approx(
        [c.arrival_s for c in a.conversations])
    parser = argparse.ArgumentParser()
    policies.add_arguments(parser)
    assert parser.parse_args(["--workloads", name]).workloads == [name]  # selectable in sim compare
    assert name in saturation.SWEEPS
    # In the default run, but the opt-in one (its long sessions cost as much as the rest).
    assert (name in parser.parse_args([]).workloads) == (name not in saturation.OPT_IN)


def test_long_context_is_the_papers_fig1_workload():
    m = wl.make_workload("long-context", 5.0, 4.0, seed=1)
    for c in m.conversations:
        assert [(t.user_tokens, t.max_tokens, t.think_time_s) for t in c.turns] == \
            [(10_000, 100, 0.0)] + [(100, 100, 0.0)] * 4


def test_many_turn_draws_2_to_16_turns_uniformly_with_chat_sized_appends_and_short_replies():
    m = wl.many_turn(50.0, 40.0, seed=2)  # ~2,000 conversations
    counts = [len(c.turns) for c in m.conversations]
    assert min(counts) == 2 and max(counts) == 16 and set(counts) == set(range(2, 17))
    assert statistics.mean(counts) == pytest.approx(9.0, abs=0.3)  # uniform on 2..16
    shares = [counts.count(n) / len(counts) for n in range(2, 17)]
    assert max(shares) - min(shares) < 0.04  # each count ~1/15
    later = [t.user_tokens for c in m.conversations for t in c.turns[1:]]
    replies = [t.max_tokens for c in m.conversations for t in c.turns]
    assert statistics.median(later) == pytest.approx(16, abs=3)  # ShareGPT's later user messages
    assert statistics.median(replies) == pytest.approx(64, rel=0.1) and max(replies) <= 512
    # the paper's protocol: each turn is sent when the previous answer ends
    assert all(t.think_time_s == 0 for c in m.conversations for t in c.turns)
    thinking = wl.many_turn(50.0, 10.0, seed=2, think_time_mean_s=1.0)
    assert statistics.mean(t.think_time_s for c in thinking.conversations for t in c.turns[1:]) == \
        pytest.approx(1.0, rel=0.1)


def test_agent_32k_grows_a_long_context_with_tool_outputs_and_short_replies():
    m = wl.agent_32k(20.0, 20.0, seed=3)  # ~400 conversations
    contexts = [context_tokens(c) for c in m.conversations]
    assert max(contexts) <= wl.AGENT_CONTEXT_TOKENS
    assert statistics.median(contexts) > 28_000  # the sessions run to the window
    assert all(2 <= len(c.turns) <= wl.AGENT_MAX_TURNS for c in m.conversations)
    first = [c.turns[0].user_tokens for c in m.conversations]
    tools = [t.user_tokens for c in m.conversations for t in c.turns[1:]]
    replies = [t.max_tokens for c in m.conversations for t in c.turns]
    assert statistics.median(first) == pytest.approx(6000, rel=0.1) and max(first) <= 16_000
    assert statistics.median(tools) == pytest.approx(2500, rel=0.15) and max(tools) <= 8192
    assert statistics.median(len(c.turns) for c in m.conversations) == pytest.approx(9, abs=2)
    assert statistics.median(replies) == pytest.approx(80, rel=0.15) and max(replies) <= 1024
    # the context is the simulator's: user tokens, replies and its template tokens
    c = m.conversations[0]
    assert context_tokens(c) == sum(t.user_tokens + t.max_tokens + sim.TEMPLATE_TOKENS for t in c.turns)


def test_coding_agent_follows_tracelabs_figures_and_shares_one_system_prompt():
    m = wl.coding_agent(0.5, 200.0, seed=2)  # ~100 sessions
    assert m.header is not None and m.header.shared_prefix_tokens == wl.CODING_SHARED_PREFIX
    contexts = [wl.CODING_SHARED_PREFIX + context_tokens(c) for c in m.conversations]
    assert max(contexts) <= wl.CODING_CONTEXT_TOKENS
    assert statistics.median(contexts) > 90_000  # TraceLab: median cached prefix 119K
    appends = [t.user_tokens for c in m.conversations for t in c.turns if t.think_time_s < 60]
    assert statistics.median(appends) == pytest.approx(875, rel=0.1)
    assert 0.85 < sum(a < 1000 for a in appends) / len(appends) < 0.95  # TraceLab: 90% under 1K
    assert max(appends) > 8_000  # and a heavy tail
    replies = [t.max_tokens for c in m.conversations for t in c.turns]
    assert statistics.median(replies) == pytest.approx(214, rel=0.1)
    gaps = [t.think_time_s for c in m.conversations for t in c.turns[1:]]
    assert statistics.median(gaps) < 1.0 and max(gaps) > 300  # sub-second tools, human pauses
    assert dump_manifest(m) == dump_manifest(wl.coding_agent(0.5, 200.0, seed=2))
    # The simulator's sessions start with the same ids (the shared prompt), then their own.
    from dynamo_ppd.workloads.manifest import parse_manifest, to_sim

    again = parse_manifest(dump_manifest(m).splitlines())  # the header's field survives a file
    one, two = (sim.ConversationPrompts(c).next_prompt(c.turns[0])[0] for c in to_sim(again)[:2])
    shared = sim.TEMPLATE_TOKENS + wl.CODING_SHARED_PREFIX
    assert one[:shared] == two[:shared] and one[shared:shared + 8] != two[shared:shared + 8]


# -- throughput per GPU and the sweep figures ----------------------------------------------------

def point(policy: str = "ppd@1", rate: float = 1.0, config: str = "1P3D", **fields) -> PolicyPoint:
    base = {"success_rate": 100.0, "turn2_ttft_s": 0.05, "turn2_tpot_s": 0.01, "turn2_p99_ttft_s": 0.2,
            "tokens_per_sec": 4000.0, "local_share": 1.0, "turn1_p50_ttft_s": 0.3,
            "turn2_p50_ttft_s": 0.04, "turn2_p50_tpot_s": 0.01, "conversations": 10}
    base.update(fields)
    return PolicyPoint(config, "cross-node", "long-context", rate, policy, **base)


def test_throughput_per_gpu_divides_by_the_configurations_gpus():
    assert [gpu_count(c) for c in ("1P3D", "2P2D", "4R", "1P2D", "1P2D1R")] == [4, 4, 4, 3, 4]
    assert tokens_per_sec_per_gpu(point(tokens_per_sec=4000.0)) == 1000.0
    assert tokens_per_sec_per_gpu(point(config="1P2D", tokens_per_sec=3000.0)) == 1000.0
    # replicas run on the configuration's GPUs: per GPU is over the same four
    assert tokens_per_sec_per_gpu(point("replicas", tokens_per_sec=2000.0)) == 500.0


def record(cid: str, turn: int, ttft: float, tpot: float = 0.01, finished: float = 1.0) -> RequestRecord:
    return RequestRecord(cid, turn, "decode_local", None, "D0", 100, 90, 10, 0.0, ttft, finished, ttft,
                         tpot, 100, 0, 0.0)


def test_sweep_figures_are_percentiles_over_successful_turns_with_paired_replicates():
    records = [record("a", 1, 0.5), record("a", 2, 0.01), record("a", 3, 0.03),
               record("b", 1, 0.7), record("b", 2, 0.02, finished=50.0)]  # b's follow-up came too late
    result = SimResult(records, 60.0, 0.1, [InFlightTurn("c", 1, 0.0)], timeout_s=30.0)
    fields = sweep_figures(result, result.outcome(), ["a", "b", "c"])
    assert fields["conversations"] == 3
    assert fields["turn1_p50_ttft_s"] == pytest.approx(0.6)
    assert fields["turn2_p50_ttft_s"] == pytest.approx(0.02)  # a's two; b's was late
    reps = fields["replicates"]
    assert len(reps.turn2_p50_ttft_s) == BOOTSTRAP_RESAMPLES
    assert {v for v in reps.turn2_p50_ttft_s if v is not None} <= {0.01, 0.02, 0.03}
    assert None in reps.turn2_p50_ttft_s  # a resample without conversation a has no follow-up
    # The same conversations resample alike: a point against itself is 1 with a zero-width interval,
    # and a policy twice as slow on every follow-up is 2 [2, 2].
    a = point(**fields)
    slower = msgspec.structs.replace(
        a, turn2_p50_ttft_s=2 * fields["turn2_p50_ttft_s"],
        replicates=msgspec.structs.replace(reps, turn2_p50_ttft_s=[None if v is None else 2 * v
                                                                   for v in reps.turn2_p50_ttft_s]))
    same = paired_ratio(a, a, "p50 ttft")
    assert same is not None and (same.value, same.low, same.high, same.conversations) == (1.0, 1.0, 1.0, 3)
    twice = paired_ratio(slower, a, "p50 ttft")
    assert twice is not None and (twice.value, twice.low, twice.high) == pytest.approx((2.0, 2.0, 2.0))
    assert paired_ratio(a, msgspec.structs.replace(a, conversations=4), "p50 ttft") is None
    assert paired_ratio(point(), a, "p50 ttft") is None  # no replicates on one side


# -- saturation ----------------------------------------------------------------------------------

def test_saturation_is_the_success_bar_or_a_median_ttft_that_exploded():
    light = point(turn1_p50_ttft_s=0.3, turn2_p50_ttft_s=0.02)
    assert not saturation.saturated(light, light)
    assert not saturation.saturated(point(turn1_p50_ttft_s=1.1), light)  # < 4x
    assert saturation.saturated(point(turn1_p50_ttft_s=1.3), light)  # turn 1 queues: P saturated
    assert not saturation.saturated(point(turn2_p50_ttft_s=0.09), light)  # 4.5x but under 100 ms
    assert saturation.saturated(point(turn2_p50_ttft_s=0.2), light)
    assert saturation.saturated(point(success_rate=94.0), light)
    assert saturation.saturated(point(turn2_p50_ttft_s=None), light)  # no follow-up answered


def test_a_light_rung_holds_enough_conversations_and_every_rung_the_same_first_ones():
    sweep = saturation.SWEEPS["agent-32k"]
    assert sweep.window(sweep.rates()[0]) == pytest.approx(saturation.MIN_CONVERSATIONS / sweep.rates()[0])
    assert sweep.window(sweep.rates()[-1]) == sweep.window_s
    by_rate = [saturation.conversations("long-context", rate, 0)[0] for rate in (0.5, 8.0)]
    assert len(by_rate[0]) >= 15 and len(by_rate[1]) > len(by_rate[0])
    first = [c.conversation_id for c in by_rate[0]]
    assert [c.conversation_id for c in by_rate[1][:len(first)]] == first
    assert saturation.conversations("long-context", 1.0, 0)[1] == 120.0  # the paper's timeout


def test_a_sweep_climbs_each_lane_until_it_saturates():
    lanes = [saturation.Lane("1P3D", "cross-node", "long-context", p) for p in ("ppd@1", "replicas", "x0")]
    knee = {"ppd@1": 2.0, "replicas": 5.0, "x0": 0.6}  # rates past which each lane's turn 1 explodes
    asked: list[list[tuple[str, float]]] = []

    def run(todo, rung):
        asked.append([(lane.policy, rate) for lane, rate in todo])
        return [point(lane.policy, rate, turn1_p50_ttft_s=0.3 if rate <= knee[lane.policy] else 30.0)
                for lane, rate in todo]

    points = saturation.sweep(lanes, run)
    rates = saturation.SWEEPS["long-context"].rates()
    assert rates[0] == 0.5 and rates[1] == pytest.approx(0.707)
    assert asked[0] == [("ppd@1", 0.5), ("replicas", 0.5), ("x0", 0.5)]
    assert ("x0", 0.707) in asked[1] and all(p != "x0" for p, _ in asked[2])  # x0 stopped at its knee
    found = saturation.saturation_rates(points)
    assert found[lanes[0]] == saturation.Saturation(2.0, 2.828) and found[lanes[2]].sustained == 0.5
    assert found[lanes[1]] == saturation.Saturation(4.0, 5.657)
    assert found[lanes[1]].text() == "4" and saturation.Saturation(8.0, None).text() == ">= 8"
    assert max(p.rate for p in points) == 5.657  # nothing past the last lane's saturated rung


def test_the_section_says_where_ppd_beats_replicas_and_where_replicas_win():
    pts = []
    for rate, rep_ttft, ppd_ttft, ppd_t1 in ((1.0, 0.10, 0.02, 0.3), (2.0, 0.12, 0.02, 0.3),
                                             (4.0, 0.15, 0.02, 30.0), (8.0, 20.0, None, None)):
        pts.append(point("replicas", rate, turn2_ttft_s=rep_ttft, turn2_p50_ttft_s=rep_ttft))
        if ppd_t1 is not None:
            pts.append(point("ppd@1", rate, turn2_ttft_s=ppd_ttft, turn2_p50_ttft_s=ppd_ttft,
                             turn1_p50_ttft_s=ppd_t1))
    pts.append(point("x0", 1.0, turn2_ttft_s=0.5, turn2_p50_ttft_s=0.5))
    text = "\n".join(sweep_report.section(pts, "pol"))
    assert "## Where disaggregation pays" in text
    # PPD wins on follow-ups while it keeps up; at 4 conv/s its turn-1 queue explodes (saturated)
    # while replicas keep up, so replicas win there whatever the follow-ups' latencies; at 8 both
    # have saturated.
    assert "- `long-context`, 1P3D: PPD wins at 1-2; replicas win at 4." in text
    assert "| workload | config | PPD | replicas | x0 |" in text  # every policy that ran, a column each
    assert "| long-context | 1P3D | 2 (1000) | 4 (1000) | >= 1 (1000) |" in text
    assert "| loss (PPD saturated) |" in text and "| both saturated |" in text
    assert "| win +0.80 | +0.96 (x0) |" in text  # (0.10 - 0.02) / 0.10; against x0 (0.5 - 0.02) / 0.5
    assert "pol-sweep-cross-node-p99-ttft.png" in text
    assert sweep_report.section([point("replicas")], "pol") == []  # no PPD: nothing to say


# -- the command, in process ---------------------------------------------------------------------

class InProcessPool:
    """A stand-in for the process pool: the points run here (a unit test starts no process)."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items, chunksize=1):
        return map(fn, items)

    def submit(self, fn, *args):  # pragma: no cover - map is all sim compare uses
        future: Future = Future()
        future.set_result(fn(*args))
        return future


def test_sim_compare_sweeps_a_workload_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "ProcessPoolExecutor", InProcessPool)
    tiny = saturation.Sweep("long-context", start_rate=0.5, step=2 ** 0.5, rungs=2, window_s=6.0,
                            timeout_s=120.0, min_conversations=1)
    monkeypatch.setitem(saturation.SWEEPS, "long-context", tiny)
    for module in (policies, sweep_report):  # matplotlib takes seconds to import: no PNGs here
        monkeypatch.setattr(module, "plot", lambda *args: [])
    out = tmp_path / "pol"
    assert cli_main(["sim", "compare", "--configs", "1P3D", "--workloads", "long-context", "--weights", "1",
                     "--policies", "replicas,ppd@1,x0.5", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "pol.json").read_text())
    swept = {(p["policy"], p["rate"]) for p in report["points"]}
    # x0.5 is left out of the sweeps; each lane climbs the (tiny) ladder
    assert swept == {("replicas", 0.5), ("replicas", 0.707), ("ppd@1", 0.5), ("ppd@1", 0.707)}
    assert all(p["link"] == "cross-node" and len(p["replicates"]["turn2_p50_ttft_s"]) == BOOTSTRAP_RESAMPLES
               for p in report["points"])
    assert report["summaries"]["cross-node w_tpot 1"] == []  # the grid's tables leave sweeps out
    text = (tmp_path / "pol.md").read_text()
    assert "## Where disaggregation pays" in text and "| long-context | 1P3D | 0.5 |" in text


@pytest.mark.slow
def test_each_seed_climbs_its_own_ladder_and_the_report_pools_the_rungs_both_kept_up(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "ProcessPoolExecutor", InProcessPool)
    tiny = saturation.Sweep("long-context", start_rate=0.5, step=2 ** 0.5, rungs=2, window_s=6.0,
                            timeout_s=120.0, min_conversations=1)
    monkeypatch.setitem(saturation.SWEEPS, "long-context", tiny)
    for module in (policies, sweep_report):
        monkeypatch.setattr(module, "plot", lambda *args: [])
    out = tmp_path / "pol"
    assert cli_main(["sim", "compare", "--configs", "1P3D", "--workloads", "long-context", "--weights", "1",
                     "--policies", "x1,ppd@1", "--seeds", "0,1", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "pol.json").read_text())
    assert sorted((p["policy"], p["rate"], p.get("seed", 0)) for p in report["points"]) == [
        (policy, rate, seed) for policy in ("ppd@1", "x1") for rate in (0.5, 0.707) for seed in (0, 1)]
    ppd = {p.get("seed", 0): p["turn2_p99_ttft_s"] for p in report["points"] if p["policy"] == "ppd@1"}
    assert ppd[0] != ppd[1]  # each seed its own conversations
    (row,) = report["families"]
    assert (row["family"], row["link"], row["lanes"]) == ("long-context", "cross-node", 1)
    assert row["x1"]["of"] == 2  # both rungs, pooled over the two seeds (neither saturated)
    assert [d["part"] for d in report["done_when"]] == ["sweeps: long-context"] * 2
    text = (tmp_path / "pol.md").read_text()
    assert text.index("## Done-when check") < text.index("## PPD at a glance")
    assert "seed 0's runs of seeds [0, 1]" in text
