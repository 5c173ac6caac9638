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
