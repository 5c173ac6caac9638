"""Random token ids in bulk: the engine's sampled outputs and the simulated users' messages.

The ids only have to differ between requests (so that their KV blocks do) and round-trip the
model; their values never change a timing. So a request's ids are slices of one table of random
ids per id range, built once per process: each slice of up to `_CHUNK` ids starts at an offset
drawn from the request's own generator (20 random bits), and is copied out in C. Drawing an id
at a time (`Random.choices`: a float per id in a Python loop) was a tenth of a long simulation.

Two requests share ids only if every offset they draw is the same (one in a million per slice):
for requests with different prompts that changes nothing, as their blocks chain different
parents. A stream is prefix-consistent: the first ``m`` of ``n`` ids drawn from a generator are
the ``m`` ids drawn from it in that state (a decode leg continues its prefill leg's stream).
"""

from __future__ import annotations

import functools
import random
from array import array

_OFFSET_BITS = 20
_CHUNK = 4096  # ids per slice (per drawn offset)


@functools.cache
def _table(low: int, high: int) -> array:
    """``2**20 + _CHUNK`` random ids in [low, high), the same in every process."""
    if high <= low:
        raise ValueError(f"empty token id range [{low}, {high})")
    size = (1 << _OFFSET_BITS) + _CHUNK
    bits = array("I", random.Random(f"token-ids:{low}:{high}").randbytes(4 * size))
    return array("I", [low + v % (high - low) for v in bits])


def random_ids(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    """``count`` ids in [low, high) from ``rng`` (deterministic for its state)."""
    table = _table(low, high)
    ids: list[int] = []
    while count > 0:
        start, take = rng.getrandbits(_OFFSET_BITS), min(count, _CHUNK)
        ids.extend(table[start:start + take])
        count -= take
    return ids
