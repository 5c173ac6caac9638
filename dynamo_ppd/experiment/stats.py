"""Bootstrap intervals for the benchmark's figures, resampling conversations.

The turns of one conversation are not independent (they share a history, a decode worker and the
load of the moment), so a figure's interval comes from resampling whole conversations with
replacement (a cluster bootstrap), not single requests. A ratio between two systems that ran the
same manifest resamples the same conversation ids on both sides (paired: the conversations'
own variation, e.g. a long paste, cancels out of the ratio). Percentile intervals, 95%.

Pure: no I/O, no clock; deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
TARGET_HALF_WIDTH = 0.10  # +-10% of the figure: what `bench compare` sizes points for
# A bootstrap over a handful of conversations can come out narrow by chance (two conversations'
# follow-ups, nearly equal): an interval is trusted only over at least this many.
MIN_CONVERSATIONS = 20


class Interval(msgspec.Struct, frozen=True):
    """A figure and its 95% bootstrap interval; ``conversations``: how many it resampled."""

    value: float
    low: float
    high: float
    conversations: int

    @property
    def half_width(self) -> float:
        """The larger distance from the value to an end, relative to the value (inf for 0)."""
        if not self.value:
            return float("inf")
        return max(self.value - self.low, self.high - self.value) / abs(self.value)

    def within(self, fraction: float = TARGET_HALF_WIDTH) -> bool:
        return self.half_width <= fraction

    def text(self, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
        """``12.3 [11.0, 13.5] ms``."""
        v, lo, hi = (x * scale for x in (self.value, self.low, self.high))
        return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]{unit}"


Samples = Mapping[str, Sequence[float]]  # conversation id -> its values (e.g. follow-up TTFTs)


def _median(values: np.ndarray) -> float:
    return float(np.percentile(values, 50)) if values.size else float("nan")


def _arrays(samples: Samples, ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    values = [v for cid in ids for v in samples.get(cid, ())]
    index = [i for i, cid in enumerate(ids) for _ in samples.get(cid, ())]
    return np.asarray(values, dtype=float), np.asarray(index, dtype=int)


def _resampled(values: np.ndarray, index: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.repeat(values, counts[index])


def _percentile_interval(statistic: Callable[[np.ndarray], float], n: int, resamples: int,
                         seed: int) -> tuple[float, float]:
    """The LEVEL percentile interval of ``statistic(counts)`` over ``resamples`` draws of ``n``
    conversations with replacement (``counts[i]``: how often conversation i was drawn)."""
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    for b in range(resamples):
        stats[b] = statistic(np.bincount(rng.integers(0, n, n), minlength=n))
    low, high = np.nanpercentile(stats, [(1 - LEVEL) / 2 * 100, (1 + LEVEL) / 2 * 100])
    return float(low), float(high)


def bootstrap(samples: Samples, statistic: Callable[[np.ndarray], float] = _median,
              resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """The statistic (default: the median) of every value pooled, with its interval from
    resampling conversations; None without values."""
    ids = sorted(cid for cid, vs in samples.items() if len(vs))
    values, index = _arrays(samples, ids)
    if not values.size:
        return None
    low, high = _percentile_interval(
        lambda counts: statistic(_resampled(values, index, counts)), len(ids), resamples, seed)
    return Interval(statistic(values), low, high, len(ids))


def paired_ratio(a: Samples, b: Samples, statistic: Callable[[np.ndarray], float] = _median,
                 resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """statistic(a) / statistic(b), both from the same resampled conversation ids (those either
    side has values for); None when a side has no values."""
    return _paired(a, b, lambda x, y: x / y if y else float("nan"), statistic, resamples, seed)


def paired_difference(a: Samples, b: Samples, statistic: Callable[[np.ndarray], float] = _median,
                      resamples: int = RESAMPLES, seed: int = 0) -> Interval | None:
    """statistic(a) - statistic(b), resampled like `paired_ratio` (e.g. the TTFT one system adds
    over another that served the same requests); None when a side has no values."""
    return _paired(a, b, lambda x, y: x - y, statistic, resamples, seed)


def _paired(a: Samples, b: Samples, combine: Callable[[float, float], float],
            statistic: Callable[[np.ndarray], float], resamples: int, seed: int) -> Interval | None:
    ids = sorted({cid for s in (a, b) for cid, vs in s.items() if len(vs)})
    va, ia = _arrays(a, ids)
    vb, ib = _arrays(b, ids)
    if not va.size or not vb.size:
        return None
    value = combine(statistic(va), statistic(vb))
    if not np.isfinite(value):
        return None

    def resampled(counts: np.ndarray) -> float:
        ra, rb = _resampled(va, ia, counts), _resampled(vb, ib, counts)
        return combine(statistic(ra), statistic(rb)) if ra.size and rb.size else float("nan")

    low, high = _percentile_interval(resampled, len(ids), resamples, seed)
    return Interval(value, low, high, len(ids))


def conversations_needed(current: int, interval: Interval | None,
                         target: float = TARGET_HALF_WIDTH) -> int:
    """Conversations for the interval to reach ``target``: a bootstrap interval narrows as
    1/sqrt(conversations), so scale by (half-width / target)^2 (with 10% to spare). No interval
    (nothing measured): double; one over fewer than `MIN_CONVERSATIONS`: enough for that many."""
    if interval is None or not np.isfinite(interval.half_width):
        return 2 * current
    if interval.conversations < MIN_CONVERSATIONS:  # too few to trust: grow to that many sampled
        return max(current + 1, int(np.ceil(current * MIN_CONVERSATIONS / max(1, interval.conversations))))
    if interval.within(target):
        return current
    return int(np.ceil(round(current * (interval.half_width / target) ** 2 * 1.1, 6)))
