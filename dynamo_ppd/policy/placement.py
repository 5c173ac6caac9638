"""Where a turn runs: the prefill and decode workers, and the policy's route between them.

One pure function set for the live router (`dynamo_ppd.relay.router`) and the simulator's PPD
router (`dynamo_ppd.policy.simulate.PolicyRouter`), so the simulator tunes what the router runs.
Each caller gathers the same state (the router from its residency index, its own bookkeeping
and the workers' load reports; the simulator from its `ClusterView`) into a `ClusterState`, and
`place` does the rest:

- prefill worker (`pick_prefill`): the least work for this prompt, the prompt tokens it does not
  hold plus those already routed there and not yet prefilled (KV overlap and load, as Dynamo's
  KV router weighs them);
- a new conversation's decode worker (`pick_decode`): the fewest requests in flight, then the
  least context, then the lowest id;
- the policy's decision (`Policy.decide`) on `RequestFeatures` assembled from those workers;
- a follow-up stays on its session's decode worker, unless it goes through a prefill worker and
  that worker is clearly hotter than the least loaded one (`moves_to_best`): its KV comes by
  transfer anyway.

No I/O, no clock. Worker ids are whatever the caller uses (Dynamo instance ids, simulator names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .decision import Decision, Policy, RequestFeatures, Route, WorkerLoad, moves_to_best

W = TypeVar("W", int, str)  # a worker id: the router's Dynamo instance ids, the simulator's names


@dataclass(frozen=True, slots=True)
class Routed:
    """What this router has sent a worker and not yet seen end (its own bookkeeping, counted from
    the moment it routes: a burst of new conversations must not all land on one worker before
    any has reached it)."""

    requests: int = 0  # requests in flight to the worker
    prefill_tokens: int = 0  # prompt tokens whose prefill leg there has not ended
    context_tokens: int = 0  # the prompt tokens of the requests in flight there
    # The sum of 1 / max_tokens of the requests in flight there: a second's stall of their
    # decoding adds that much to the sum of their TPOTs (`predictor`: who pays an append).
    inverse_outputs: float = 0.0


@dataclass(frozen=True)
class ClusterState(Generic[W]):
    """The workers as one router sees them when a turn arrives."""

    prefill_workers: Sequence[W]
    decode_workers: Sequence[W]
    loads: Mapping[W, WorkerLoad]  # what the policy reads (own counts merged with reports)
    routed: Mapping[W, Routed]  # what placement ranks by
    cached_tokens: Mapping[W, int]  # leading prompt tokens whose KV each worker holds (full blocks)
    # Tokens of KV each worker holds in all (its sessions' histories, idle or not): where new
    # sessions go when the active load ties (an idle fleet), so histories spread out.
    resident_tokens: Mapping[W, int] = field(default_factory=dict)

    def load(self, worker: W | None) -> WorkerLoad:
        return self.loads.get(worker, WorkerLoad()) if worker is not None else WorkerLoad()

    def routed_to(self, worker: W) -> Routed:
        return self.routed.get(worker, Routed())

    def cached(self, worker: W | None) -> int:
        return self.cached_tokens.get(worker, 0) if worker is not None else 0


@dataclass(frozen=True, slots=True)
class TurnRequest(Generic[W]):
    """The turn, as the router knows it once it has found the conversation's session."""

    decision_key: str  # session and turn (the fraction mode's coin is fixed per key)
    turn: int  # 1-based
    prompt_tokens: int
    expected_output_tokens: int
    session_decode: W | None  # the conversation's live decode worker (None: new, or gone)
    history_tokens: int  # what the conversation sent and received before (0 without a session)
    qps: float  # the request rate the router sees


@dataclass(frozen=True, slots=True)
class Placement(Generic[W]):
    decision: Decision
    prefill: W | None  # None: no prefill worker (the route is then decode-local)
    decode: W
    moved: bool  # a via-prefill follow-up left its hot session worker for the least loaded one
    features: RequestFeatures  # what the policy decided on


