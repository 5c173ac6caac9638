"""The policy core and its tables: grid lookup, rate window, table files, building, explaining,
and the online correction against the pure table in the simulation."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

import msgspec
import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.policy.decision import (
    Calibration,
    Mode,
    Policy,
    PolicyConfig,
    ProfilePredictor,
    RequestFeatures,
    Route,
    WorkerLoad,
)
from dynamo_ppd.policy.grid import ContextClass, GridSpec, WorkloadClass, default_grid
from dynamo_ppd.policy.qps import SlidingWindowRate
from dynamo_ppd.policy.score import Prediction
from dynamo_ppd.policy.simulate import cell_workload
from dynamo_ppd.policy.table import (
    TableError,
    Weights,
    bundled_table,
    load_table,
    reweight,
    save_table,
    validate,
)
from dynamo_ppd.sim import conversation as sim
from dynamo_ppd.tables.build import build_sim_table
from dynamo_ppd.workloads.generators import PAPER_QPS, PAPER_T1, PAPER_T2, paper_arrivals

pytestmark = pytest.mark.unit

TINY = GridSpec(
    context_classes=[ContextClass("small", 512, 320, (128, 128)),
                     ContextClass("large", None, 2112, (1024, 1024))],
    workload_classes=[WorkloadClass("short_gen", 32, 256), WorkloadClass("huge_paste", 1024, 32)],
    qps_levels=[2, 8])


@pytest.fixture(scope="module")
def tiny_table():
    return build_sim_table("h100-llama3.1-8b", "1P3D", Weights(), grid=TINY, seconds_per_cell=3, jobs=1,
                           progress=False)


def test_grid_lookup_at_the_edges():
    grid = default_grid()
    assert [grid.context_class(n).name for n in (1, 512, 513, 4096, 4097, 10**6)] == \
        ["small", "small", "large", "large", "huge", "huge"]
    assert grid.workload_class(1, 1).name == "tiny"
    assert grid.workload_class(10_000, 10_000).name == "very_long_gen"
    assert grid.workload_class(900, 40).name == "huge_paste"
    assert grid.workload_class(30, 300).name == "short_gen"
    assert [grid.qps_level(q) for q in (0, 0.7, 5, 14, 30, 100)] == [1, 1, 4, 12, 32, 40]
    labels = {w.name: grid.ratio_class(w) for w in grid.workload_classes}
    assert labels["long_gen"] == "decode-heavy" and labels["huge_paste"] == "prefill-heavy"
    assert labels["mid_bal"] == "balanced"


def test_default_grid_is_the_papers_workloads():
    grid = default_grid()
    sizes = {w.name: (w.input_tokens, w.output_tokens) for w in grid.workload_classes}
    assert sizes == PAPER_T2
    # The request rates the router sees at the paper's conversation rates (two turns each).
    assert grid.qps_levels == [2 * q for q in PAPER_QPS] and grid.qps_levels[-1] == 40
    small, large, huge = grid.context_classes
    assert small.first_turn == PAPER_T1["small"] and large.first_turn == PAPER_T1["large"]
    assert huge.first_turn is None and huge.representative_tokens == 8192  # no paper workload there
    assert small.representative_tokens == 128 + 128 + 64 and large.representative_tokens == 1024 + 1024 + 64


def test_cells_are_measured_with_the_papers_protocol():
    grid = default_grid()
    small = grid.context_classes[0]
    convs = cell_workload(small, WorkloadClass("huge_paste", 1024, 32), qps=8.0, duration_s=10.0, seed=3)
    # Request rate 8 = 4 conversations/s of 2 turns, arriving as the authors' process draws them.
    assert [c.arrival_s for c in convs] == paper_arrivals(4.0, 3)
    assert all(c.turns == [sim.Turn(128, 128), sim.Turn(1024, 32)] for c in convs)
    huge = cell_workload(grid.context_classes[2], WorkloadClass("tiny", 16, 32), qps=8.0, duration_s=10.0,
                         seed=3)
    turns = huge[0].turns  # turn 2's prompt is the representative 8192 tokens (with the template's)
    assert turns[0].user_tokens + turns[0].max_tokens + turns[1].user_tokens == 8192 - 2 * sim.TEMPLATE_TOKENS
    # A draw with no conversation in the window is redrawn (a cell must have traffic).
    assert all(cell_workload(small, WorkloadClass("tiny", 16, 32), qps=0.5, duration_s=10.0, seed=s)
               for s in range(40))


def test_rate_is_a_sliding_window_not_an_average_since_start():
    rate = SlidingWindowRate(window_s=10)
    for i in range(100):  # a burst of 10 req/s for 10 s
        rate.record(i * 0.1)
    assert rate.rate(10.0) == pytest.approx(10, rel=0.05)
    assert rate.rate(30.0) == 0  # the burst is forgotten, an average since start would say 3.3


def test_small_sim_build_is_deterministic_and_round_trips(tiny_table, tmp_path):
    again = build_sim_table("h100-llama3.1-8b", "1P3D", Weights(), grid=TINY, seconds_per_cell=3, jobs=1,
                            progress=False)
    assert again.cells == tiny_table.cells
    assert len(tiny_table.cells) == 8
    path = tmp_path / "t.json"
    save_table(tiny_table, path)
    assert load_table(path) == tiny_table
    for cell in tiny_table.cells:
        assert cell.via_prefill.requests > 0 and 0 < cell.via_prefill.achieved_rps <= cell.qps * 1.5


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(format_version=9), "format_version 9"),
    (lambda d: d["cells"].pop(), "grid cells missing"),
    (lambda d: d["cells"].append(d["cells"][0]), "appears twice"),
    (lambda d: d["cells"][0].update(decision="via_prefill" if d["cells"][0]["decision"] == "decode_local"
                                     else "decode_local"), "do not follow"),
    (lambda d: d["cells"][0]["via_prefill"].update(tpot_s="fast"), r"\$.cells\[0\].via_prefill.tpot_s"),
    (lambda d: d.update(colour="red"), "colour"),
])
def test_invalid_tables_name_the_problem(tiny_table, tmp_path, edit, message):
    data = json.loads(msgspec.json.encode(tiny_table))
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TableError, match=message):
        load_table(path)


def test_raising_w_tpot_never_raises_the_local_share_on_a_table():
    table = load_table(bundled_table("1P3D"))
    shares = [sum(c.decision == "decode_local" for c in reweight(table, Weights(1, w)).cells)
              for w in (0.5, 1, 2, 4, 8, 32)]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]
    validate(reweight(table, Weights(2, 1)))


@pytest.mark.parametrize("config", ["1P3D", "2P2D", "3P1D"])
def test_shipped_tables_load_for_the_default_profile(config):
    table = load_table(bundled_table(config))
    assert table.config == config and table.profile == "h100-llama3.1-8b"
    assert len(table.cells) == 3 * 9 * 10


def features(prompt=3000, new=300, out=200, qps=8.0, batch=0, kv=0, queue=0) -> RequestFeatures:
    return RequestFeatures(
        decision_key="k:2", turn=2, prompt_tokens=prompt, cached_on_decode=prompt - new,
        cached_on_prefill=prompt - new, expected_output_tokens=out, has_session_decode=True,
        decode_load=WorkerLoad(decode_requests=batch, decode_kv_tokens=kv),
        prefill_load=WorkerLoad(pending_prefill_tokens=queue), qps=qps)


def test_table_decides_alone_without_drift_and_a_hot_decode_worker_moves_it():
    table = load_table(bundled_table("1P3D"))
    policy = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(load_profile()), table)
    _, nominal = policy.cell_of(features())
    calm = policy.decide(nominal, history_tokens=nominal.cached_on_decode)
    assert calm.score == pytest.approx(calm.table_score)  # no drift: the measured score stands
    # The session's decode worker is hot and another one is idle: through a prefill worker the
    # turn moves there (`moves_to_best`); decode-local it would stay in the hot batch.
    hot_features = dataclasses.replace(features(batch=200, kv=400_000), best_decode_load=WorkerLoad())
    hot = policy.decide(hot_features, history_tokens=2700)
    assert hot.cell == calm.cell and hot.score < calm.score
    assert hot.route is Route.VIA_PREFILL and calm.route is Route.DECODE_LOCAL


def test_calibration_follows_observed_outcomes():
    calibration = Calibration()
    predicted = Prediction(0.010, 0.006)
    for _ in range(60):
        calibration.observe("via_prefill", "c1-a0-l0", predicted, predicted, ttft_s=0.030, tpot_s=0.006)
    adjusted = calibration.apply("via_prefill", "c1-a0-l0", predicted)
    assert adjusted.ttft_s == pytest.approx(0.030, rel=0.01) and adjusted.tpot_s == pytest.approx(0.006)
    assert calibration.apply("decode_local", "c1-a0-l0", predicted) == predicted


@pytest.mark.slow
def test_online_correction_beats_the_pure_table_on_a_hot_decode_worker():
    from dynamo_ppd.tables.evaluate import MARGIN, compare, weighted

    table = reweight(load_table(bundled_table("1P3D")), Weights(1, 3))
    results = compare(table, seconds=20, seed=0, scenarios=("hot-decode", "drift"))
    for scenario, outcomes in results.items():
        base = outcomes["x=0"]
        best_static = max(0.0, weighted(outcomes["x=1"], base, table))
        online = weighted(outcomes["table+online"], base, table)
        assert online >= best_static - MARGIN, scenario
    hot = results["hot-decode"]
    assert weighted(hot["table+online"], hot["x=0"], table) > weighted(hot["table"], hot["x=0"], table) + 0.5


def test_explain_agrees_with_the_router_decision(capsys):
    from dynamo_ppd.bench import decisions
    from dynamo_ppd.cli import table as table_cli
    from dynamo_ppd.engine.blocks import prefix_chain

    router, histories = decisions.build(1, 2900, "ppd", table="auto")
    history_local = router._hash(histories[0], 32)
    blocks = [{"block_hash": 900 + i, "tokens_hash": h} for i, h in enumerate(history_local)]
    router.residency.apply(1, {"event_id": 9, "data": {"stored": {"parent_hash": None, "blocks": blocks}}})
    tokens = histories[0] + list(range(3000, 3100))
    cached = router.residency.held_blocks(11, prefix_chain(router._hash(tokens, 32))) * 32
    assert cached == router.residency.held_blocks(1, prefix_chain(router._hash(tokens, 32))) * 32 == 2880
    request = {"token_ids": tokens, "stop_conditions": {"max_tokens": 200},
               "agent_context": {"session_id": "s0"}}
    plan = asyncio.run(router.plan_turn(request, tokens))
    assert plan.decision.cell is not None  # the router used the shipped 1P3D table
    session_load = router.loads.of(11)
    args = argparse.Namespace(prompt_tokens=len(tokens), new_tokens=len(tokens) - cached, output_tokens=200,
                              qps=0.0, weights=None,
                              decode_batch=session_load.decode_requests,
                              decode_kv_tokens=session_load.decode_kv_tokens, prefill_queue=0)
    text = table_cli.explain(load_table(bundled_table("1P3D")), args)
    assert f"decision: {plan.decision.route.value}" in text
    assert f"{plan.decision.score:+.3f}" in text
