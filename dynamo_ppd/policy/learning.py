"""What the policy learns from finished requests (both shells feed it: the relay router sees every
token, the endpoint picker a sample of answers through ext_proc).

- **Corrections per route and bucket** (`Calibration`): the ratio of observed to predicted TTFT and
  TPOT, an exponentially weighted mean per route and per bucket of (context, append, load), so a
  30K-token context and a 1K one are corrected apart. A ratio starts as the plain mean of its
  first outcomes (a profile wrong about the cluster is corrected by its first few outcomes, not
  after ~20), then keeps moving with a fixed weight on each new outcome, so it recovers when
  conditions change; ratios are bounded ([0.25, 4]).
  A bucket with too few outcomes of its own borrows its route's overall ratio.
- **The predictor's measured error** (`Calibration.error`): per route and bucket, the mean
  absolute relative error of the corrected predictions the policy used, one request's spread.
  A route is chosen for its mean, so the margin inside which going through a prefill worker is
  not worth moving KV for (`decision.Policy.decide`) is the error of the learned mean
  (`Calibration.mean_error`): that spread over the square root of the outcomes it rests on, at
  most the ~19 an exponentially weighted mean remembers. Before any outcome the spread is
  `PRIOR_ERROR` and rests on none: an unproven model is not trusted to a few percent.
- **Fleet means** (`FleetMeans`): the mean follow-up TTFT and TPOT observed, what the score's terms
  are divided by, so that a decision weighs seconds as the fleet's mean pays them.

Pure: no I/O, no clock; the callers say when a request finished by calling `observe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .features import RequestFeatures
from .score import Prediction

ALPHA = 0.1  # weight of each new outcome in a bucket's ratio and error (~10 outcomes of memory)
FLOOR, CAP = 0.25, 4.0  # bounds of a correction ratio
MIN_OUTCOMES = 5  # a bucket's own ratio is used once it has seen this many outcomes
PRIOR_ERROR = 0.2  # relative error assumed before outcomes say otherwise
MEMORY = (2 - ALPHA) / ALPHA  # outcomes an exponentially weighted mean rests on (its effective count)

# Bucket edges: prompt tokens (context), tokens to compute decode-local (append), sequences
# decoding on the worker that would run the turn (load). Coarse on purpose: a bucket must see
# enough outcomes to learn, and the cost model already follows each figure within a bucket.
CONTEXT_EDGES = (1024, 4096, 16384)
APPEND_EDGES = (128, 1024)
LOAD_EDGES = (4, 16)


def _index(value: int, edges: tuple[int, ...]) -> int:
    return sum(value >= edge for edge in edges)


def bucket_of(f: RequestFeatures) -> str:
    """A request's calibration bucket, e.g. ``c2-a1-l0``: context class, append class, load class
    (each 0 = smallest). A small fixed set (4 x 3 x 3), safe as a metric label."""
    return (f"c{_index(f.prompt_tokens, CONTEXT_EDGES)}-a{_index(max(0, f.new_tokens), APPEND_EDGES)}"
            f"-l{_index(f.decode_load.decode_requests, LOAD_EDGES)}")


@dataclass
class _Track:
    """One (route, bucket)'s learning: correction ratios, errors and how many outcomes."""

    ttft_ratio: float = 1.0
    tpot_ratio: float = 1.0
    ttft_error: float = PRIOR_ERROR
    tpot_error: float = PRIOR_ERROR
    outcomes: int = 0
    last_outcome: int = -1  # its bucket's outcome count (a route's track: all) when it last learned

    def learn(self, ttft_ratio: float, tpot_ratio: float | None, ttft_error: float,
              tpot_error: float | None, now: int) -> None:
        # The ratios start as a plain mean of the outcomes so far (the prior of 1 weighs nothing
        # once one outcome is in) and become the weighted mean once ~1/ALPHA are in.
        rate = max(ALPHA, 1.0 / (self.outcomes + 1))
        self.ttft_ratio += rate * (ttft_ratio - self.ttft_ratio)
        self.ttft_error += ALPHA * (ttft_error - self.ttft_error)
        if tpot_ratio is not None:
            self.tpot_ratio += rate * (tpot_ratio - self.tpot_ratio)
        if tpot_error is not None:
            self.tpot_error += ALPHA * (tpot_error - self.tpot_error)
        self.outcomes += 1
        self.last_outcome = now


