"""The congestion a route adds to its pool (`policy.congestion`), and the decision that prices it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynamo_ppd.engine.profile import load_profile
from dynamo_ppd.policy.congestion import RHO_CAP, Pool, PoolTraffic
from dynamo_ppd.policy.decision import (
    Mode,
    Policy,
    PolicyConfig,
    ProfilePredictor,
    RequestFeatures,
    WorkerLoad,
)

pytestmark = pytest.mark.unit


def test_nothing_routed_or_no_rate_costs_nothing():
    assert Pool().congestion_s(0.01, 0.05, qps=10, workers=1) == 0.0
    pool = Pool()
    pool.record(True, 0.01)
    assert pool.congestion_s(0.01, 0.05, qps=0, workers=1) == 0.0
    assert pool.congestion_s(0.0, 0.05, qps=10, workers=1) == 0.0


def test_it_grows_with_the_queue_the_rate_and_the_work_and_falls_with_more_workers():
    pool = Pool()
    for _ in range(100):
        pool.record(True, 0.004)
    base = pool.congestion_s(0.004, 0.0, qps=20, workers=1)
    assert pool.congestion_s(0.004, 0.05, qps=20, workers=1) > base > 0
    assert pool.congestion_s(0.004, 0.0, qps=40, workers=1) > 2 * base  # more arrivals, and busier
    assert pool.congestion_s(0.008, 0.0, qps=20, workers=1) > 2 * base
    assert pool.congestion_s(0.004, 0.0, qps=20, workers=3) < base / 3
    # M/G/1 by hand: lambda = 20/s, rho = 20 x 4 ms = 0.08: 20 x 4 ms x 4 ms / 0.92.
    assert base == pytest.approx(20 * 0.004 * 0.004 / (1 - 20 * 0.004), rel=1e-6)
    # A saturated pool is priced at the cap, not at infinity.
    assert pool.congestion_s(0.004, 0.0, qps=10_000, workers=1) == pytest.approx(
        10_000 * 0.004 * 0.004 / (1 - RHO_CAP))


def test_shares_are_plain_means_at_first_then_follow_the_routing():
    traffic = PoolTraffic()
    traffic.record(True, 0.01)
    traffic.record(False, 0.001)
    assert traffic.prefill.share == pytest.approx(0.5) and traffic.decode.share == pytest.approx(0.5)
    for _ in range(500):
        traffic.record(False, 0.001)
    assert traffic.decode.share > 0.99 and traffic.decode.work_s == pytest.approx(0.001)


def _follow_up(queue_on_decode: int) -> RequestFeatures:
    decode = WorkerLoad(decode_requests=8, decode_kv_tokens=30_000, pending_prefill_tokens=queue_on_decode,
                        inverse_outputs=8 / 200)
    return RequestFeatures("s:3", 3, 6_000, 4_800, 1_000, 200, True, decode, WorkerLoad(), qps=30.0,
                           best_decode_load=decode, prefill_workers=3, decode_workers=1)


def test_a_decode_pool_that_takes_every_append_prices_the_next_ones_in():
    policy = Policy(PolicyConfig(Mode.PPD), ProfilePredictor(load_profile("h100-llama3.1-8b")))
    quiet = policy.decide(_follow_up(0), 4_800)
    # The decode workers have taken most turns lately, and a queue has built on the session's.
    for _ in range(200):
        policy.pools.record(False, 0.01)
    queued = policy.decide(_follow_up(20_000), 4_800)
    local_q, via_q = policy._congestion(_follow_up(20_000), *policy.predictor.costs(_follow_up(20_000)),
                                        queued.local, queued.via_prefill)
    assert local_q > via_q >= 0
    assert quiet.score is not None and queued.score is not None and queued.score < quiet.score
    # The same, told there are 4 decode workers to spread the appends over: less congestion.
    spread = replace(_follow_up(20_000), decode_workers=4)
    costs = policy.predictor.costs(spread)
    spread_q, _ = policy._congestion(spread, *costs, queued.local, queued.via_prefill)
    assert spread_q < local_q
