"""`dynamo-ppd advise` (`dynamo_ppd.advisor.advise`, `dynamo_ppd.cli.advise`): the candidates it
weighs, the Pareto front, the choice and its margin, and a whole run on the virtual clock."""

from __future__ import annotations

import json

import pytest

from dynamo_ppd.advisor import advise
from dynamo_ppd.advisor.advise import Measured, Slo
from dynamo_ppd.cli import main
from dynamo_ppd.engine.profile import DEFAULT_PROFILE, load_profile

pytestmark = pytest.mark.unit


def _m(deployment, policy, ttft, tpot, *, p99=None, tokens=100.0, ok=100.0, slo=None, factor=1.0):
    return Measured(deployment, policy, factor, 1.0 * factor, ok, 50, ttft, p99 or ttft * 3, tpot, tokens,
                    slo, 0.5)


def test_deployments_are_replicas_every_split_and_the_hybrids():
    assert advise.deployments(4) == ["4R", "1P3D", "2P2D", "3P1D", "1R_1P_2D", "1R_2P_1D", "2R_1P_1D"]
    eight = advise.deployments(8)
    assert eight[:8] == ["8R", "1P7D", "2P6D", "3P5D", "4P4D", "5P3D", "6P2D", "7P1D"]
    assert sum(d.startswith("1R_") for d in eight) == 6 and sum(d.startswith("4R_") for d in eight) == 3
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        advise.deployments(1)


def test_policies_per_kind():
    assert advise.policies_for("4R") == ["dynamo-kv-agg"]
    assert advise.policies_for("1R_1P_2D") == ["paper-proxy"]
    pd = advise.policies_for("2P2D")
    assert [p for p in pd if p.startswith("ppd@")] == ["ppd@1,1", "ppd@2,1", "ppd@1,3", "ppd@1,6"]
    assert set(advise.REFERENCE_POLICIES) <= set(pd)


def test_every_candidate_has_a_router():
    profile = load_profile(DEFAULT_PROFILE)
    for spec in advise.plan(8, [1.0]):  # 8 GPUs: splits with no shipped table predict from the profile
        config, router = advise.make_router(profile, DEFAULT_PROFILE, spec.deployment, spec.policy, 0)
        assert config and router is not None


def test_pareto_front_keeps_only_the_undominated():
    a = _m("1P3D", "ppd@1,1", 0.010, 0.008, tokens=100)
    b = _m("4R", "dynamo-kv-agg", 0.012, 0.007, tokens=100)  # worse TTFT, better TPOT: kept
    c = _m("2P2D", "ppd@1,1", 0.011, 0.009, tokens=90)  # worse than a on every axis
    failed = _m("3P1D", "x0", 0.001, 0.001, ok=80.0)  # misses the success bar: out
    assert advise.pareto_front([a, b, c, failed]) == [a, b]


def test_recommendation_by_weighted_cost_names_the_runner_up_and_a_better_reference():
    ppd = _m("1P3D", "ppd@1,1", 0.010, 0.008)
    ppd_other_weight = _m("1P3D", "ppd@1,3", 0.011, 0.008)
    replicas = _m("4R", "dynamo-kv-agg", 0.013, 0.008)
    reference = _m("1P3D", "x1", 0.009, 0.008)
    choice = advise.recommend([ppd, ppd_other_weight, replicas, reference], (1.0, 1.0), Slo(), 1.5)
    assert choice.best is ppd and choice.key == "weighted cost"
    assert choice.runner_up is replicas  # the best other deployment, not the same one at another weight
    assert choice.better_reference is reference  # shown, never recommended
    assert "+" in choice.margin


def test_recommendation_with_slos_prefers_attainment_then_headroom():
    fast = _m("1P3D", "ppd@1,1", 0.010, 0.008, slo=0.90)
    steady = _m("4R", "dynamo-kv-agg", 0.020, 0.008, slo=0.97)
    choice = advise.recommend([fast, steady], (1.0, 1.0), Slo(0.05, 0.02), 1.5)
    assert choice.best is steady and choice.key == "slo attainment" and "97.0%" in choice.margin
    # Same attainment at the rate: the one that holds it at 1.5x wins.
    a = _m("1P3D", "ppd@1,1", 0.010, 0.008, slo=1.0)
    b = _m("4R", "dynamo-kv-agg", 0.020, 0.008, slo=1.0)
    a_hot = _m("1P3D", "ppd@1,1", 0.030, 0.009, slo=0.7, factor=1.5)
    b_hot = _m("4R", "dynamo-kv-agg", 0.025, 0.009, slo=0.95, factor=1.5)
    choice = advise.recommend([a, b, a_hot, b_hot], (1.0, 1.0), Slo(0.05, 0.02), 1.5)
    assert choice.best is b and choice.key == "headroom"


def test_nothing_meets_the_bar_then_no_recommendation():
    assert advise.recommend([_m("4R", "dynamo-kv-agg", 0.01, 0.01, ok=50.0)], (1, 1), Slo(), 1.5) is None


