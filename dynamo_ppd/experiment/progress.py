"""The one progress bar of the experiments: table builds, sim paper and sim compare (cells or
points), and the live benchmark's runs (requests, with their failures)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Steps done out of ``total`` on stderr: on a terminal a bar redrawn at each step, else a
    line per 10% and, with ``every_s``, at least one that often (a live run's 10% can be minutes).
    ``total`` may be an estimate (a run cut at a horizon sends fewer requests than planned)."""

    def __init__(self, total: int, label: str, unit: str = "cells", every_s: float | None = None):
        self.total, self.label, self.unit, self.every_s = total, label, unit, every_s
        self.done = self.failed = 0
        self.start = self._last_line = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def step(self, failed: bool = False) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        elapsed = now - self.start
        frac = min(1.0, self.done / self.total)
        failures = f", {self.failed} failed" if self.failed else ""
        if self.tty:
            eta = elapsed / self.done * max(0, self.total - self.done)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total}{failures} "
                             f"{elapsed:5.0f}s elapsed, ~{eta:4.0f}s left")
            if self.done == self.total:
                sys.stderr.write("\n")
        elif int(frac * 10) != self._last_decile or (self.every_s is not None
                                                      and now - self._last_line >= self.every_s):
            self._last_decile, self._last_line = int(frac * 10), now
            sys.stderr.write(f"{self.label}: {self.done}/{self.total} {self.unit}{failures}, "
                             f"{elapsed:.0f}s\n")
        sys.stderr.flush()

    def close(self) -> None:
        """The closing line: what was done, what failed, how long it took."""
        if self.tty and self.done != self.total:
            sys.stderr.write("\n")
        sys.stderr.write(f"{self.label}: {self.done} {self.unit}, {self.failed} failed, "
                         f"{time.monotonic() - self.start:.0f} s\n")
        sys.stderr.flush()
