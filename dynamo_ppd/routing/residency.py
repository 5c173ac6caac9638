"""Which KV blocks each worker holds, from the workers' KV events (stored/removed over NATS).

Dynamo's events carry, per block, the engine's own block id, the hash of the block's tokens
(Dynamo's `compute_block_hash_for_seq`) and the parent block's id. We turn each stored block into
a prefix id (`engine.blocks.prefix_id`), the chain of token hashes from the root (so two blocks
with the same tokens after different histories differ), and keep per worker the prefix ids it
holds. How many leading blocks of a prompt a worker holds is then one chain over the prompt's
token hashes and a set lookup per block: a few microseconds, which matters on the decision path
(Dynamo's RadixTree answers the same question, but each call crosses to its own thread: ~65 us
here). Works for any engine that publishes Dynamo KV events; TensorRT-LLM's block ids never need
to be understood.

The index never trusts a view it cannot prove: each worker's events carry a monotonic `event_id`,
and a gap in it, or a `stored` block whose parent the index never saw (events published before this
router subscribed, or lost in a NATS reconnect), puts the worker in `resync_requests`. The adapter
(`kv_sync`) answers with the worker's whole state from Dynamo's worker-local indexer and
`replace_worker` rebuilds the view from it, replaying the events received meanwhile. An orphan
block is kept (in that replay buffer) until a rebuild places it; `unresolved_orphans` says how many
a worker still has. Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any

import msgspec

from ..engine.blocks import ROOT, prefix_id

log = logging.getLogger("dynamo_ppd.routing.residency")

REPLAY_EVENTS = 2048  # per worker: events a rebuild replays over the worker's dump (see replace_worker)


def kv_events_subject(namespace: str, component: str, endpoint: str = "generate",
                      topic: str = "kv-events") -> str:
    """The NATS subject Dynamo 1.6.1 publishes a component's KV events on (its NATS event plane); with
    ``topic="forward-pass-metrics"``, its load reports."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.{topic}"


