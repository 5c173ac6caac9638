"""Bootstrap intervals over conversations, point sizing on the virtual clock, the results tables
with intervals, and the router's model clock under dilation (pure parts: no servers)."""

from __future__ import annotations

import random

import msgspec
import pytest

from dynamo_ppd.bench import results as res
from dynamo_ppd.bench import sizing
from dynamo_ppd.bench.compare import per_rate
from dynamo_ppd.experiment import stats as bs
from dynamo_ppd.launch.graph import speedup_args
from dynamo_ppd.sim.outcome import summarize as summarize_outcome
from dynamo_ppd.workloads.generators import make_workload

pytestmark = pytest.mark.unit


def _lognormal(n_conv: int, seed: int, turns: int = 3, scale: float = 0.02) -> dict[str, list[float]]:
    rng = random.Random(seed)
    return {f"c{i}": [scale * rng.lognormvariate(0, 0.6) for _ in range(turns)] for i in range(n_conv)}


def test_bootstrap_interval_holds_the_median_and_narrows_with_more_conversations():
    small = bs.bootstrap(_lognormal(30, 1))
    large = bs.bootstrap(_lognormal(600, 1))
    assert small is not None and large is not None
    for iv in (small, large):
        assert iv.low < iv.value < iv.high
    assert small.conversations == 30 and large.conversations == 600
    assert large.half_width < small.half_width / 2.5  # ~1/sqrt(20) narrower: 4.5x
    assert bs.bootstrap(_lognormal(30, 1)) == small  # deterministic for its seed
    assert bs.bootstrap({}) is None and bs.bootstrap({"c": []}) is None


def test_bootstrap_resamples_whole_conversations():
    """Ten conversations, each of one repeated value: resampling requests would give a tight
    interval from 10 x 50 "samples"; resampling conversations sees only ten."""
    clustered = {f"c{i}": [float(i)] * 50 for i in range(10)}
    iv = bs.bootstrap(clustered)
    assert iv is not None and iv.conversations == 10
    assert iv.high - iv.low >= 3.0  # wide: there are ten independent values, not 500


def test_paired_ratio_cancels_the_conversations_own_variation():
    base = _lognormal(40, 2)
    doubled = {cid: [2 * v for v in vs] for cid, vs in base.items()}
    paired = bs.paired_ratio(doubled, base)
    assert paired is not None and paired.value == pytest.approx(2.0)
    assert paired.low == pytest.approx(2.0) and paired.high == pytest.approx(2.0)
    other = bs.paired_ratio(_lognormal(40, 3), base)  # independent draws: a real interval around ~1
    assert other is not None and other.low < 1.0 < other.high
    assert bs.paired_ratio({}, base) is None


def test_paired_difference_cancels_what_both_sides_share():
    base = _lognormal(40, 2)
    shifted = {cid: [v + 0.003 for v in vs] for cid, vs in base.items()}  # +3 ms on every request
    paired = bs.paired_difference(shifted, base)
    assert paired is not None and paired.value == pytest.approx(0.003)
    assert paired.low == pytest.approx(0.003) and paired.high == pytest.approx(0.003)
    other = bs.paired_difference(_lognormal(40, 3), base)  # independent draws: around 0
    assert other is not None and other.low < 0.0 < other.high and other.conversations == 40
    assert bs.paired_difference(base, {}) is None


def test_conversations_needed_scales_with_the_square_of_the_width():
    wide = bs.Interval(10.0, 8.0, 12.0, 100)  # +-20%
    assert bs.conversations_needed(100, wide) == 440  # 100 x (0.2 / 0.1)^2 x 1.1
    assert bs.conversations_needed(100, bs.Interval(10.0, 9.5, 10.4, 100)) == 100
    assert bs.conversations_needed(100, None) == 200
    # Narrow by chance over 2 sampled conversations (of 20 sent): not trusted, grow to 20 sampled.
    assert bs.conversations_needed(20, bs.Interval(10.0, 9.9, 10.1, 2)) == 200
    assert bs.conversations_needed(20, bs.Interval(10.0, 9.9, 10.1, 20)) == 20


