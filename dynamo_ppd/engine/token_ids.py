"""Random token ids in bulk: the engine's sampled outputs and the simulated users' messages.

The ids only have to differ between requests (so that their KV blocks do) and round-trip the
model; their values never change a timing. So they are drawn in C: 16 random bits per id
(`Random.randbytes`), looked up in a table over the id range (`itemgetter`), nearly uniform for
ranges of a few thousand ids. `Random.choices` drew a float per id in a Python loop: a tenth of
a long simulation. Each id has its own 16 bits, so two messages share a 16-token block with
probability 2**-256, as unrelated messages should.

Ids come in chunks of `_CHUNK` (one `randbytes` call each), the last one cut: so a stream is
prefix-consistent, the first ``m`` of ``n`` ids drawn from a generator are the ``m`` ids drawn
from it in that state (a decode leg continues the stream its one-token prefill leg started).
"""

from __future__ import annotations

import functools
import random
from array import array
from operator import itemgetter

_CHUNK = 64  # ids per randbytes call


@functools.cache
def _table(low: int, high: int) -> list[int]:
    """An id in [low, high) for each 16-bit draw: the range repeated."""
    if high <= low:
        raise ValueError(f"empty token id range [{low}, {high})")
    return [low + v % (high - low) for v in range(1 << 16)]


def random_ids(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    """``count`` ids in [low, high) from ``rng`` (deterministic for its state)."""
    table = _table(low, high)
    ids: list[int] = []
    for _ in range(-(-count // _CHUNK)):
        ids.extend(itemgetter(*array("H", rng.randbytes(2 * _CHUNK)))(table))
    del ids[count:]
    return ids