def test_slo_attainment_counts_each_request():
    from dynamo_ppd.sim.outcome import TurnResult

    slo = Slo(ttft_s=0.1, tpot_s=0.01)
    ok = TurnResult("c", 2, 0.0, 0.05, 0.05 + 0.005 * 10, 11)
    slow_first = TurnResult("c", 2, 0.0, 0.2, 0.25, 11)
    slow_tokens = TurnResult("c", 2, 0.0, 0.05, 0.05 + 0.02 * 10, 11)
    failed = TurnResult("c", 2, 0.0, None, None, 0, error="boom")
    assert [slo.met(t, 30.0) for t in (ok, slow_first, slow_tokens, failed)] == [True, False, False, False]


@pytest.mark.slow
def test_a_whole_run_prints_the_choice_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "advise.json", tmp_path / "advise.png"
    code = main(["advise", "--workload", "wildchat", "--rate", "1", "--window", "8", "--gpus", "2",
                 "--rate-factors", "2", "--processes", "1", "--slo-ttft", "200", "--slo-tpot", "40",
                 "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0
    assert "recommended:" in text and "Around the rate" in text
    data = json.loads(out.read_text())
    deployments = {p["deployment"] for p in data["points"]}
    assert deployments == {"2R", "1P1D"}  # 2 GPUs: replicas or one split (no hybrid fits)
    assert {p["rate_factor"] for p in data["points"]} == {1.0, 2.0}
    assert data["recommendation"]["best"]["deployment"] in deployments
    assert all(p["slo_attainment"] is not None for p in data["points"])
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--workload", "wildchat", "--gpus", "4"], "needs --rate"),
    (["--workload", "nope", "--rate", "1", "--gpus", "4"], "nope"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "1"], "at least 2 workers"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "8", "--tp-choices", "2"],
     "--tp-choices need --model or --config"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "8", "--profile", "h200-llama3.1-8b",
      "--gpu", "h100"], "--gpu need --model or --config"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "8", "--model", "Llama-3.1-70B-Instruct",
      "--tp-choices", "1"], "fits no TP degree of [1] on h100"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "4", "--model", "Llama-3.1-70B-Instruct",
      "--tp-choices", "4,8"], "4 GPUs make no 2 workers at TP 4, 8"),
    (["--workload", "wildchat", "--rate", "1", "--gpus", "4", "--profile", "nope"], "nope"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["advise", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_tail_counts_a_median_one_percent_better_does_not_win_with_a_p99_twenty_times_worse():
    replicas = _m("4R", "dynamo-kv-agg", 0.0170, 0.0084, p99=0.444)
    ppd = _m("1P3D", "ppd@1,1", 0.0172, 0.0085, p99=0.0198)
    choice = advise.recommend([replicas, ppd], (1.0, 1.0), Slo(), 1.5)
    assert choice.best is ppd and choice.runner_up is replicas


def test_evenly_spreads_keeping_both_ends():
    from dynamo_ppd.advisor.search import evenly

    assert evenly(list(range(1, 8)), 8) == list(range(1, 8))
    picks = evenly(list(range(1, 64)), 8)
    assert picks[0] == 1 and picks[-1] == 63 and len(picks) == 8
    assert max(b - a for a, b in zip(picks, picks[1:], strict=False)) <= 9


@pytest.mark.slow
def test_the_staged_search_recommends_what_the_exhaustive_one_does():
    """On a fixed seed, the staged search (a fraction of the simulations) makes the same choice as
    simulating every candidate, and every candidate it ran measured the same."""
    from dynamo_ppd.advisor.search import Runner, search
    from dynamo_ppd.workloads.generators import make_workload

    manifest = make_workload("wildchat", 5.0, 12.0, 0)
    profile = load_profile(DEFAULT_PROFILE)
    results = {}
    for how in ("staged", "exhaustive"):
        runner = Runner(manifest, {1: profile}, 1, link="cross-node", gpus=12, rate=5.0, timeout_s=30.0,
                        seed=0, slo=Slo())
        points = search(runner, 12, [1.0], (1.0, 1.0), Slo(), how)
        results[how] = (points, advise.recommend(points, (1.0, 1.0), Slo(), 1.0))
    staged, exhaustive = results["staged"], results["exhaustive"]
    assert len(staged[0]) < 0.75 * len(exhaustive[0])
    assert staged[1].best.key == exhaustive[1].best.key
    every = {p.key: p for p in exhaustive[0]}
    assert all(every[p.key] == p for p in staged[0])


def test_a_model_is_searched_at_each_tp_it_fits_with_the_bundled_refit_where_one_ships():
    import argparse

    from dynamo_ppd.cli.advise import profiles_for

    args = argparse.Namespace(model="Llama-3.1-70B-Instruct", config=None, profile=None, gpu=None,
                              dtype=None, tp_choices=None)
    profiles = profiles_for(args)
    assert sorted(profiles) == [2, 4, 8]  # TP1 does not hold 70B on an 80 GB GPU
    bundled = load_profile("h100-llama3.1-70b-tp4")
    assert profiles[4] == bundled and profiles[2].name == "h100-llama3.1-70b-tp2"
    assert profiles_for(argparse.Namespace(model=None, config=None, profile=None, tp_choices=None, gpu=None,
                                           dtype=None)) == \
        {1: load_profile(DEFAULT_PROFILE)}
