"""What a simulated router is given and what it answers: `SimRequestFeatures` (what the live router
learns from the request and the conversation's earlier turns) and an `Assignment` (a route with
its workers).

An `Assignment` is one of three structs, one per route of `policy.decision.Route` (the route's
name alone), each naming the workers that execute it, as the live router would:
- `ViaPrefill(prefill, decode)`: classic PD (x=0). The prompt is prefilled on ``prefill`` and its
  whole KV cache is sent to ``decode``.
- `DecodeLocal(decode)`: PPD's x=1. ``decode`` runs the (append-)prefill itself, reusing the
  conversation's KV it already holds; nothing is transferred.
- `Replica(worker)`: a replica, an aggregated worker, does prefill and decode (no
  disaggregation): the paper's Replica, the R of a config like 4R (Dynamo and the graphs say
  ``agg``; the records' route name is ``aggregated``).

The lowest module of the simulator's routing: the cluster executes assignments, `routing` and
`peers` make them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class ViaPrefill(msgspec.Struct, frozen=True):
    prefill: str
    decode: str


class DecodeLocal(msgspec.Struct, frozen=True):
    decode: str


class Replica(msgspec.Struct, frozen=True):
    worker: str


Assignment = ViaPrefill | DecodeLocal | Replica


def route_name(assignment: Assignment) -> str:
    """The route's name a record stores: via_prefill, decode_local, or aggregated for a replica
    (the spelling `sim run --json` has always written; the live router's is `Route.REPLICA`)."""
    if isinstance(assignment, ViaPrefill):
        return "via_prefill"
    if isinstance(assignment, DecodeLocal):
        return "decode_local"
    return "aggregated"


class RoutingError(ValueError):
    """A router returned something the cluster cannot execute (unknown worker, wrong role)."""


@dataclass(frozen=True, slots=True)
class SimRequestFeatures:
    """What a real router knows when a turn arrives: the raw request and session facts a
    simulated router starts from (the PPD router derives `policy.decision.RequestFeatures`, the
    policy's inputs, from these and the `ClusterView`, in `policy.placement`).

    ``new_tokens`` counts the prompt tokens beyond the previous turn's prompt and output (the
    router saw both stream through it); for turn 1 it is the whole prompt. ``decode_worker`` is
    the worker that decoded the conversation's previous turn (its session worker), and
    ``cached_on_decode`` how many prompt tokens it still holds, as its KV events report."""

    conversation_id: str
    turn: int  # 1-based
    prompt_tokens: int
    new_tokens: int
    max_tokens: int
    decode_worker: str | None
    cached_on_decode: int
    now: float
    token_ids: list[int] = field(repr=False)