def test_bench_compare_rejects_settings_it_cannot_honour(tmp_path, capsys):
    from dynamo_ppd.cli import main

    assert main(["bench", "compare", "--qps", "1,2", "--dilation", "2,3,4", "--out", str(tmp_path)]) == 2
    assert "--dilation has 3 values for 2 rates" in capsys.readouterr().err
    assert main(["bench", "compare", "--point-budget", "60", "--out", str(tmp_path)]) == 2
    assert "--point-budget needs --cut-after" in capsys.readouterr().err


def test_per_rate_and_speedup_args():
    assert per_rate(None, [1, 4]) == [1.0, 1.0]
    assert per_rate([8.0], [1, 4]) == [8.0, 8.0]
    assert per_rate([4.0, 16.0], [1, 4]) == [4.0, 16.0]
    with pytest.raises(ValueError, match="2 values for 3 rates"):
        per_rate([4.0, 16.0], [1, 4, 8])
    args = speedup_args("pd", 4.0)
    assert args == {"prefill": ["--speedup", "0.25"], "decode": ["--speedup", "0.25"]}  # not the frontend
    assert set(speedup_args("ppd-relay", 8.0)) == {"prefill", "decode", "router"}
    assert set(speedup_args("ppd", 8.0)) == {"prefill", "decode", "picker"}  # not the gateway
    assert speedup_args("pd", 1.0) == {}


def test_sizing_grows_a_point_until_its_interval_is_narrow_enough_or_says_why_not():
    base = make_workload("wildchat", 8.0, 200 / 8.0, seed=0)
    sized = sizing.size_point(["ppd"], "1P3D", base, conversations=20, dilation=1.0, cut_after_s=5.0,
                              budget_s=None, target=0.10)
    n = len(sized.manifest.conversations)
    assert 20 < n <= len(base.conversations)
    assert sized.horizon_s == pytest.approx(sized.manifest.conversations[-1].arrival_s + 5.0)
    if not sized.note:
        iv = bs.bootstrap(res.by_conversation(sized.sims["ppd"].samples, "turn2_ttft"), resamples=500)
        assert iv is not None and iv.within(0.10)
    # A wall budget of 40 s at dilation 4: arrivals up to 40 / 4 - 5 = 5 model seconds.
    capped = sizing.size_point(["pd"], "1P3D", base, conversations=20, dilation=4.0, cut_after_s=5.0,
                               budget_s=40.0, target=0.01)
    assert all(c.arrival_s <= 5.0 for c in capped.manifest.conversations)
    assert "wall-clock budget" in capped.note and "+-1%" in capped.note


def _point(system: str, qps: float, scale: float, sim_scale: float | None = None) -> res.Point:
    samples = [res.Sample(cid, turn, v * scale / 0.02, 0.006 * scale / 0.02)
               for cid, vs in _lognormal(120, 7).items() for turn, v in enumerate(vs, start=1)]
    sim = (None if sim_scale is None else
           [res.Sample(s.conversation_id, s.turn, s.ttft_s * sim_scale, s.tpot_s) for s in samples])
    return res.Point(system, "wildchat", qps, summarize_outcome([], 30.0), 1.0, res.stats([0.1, 0.2]),
                     dilation=8.0, conversations=120, samples=samples, sim_samples=sim)


@pytest.mark.slow
def test_markdown_gives_every_figure_and_ratio_an_interval():
    ppd = msgspec.structs.replace(_point("ppd", 4.0, 0.018, 1.05),
                                  routes={"decode_local": 6, "via_prefill": 4},
                                  sim_routes={"decode_local": 3, "via_prefill": 1})
    results = res.BenchResults(res.RESULTS_VERSION, "1P3D", [
        _point("pd", 4.0, 0.04), _point("cond-disagg", 4.0, 0.02, 1.0), ppd])
    table = res.markdown(results)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ") and "wildchat" in line}
    assert "[" in rows["ppd"] and "0.45 [0.45, 0.45]x" in rows["ppd"]  # 0.018 / 0.04, paired exactly
    assert "0.90 [0.90, 0.90]x | 0.90 [0.90, 0.90]x | yes" in table  # ppd / cond-disagg head-to-head
    health = [line for line in table.splitlines() if line.startswith("| ppd | 4 | 8 |")]
    assert health and "0.95 [0.95, 0.95]x" in health[0]  # live / sim, 1 / 1.05
    assert "| 60% / 75% of 10 |" in health[0]  # decode-local share, live / simulated
    assert "| - |" in next(line for line in table.splitlines() if line.startswith("| pd | 4 | 8 |"))


