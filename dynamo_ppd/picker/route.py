"""How the endpoint picker expresses a turn's route to Dynamo's frontend: request headers.

Pure: a plan's route in, the headers to set and to remove out. Dynamo's frontend reads two
routing headers, decimal instance ids (``HEADER_WORKER_INSTANCE_ID =
"x-dynamo-worker-instance-id"``, ``HEADER_PREFILL_INSTANCE_ID = "x-dynamo-prefill-instance-id"``
and their unprefixed aliases and data-parallel ranks in `nvext.rs` of ai-dynamo/dynamo's llm
crate; Dynamo 1.6.1's behaviour with the two prefixed ones was tried live, issue 26), and the body's
``nvext`` carries the same pins (``backend_instance_id``, ``prefill_worker_id``,
``decode_worker_id``), which the headers override.

The choice (measured in docs/bench/picker.md):

- **via prefill**: pin the prefill worker only. The frontend runs the prefill there, then its KV
  router picks the decode worker (overlap against load: the one holding the history, or the least
  loaded for a new conversation), and Dynamo's migration can move the answer if that worker dies.
- **decode-local**: no pin. The frontend's KV router picks the decode worker holding the history,
  and its conditional disaggregation, configured to bypass the prefill worker whenever the chosen
  worker holds any of the prompt (``isl_bounding`` with an unreachable ISL threshold and a ratio
  of 1.0), makes the turn an append-prefill there. If the chosen worker holds none of it, the turn
  goes through a prefill worker instead of failing.
- **replica** (aggregated workers): no pin; the KV router's overlap rule is replica mode's.

A decode pin (``x-dynamo-worker-instance-id``) is never sent: a pinned turn whose decode worker
dies mid-answer ends in an error event, and a pin to a worker holding none of the prompt is a 400
(both tried on Dynamo 1.6.1, issue 26).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy.decision import Route

PREFILL_PIN = "x-dynamo-prefill-instance-id"
DECODE_PIN = "x-dynamo-worker-instance-id"
# Every routing header Dynamo's frontend may read: a client's own copies are dropped, so a client
# cannot choose its route (the relay router drops a client's bypass annotation the same way).
CLIENT_ROUTING_HEADERS = (
    PREFILL_PIN, DECODE_PIN, "x-worker-instance-id", "x-prefill-instance-id",
    "x-dynamo-dp-rank", "x-dynamo-prefill-dp-rank", "x-dp-rank", "x-data-parallel-rank",
    "x-prefill-dp-rank",
)
# The same pins in the body's ``nvext`` (and the annotations a client could force a path with).
CLIENT_ROUTING_NVEXT = ("backend_instance_id", "prefill_worker_id", "decode_worker_id", "dp_rank",
                        "prefill_dp_rank", "annotations")
# The header a client names its conversation with (Dynamo's agent_context.session_id).
SESSION_HEADER = "x-dynamo-session-id"
# The picker's route, for logs and the benchmarks' per-turn accounting; Dynamo ignores it.
ROUTE_HEADER = "x-ppd-route"


@dataclass(frozen=True)
class RouteHeaders:
    """The header mutation that carries a route: set these (overwriting), remove those."""

    set: dict[str, str]
    remove: tuple[str, ...]


def route_headers(route: Route, prefill: int | None) -> RouteHeaders:
    """The headers for a plan's route (``prefill``: its prefill worker, via prefill only)."""
    headers = {ROUTE_HEADER: route.value}
    if route is Route.VIA_PREFILL:
        if prefill is None:
            raise ValueError("a via-prefill route needs its prefill worker")
        headers[PREFILL_PIN] = str(prefill)
    removed = tuple(h for h in CLIENT_ROUTING_HEADERS if h not in headers)
    return RouteHeaders(headers, removed)


def without_client_pins(body: dict) -> bool:
    """Drop the routing pins a client put in ``nvext`` (in place); True if any was there."""
    nvext = body.get("nvext")
    if not isinstance(nvext, dict):
        return False
    found = [key for key in CLIENT_ROUTING_NVEXT if key in nvext]
    for key in found:
        del nvext[key]
    return bool(found)
