"""How the endpoint picker expresses a turn's route to Dynamo's frontend: request headers.

Pure: a plan's route in, the headers to set and to remove out. Dynamo's frontend reads two
routing headers, decimal instance ids (``HEADER_WORKER_INSTANCE_ID =
"x-dynamo-worker-instance-id"``, ``HEADER_PREFILL_INSTANCE_ID = "x-dynamo-prefill-instance-id"``
and their unprefixed aliases and data-parallel ranks in `nvext.rs` of ai-dynamo/dynamo's llm
crate; Dynamo 1.6.1's behaviour with the two prefixed ones was tried live, issue 26), and the body's
``nvext`` carries the same pins (``backend_instance_id``, ``prefill_worker_id``,
``decode_worker_id``), which the headers override.

The choice (measured in docs/bench/picker.md):

- **every turn** carries ``x-dynamo-session-id`` set to the conversation as the planner knows it
  (the client's id, a fork's own id, or the id the picker gave a headerless conversation). The
  frontend runs with soft session affinity (``--router-session-affinity-mode soft``): its KV
  router prefers the decode worker the session is bound to (where its first turn went), so a
  follow-up finds its history even when other decode workers hold a long shared system prompt
  and are less loaded; and unlike a pin, or hard affinity, the preference does not hold when that
  worker is gone, so Dynamo's migration can continue an answer elsewhere.
- **via prefill**: pin the prefill worker only. The frontend runs the prefill there, then its KV
  router picks the decode worker (the session's, or the least loaded for a new conversation).
- **decode-local**: no pin. The frontend's KV router picks the session's decode worker, and its
  conditional disaggregation, configured to bypass the prefill worker whenever the chosen worker
  holds any of the prompt (``isl_bounding`` with an unreachable ISL threshold and a ratio of 1.0),
  makes the turn an append-prefill there. If the chosen worker holds none of it, the turn goes
  through a prefill worker instead of failing.

A decode pin (``x-dynamo-worker-instance-id``) is never sent: a pinned turn whose decode worker
dies mid-answer ends in an error event, and a pin to a worker holding none of the prompt is a 400
(both tried on Dynamo 1.6.1, issue 26); hard affinity fails the same way (chaos decode-kill: 6
failed and 10 truncated of 104), and no affinity at all let the KV router move 27-38% of
follow-ups sharing a 1,500-token system prompt to another decode worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
# The headers Dynamo 1.6.1's frontend takes a session id from, in its priority
# (lib/llm/src/protocols/agents.rs ``agent_context_header_values``, observed on the 1.6.1 wheel):
# its own; Claude Code's (X-Claude-Code-Session-Id on every request, a subagent's
# x-claude-code-agent-id first: the subagent has its own context); Codex's thread-id; opencode's
# x-session-id. Codex releases that send only ``session_id`` are not read by Dynamo either.
AGENT_SESSION_HEADERS = (SESSION_HEADER, "x-claude-code-agent-id", "x-claude-code-session-id", "thread-id",
                         "x-session-id")
# The picker's route, for logs and the benchmarks' per-turn accounting; Dynamo ignores it.
ROUTE_HEADER = "x-ppd-route"


@dataclass(frozen=True)
class RouteHeaders:
    """The header mutation that carries a route: set these (overwriting), remove those."""

    set: dict[str, str]
    remove: tuple[str, ...]


def route_headers(route: Route, prefill: int | None, session_id: str | None = None) -> RouteHeaders:
    """The headers for a plan's route (``prefill``: its prefill worker, via prefill only;
    ``session_id``: the conversation as the planner knows it, which keys the frontend's session
    affinity: headerless conversations get one, a fork gets its own)."""
    headers = {ROUTE_HEADER: route.value}
    if session_id is not None:
        headers[SESSION_HEADER] = session_id
    if route is Route.VIA_PREFILL:
        if prefill is None:
            raise ValueError("a via-prefill route needs its prefill worker")
        headers[PREFILL_PIN] = str(prefill)
    removed = tuple(h for h in CLIENT_ROUTING_HEADERS if h not in headers)
    if session_id is None:
        # Unnamed on purpose (its prefill worker is gone, `Routing._keep_bound_prefill`): the
        # client's own session headers go too, or the frontend would bind the turn by them to
        # the dead worker and refuse it (HTTP 400 "session ... is bound to worker A, not B").
        removed += AGENT_SESSION_HEADERS
    return RouteHeaders(headers, removed)


def session_from_headers(headers: Mapping[str, str], names: Sequence[str] = AGENT_SESSION_HEADERS
                         ) -> str | None:
    """The conversation a request names: the first of ``names`` (lower case) present and not empty
    in ``headers`` (lower-cased keys, as the gateway sends them), else None."""
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


def without_client_pins(body: dict) -> bool:
    """Drop the routing pins a client put in ``nvext`` (in place); True if any was there."""
    nvext = body.get("nvext")
    if not isinstance(nvext, dict):
        return False
    found = [key for key in CLIENT_ROUTING_NVEXT if key in nvext]
    for key in found:
        del nvext[key]
    return bool(found)
