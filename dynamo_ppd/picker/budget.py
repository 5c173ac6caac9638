"""A bound on the work one request does on the picker's path: its prompt's tokenization.

The gateway waits for the picker's answer for a fixed time (Envoy's ext_proc ``message_timeout``,
1 s on the local gateway) and leaves a picker that does not answer in time out of later requests.
Tokenizing a prompt costs in proportion to its text (a 2 MB prompt: seconds), so without a bound
one large request would hold up every request behind it and take the picker off for everyone.

`TokenizeBudget.tokens` therefore:

- tokenizes a small body inline (a thread hop costs more than it saves);
- tokenizes a larger one on a single worker thread (Hugging Face ``tokenizers`` encodes with the
  GIL released, so the event loop keeps answering other requests), one at a time;
- gives up after ``deadline_s`` with `OverBudget`: the picker then sends the request on unrouted,
  and Dynamo's frontend serves it (or refuses it) as it would without a picker;
- does not start a tokenization it predicts will not finish in time, from the throughput
  (body bytes per second) the finished ones measured: a tokenization abandoned at its deadline
  runs on to its end on the worker thread, so the prediction keeps that waste to the first one.
  Once every `PROBE_EVERY_S`, when the thread is idle, one such body is tokenized all the same: a
  throughput measured on a busy moment must be able to recover, or every body of that size would
  go unrouted from then on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

DEFAULT_DEADLINE_S = 0.5  # half the local gateway's 1 s message timeout: a 100K-token prompt takes ~0.2 s
# A body this large goes to the worker thread: ~16K tokens of prompt, ~10 ms of tokenizing.
OFFLOAD_BYTES = 64 << 10
PROBE_EVERY_S = 10.0  # at most one tokenization predicted to miss its deadline is tried this often


class OverBudget(Exception):
    """The request's tokenization would not fit (``predicted``) or did not fit in the deadline."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "over_deadline" (started, not done in time) or "predicted_over_deadline"


class TokenizeBudget:
    """See the module docstring. ``deadline_s`` None or 0: no bound (everything inline)."""

    def __init__(self, deadline_s: float | None = DEFAULT_DEADLINE_S, offload_bytes: int = OFFLOAD_BYTES,
                 clock: Callable[[], float] = time.perf_counter, now: Callable[[], float] = time.monotonic):
        self.deadline_s = deadline_s or None
        self.offload_bytes = offload_bytes
        self.clock = clock  # times a tokenization
        self.now = now  # spaces the probes
        self._in_flight = 0  # tokenizations on the worker thread or queued for it
        self._last_probe = float("-inf")
        self.bytes_per_s: float | None = None  # the slowest recent offloaded throughput
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize") if self.deadline_s else None

    def predicted_s(self, size: int) -> float | None:
        return size / self.bytes_per_s if self.bytes_per_s else None

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` (the tokenization of a body of ``size`` bytes) within the budget."""
        if self._thread is None or size < self.offload_bytes:
            return work()
        assert self.deadline_s is not None
        predicted = self.predicted_s(size)
        if predicted is not None and predicted > self.deadline_s:
            if self._in_flight or self.now() - self._last_probe < PROBE_EVERY_S:
                raise OverBudget("predicted_over_deadline",
                                 f"a {size}-byte body is predicted to take {predicted:.2f} s to tokenize, "
                                 f"over the picker's --deadline-ms {self.deadline_s * 1e3:g}")
            self._last_probe = self.now()  # a probe: measured again, within the deadline as any
        loop = asyncio.get_running_loop()
        self._in_flight += 1
        future = loop.run_in_executor(self._thread, self._timed, size, work)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except asyncio.TimeoutError:
            # It runs on to its end; its result or error is nobody's (retrieved, so not logged).
            future.add_done_callback(lambda done: done.cancelled() or done.exception())
            raise OverBudget("over_deadline", f"a {size}-byte body was not tokenized within the picker's "
                             f"--deadline-ms {self.deadline_s * 1e3:g}") from None

    def _done(self, _future: asyncio.Future) -> None:
        self._in_flight -= 1  # (on the event loop's thread, as every change of the count)

    def _timed(self, size: int, work: Callable[[], T]) -> T:
        start = self.clock()
        result = work()
        seconds = self.clock() - start
        if seconds > 0:
            rate = size / seconds
            # The slower of the last rate and this one, relaxed toward this one: a busy machine's
            # slow measurement counts at once, a quick one only gradually.
            last = self.bytes_per_s
            self.bytes_per_s = rate if last is None else min(rate, 0.5 * (last + rate))
        return result

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
