"""Which KV blocks each worker holds, from the workers' KV events (stored/removed over NATS).

Dynamo's events carry, per block, the engine's own block id, the hash of the block's tokens
(Dynamo's `compute_block_hash_for_seq`) and the parent block's id. We turn each stored block into
a prefix id, the chain of token hashes from the root (so two blocks with the same tokens after
different histories differ), and keep per worker the prefix ids it holds. How many leading blocks
of a prompt a worker holds is then one chain over the prompt's token hashes and a set lookup per
block: a few microseconds, which matters on the decision path (Dynamo's RadixTree answers the same
question, but each call crosses to its own thread: ~65 us here). Works for any engine that
publishes Dynamo KV events; TensorRT-LLM's block ids never need to be understood.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import msgspec

log = logging.getLogger("dynamo_ppd.router.residency")

_ROOT = 0


def kv_events_subject(namespace: str, component: str, endpoint: str = "generate",
                      topic: str = "kv-events") -> str:
    """The NATS subject Dynamo publishes a component's KV events on (brief §4); with
    ``topic="forward-pass-metrics"``, its load reports."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.{topic}"


def prefix_chain(local_hashes: list[int]) -> list[int]:
    """Prefix ids of a sequence's full blocks (int-tuple hashing: fast, and the same in every
    process; these ids never leave the router)."""
    out = []
    prefix = _ROOT
    for h in local_hashes:
        prefix = hash((prefix, h))
        out.append(prefix)
    return out


class Residency:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_prefix: dict[int, dict[int, int]] = {}  # worker -> engine block id -> prefix id
        self._held: dict[int, Counter[int]] = {}  # worker -> prefix id -> blocks holding it
        self.events_applied = 0
        self.orphans = 0  # stored blocks whose parent we never saw (events missed before we started)

    def apply_envelope(self, data: bytes) -> int:
        """Apply one NATS message (msgpack envelope whose payload is a list of router events)."""
        envelope = msgspec.msgpack.decode(data)
        events = msgspec.msgpack.decode(envelope["payload"])
        for router_event in events:
            self.apply(router_event["worker_id"], router_event["event"])
        return len(events)

    def apply(self, worker_id: int, event: dict[str, Any]) -> None:
        data = event["data"]
        blocks = self._block_prefix.setdefault(worker_id, {})
        held = self._held.setdefault(worker_id, Counter())
        if "stored" in data:
            stored = data["stored"]
            parent = stored.get("parent_hash")
            prefix = _ROOT if parent is None else blocks.get(parent)
            if prefix is None:
                self.orphans += 1
                return
            for block in stored["blocks"]:
                prefix = hash((prefix, block["tokens_hash"]))
                blocks[block["block_hash"]] = prefix
                held[prefix] += 1
        elif "removed" in data:
            for block_hash in data["removed"]["block_hashes"]:
                prefix = blocks.pop(block_hash, None)
                if prefix is not None:
                    held[prefix] -= 1
                    if held[prefix] <= 0:
                        del held[prefix]
        elif "cleared" in data:
            self.remove_worker(worker_id)
        self.events_applied += 1

    def held_blocks(self, worker_id: int | None, chain: list[int]) -> int:
        """Leading blocks of the sequence (given by its `prefix_chain`) the worker holds."""
        held = self._held.get(worker_id) if worker_id is not None else None
        if not held:
            return 0
        count = 0
        for prefix in chain:
            if prefix not in held:
                break
            count += 1
        return count

    def held_by_worker(self, chain: list[int], workers: list[int]) -> dict[int, int]:
        return {w: self.held_blocks(w, chain) for w in workers}

    def remove_worker(self, worker_id: int) -> None:
        self._block_prefix.pop(worker_id, None)
        self._held.pop(worker_id, None)