@dataclass
class Calibration:
    """Corrections and errors per route and bucket (the module docstring). Routes are plain
    strings here (the decision's `Route` values), so this module needs nothing of the decision."""

    routes: dict[str, _Track] = field(default_factory=dict)
    buckets: dict[tuple[str, str], _Track] = field(default_factory=dict)
    outcomes: int = 0
    bucket_outcomes: dict[str, int] = field(default_factory=dict)  # both routes', per bucket

    def _track(self, route: str, bucket: str) -> _Track:
        """The bucket's track once it has learned enough, else the route's."""
        own = self.buckets.get((route, bucket))
        if own is not None and own.outcomes >= MIN_OUTCOMES:
            return own
        return self.routes.get(route) or _Track()

    def apply(self, route: str, bucket: str, p: Prediction) -> Prediction:
        track = self._track(route, bucket)
        return Prediction(p.ttft_s * track.ttft_ratio, p.tpot_s * track.tpot_ratio)

    def error(self, route: str, bucket: str) -> tuple[float, float]:
        """(TTFT, TPOT) mean absolute relative error of the corrected predictions."""
        track = self._track(route, bucket)
        return track.ttft_error, track.tpot_error

    def mean_error(self, route: str, bucket: str) -> tuple[float, float]:
        """(TTFT, TPOT) relative error of the corrected *mean* prediction: `error` over the square
        root of the outcomes behind it (as many as the weighted mean remembers at most)."""
        track = self._track(route, bucket)
        shrink = math.sqrt(max(1.0, min(track.outcomes, MEMORY)))
        return track.ttft_error / shrink, track.tpot_error / shrink

    def stale(self, route: str, bucket: str, after: int) -> bool:
        """The route has not learned in this bucket within the bucket's last ``after`` outcomes
        (or has learned too little there to have its own correction)."""
        track = self.buckets.get((route, bucket))
        if track is None or track.outcomes < MIN_OUTCOMES:
            return True
        return self.bucket_outcomes.get(bucket, 0) - track.last_outcome > after

    def observe(self, route: str, bucket: str, raw: Prediction, used: Prediction, ttft_s: float,
                tpot_s: float | None) -> None:
        """One finished request: ``raw`` the model's prediction of its route, ``used`` the
        corrected one the decision read."""
        if raw.ttft_s <= 0 or used.ttft_s <= 0 or not math.isfinite(ttft_s):
            return
        ttft_ratio = _bounded(ttft_s / raw.ttft_s)
        tpot_ratio = _bounded(tpot_s / raw.tpot_s) if tpot_s and raw.tpot_s > 0 else None
        ttft_error = min(CAP, abs(ttft_s / used.ttft_s - 1))
        tpot_error = min(CAP, abs(tpot_s / used.tpot_s - 1)) if tpot_s and used.tpot_s > 0 else None
        self.outcomes += 1
        in_bucket = self.bucket_outcomes[bucket] = self.bucket_outcomes.get(bucket, 0) + 1
        learned = (ttft_ratio, tpot_ratio, ttft_error, tpot_error)
        self.routes.setdefault(route, _Track()).learn(*learned, self.outcomes)
        self.buckets.setdefault((route, bucket), _Track()).learn(*learned, in_bucket)


def _bounded(ratio: float) -> float:
    return min(CAP, max(FLOOR, ratio))


@dataclass
class FleetMeans:
    """Mean follow-up TTFT and TPOT observed (exponentially weighted: ~1/alpha outcomes), both
    routes together; None before the first outcome."""

    alpha: float = 0.02
    ttft_s: float | None = None
    tpot_s: float | None = None

    def observe(self, ttft_s: float, tpot_s: float | None) -> None:
        if math.isfinite(ttft_s) and ttft_s > 0:
            self.ttft_s = ttft_s if self.ttft_s is None else self.ttft_s + self.alpha * (ttft_s - self.ttft_s)
        if tpot_s and tpot_s > 0:
            self.tpot_s = tpot_s if self.tpot_s is None else self.tpot_s + self.alpha * (tpot_s - self.tpot_s)
