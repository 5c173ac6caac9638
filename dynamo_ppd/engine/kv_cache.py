"""A paged KV cache with prefix reuse, as TensorRT-LLM's block manager keeps it.

- Tokens live in blocks of ``block_size``. A block is reusable once it is full and its tokens' KV
  is computed; it is then known by a chained hash (its tokens and everything before it), so two
  prompts share exactly their common full-block prefix.
- The per-block token hash is Dynamo's own (`blocks.dynamo_block_hasher`): our KV events carry the
  tokens, Dynamo's indexer hashes them the same way, and so its view matches this cache.
- A full block no request references stays cached until space is needed; then the least recently
  used goes first, leaf before parent (evicting a parent evicts its cached descendants: they can
  no longer be reached by a prefix match).
- Admission reserves the blocks a request may still need, so a running request never runs out.

Every change to the set of cached blocks is recorded as a `KvStored`/`KvRemoved` event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from .blocks import BlockHasher, chain_hash, chained_block_hashes, dynamo_block_hasher


class KvStored(msgspec.Struct, tag="stored", frozen=True):
    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]  # block_size tokens per block, in order


class KvRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[int]


KvEvent = KvStored | KvRemoved


class CacheFull(Exception):
    pass


class _Block:
    """A cached block: its parent's id, the sequences holding it, and its cached children (None
    until it has one: most blocks are leaves, and one is made per block filled)."""

    __slots__ = ("parent", "ref_count", "children")

    def __init__(self, parent: int | None, ref_count: int = 0):
        self.parent = parent
        self.ref_count = ref_count
        self.children: set[int] | None = None


@dataclass
class SequenceKv:
    """The blocks one request holds."""

    hashes: list[int] = field(default_factory=list)  # its full blocks, referenced, in order
    kv_tokens: int = 0  # tokens whose KV is in the cache
    has_partial: bool = False  # holds one private block for a trailing partial block
    reserved: int = 0  # blocks reserved for it and not yet taken


class KvCache:
    def __init__(self, capacity_blocks: int, block_size: int, hasher: BlockHasher | None = None,
                 events: bool = True):
        """``events`` False: no `KvStored`/`KvRemoved` is recorded (a simulated worker with no
        indexer to publish to; building each block's event cost a simulation a few percent)."""
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.hasher = hasher or dynamo_block_hasher()
        self._blocks: dict[int, _Block] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, oldest first
        self._partial_blocks = 0
        self._reserved = 0
        self.events: list[KvEvent] = []
        self.record_events = events
        self.evicted_blocks = 0  # blocks evicted so far (with or without events)

    # -- accounting ------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks holding data: cached (referenced or not) and private partial ones."""
        return len(self._blocks) + self._partial_blocks

    @property
    def active_blocks(self) -> int:
        """Blocks referenced by running requests (cannot be evicted)."""
        return self.used_blocks - len(self._evictable)

    def available_blocks(self) -> int:
        """Blocks a new request could still reserve (free + evictable - reserved)."""
        return self.capacity - self.active_blocks - self._reserved

    def cached_hashes(self) -> set[int]:
        return set(self._blocks)

    def holders(self, h: int) -> int:
        """How many sequences hold cached block ``h`` (0 if it is not cached). A sequence holds
        a contiguous chain of blocks from the start, so along one sequence's blocks this never
        grows."""
        block = self._blocks.get(h)
        return block.ref_count if block is not None else 0

    # -- hashing ---------------------------------------------------------------------------------
    def prefix_hashes(self, tokens: list[int]) -> list[int]:
        """Chained ids of the full blocks of ``tokens``."""
        return chained_block_hashes(self.hasher(tokens, self.block_size))

    def match_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are cached (without taking them)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    # -- request life cycle ---------------------------------------------------------------------
    def admit(self, seq: SequenceKv, prompt_hashes: list[int], total_blocks_needed: int) -> int:
        """Take the cached prefix of a prompt and reserve what the request may still need.

        Returns the number of prompt blocks reused. Raises CacheFull if the reservation does not
        fit now (the caller retries later)."""
        matched = self.match_blocks(prompt_hashes)
        need = max(0, total_blocks_needed - matched)
        # Taking matched blocks that are evictable also removes them from the available pool.
        taking_evictable = sum(1 for h in prompt_hashes[:matched] if h in self._evictable)
        if need > self.available_blocks() - taking_evictable:
            raise CacheFull
        for h in prompt_hashes[:matched]:
            self._ref(h)
        seq.hashes = list(prompt_hashes[:matched])
        seq.kv_tokens = matched * self.block_size
        seq.reserved = need
        self._reserved += need
        return matched

    def commit(self, seq: SequenceKv, tokens: list[int], kv_tokens: int, offset: int = 0) -> None:
        """Record that the sequence's first ``kv_tokens`` tokens now have KV in the cache: new full
        blocks become cached (deduplicated against identical blocks already there). ``tokens``
        are the sequence's tokens from position ``offset`` on, which must not be after the first
        block not yet cached (a growing sequence passes only its tail, not its whole history)."""
        bs, record = self.block_size, self.record_events
        if offset > len(seq.hashes) * bs:
            raise ValueError(f"tokens from {offset} on miss block {len(seq.hashes)}'s start")
        full, first = kv_tokens // bs, len(seq.hashes)
        if full <= first:
            self._partial(seq, kv_tokens)
            return
        blocks = self._blocks
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        first_parent = seq.hashes[-1] if seq.hashes else None
        # The new blocks' token hashes in one call (one per block filled, on a decode step).
        local_hashes = self.hasher(tokens[first * bs - offset:full * bs - offset], bs)
        for index, local in zip(range(first, full), local_hashes, strict=True):
            parent = seq.hashes[-1] if seq.hashes else None
            h = chain_hash(parent, local)
            if h in blocks:
                self._ref(h)
                if seq.has_partial:  # the private block we were filling is not needed any more
                    seq.has_partial = False
                    self._partial_blocks -= 1
            else:
                if seq.has_partial:  # the private block becomes this cached block
                    seq.has_partial = False
                    self._partial_blocks -= 1
                else:
                    self._take_physical(seq)
                blocks[h] = _Block(parent, 1)
                parent_block = blocks.get(parent) if parent is not None else None
                if parent_block is not None:
                    if parent_block.children is None:
                        parent_block.children = set()
                    parent_block.children.add(h)
                if record:
                    if new_hashes and new_hashes[-1] != parent:  # keep each event one chain
                        self._emit_stored(new_hashes, new_tokens, first_parent)
                        new_hashes, new_tokens = [], []
                    if not new_hashes:
                        first_parent = parent
                    new_hashes.append(h)
                    new_tokens.extend(tokens[index * bs - offset:(index + 1) * bs - offset])
            seq.hashes.append(h)
        if new_hashes:
            self._emit_stored(new_hashes, new_tokens, first_parent)
        self._partial(seq, kv_tokens)

    def _partial(self, seq: SequenceKv, kv_tokens: int) -> None:
        """The sequence's KV now ends at ``kv_tokens``: a trailing partial block needs a block."""
        if kv_tokens % self.block_size and not seq.has_partial:
            self._take_physical(seq)
            seq.has_partial = True
            self._partial_blocks += 1
        seq.kv_tokens = kv_tokens

    def extend(self, seq: SequenceKv, kv_tokens: int, tokens: Callable[[], list[int]]) -> None:
        """`commit` for a sequence growing token by token (decode): the token list is only built
        when a block fills or a new partial block starts, not on every step."""
        bs = self.block_size
        if kv_tokens // bs == len(seq.hashes) and (kv_tokens % bs == 0 or seq.has_partial):
            seq.kv_tokens = kv_tokens
        else:
            self.commit(seq, tokens(), kv_tokens)

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    def release(self, seq: SequenceKv) -> None:
        """A request is done: its blocks stay cached but become evictable, leaf first."""
        for h in reversed(seq.hashes):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                self._evictable[h] = None
        seq.hashes = []
        if seq.has_partial:
            seq.has_partial = False
            self._partial_blocks -= 1
        self._reserved -= seq.reserved
        seq.reserved = 0

    def drain_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    # -- internals -------------------------------------------------------------------------------
    def _ref(self, h: int) -> None:
        block = self._blocks[h]
        if block.ref_count == 0:
            self._evictable.pop(h, None)
        block.ref_count += 1

    def _take_physical(self, seq: SequenceKv) -> None:
        """Make room for one more used block for ``seq`` (the caller then adds it), drawing on
        the sequence's reservation and evicting the least recently used cached block if needed."""
        if seq.reserved > 0:
            seq.reserved -= 1
            self._reserved -= 1
        while self.used_blocks >= self.capacity:
            if not self._evictable:
                raise CacheFull("no free or evictable KV block")
            self._evict(next(iter(self._evictable)))

    def _evict(self, h: int) -> None:
        removed: list[int] = []
        stack = [h]
        while stack:
            current = stack.pop()
            block = self._blocks.pop(current)
            self._evictable.pop(current, None)
            assert block.ref_count == 0, "evicting a referenced block"
            removed.append(current)
            if block.children:
                stack.extend(block.children)
            if block.parent is not None and block.parent in self._blocks:
                siblings = self._blocks[block.parent].children
                if siblings is not None:
                    siblings.discard(current)
        self.evicted_blocks += len(removed)
        if self.record_events:
            self.events.append(KvRemoved(block_hashes=removed))

    def _emit_stored(self, hashes: list[int], tokens: list[int], parent: int | None) -> None:
        self.events.append(KvStored(block_hashes=list(hashes), parent_hash=parent, token_ids=list(tokens)))
