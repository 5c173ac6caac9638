"""What a turn's outcome teaches, in the routing state both shells share
(`Routing.observe_outcome`): which turns the policy learns from, the metrics of its prediction
errors (bounded labels), the debug line, and the relay router calling it for the follow-ups it
relays. The endpoint picker's side: tests/test_picker_outcomes.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from test_router_dispatch import hold, make_router, turn

from dynamo_ppd.policy.decision import Decision, Observed, Route
from dynamo_ppd.policy.score import Prediction
from dynamo_ppd.routing.metrics import MAX_BUCKET_LABELS, RoutingMetrics
from dynamo_ppd.routing.state import Turn

pytestmark = pytest.mark.unit

PREDICTED = Prediction(ttft_s=0.040, tpot_s=0.010)


def _plan(turn_number: int = 2, reason: str = "ppd_table", bucket: str = "", raw: bool = True) -> Turn:
    decision = Decision(Route.DECODE_LOCAL, reason, 0.2, local=PREDICTED, via_prefill=Prediction(0.06, 0.009),
                        raw=PREDICTED if raw else None, bucket=bucket)
    return Turn("s", turn_number, 1000, [], None, decision=decision, decode=11)


def _sample(metrics: RoutingMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_only_predicted_follow_ups_teach_and_each_is_counted_with_its_error():
    router = make_router("ppd")
    metrics = router.metrics
    for plan in (_plan(turn_number=1), _plan(reason="rehome_ppd_table"), _plan(raw=False)):
        assert router.observe_outcome(plan, 0.080, 0.020) is None
    assert _sample(metrics, "ppd_outcomes_observed_total", route="decode_local") == 0
    observed = router.observe_outcome(_plan(), 0.080, 0.020)
    assert observed == Observed(Route.DECODE_LOCAL, "", pytest.approx(1.0), pytest.approx(1.0))
    assert _sample(metrics, "ppd_outcomes_observed_total", route="decode_local") == 1
    # An empty bucket is "all"; the ratio observed/predicted is 2 (the error + 1).
    assert _sample(metrics, "ppd_ttft_prediction_ratio_sum", route="decode_local", bucket="all") == 2.0
    tpot = "ppd_tpot_prediction_ratio_bucket"
    assert _sample(metrics, tpot, route="decode_local", bucket="all", le="1.5") == 0
    assert _sample(metrics, tpot, route="decode_local", bucket="all", le="2.0") == 1
    # One token: no TPOT, the TTFT still teaches.
    router.observe_outcome(_plan(bucket="ctx1-app0-load2"), 0.040, None)
    bucket = "ctx1-app0-load2"
    assert _sample(metrics, "ppd_ttft_prediction_ratio_count", route="decode_local", bucket=bucket) == 1
    assert _sample(metrics, "ppd_tpot_prediction_ratio_count", route="decode_local", bucket=bucket) == 0
    assert router.last_observed is not None and router.last_observed.bucket == "ctx1-app0-load2"


def test_bucket_labels_are_bounded():
    metrics = RoutingMetrics()
    labels = {metrics.bucket_label(f"ctx{i}-app0-load0") for i in range(MAX_BUCKET_LABELS + 10)}
    assert len(labels) == MAX_BUCKET_LABELS + 1 and "other" in labels
    assert metrics.bucket_label("ctx0-app0-load0") == "ctx0-app0-load0"  # still its own
    assert metrics.bucket_label("") == "other"  # "all" came too late to be a label of its own


def test_the_relay_router_learns_from_each_follow_up_and_logs_the_latest_error(caplog):
    async def run():
        router = make_router("ppd")
        first = list(range(2000, 2300))
        out = await turn(router, first)
        decode = router.clients["decode"].sent[0][0]
        hold(router, decode, first + out)
        assert _sample(router.metrics, "ppd_outcomes_observed_total", route="via_prefill") == 0  # turn 1
        with caplog.at_level(logging.DEBUG, logger="dynamo_ppd.routing.decisions"):
            follow = first + out + list(range(3000, 3040))
            await turn(router, follow)
            assert router.last_observed is not None
            await turn(router, follow + [1000, 1001, 1002, 1003] + list(range(4000, 4040)))
        return router

    router = asyncio.run(run())
    learned = sum(_sample(router.metrics, "ppd_outcomes_observed_total", route=r)
                  for r in ("decode_local", "via_prefill"))
    assert learned == 2
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "dynamo_ppd.routing.decisions"]
    assert "last_error" not in lines[0]  # nothing observed before the first follow-up was decided
    last = lines[-1]["last_error"]
    assert last["bucket"] == (router.last_observed.bucket or "all") and isinstance(last["ttft"], float)
