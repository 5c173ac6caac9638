"""The decision priced as the fleet pays it (`dynamo_ppd.policy.predictor`, `.learning`, `.decision`):
who pays an append, corrections per bucket, the measured-error margin, exploration."""

from __future__ import annotations

import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.policy.decision import (
    EXPLORE_SHARE,
    Mode,
    Policy,
    PolicyConfig,
    ProfilePredictor,
    RequestFeatures,
    Route,
    WorkerLoad,
)
from dynamo_ppd.policy.learning import CAP, FLOOR, MEMORY, MIN_OUTCOMES, PRIOR_ERROR, Calibration, bucket_of
from dynamo_ppd.policy.score import Prediction

pytestmark = pytest.mark.unit

PROFILE = load_profile("h100-llama3.1-8b")


def follow_up(prompt=20_000, new=2_000, out=80, batch=0, key="s:2", on_prefill=None) -> RequestFeatures:
    load = WorkerLoad(decode_requests=batch, decode_kv_tokens=batch * 8_000)
    return RequestFeatures(key, 2, prompt, prompt - new, prompt - new if on_prefill is None else on_prefill,
                           out, True, load, WorkerLoad(), qps=1.0, best_decode_load=load)


def test_nobody_pays_an_append_on_an_idle_worker_and_every_sequence_does_on_a_busy_one():
    predictor = ProfilePredictor(PROFILE)
    idle_local, _ = predictor.costs(follow_up(batch=0))
    assert idle_local.others_tpot_s == 0.0
    busy_local, busy_via = predictor.costs(follow_up(batch=24))
    quiet_local, _ = predictor.costs(follow_up(batch=2))
    # The delay is the append's extra iteration time over each delayed sequence's reply.
    assert busy_local.others_tpot_s > 10 * quiet_local.others_tpot_s > 0
    # The request does not pay its own append in TPOT: its first token comes out of it.
    assert busy_local.own.tpot_s == pytest.approx(busy_via.own.tpot_s)


def test_a_prefill_worker_holding_only_turn_one_recomputes_the_rest():
    predictor = ProfilePredictor(PROFILE)
    _, warm = predictor.costs(follow_up(on_prefill=18_000))
    _, turn_one_only = predictor.costs(follow_up(on_prefill=6_000))
    assert turn_one_only.own.ttft_s > warm.own.ttft_s + 0.05


def test_buckets_learn_apart_borrow_the_route_until_they_have_their_own_and_recover():
    calibration = Calibration()
    p = Prediction(0.100, 0.010)
    for _ in range(40):
        calibration.observe("via_prefill", "c3-a2-l0", p, p, ttft_s=0.300, tpot_s=0.010)
    assert calibration.apply("via_prefill", "c3-a2-l0", p).ttft_s == pytest.approx(0.300, rel=0.05)
    # An unseen bucket borrows the route's overall correction.
    borrowed = calibration.apply("via_prefill", "c0-a0-l0", p).ttft_s
    assert borrowed == pytest.approx(0.300, rel=0.05)
    for _ in range(MIN_OUTCOMES + 30):
        calibration.observe("via_prefill", "c0-a0-l0", p, p, ttft_s=0.100, tpot_s=0.010)
    assert calibration.apply("via_prefill", "c0-a0-l0", p).ttft_s == pytest.approx(0.100, rel=0.05)
    assert calibration.apply("via_prefill", "c3-a2-l0", p).ttft_s == pytest.approx(0.300, rel=0.05)
    # Bounded, and recovers when conditions change back.
    for _ in range(60):
        calibration.observe("via_prefill", "c3-a2-l0", p, p, ttft_s=100.0, tpot_s=0.010)
    assert calibration.apply("via_prefill", "c3-a2-l0", p).ttft_s == pytest.approx(0.100 * CAP, rel=0.01)
    for _ in range(80):
        calibration.observe("via_prefill", "c3-a2-l0", p, p, ttft_s=0.001, tpot_s=0.010)
    assert calibration.apply("via_prefill", "c3-a2-l0", p).ttft_s == pytest.approx(0.100 * FLOOR, rel=0.05)


def test_a_correction_starts_as_the_plain_mean_of_its_first_outcomes():
    """A link four times slower than the profile says: the first outcomes are the whole evidence,
    so the correction is their mean at once (a fixed 0.1 weight from a prior of 1 left it at 1.4
    after 5 outcomes at 3x), and a weighted mean later, still able to move."""
    calibration = Calibration()
    p = Prediction(0.100, 0.010)
    calibration.observe("via_prefill", "c1-a1-l0", p, p, ttft_s=0.300, tpot_s=0.010)
    assert calibration.routes["via_prefill"].ttft_ratio == pytest.approx(3.0)
    calibration.observe("via_prefill", "c1-a1-l0", p, p, ttft_s=0.200, tpot_s=0.020)
    track = calibration.routes["via_prefill"]
    assert track.ttft_ratio == pytest.approx(2.5) and track.tpot_ratio == pytest.approx(1.5)
    for _ in range(MIN_OUTCOMES):
        calibration.observe("via_prefill", "c1-a1-l0", p, p, ttft_s=0.300, tpot_s=0.010)
    assert calibration.apply("via_prefill", "c1-a1-l0", p).ttft_s == pytest.approx(0.100 * 20 / 7)


