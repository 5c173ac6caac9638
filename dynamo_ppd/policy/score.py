"""The paper's score S (*Not All Prefills Are Equal*; README, "PPD tables and the decision"): how
much better decode-local (x=1) serves the weighted goal than going through a prefill worker
(x=0). Positive means decode-local."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float
    tpot_s: float


def score(local: Prediction, via_prefill: Prediction, w_ttft: float, w_tpot: float,
          over: Prediction | None = None) -> float:
    """``S = w_ttft (TTFT_pd - TTFT_local)/TTFT_pd - w_tpot (TPOT_local - TPOT_pd)/TPOT_pd``; with
    ``over``, the differences are divided by its TTFT and TPOT instead (the decision divides by
    the fleet's means: `decision.Policy`)."""
    over = over or via_prefill
    return (w_ttft * (via_prefill.ttft_s - local.ttft_s) / over.ttft_s
            - w_tpot * (local.tpot_s - via_prefill.tpot_s) / over.tpot_s)