class Residency:
    """Per worker, the prefix ids of the KV blocks it holds, kept from its KV event stream, and
    whether that view can still be trusted (`resync_requests`: rebuild it with `replace_worker`).
    The router asks it how many leading blocks of a prompt each worker holds (`held_blocks`)."""

    def __init__(self, block_size: int, replay_events: int = REPLAY_EVENTS):
        self.block_size = block_size
        self._block_prefix: dict[int, dict[int, int]] = {}  # worker -> engine block id -> prefix id
        self._held: dict[int, Counter[int]] = {}  # worker -> prefix id -> blocks holding it
        # (worker, dp rank) -> newest event id seen in the stream (each rank's publisher counts alone)
        self._last_event_id: dict[tuple[int, int], int] = {}
        # worker -> its latest stream events, each with its place in the stream (see `mark`)
        self._recent: dict[int, deque[tuple[int, dict[str, Any]]]] = {}
        self._seq = 0
        self._orphans: dict[int, set[int]] = {}  # worker -> block ids stored under an unseen parent
        self._replay_events = replay_events
        # worker -> why its view must be rebuilt from the worker ("gap", "orphan"); drained by the
        # adapter, which owns the I/O.
        self.resync_requests: dict[int, str] = {}
        self.events_applied = 0
        self.orphans = 0  # stored events whose parent we had not seen, ever
        self.gaps = 0  # missing event-id ranges seen in the stream
        self.stale = 0  # events whose id went back (publisher restarted, or reordered)

    # -- the event stream --------------------------------------------------------------------------
    def apply_envelope(self, data: bytes) -> int:
        """Apply one NATS message (msgpack envelope whose payload is a list of router events)."""
        envelope = msgspec.msgpack.decode(data)
        events = msgspec.msgpack.decode(envelope["payload"])
        for router_event in events:
            self.apply(router_event["worker_id"], router_event["event"], router_event.get("dp_rank") or 0)
        return len(events)

    def apply(self, worker_id: int, event: dict[str, Any], dp_rank: int = 0) -> None:
        """One event from a worker's live stream: checked against the event ids of its publisher
        (one per worker and data-parallel rank, each counting from 0), kept for replay, applied."""
        event_id = event.get("event_id")
        if isinstance(event_id, int):
            last = self._last_event_id.get((worker_id, dp_rank))
            if last is not None and event_id != last + 1:
                # A jump: events were lost. Going back: the publisher restarted its count, or
                # events arrive out of order. Either way the view is no longer provable.
                if event_id > last:
                    self.gaps += 1
                    self._request(worker_id, "gap")
                else:
                    self.stale += 1
                    self._request(worker_id, "reordered")
            self._last_event_id[(worker_id, dp_rank)] = event_id
        recent = self._recent.get(worker_id)
        if recent is None:
            recent = self._recent[worker_id] = deque(maxlen=self._replay_events)
        self._seq += 1
        recent.append((self._seq, event))
        if not self._apply_one(worker_id, event):
            self.orphans += 1
            self._request(worker_id, "orphan")
        self.events_applied += 1

    def _request(self, worker_id: int, reason: str) -> None:
        self.resync_requests.setdefault(worker_id, reason)

    def mark(self) -> int:
        """Where the stream is now: `replace_worker(..., since=mark)` replays what came after."""
        return self._seq

    def take_resync_requests(self) -> dict[int, str]:
        requests, self.resync_requests = self.resync_requests, {}
        return requests

    def _apply_one(self, worker_id: int, event: dict[str, Any]) -> bool:
        """Apply an event to the view; False if it is a `stored` whose parent is unknown (kept as
        an orphan until a rebuild, never silently dropped)."""
        data = event["data"]
        blocks = self._block_prefix.setdefault(worker_id, {})
        held = self._held.setdefault(worker_id, Counter())
        if "stored" in data:
            stored = data["stored"]
            parent = stored.get("parent_hash")
            prefix = ROOT if parent is None else blocks.get(parent)
            if prefix is None:
                self._orphans.setdefault(worker_id, set()).update(
                    b["block_hash"] for b in stored["blocks"])
                return False
            orphans = self._orphans.get(worker_id)
            for block in stored["blocks"]:
                prefix = prefix_id(prefix, block["tokens_hash"])
                block_hash = block["block_hash"]
                old = blocks.get(block_hash)
                if old == prefix:
                    continue  # already known (a replayed or re-delivered event): idempotent
                if old is not None:
                    self._drop(held, old)
                blocks[block_hash] = prefix
                held[prefix] += 1
                if orphans:
                    orphans.discard(block_hash)
        elif "removed" in data:
            orphans = self._orphans.get(worker_id)
            for block_hash in data["removed"]["block_hashes"]:
                if orphans:
                    orphans.discard(block_hash)
                prefix = blocks.pop(block_hash, None)
                if prefix is not None:
                    self._drop(held, prefix)
        elif "cleared" in data:
            self._block_prefix.pop(worker_id, None)
            self._held.pop(worker_id, None)
            self._orphans.pop(worker_id, None)
        return True

    @staticmethod
    def _drop(held: Counter[int], prefix: int) -> None:
        held[prefix] -= 1
        if held[prefix] <= 0:
            del held[prefix]

    # -- rebuilding from the worker ------------------------------------------------------------------
    def replace_worker(self, worker_id: int, dump: list[dict[str, Any]], since: int | None = None) -> int:
        """Rebuild a worker's view from a dump of its whole state (``dump``: KV events, in any order;
        Dynamo's tree dumps are parent-first), then replay the stream events that came after
        ``since`` (a `mark` taken when the rebuild was asked for), which the dump may not hold yet.
        Earlier ones are the dump's to tell: replaying a `stored` whose `removed` was lost would
        bring back a phantom. Applying is idempotent and the replay is in stream order, so the
        newest event per block wins. Returns the orphans left: blocks stored under a parent
        neither the dump nor the replay places."""
        self._block_prefix.pop(worker_id, None)
        self._held.pop(worker_id, None)
        self._orphans.pop(worker_id, None)
        pending = list(dump)
        while pending:  # parents first, whatever order the dump came in
            left = [e for e in pending if not self._apply_one(worker_id, e)]
            if len(left) == len(pending):
                break
            self._orphans.pop(worker_id, None)  # recomputed by the next pass
            pending = left
        if since is not None:
            for seq, event in self._recent.get(worker_id, ()):
                if seq > since:
                    self._apply_one(worker_id, event)
        self.resync_requests.pop(worker_id, None)
        return self.unresolved_orphans(worker_id)

    def unresolved_orphans(self, worker_id: int) -> int:
        return len(self._orphans.get(worker_id, ()))

    def forget_worker(self, worker_id: int) -> None:
        """The worker left discovery: nothing of it is kept (a restarted engine has a new id)."""
        self.remove_worker(worker_id)
        for key in [k for k in self._last_event_id if k[0] == worker_id]:
            del self._last_event_id[key]
        self._recent.pop(worker_id, None)
        self.resync_requests.pop(worker_id, None)

    def has_events(self, worker_id: int) -> bool:
        """Whether any event from this worker reached the stream."""
        return bool(self._recent.get(worker_id))

    def block_count(self, worker_id: int) -> int:
        return len(self._block_prefix.get(worker_id, ()))

    # -- queries ----------------------------------------------------------------------------------
    def held_blocks(self, worker_id: int | None, chain: list[int]) -> int:
        """Leading blocks of the sequence (given by its `blocks.prefix_chain`) the worker holds."""
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
        self._orphans.pop(worker_id, None)
