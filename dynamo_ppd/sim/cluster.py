"""The simulated cluster: one `Engine` per worker, one `TransferLink` per prefill worker, and the
discrete-event loop that owns the virtual clock (the entities and events of Vidur, small).

Events are ``(time, seq, kind, payload)`` on a heap; ``seq`` grows monotonically, so events at the
same time run in the order they were scheduled and a run is deterministic. Three kinds:

- ``STEP``: an idle worker looks for work (after a submit, or when a transfer lands on it).
- ``DONE``: a worker's iteration ends; its tokens are applied and it steps again at once.
- ``CALL``: anything else at a given time (the driver's turn arrivals), a function to call.

The P -> D handoff is the live worker's: P runs the prompt as ``context_only``; when its token
is emitted at t, the KV of all prompt tokens is queued on P's link with ``ready_at=t``, and D gets
the prompt as ``generation_only`` with P's token and ``kv_ready_at`` = the link's finish time.

Most iterations are a decode worker's, and most of those change nothing that anyone else sees.
So a decode-only batch is planned as one run of iterations up to its first finished request
(`Engine.step`'s ``run``), and whatever acts on a worker or reads it first interrupts its run
(`Cluster.touch`: the iterations that ended by then are applied, the one in flight ends as
planned). Outcomes are the same as stepping every iteration; the work is a fraction of it.

No I/O here: the cluster reports each finished request to the callback it came with.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import (
    Engine,
    EngineConfig,
    EngineProfile,
    EngineRequest,
    Iteration,
    LoadSnapshot,
    RequestKind,
    TokenOutput,
    TransferLink,
)
from ..engine.handoff import decode_leg, prefill_leg, ship_prompt_kv
from ..engine.profile import TransferConstants
from .assignment import Assignment, DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    REPLICA = "replica"


_ID_PREFIX = {Role.PREFILL: "P", Role.DECODE: "D", Role.REPLICA: "A"}  # ids as records show them


def parse_config(text: str) -> tuple[int, int, int]:
    """``"1P3D"`` -> (1, 3, 0), ``"4R"`` -> (0, 0, 4), ``"1P2D1R"`` -> (1, 2, 1): counts of
    prefill, decode and replica (aggregated) workers, as the paper names its configs."""
    spec = text.strip().upper()
    if not re.fullmatch(r"(\d+[PDR])+", spec):
        raise ValueError(f"config {text!r} is not like 1P3D, 2P2D or 4R (counts of P, D, R workers)")
    counts = {"P": 0, "D": 0, "R": 0}
    for number, role in re.findall(r"(\d+)([PDR])", spec):
        counts[role] += int(number)
    p, d, r = counts["P"], counts["D"], counts["R"]
    if (p == 0) != (d == 0):
        raise ValueError(f"config {text!r}: prefill and decode workers come together (e.g. 1P3D)")
    if p + d + r == 0:
        raise ValueError(f"config {text!r} has no workers")
    return p, d, r


@dataclass(eq=False)
class Worker:
    worker_id: str
    role: Role
    engine: Engine
    link: TransferLink | None = None  # prefill workers: their outgoing KV link
    iteration: Iteration | None = None  # the iteration (or run of them) in flight, if busy
    done_seq: int | None = None  # its DONE event (an interrupted run's later one is stale)
    wake_seq: int | None = None  # the pending STEP event that counts (later ones are stale)
    wake_at: float = float("inf")
    inflight: int = 0  # requests routed here and not done with it yet
    inflight_prompt_tokens: int = 0  # their prompts' tokens (the live router's own count, `Routed`)
    inflight_inverse_outputs: float = 0.0  # the sum of 1 / their max_tokens (`Routed`)


@dataclass(eq=False)
class ClusterRequest:
    """One turn as the cluster carries it, from routing to its last token."""

    request_id: str
    conversation_id: str
    prompt: list[int] = field(repr=False)
    prompt_hashes: list[int] = field(repr=False)  # chained block ids, computed once for all engines
    max_tokens: int
    arrival_s: float
    assignment: Assignment
    on_done: Callable[[ClusterRequest], None]
    prefill: EngineRequest | None = None  # the context_only request on P (via_prefill only)
    serving: EngineRequest | None = None  # the request that emits the tokens (on D or A)
    transfer_bytes: int = 0
    transfer_s: float = 0.0  # queueing on P's link + sending

    @property
    def prefill_worker(self) -> str | None:
        return self.assignment.prefill if isinstance(self.assignment, ViaPrefill) else None

    @property
    def serving_worker(self) -> str:
        return self.assignment.worker if isinstance(self.assignment, Replica) else self.assignment.decode


class _Event(enum.IntEnum):
    CALL = 0
    STEP = 1
    DONE = 2


class Cluster:
    """Workers P0.., D0.., A0.. of one engine profile, and the clock that drives them."""

    def __init__(self, profile: EngineProfile, num_prefill: int, num_decode: int, num_replica: int = 0,
                 link_bandwidth_bytes_s: float | None = None, seed: int = 0,
                 capacity_blocks: int | None = None, link: TransferConstants | None = None,
                 decode_runs: bool = True):
        """``link`` replaces the profile's KV link (a preset); ``link_bandwidth_bytes_s`` then
        overrides its bandwidth alone (a bandwidth sweep). ``decode_runs`` False: every
        iteration is its own event (the reference that runs of iterations are tested against)."""
        if min(num_prefill, num_decode, num_replica) < 0 or num_prefill + num_decode + num_replica == 0:
            raise ValueError("a cluster needs at least one worker and no negative counts")
        self.profile = profile
        self.stack = profile.stack
        self.kv_bytes_per_token = profile.gpu_kv_bytes_per_token  # each GPU pair moves its shard at once
        constants = link or profile.transfer
        bandwidth = constants.link_bandwidth_bytes_s
        if link_bandwidth_bytes_s is not None:  # 0 or less is refused by the link, not replaced
            bandwidth = link_bandwidth_bytes_s
        setup_s = constants.transfer_setup_s
        self.link = TransferConstants(bandwidth, setup_s)  # what a transfer costs here (the truth)
        self.workers: dict[str, Worker] = {}
        index = itertools.count()
        for role, count in ((Role.PREFILL, num_prefill), (Role.DECODE, num_decode),
                            (Role.REPLICA, num_replica)):
            for i in range(count):
                worker_id = f"{_ID_PREFIX[role]}{i}"
                # A seed per worker, as independent GPUs sample (the engine also continues a decode
                # leg's stream past the prefill's token, so equal seeds would not repeat it).
                config = EngineConfig(seed=seed * 1_000_003 + next(index), capacity_blocks=capacity_blocks,
                                      every_token=False, kv_events=False)
                outgoing = TransferLink(bandwidth, setup_s) if role is Role.PREFILL else None
                self.workers[worker_id] = Worker(worker_id, role, Engine(profile, config), outgoing)
        self.block_size = profile.engine.block_size
        self.decode_runs = decode_runs
        self.events_run = 0  # events processed (what a run of iterations saves shows here)
        self.now = 0.0
        self.sessions: dict[str, str] = {}  # conversation id -> worker that decoded its last turn
        self._requests: dict[str, ClusterRequest] = {}  # in flight, by request id
        self._events: list[tuple[float, int, _Event, Any]] = []
        self._seq = itertools.count()
        self.view = ClusterView(self)

    @classmethod
    def from_config(cls, profile: EngineProfile, config: str, **kwargs: Any) -> Cluster:
        p, d, r = parse_config(config)
        return cls(profile, p, d, r, **kwargs)

    def ids(self, role: Role) -> list[str]:
        return [w.worker_id for w in self.workers.values() if w.role is role]

    # -- the clock -------------------------------------------------------------------------------
    def call_at(self, at: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` when the clock reaches ``at`` (never in the past)."""
        self._push(max(at, self.now), _Event.CALL, (fn, args))

    def run(self, until_s: float | None = None) -> float:
        """Process events in time order until none are left (or the next is after ``until_s``);
        returns the clock's final time."""
        events = self._events
        while events:
            at, seq, kind, payload = events[0]
            if until_s is not None and at > until_s:
                self.now = until_s
                break
            heapq.heappop(events)
            self.now = at
            self.events_run += 1
            if kind is _Event.DONE:
                if payload.done_seq == seq:
                    self._finish_iteration(payload, at)
            elif kind is _Event.STEP:
                if payload.wake_seq == seq:  # otherwise superseded by an earlier wake
                    payload.wake_seq, payload.wake_at = None, float("inf")
                    self._step(payload, at)
            else:
                fn, args = payload
                fn(*args)
        return self.now

    def pending_requests(self) -> int:
        """Requests dispatched and not finished (non-zero after a run stopped by ``until_s``)."""
        return len(self._requests)

    def prompt_hashes(self, tokens: list[int]) -> list[int]:
        """Chained block ids of a prompt (the same on every worker: one profile, one hasher)."""
        return self.view.prompt_hashes(tokens)

    # -- requests --------------------------------------------------------------------------------
    def dispatch(self, request: ClusterRequest) -> None:
        """Start a routed request now; raises RoutingError if its assignment cannot be executed.

        The stack's fixed costs (`StackCosts`, zero unless the profile models its stack) delay
        the request's arrival at its first worker; the routing decision is made now, on what
        the router sees at the request's arrival, as a proxy decides before it forwards."""
        assignment = request.assignment
        stack = self.stack
        if isinstance(assignment, ViaPrefill):
            prefill = self._worker(assignment.prefill, Role.PREFILL, assignment)
            decode = self._worker(assignment.decode, Role.DECODE, assignment)
            request.prefill = prefill_leg(request.request_id, request.prompt, request.prompt_hashes)
            self._submit(prefill, request.prefill, stack.request_overhead_s)
            decode.inflight += 1  # counted from now: the router has committed to it
            decode.inflight_prompt_tokens += len(request.prompt)
            decode.inflight_inverse_outputs += 1 / max(1, request.max_tokens)
        elif isinstance(assignment, (DecodeLocal, Replica)):
            delay_s = stack.request_overhead_s
            if isinstance(assignment, DecodeLocal):
                decode = self._worker(assignment.decode, Role.DECODE, assignment)
                delay_s += stack.decode_local_overhead_s
            else:
                decode = self._worker(assignment.worker, Role.REPLICA, assignment)
            request.serving = EngineRequest(request.request_id, request.prompt, request.max_tokens,
                                            RequestKind.CONTEXT_AND_GENERATION,
                                            prompt_hashes=request.prompt_hashes)
            self._submit(decode, request.serving, delay_s)
        else:
            raise RoutingError(f"a router returned {assignment!r}, which is not a ViaPrefill, DecodeLocal "
                               f"or Replica assignment")
        self._requests[request.request_id] = request
        self.sessions[request.conversation_id] = decode.worker_id

    def submit_background(self, worker_id: str, request: EngineRequest) -> None:
        """Give ``request`` straight to a worker's engine now, outside any conversation
        (background load in experiments): no callback, no route, not in ``inflight``."""
        worker = self.view._get(worker_id)
        worker.engine.submit(request, self.now)
        self._wake(worker, self.now)

    def _worker(self, worker_id: str, role: Role, assignment: Assignment) -> Worker:
        worker = self.workers.get(worker_id) if isinstance(worker_id, str) else None
        if worker is None or worker.role is not role:
            valid = ", ".join(self.ids(role)) or "none"
            raise RoutingError(f"route {assignment!r} names {worker_id!r} as a {role.value} worker; this "
                               f"cluster's {role.value} workers are: {valid}")
        return worker

    def _submit(self, worker: Worker, request: EngineRequest, delay_s: float = 0.0) -> None:
        """Hand ``request`` to the worker's engine ``delay_s`` from now (counted in its
        in-flight requests from now: the router has committed to it)."""
        worker.inflight += 1
        worker.inflight_prompt_tokens += len(request.prompt)
        worker.inflight_inverse_outputs += 1 / max(1, request.max_tokens)
        if delay_s > 0:
            self.call_at(self.now + delay_s, self._arrive, worker, request)
        else:
            self._arrive(worker, request)

    def _arrive(self, worker: Worker, request: EngineRequest) -> None:
        self.touch(worker)
        worker.engine.submit(request, self.now)
        self._wake(worker, self.now)

    # -- workers ---------------------------------------------------------------------------------
    def _wake(self, worker: Worker, at: float) -> None:
        """Make an idle worker step at ``at`` unless it already will by then. A busy worker
        steps when its iteration ends anyway."""
        if worker.iteration is not None or worker.wake_at <= at:
            return
        worker.wake_seq = self._push(at, _Event.STEP, worker)
        worker.wake_at = at

    def touch(self, worker: Worker) -> None:
        """Bring a worker's engine up to now before anything acts on it or reads it: a run of
        decode iterations in flight is cut at the iteration in flight (`Engine.interrupt`)."""
        iteration = worker.iteration
        if iteration is not None and iteration.repeated_s:
            worker.iteration = worker.engine.interrupt(iteration, self.now)
            worker.done_seq = self._push(worker.iteration.ends_at, _Event.DONE, worker)

    def _step(self, worker: Worker, now: float) -> None:
        outputs, iteration = worker.engine.step(now, run=self.decode_runs)
        if iteration is not None:
            worker.iteration = iteration
            worker.wake_seq, worker.wake_at = None, float("inf")
            worker.done_seq = self._push(iteration.ends_at, _Event.DONE, worker)
        else:
            wakeup = worker.engine.next_wakeup()
            if wakeup is not None:
                self._wake(worker, max(wakeup, now))
        self._handle(worker, outputs)

    def _finish_iteration(self, worker: Worker, now: float) -> None:
        iteration, worker.iteration = worker.iteration, None
        assert iteration is not None
        outputs = worker.engine.finish(iteration, now)
        self._handle(worker, outputs)
        self._step(worker, now)

    def _handle(self, worker: Worker, outputs: list[TokenOutput]) -> None:
        """Apply a worker's outputs: hand finished prefills to their decode worker, report
        finished requests."""
        for out in outputs:
            request = self._requests.get(out.request_id)
            if not out.finished or request is None:  # None: submitted to the engine directly
                continue  # (background load in experiments), not routed through the cluster
            worker.inflight -= 1
            worker.inflight_prompt_tokens -= len(request.prompt)
            worker.inflight_inverse_outputs = max(0.0, worker.inflight_inverse_outputs
                                                  - 1 / max(1, request.max_tokens))
            if worker.role is Role.PREFILL:
                self._hand_off(worker, request, out)
            else:
                del self._requests[out.request_id]
                request.on_done(request)

    def _hand_off(self, prefill: Worker, request: ClusterRequest, out: TokenOutput) -> None:
        """P's token is out at ``out.at``: queue the KV of all prompt tokens on P's link and give
        D the request with P's token, to be emitted when the KV lands."""
        assert prefill.link is not None and isinstance(request.assignment, ViaPrefill)
        decode = self.workers[request.assignment.decode]
        ready_at = out.at + self.stack.handoff_overhead_s
        num_bytes, _, landed = ship_prompt_kv(prefill.link, len(request.prompt), self.kv_bytes_per_token,
                                              ready_at)
        request.transfer_bytes, request.transfer_s = num_bytes, landed - ready_at
        request.serving = decode_leg(request.request_id, request.prompt, request.max_tokens,
                                     out.token_ids[0], landed, request.prompt_hashes)
        self.touch(decode)
        decode.engine.submit(request.serving, out.at)  # counted in decode.inflight since dispatch
        self._wake(decode, out.at)

    def _push(self, at: float, kind: _Event, payload: Any) -> int:
        seq = next(self._seq)
        heapq.heappush(self._events, (at, seq, kind, payload))
        return seq


