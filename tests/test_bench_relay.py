"""The relay benchmark's paired ratio: each system against the bare relay of the same round."""

from __future__ import annotations

import pytest

from dynamo_ppd.bench.relay import Run, paired_ratios

pytestmark = pytest.mark.unit


def _run(system: str, cpu_s: float, round_: int, tokens: int = 1000) -> Run:
    return Run(system, 1, 2.0, {"router": cpu_s}, tokens, 10, 0, 30.0, round=round_)


def test_each_round_is_compared_with_its_own_relay_run():
    # Round 0 ran on a busier machine (everything cheaper per token): its ppd/relay is 1.2, round
    # 1's is 1.1; an unpaired mean of means would say (0.12 + 0.22) / (0.10 + 0.20) = 1.13.
    runs = [_run("ppd", 0.12, 0), _run("relay", 0.10, 0), _run("ppd", 0.22, 1), _run("relay", 0.20, 1)]
    lines = paired_ratios(runs)
    row = next(line for line in lines if line.startswith("| ppd |"))
    assert row == "| ppd | 1 | 2 | 1 | 2 | 1.15 [1.10-1.20] |"


def test_no_relay_run_no_ratio():
    assert paired_ratios([_run("ppd", 0.12, 0), _run("pd", 0.10, 0)]) == []
