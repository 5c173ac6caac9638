"""The request rate the router actually sees, over a sliding window (not an average since start,
which the paper's proxy used and which never forgets a burst or a lull)."""

from __future__ import annotations

from collections import deque


class SlidingWindowRate:
    def __init__(self, window_s: float = 10.0, min_span_s: float = 1.0):
        if window_s <= 0:
            raise ValueError("window must be positive")
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._arrivals: deque[float] = deque()
        self._first: float | None = None

    def record(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._arrivals.append(now)
        self._trim(now)

    def rate(self, now: float) -> float:
        """Requests per second over the last window (or since the first request, if sooner)."""
        self._trim(now)
        if self._first is None:
            return 0.0
        span = min(self.window_s, max(self.min_span_s, now - self._first))
        return len(self._arrivals) / span

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._arrivals and self._arrivals[0] <= horizon:
            self._arrivals.popleft()