class ClusterView:
    """What a router may read: per-worker load metrics, KV-cache prefix matches (what KV events
    tell Dynamo's indexer), each prefill link's backlog, and the conversations' session workers."""

    def __init__(self, cluster: Cluster):
        self._cluster = cluster
        self.prefill_workers = cluster.ids(Role.PREFILL)
        self.decode_workers = cluster.ids(Role.DECODE)
        self.replica_workers = cluster.ids(Role.REPLICA)
        self.block_size = cluster.block_size
        self._hashed: tuple[list[int], list[int]] | None = None  # (tokens, their block hashes)

    @property
    def now(self) -> float:
        return self._cluster.now

    def _get(self, worker_id: str) -> Worker:
        """The worker, brought up to now (`Cluster.touch`): a router reads what is there now."""
        worker = self._cluster.workers.get(worker_id)
        if worker is None:
            raise RoutingError(f"no worker {worker_id!r}; workers are: {', '.join(self._cluster.workers)}")
        self._cluster.touch(worker)
        return worker

    def load(self, worker_id: str) -> LoadSnapshot:
        return self._get(worker_id).engine.load()

    def inflight(self, worker_id: str) -> int:
        """Requests routed to the worker and not finished there (a router's own bookkeeping)."""
        return self._get(worker_id).inflight

    def inflight_prompt_tokens(self, worker_id: str) -> int:
        """The prompt tokens of those requests (on a prefill worker: of its prefill legs), as the
        live router counts what it routed (`dynamo_ppd.policy.placement.Routed`)."""
        return self._get(worker_id).inflight_prompt_tokens

    def inflight_inverse_outputs(self, worker_id: str) -> float:
        """The sum of 1 / max_tokens over those requests (how much a stall of their decoding
        adds to their TPOTs, per second of stall)."""
        return self._get(worker_id).inflight_inverse_outputs

    def cached_prefix_tokens(self, worker_id: str, tokens: list[int]) -> int:
        """Leading tokens of ``tokens`` whose KV blocks the worker holds (full blocks only)."""
        cache = self._get(worker_id).engine.cache
        return cache.match_blocks(self.prompt_hashes(tokens)) * cache.block_size

    def prompt_hashes(self, tokens: list[int]) -> list[int]:
        """Block ids of ``tokens``, remembered for the last list asked about: routers ask about
        the same prompt once per worker, and the cluster hashes it once more for the engines."""
        if self._hashed is None or self._hashed[0] is not tokens:
            cache = next(iter(self._cluster.workers.values())).engine.cache
            self._hashed = (tokens, cache.prefix_hashes(tokens))
        return self._hashed[1]

    def link_backlog_s(self, prefill_id: str) -> float:
        """Seconds a transfer queued now on this prefill worker's link would wait."""
        link = self._get(prefill_id).link
        if link is None:
            raise RoutingError(f"{prefill_id} is not a prefill worker; it has no outgoing KV link")
        return link.backlog_s(self._cluster.now)

    def session_decode(self, conversation_id: str) -> str | None:
        """The worker that decoded the conversation's last turn (None for a new conversation)."""
        return self._cluster.sessions.get(conversation_id)


# A router is any callable (features, view) -> assignment: the built-in ones are in `routing`, the
# peers' in `peers`, the PPD router's in `policy.simulate`. Declared beside the view it is given.
Router = Callable[[SimRequestFeatures, ClusterView], Assignment]
