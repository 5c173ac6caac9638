"""Which KV blocks each worker holds, from the workers' KV events (stored/removed over NATS).

Kept in a Dynamo `RadixTree` keyed by Dynamo's per-block token hashes, so it works for any engine
that publishes Dynamo KV events (TensorRT-LLM's own block ids never need to be known). The
router asks how many leading blocks of a prompt a given worker still holds: the real cached and
new token counts of a decode-local decision, and whether the history was evicted.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec

log = logging.getLogger("dynamo_ppd.router.residency")


def kv_events_subject(namespace: str, component: str, endpoint: str = "generate") -> str:
    """The NATS subject Dynamo publishes a component's KV events on (brief §4)."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.kv-events"


class Residency:
    def __init__(self, block_size: int):
        from dynamo._core import RadixTree

        self.block_size = block_size
        self._tree = RadixTree()
        self.events_applied = 0

    def apply_envelope(self, data: bytes) -> int:
        """Apply one NATS message (msgpack envelope whose payload is a list of router events)."""
        envelope = msgspec.msgpack.decode(data)
        events = msgspec.msgpack.decode(envelope["payload"])
        for router_event in events:
            self.apply(router_event["worker_id"], router_event["event"], router_event.get("dp_rank", 0))
        return len(events)

    def apply(self, worker_id: int, event: dict[str, Any], dp_rank: int = 0) -> None:
        self._tree.apply_event(worker_id, json.dumps({**event, "dp_rank": dp_rank}).encode())
        self.events_applied += 1

    def cached_blocks(self, local_hashes: list[int]) -> dict[int, int]:
        """Leading blocks of the prompt held, per worker id (workers holding none are absent)."""
        scores: dict[Any, int] = self._tree.find_matches(local_hashes).scores
        return {key[0]: blocks for key, blocks in scores.items()}  # keys are (worker_id, dp_rank)

    def cached_tokens(self, worker_id: int | None, local_hashes: list[int]) -> int:
        if worker_id is None or not local_hashes:
            return 0
        return self.cached_blocks(local_hashes).get(worker_id, 0) * self.block_size

    def remove_worker(self, worker_id: int) -> None:
        self._tree.remove_worker(worker_id)
