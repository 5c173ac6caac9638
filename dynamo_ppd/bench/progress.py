"""The progress bar of the long simulated experiments (table builds, sim paper, sim compare)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar on stderr (a line per 10% when not a terminal)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.start = total, label, 0, time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def step(self) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        frac = self.done / self.total
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} "
                             f"{elapsed:5.0f}s elapsed, ~{eta:4.0f}s left")
            if self.done == self.total:
                sys.stderr.write("\n")
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            sys.stderr.write(f"{self.label}: {self.done}/{self.total} cells, {elapsed:.0f}s\n")
        sys.stderr.flush()
