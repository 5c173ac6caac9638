"""The engine's sampled token ids, in bulk (the simulated users' messages come from numpy:
`sim.conversation`).

An id only names a token: it must round-trip the model, and a request's ids must continue its
own stream; no timing reads its value. So a request's ids are slices of one table of random ids
per id range, built once per process: each slice of up to `_CHUNK` ids starts at an offset drawn
from the request's own generator (16 random bits) and is copied out in C. Drawing an id at a
time (`Random.choices`: a float per id in a Python loop) was a tenth of a long simulation.

Two requests' answers coincide when their offsets do, once in 65,536. That changes no
cache hit: a block's id chains everything before it, so answers to different prompts never share
a block, and the simulated users never send the same prompt twice (their messages are drawn per
id). A stream is prefix-consistent: the first ``m`` of ``n`` ids drawn from a generator are the
``m`` ids drawn from it in that state (a decode leg continues its one-token prefill leg's stream).
"""

from __future__ import annotations

import functools
import random
from array import array

_OFFSET_BITS = 16  # a table of 70k ids: built in ~10 ms, once per process
_CHUNK = 4096  # ids per slice (per drawn offset)


@functools.cache
def _table(low: int, high: int) -> array:
    """``2**_OFFSET_BITS + _CHUNK`` random ids in [low, high), the same in every process."""
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
