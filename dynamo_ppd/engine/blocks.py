"""Block hashing, for the engine's KV cache and the router's residency index alike.

A sequence's KV lives in blocks of ``block_size`` tokens; only full blocks are shared. Three steps:

- `dynamo_block_hasher`: Dynamo's own per-block token hash (`compute_block_hash_for_seq`). The
  engine's KV events carry the tokens, Dynamo's indexer hashes them with this function, and the
  router hashes a prompt with it, so all three name a block's tokens alike.
- `chain_hash` / `chained_block_hashes`: the engine's block ids, a block's token hash chained to
  its parent's id (63 bits: a valid signed 64-bit ``block_hash`` in Dynamo's events).
- `prefix_chain` / `prefix_id`: the router's prefix ids, the same chaining from `ROOT`. Session
  records in etcd store them (``history_hash``), so they must stay as they are. The router never
  needs the engine's block ids: it chains the token hashes of the KV events itself.

Both chain with int-tuple hashing: the same in every process (only str/bytes hashing is salted),
and several times cheaper than a cryptographic digest (blake2b was a twentieth of a simulation,
one call per block filled).

Pure; the Dynamo import is deferred to the first call, so importing this module needs no runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# local_block_hashes(tokens, block_size) -> one hash per full block of ``tokens``.
BlockHasher = Callable[[Sequence[int], int], list[int]]

ROOT = 0  # the parent of a sequence's first block, in prefix ids
_MAX_BLOCK_ID = (1 << 63) - 1  # engine block ids are non-negative signed 64-bit integers


def dynamo_block_hasher() -> BlockHasher:
    """Dynamo's per-block token hash (what its KV indexer and the router compute)."""
    from dynamo._core import compute_block_hash_for_seq

    return compute_block_hash_for_seq  # type: ignore[return-value]


def chain_hash(parent: int | None, local: int) -> int:
    """The engine's id of a block: its own token hash chained to its parent's id (63 bits, so it
    is a valid signed 64-bit block hash in Dynamo's events)."""
    return hash((parent or 0, local)) & _MAX_BLOCK_ID


def chained_block_hashes(local_hashes: list[int]) -> list[int]:
    """Chain per-block token hashes into the engine's block ids: block i's id depends on blocks 0..i."""
    out: list[int] = []
    parent = None
    for local in local_hashes:
        parent = chain_hash(parent, local)
        out.append(parent)
    return out


def prefix_id(parent: int, local: int) -> int:
    """The router's prefix id of a block: its token hash chained to its parent's prefix id
    (`ROOT` for a first block)."""
    return hash((parent, local))


def prefix_chain(local_hashes: list[int], prefix: int = ROOT) -> list[int]:
    """Prefix ids of a sequence's full blocks (`prefix_id` along the sequence, written out: this
    runs once per request on the decision path); ``prefix``: the id of the block before them."""
    out = []
    for h in local_hashes:
        prefix = hash((prefix, h))
        out.append(prefix)
    return out
