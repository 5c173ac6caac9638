"""`bench overhead`'s figure: the TTFT the router adds, a paired difference of medians over request
pairs (each prompt sent to both graphs), with its interval."""

from __future__ import annotations

import random

import pytest

from dynamo_ppd.bench.overhead import render

pytestmark = pytest.mark.unit


def test_the_added_ttft_is_paired_over_requests():
    rng = random.Random(1)
    pd = [50 + rng.uniform(-8, 8) for _ in range(60)]  # each prompt's own variation, shared by both
    samples = {"pd": pd, "ppd": [v + 2.0 for v in pd]}
    text = render(samples)
    assert "router adds +2.00 ms to median TTFT, 95% interval [+2.00, +2.00] over 60 request pairs" in text
    noisy = {"pd": pd, "ppd": [v + 2.0 + rng.uniform(-3, 3) for v in pd]}
    line = next(x for x in render(noisy).splitlines() if x.startswith("router adds"))
    low, high = (float(x) for x in line.split("[")[1].split("]")[0].split(", "))
    assert low < 2.5 and high > 1.5 and high - low < 6.0  # around the +2 ms, as wide as the noise


def test_the_routers_own_decision_time_is_its_histograms_mean():
    from prometheus_client import generate_latest

    from dynamo_ppd.bench.overhead import decision_mean_ms
    from dynamo_ppd.routing.metrics import RoutingMetrics

    metrics = RoutingMetrics()
    assert decision_mean_ms(generate_latest(metrics.registry).decode()) is None
    for seconds in (0.0002, 0.0004, 0.0009):
        metrics.decision_seconds.observe(seconds)
    mean_ms, count = decision_mean_ms(generate_latest(metrics.registry).decode())
    assert count == 3 and mean_ms == pytest.approx(0.5)
    samples = {"pd": [50.0, 51.0], "ppd": [52.0, 53.0]}
    assert "router's decision (session lookup, residency, loads, policy): mean 0.500 ms over 3 decisions" \
        in render(samples, (mean_ms, count))
