"""The router's decision for one turn, as a pure function: `plan`.

The router (`router.PpdRouter`) gathers what it knows when a turn arrives into frozen views:

- `SessionView`: the conversation's session as its lookup found it (the record, or None for a new
  conversation or a fork routed by residency; its id; the turn's number);
- `WorkersView`: the live workers per role, how many leading prompt tokens each holds (the residency
  index), the loads the policy reads and this router's own counts, which placement ranks by;
- `TurnView`: the prompt's size, the expected output, the request rate, a forced route;

and `plan` returns a `Plan`: the route, the prefill and decode workers, and what the router acts
on (claim a new session in etcd; count a re-home, a session move, a residency miss). The modes:

- P/D (``pd``, ``local``, ``fraction``, ``ppd``): a follow-up stays on its session's decode worker
  when that worker is still live, else it is re-homed (through a prefill worker, to the least
  loaded decode worker); a fork goes to the decode worker holding most of its prompt; then
  `placement.place` picks the prefill worker and asks the policy for the route.
- hybrid (aggregated "replica" workers beside P/D): a conversation placed on a replica stays
  there; a new one goes to the least loaded of the replicas and the decode workers.
- ``replica``: aggregated workers only, the one holding most of the prompt, then the least busy.

No asyncio, no Dynamo, no etcd, no metrics, no clock: a test builds the views and calls `plan`.
The policy is the one stateful input (its table and online correction); `plan` only asks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..policy import placement
from ..policy.decision import Decision, Policy, RequestFeatures, Route, WorkerLoad
from .sessions import SessionRecord

_NO_STATE: placement.ClusterState[int] = placement.ClusterState((), (), {}, {}, {})


class NoWorkers(Exception):
    """No worker of a needed kind: HTTP 503."""


@dataclass(frozen=True, slots=True)
class SessionView:
    """The turn's conversation, as the session lookup (`Routing._find_session`) found it."""

    session_id: str
    turn: int  # 1-based
    record: SessionRecord | None = None  # None: a new conversation, or one routed by residency

    @property
    def by_residency(self) -> bool:
        """A follow-up without a record (a fork, or etcd away): routed to whichever decode worker
        holds most of the prompt."""
        return self.record is None and self.turn > 1


@dataclass(frozen=True, slots=True)
class WorkersView:
    """The workers as the router sees them when the turn arrives."""

    prefill: Sequence[int] = ()
    decode: Sequence[int] = ()
    replica: Sequence[int] = ()  # aggregated workers (replica mode, or hybrid beside P/D)
    # Leading prompt tokens whose KV each worker holds (full blocks: the residency index).
    cached_tokens: Mapping[int, int] = field(default_factory=dict)
    loads: Mapping[int, WorkerLoad] = field(default_factory=dict)  # what the policy reads
    routed: Mapping[int, placement.Routed] = field(default_factory=dict)  # this router's own counts
    # KV tokens each decode worker holds in all (the residency index): spreads new sessions.
    resident_tokens: Mapping[int, int] = field(default_factory=dict)

    def cached(self, worker: int) -> int:
        return self.cached_tokens.get(worker, 0)

    def requests(self, worker: int) -> int:
        """Requests this router has in flight to the worker."""
        routed = self.routed.get(worker)
        return routed.requests if routed is not None else 0


@dataclass(frozen=True, slots=True)
class TurnView:
    """The request, as far as the decision reads it."""

    prompt_tokens: int
    expected_output_tokens: int  # the request's max_tokens, else the router's default
    qps: float = 0.0  # the request rate of all router replicas
    forced: Route | None = None  # a table-building client's route (obeyed only when allowed)


@dataclass(frozen=True, slots=True)
class Plan:
    """The turn's route and workers, and what the router does about them."""

    decision: Decision
    decode: int  # the decode (or aggregated) worker
    prefill: int | None = None  # None: decode-local or replica
    claim: bool = False  # a new session: claim it in etcd (another router replica may place it too)
    rehome: bool = False  # the session's decode worker is gone: the turn moves to another one
    moved: bool = False  # a via-prefill follow-up left its hot session worker for the least loaded
    features: RequestFeatures | None = None  # what the policy decided on (P/D only: the debug line)

    @property
    def residency_miss(self) -> bool:
        """The session's decode worker no longer holds the history (evicted)."""
        return self.decision.reason == "history_evicted"


def plan(policy: Policy, session: SessionView, cluster: WorkersView, turn: TurnView, *,
         replica_mode: bool = False) -> Plan:
    """Route one turn. Raises `NoWorkers` when no worker of a kind the turn needs is live."""
    if replica_mode:
        return _replica_mode(policy, session, cluster, turn)
    if cluster.replica:
        hybrid = _hybrid(session, cluster)
        if hybrid is not None:
            return hybrid
    return _disaggregated(policy, session, cluster, turn)


def _turn_request(session: SessionView, turn: TurnView, session_decode: int | None
                  ) -> placement.TurnRequest[int]:
    record = session.record
    return placement.TurnRequest(
        decision_key=f"{session.session_id}:{session.turn}", turn=session.turn,
        prompt_tokens=turn.prompt_tokens, expected_output_tokens=turn.expected_output_tokens,
        session_decode=session_decode, history_tokens=record.context_tokens if record else 0, qps=turn.qps)


