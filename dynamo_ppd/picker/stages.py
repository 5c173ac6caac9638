"""Where one request's time in the endpoint picker goes, stage by stage: the clock the picker
laps as a request goes through it, and the stages' names. Pure (a monotonic clock, no I/O), so the
request-path benchmark reads the names without importing the picker and Dynamo with it."""

from __future__ import annotations

import time


class StageClock:
    """Where one request's time in the picker goes: seconds per stage, each stage the time since
    the previous lap (`STAGES` in path order). Started at the stream's first ext_proc message."""

    __slots__ = ("started", "stages", "_last")

    def __init__(self, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self._last = self.started
        self.stages: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now

    @property
    def total(self) -> float:
        """From the first message in to the last lap."""
        return self._last - self.started


# The stages of a routed request, in order: the body arriving over gRPC, JSON parse, the chat
# template, tokenization, Dynamo's block hashes, the plan (session, residency, loads, policy),
# charging and recording the turn, and the ext_proc answer built.
STAGES = ("body", "parse", "template", "tokenize", "hashes", "plan", "record", "answer")