def test_the_error_starts_at_the_prior_and_follows_outcomes():
    calibration = Calibration()
    assert calibration.error("decode_local", "c0-a0-l0") == (PRIOR_ERROR, PRIOR_ERROR)
    p = Prediction(0.050, 0.010)
    for _ in range(60):
        calibration.observe("decode_local", "c0-a0-l0", p, p, ttft_s=0.050, tpot_s=0.010)
    ttft_error, tpot_error = calibration.error("decode_local", "c0-a0-l0")
    assert ttft_error < 0.01 and tpot_error < 0.01


def test_buckets_are_a_small_fixed_set():
    seen = {bucket_of(follow_up(prompt=p, new=n, batch=b))
            for p in (100, 2_000, 9_000, 100_000) for n in (10, 500, 5_000) for b in (0, 8, 100) if n < p}
    assert len(seen) <= 36 and all(b.count("-") == 2 for b in seen)


def test_the_score_s_sign_decides_and_outcomes_shrink_the_margin_that_bounds_exploration():
    policy = Policy(PolicyConfig(Mode.PPD, w_tpot=3.0), ProfilePredictor(PROFILE))

    def at(batch: int):
        features = follow_up(prompt=12_000, new=1_500, out=200, batch=batch, on_prefill=11_000)
        return policy.decide(features, 10_500)

    # The first decode batch at which going through prefill is predicted to pay at all: it goes
    # there, though the gain is within the unproven model's error (an error that can go either
    # way favours neither route).
    thin = next(d for d in map(at, range(0, 200, 2)) if d.score is not None and d.score < 0)
    assert thin.margin is not None and -thin.margin < thin.score < 0
    assert thin.route is Route.VIA_PREFILL and thin.reason == "predicted"
    before = [d for d in map(at, range(0, 200, 2)) if d.score is not None and d.score >= 0]
    assert before and all(d.route is Route.DECODE_LOCAL for d in before)
    # Outcomes that match the predictions of both routes in its bucket shrink the error.
    p = Prediction(0.05, 0.01)
    for _ in range(60):
        for route in ("decode_local", "via_prefill"):
            policy.calibration.observe(route, thin.bucket, p, p, ttft_s=0.05, tpot_s=0.01)
    batch = next(b for b in range(0, 200, 2) if (d := at(b)).score is not None and d.score < 0)
    proven = at(batch)
    assert proven.margin is not None and proven.margin < thin.margin / 4
    assert proven.route is Route.VIA_PREFILL


def test_with_a_table_the_cells_measured_score_decides_and_without_one_the_priced_model():
    from dynamo_ppd.policy.table import bundled_table, load_table

    features = follow_up(prompt=2_000, new=64, out=64, batch=2)
    tabled = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(PROFILE), load_table(bundled_table("1P3D")))
    measured = tabled.decide(features, history_tokens=1_900)
    assert measured.cell is not None and measured.reason == "table_corrected" and measured.margin == 0.0
    model_only = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(PROFILE))
    predicted = model_only.decide(features, history_tokens=1_900)
    assert predicted.cell is None and predicted.reason == "predicted"
    assert predicted.margin is not None and predicted.margin > 0


def test_exploration_is_bounded_and_only_where_the_margin_is_thin():
    policy = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(PROFILE))
    decisions = [policy.decide(follow_up(prompt=4_000, new=300, out=200, batch=4, key=f"s{i}:2"), 3_600)
                 for i in range(2_000)]
    explored = [d for d in decisions if d.reason == "explore"]
    assert len(explored) <= 2 * EXPLORE_SHARE * len(decisions)
    assert all(d.score is not None and d.margin is not None and abs(d.score) < d.margin for d in explored)
    # A clear call (an idle worker, a tiny append on a long history) is never explored.
    clear = [policy.decide(follow_up(prompt=30_000, new=20, out=200, batch=0, key=f"t{i}:2"), 29_000)
             for i in range(500)]
    assert all(d.route is Route.DECODE_LOCAL for d in clear)


def test_the_margin_rests_on_the_error_of_the_mean_which_shrinks_with_outcomes():
    calibration = Calibration()
    assert calibration.mean_error("via_prefill", "c1-a1-l1") == (PRIOR_ERROR, PRIOR_ERROR)
    p = Prediction(0.050, 0.010)
    for k in range(40):  # each outcome 30% off, alternately: the mean is right, one request is not
        ttft = 0.050 * (1.3 if k % 2 else 0.7)
        calibration.observe("via_prefill", "c1-a1-l1", p, p, ttft_s=ttft, tpot_s=0.010)
    spread, _ = calibration.error("via_prefill", "c1-a1-l1")
    of_mean, _ = calibration.mean_error("via_prefill", "c1-a1-l1")
    assert spread > 0.2 and of_mean == pytest.approx(spread / MEMORY ** 0.5)