def pick_prefill(candidates: Sequence[W], prompt_tokens: int, state: ClusterState[W]) -> tuple[W | None, int]:
    """(worker, prompt tokens it holds): the least work for this prompt, the tokens it does not
    hold plus the prompt tokens already routed there and not yet prefilled; ties to the lowest
    id. (None, 0) without candidates."""
    if not candidates:
        return None, 0

    def cost(worker: W) -> tuple[int, W]:
        return prompt_tokens - state.cached(worker) + state.routed_to(worker).prefill_tokens, worker

    best = min(candidates, key=cost)
    return best, state.cached(best)


def pick_decode(candidates: Sequence[W], state: ClusterState[W]) -> W:
    """A new conversation's decode worker (also a via-prefill follow-up's if its own is hot): the
    fewest requests in flight (this router's count or the worker's report, the larger), then the
    least context routed there, then the least KV held in all (the sessions that live there, idle
    or not), then the lowest id (never by hash)."""
    if not candidates:
        raise ValueError("no decode worker to place the turn on")

    def key(worker: W) -> tuple[int, int, int, W]:
        # Requests: what this router sent there or what the worker reports running, whichever is
        # larger (as `Loads.of` merges them), so that work it did not send (another replica's, a
        # background job's) keeps new conversations away too. Context: the prompts it routed
        # there, not the worker's KV, which grows as it answers (ranking by that sent the
        # simulator's conversations elsewhere than the live router's, docs/bench/dilation.md).
        # KV held: on an idle fleet (nothing in flight) the lowest id took every new session,
        # and their follow-ups later decoded in one crowded batch.
        routed = state.routed_to(worker)
        return (max(routed.requests, state.load(worker).decode_requests), routed.context_tokens,
                state.resident_tokens.get(worker, 0), worker)

    return min(candidates, key=key)


def features(request: TurnRequest[W], state: ClusterState[W], decode: W | None, prefill: W | None,
             best_decode: W | None = None) -> RequestFeatures:
    """What the policy decides on: the turn, what ``decode`` (the session's worker) and
    ``prefill`` hold of the prompt and their loads, and the least loaded decode worker's."""
    return RequestFeatures(
        decision_key=request.decision_key, turn=request.turn, prompt_tokens=request.prompt_tokens,
        cached_on_decode=state.cached(decode), cached_on_prefill=state.cached(prefill),
        expected_output_tokens=request.expected_output_tokens, has_session_decode=decode is not None,
        decode_load=state.load(decode), prefill_load=state.load(prefill), qps=request.qps,
        best_decode_load=state.load(best_decode) if best_decode is not None else None,
        prefill_workers=max(1, len(state.prefill_workers)), decode_workers=max(1, len(state.decode_workers)))


def place(policy: Policy, state: ClusterState[W], request: TurnRequest[W],
          forced: Route | None = None) -> Placement[W]:
    """The turn's workers and route. ``forced``: a table-building client's route for a follow-up
    that has a session worker (the router obeys it only with ``--allow-forced-route``)."""
    session = request.session_decode
    prefill, _ = pick_prefill(state.prefill_workers, request.prompt_tokens, state)
    best = pick_decode(state.decode_workers, state)
    f = features(request, state, session, prefill, best)
    decision = policy.decide(f, history_tokens=request.history_tokens if session is not None else 0)
    if forced is not None and session is not None and request.turn > 1:
        decision = Decision(forced, "forced")
    if decision.route is Route.VIA_PREFILL and prefill is None:
        # No prefill worker (all gone, or restarting): a decode worker prefills the whole prompt
        # itself (the bypass contract), slower than PD but an answer, not a 503.
        decision = Decision(Route.DECODE_LOCAL, "no_prefill_worker")
    moved = (decision.route is Route.VIA_PREFILL and session is not None and f.best_decode_load is not None
             and moves_to_best(f.decode_load, f.best_decode_load))
    decode = best if session is None or moved else session
    return Placement(decision, prefill, decode, moved, f)
