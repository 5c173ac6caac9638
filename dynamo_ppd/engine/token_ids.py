"""Random token ids in bulk: the engine's sampled outputs and the simulated users' messages.

The ids only have to differ between requests (so that their KV blocks do) and round-trip the
model; their values never change a timing. So they are drawn in C: 16 random bits per id
(`Random.randbytes`), looked up in a table over the id range (`itemgetter`), nearly uniform
for ranges of a few thousand ids. `Random.choices` drew a float per id in a Python loop: a tenth
of a long simulation.
"""

from __future__ import annotations

import functools
import random
from array import array
from operator import itemgetter


@functools.cache
def _table(low: int, high: int) -> list[int]:
    """An id in [low, high) for each 16-bit draw: the range repeated."""
    if high <= low:
        raise ValueError(f"empty token id range [{low}, {high})")
    return [low + v % (high - low) for v in range(1 << 16)]


def random_ids(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    """``count`` ids in [low, high) from ``rng`` (deterministic for its state)."""
    if count <= 0:
        return []
    ids = itemgetter(*array("H", rng.randbytes(2 * count)))(_table(low, high))
    return list(ids) if count > 1 else [ids]