def _replica_mode(policy: Policy, session: SessionView, cluster: WorkersView, turn: TurnView) -> Plan:
    """Aggregated workers only: the one holding the longest prefix of the prompt, then the one
    with the fewest requests in flight, then the lowest id."""
    if not cluster.replica:
        raise NoWorkers("no aggregated (replica) worker is available")
    decode = max(cluster.replica, key=lambda w: (cluster.cached(w), -cluster.requests(w), -w))
    f = placement.features(_turn_request(session, turn, None), _NO_STATE, None, None)
    return Plan(policy.decide(f, 0), decode)


def _hybrid(session: SessionView, cluster: WorkersView) -> Plan | None:
    """Aggregated workers beside P/D: a conversation placed on a replica stays there (prefill and
    decode with prefix reuse, no transfers); a new one goes to the least loaded of the replicas
    and the decode workers. None: the turn goes the P/D way."""
    record = session.record
    if record is not None and record.decode_worker is not None and record.decode_worker in cluster.replica:
        return Plan(Decision(Route.REPLICA, "replica_session"), record.decode_worker)
    if record is not None:
        return None
    candidates = [*cluster.replica, *cluster.decode]
    chosen = placement.pick_decode(candidates, _placement_state(cluster, decode=candidates))
    if chosen not in cluster.replica:
        return None
    return Plan(Decision(Route.REPLICA, "hybrid_new_conversation"), chosen, claim=True)


def _disaggregated(policy: Policy, session: SessionView, cluster: WorkersView, turn: TurnView) -> Plan:
    decode_ids = cluster.decode
    if not decode_ids:
        raise NoWorkers("no decode worker is available; start one (or wait for it to register)")
    record = session.record
    session_decode = record.decode_worker if record and record.decode_worker in decode_ids else None
    if session.by_residency:
        session_decode = residency_home(cluster)
    rehome = record is not None and record.decode_worker is not None and session_decode is None
    placed = placement.place(policy, _placement_state(cluster), _turn_request(session, turn, session_decode),
                             turn.forced)
    return Plan(placed.decision, placed.decode, placed.prefill, claim=record is None, rehome=rehome,
                moved=placed.moved, features=placed.features)


def residency_home(cluster: WorkersView) -> int | None:
    """The decode worker holding the longest prefix of the prompt, then the one with the fewest
    requests in flight, then the lowest id (None: none holds any)."""
    best = max(cluster.decode, key=lambda w: (cluster.cached(w), -cluster.requests(w), -w), default=None)
    return best if best is not None and cluster.cached(best) > 0 else None


def _placement_state(cluster: WorkersView, decode: Sequence[int] | None = None
                     ) -> placement.ClusterState[int]:
    return placement.ClusterState(cluster.prefill, cluster.decode if decode is None else decode,
                                  cluster.loads, cluster.routed, cluster.cached_tokens,
                                  cluster.resident_tokens)


def served_home(record: SessionRecord, cluster: WorkersView) -> int | None:
    """The decode worker a session's history is on, when something other than the planner chose
    it (Dynamo's frontend, behind an endpoint picker that pins only prefill workers): the
    recorded worker, unless another live decode worker holds more of the prompt (the residency
    index, from the workers' KV events), which then served the last turn."""
    recorded = record.decode_worker
    if recorded is None or recorded not in cluster.decode:
        return recorded  # none yet, or gone: the plan places or re-homes the turn
    home = residency_home(cluster)
    if home is None or cluster.cached(home) <= cluster.cached(recorded):
        return recorded
    return home


def follow_up_turn(cached_on_decode: Mapping[int, int], prompt_tokens: int,
                   min_resident_fraction: float) -> int:
    """A header's turn when etcd is away (its record may exist unseen): 2, a follow-up of the
    history a decode worker holds, when one holds at least ``min_resident_fraction`` of the
    prompt; else 1, a new conversation."""
    share = max(cached_on_decode.values(), default=0) / prompt_tokens
    return 2 if share >= min_resident_fraction else 1


def rehome(policy: Policy, session: SessionView, decision: Decision, decode: int, cluster: WorkersView,
           turn: TurnView) -> Plan:
    """The turn again after a worker failed, over the workers left (``cluster``, the failed ones
    out): a replica turn goes to the least busy replica left; otherwise the turn keeps its decode
    worker if that is still live (only the prefill worker failed), else goes to the least loaded
    one, and the policy routes it as a follow-up of the history ``turn``'s prompt holds: through a
    prefill worker, or decode-local when none is left (the decode worker recomputes what it does
    not hold). ``decision``, ``decode``: the turn's route and decode worker so far."""
    if decision.route is Route.REPLICA:
        if not cluster.replica:
            raise NoWorkers("no aggregated worker is left to serve this request; start one")
        return Plan(decision, min(cluster.replica, key=lambda w: (cluster.requests(w), w)), rehome=True)
    state = _placement_state(cluster)
    if decode not in cluster.decode:
        if not cluster.decode:
            raise NoWorkers("no decode worker is available")
        decode = placement.pick_decode(cluster.decode, state)
    if not cluster.prefill:
        return Plan(Decision(Route.DECODE_LOCAL, "rehome_no_prefill_worker"), decode, rehome=True)
    prefill, _ = placement.pick_prefill(cluster.prefill, turn.prompt_tokens, state)
    request = placement.TurnRequest(
        decision_key=f"{session.session_id}:{session.turn}", turn=max(2, session.turn),
        prompt_tokens=turn.prompt_tokens, expected_output_tokens=turn.expected_output_tokens,
        session_decode=decode, history_tokens=turn.prompt_tokens, qps=turn.qps)
    routed = policy.decide(placement.features(request, state, decode, prefill),
                           history_tokens=turn.prompt_tokens)
    return Plan(Decision(routed.route, f"rehome_{routed.reason}", routed.score), decode, prefill, rehome=True)