def test_model_clock_rate_and_policy_read_dilated_wall_times_in_model_seconds():
    from dynamo_ppd.policy.decision import Decision, Mode, PolicyConfig
    from dynamo_ppd.routing.start import ModelClockPolicy, ModelClockRate

    rate = ModelClockRate(speedup=0.25, window_s=10.0)
    for i in range(40):  # one request per wall second for 40 s: 4 per model second
        rate.record(1000.0 + i)
    assert rate.rate(1039.5) == pytest.approx(4.0, rel=0.05)

    from dynamo_ppd.engine import load_profile
    from dynamo_ppd.policy.decision import Policy, Prediction, ProfilePredictor, Route

    # A follow-up predicted at 20 ms TTFT / 6 ms TPOT, seen at 4x that on the wall clock of
    # workers running at --speedup 0.25: on the model's clock the prediction was right.
    predicted = Prediction(0.020, 0.006)
    decision = Decision(Route.DECODE_LOCAL, "test", local=predicted, raw=predicted, bucket="c0-a0-l0")
    dilated = ModelClockPolicy(PolicyConfig(Mode.PPD), ProfilePredictor(load_profile()))
    dilated.speedup = 0.25
    plain = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(load_profile()))
    for policy in (dilated, plain):
        policy.observe(decision, 0.080, 0.024)
    learned = dilated.calibration.routes[Route.DECODE_LOCAL.value]
    assert (learned.ttft_ratio, learned.tpot_ratio) == pytest.approx((1.0, 1.0))
    assert plain.calibration.routes[Route.DECODE_LOCAL.value].ttft_ratio > 1.2  # it would learn the dilation


def test_versus_pairs_the_points_two_runs_share():
    dilated = res.BenchResults(res.RESULTS_VERSION, "1P3D",
                               [_point("ppd", 0.5, 0.0105), _point("pd", 0.5, 0.03)])
    plain = res.BenchResults(res.RESULTS_VERSION, "1P3D", [_point("ppd", 0.5, 0.0100)])
    table = res.versus(dilated, plain, "dilated", "undilated")
    rows = [line for line in table.splitlines() if "wildchat" in line]
    assert len(rows) == 1 and rows[0].startswith("| ppd |")  # pd ran in one of them only
    assert "1.05 [1.05, 1.05]x" in rows[0]


def test_bench_resimulate_simulates_a_runs_twins_again_and_keeps_its_live_figures(tmp_path, capsys):
    """`bench resimulate`: after the simulator changed, a run's twins are simulated again on the
    manifests it played (docs/bench/dilation.md); here the "live" samples are the pd twin's own,
    so the new twin must give them back exactly."""
    from dynamo_ppd.bench.compare import _base_manifests
    from dynamo_ppd.cli import main

    _, (base,) = _base_manifests("wildchat", None, [8.0], 2000, 0)
    manifest = sizing.first(base, 12)
    twin = sizing.simulate_manifest("pd", "1P3D", manifest, None, 0)
    live = res.Point("pd", "wildchat", 8.0, twin.outcome, 8.0, res.stats([0.1]), dilation=32.0,
                     conversations=12, samples=twin.samples, routes={"via_prefill": 1})
    src = tmp_path / "run" / "results.json"
    src.parent.mkdir()
    res.save(res.BenchResults(res.RESULTS_VERSION, "1P3D", [live]), src)

    assert main(["bench", "resimulate", str(src), "--out", str(tmp_path / "again")]) == 0
    (point,) = res.load(tmp_path / "again" / "results.json").points
    assert point.sim_samples == twin.samples and point.sim_routes == twin.routes
    assert point.samples == live.samples and point.routes == {"via_prefill": 1}  # the live side kept
    capsys.readouterr()

    assert main(["bench", "resimulate", str(tmp_path / "nothing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "nothing.json" in capsys.readouterr().err
