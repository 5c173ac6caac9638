"""Run conversations through a simulated cluster and summarize them (`dynamo-ppd sim run` is its
command line, in `dynamo_ppd.cli.sim`).

The driver plays the users and the router: each conversation's first turn arrives at its
arrival time, every later turn ``think_time_s`` after the previous one finished (a closed loop
per conversation). When a turn arrives, its prompt is built from the history the engine really
generated, the router picks a route from `SimRequestFeatures` and the `ClusterView`, and the cluster
runs it. One `RequestRecord` per finished turn; the turns still running when the run ends are
kept too (`InFlightTurn`), so that the outcome (`dynamo_ppd.sim.outcome`) counts every turn sent.

With a ``timeout_s``, a turn not answered within it fails and its conversation sends no further
turn, as the paper's client does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from .assignment import SimRequestFeatures, ViaPrefill, route_name
from .cluster import Cluster, ClusterRequest, Router
from .conversation import Conversation, ConversationPrompts
from .outcome import Outcome, TurnResult, summarize


class RequestRecord(msgspec.Struct, frozen=True):
    """One finished turn. ``cached_tokens`` is what the worker that ran the prompt's prefill
    reported reusing (P for via_prefill, as Dynamo forwards P's prompt_tokens_details; else the
    decode or aggregated worker); ``transfer_s`` is queueing on P's link plus sending."""

    conversation_id: str
    turn: int
    route: str  # via_prefill | decode_local | aggregated
    prefill_worker: str | None
    decode_worker: str
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    arrival_s: float
    first_token_s: float
    finished_s: float
    ttft_s: float
    tpot_s: float | None  # None for a single output token
    output_tokens: int
    transfer_bytes: int
    transfer_s: float

    def turn_result(self) -> TurnResult:
        return TurnResult(self.conversation_id, self.turn, self.arrival_s, self.ttft_s,
                          self.finished_s - self.arrival_s, self.output_tokens)


class InFlightTurn(msgspec.Struct, frozen=True):
    """A turn sent and not finished when the run ended (cut by ``until_s``, or given up on)."""

    conversation_id: str
    turn: int
    arrival_s: float

    def turn_result(self) -> TurnResult:
        return TurnResult(self.conversation_id, self.turn, self.arrival_s, None, None, 0)


@dataclass
class SimResult:
    records: list[RequestRecord]  # finished turns
    simulated_s: float  # the virtual clock at the end
    wall_s: float  # real seconds the run took
    in_flight: list[InFlightTurn] = field(default_factory=list)  # sent, not finished at the end
    timeout_s: float | None = None  # the deadline the run gave each turn (None: none)

    @property
    def unfinished(self) -> int:
        """Turns routed but not finished when the run stopped."""
        return len(self.in_flight)

    def turn_results(self) -> list[TurnResult]:
        """Every turn sent, finished or not, as the outcome summary takes them."""
        return [r.turn_result() for r in self.records] + [t.turn_result() for t in self.in_flight]

    def outcome(self) -> Outcome:
        """The run's outcome under the timeout it ran with (`dynamo_ppd.sim.outcome`)."""
        return summarize(self.turn_results(), self.timeout_s,
                         cut_s=self.simulated_s if self.in_flight else None)

    def speed(self) -> float:
        """Simulated seconds per wall second."""
        return self.simulated_s / self.wall_s if self.wall_s else float("inf")

    def route_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.route] = counts.get(r.route, 0) + 1
        return counts

    def local_share(self) -> float:
        """Share of finished follow-ups that ran decode-local."""
        follow = [r for r in self.records if r.turn > 1]
        return sum(r.route == "decode_local" for r in follow) / max(1, len(follow))

    def summary(self) -> dict[str, object]:
        return {"outcome": self.outcome(), "finished": len(self.records), "in_flight_at_end": self.unfinished,
                "routes": self.route_counts(), "simulated_s": self.simulated_s,
                "wall_s": self.wall_s, "simulated_s_per_wall_s": self.speed()}


class _Conversation:
    """A conversation in progress: its prompts, the turn it is on, the turn it has in flight."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        self.prompts = ConversationPrompts(conversation)
        self.next_turn = 0  # index into conversation.turns
        self.in_flight: InFlightTurn | None = None
        self.over = False  # every turn answered, or one failed (no further turn is sent)


# How often (simulated seconds) a run with a timeout checks whether every conversation is over.
_CHECK_EVERY_S = 1.0


class _Driver:
    def __init__(self, cluster: Cluster, router: Router,
                 on_finish: Callable[[RequestRecord], None] | None = None, timeout_s: float | None = None,
                 max_connections: int | None = None):
        self.cluster = cluster
        self.router = router
        self.on_finish = on_finish
        self.timeout_s = timeout_s
        self.records: list[RequestRecord] = []
        self.conversations: list[_Conversation] = []
        # The client's connection pool: conversations holding a connection, and those waiting.
        self.max_connections = max_connections
        self.connected: set[_Conversation] = set()
        self.waiting: collections.deque[_Conversation] = collections.deque()

    def arrive(self, conv: _Conversation) -> None:
        """A conversation's first turn is sent: it takes a connection, or waits for one (the
        wait counts in its TTFT and its timeout, as the client's clock started at the send)."""
        conversation = conv.conversation
        # Sent, as far as the client is concerned: it fails if its deadline passes first, also
        # while it waits for a connection.
        conv.in_flight = InFlightTurn(conversation.conversation_id, 1, conversation.arrival_s)
        if self.timeout_s is not None:
            self.cluster.call_at(conversation.arrival_s + self.timeout_s, self.give_up, conv, 1)
        if self.max_connections is None or len(self.connected) < self.max_connections:
            self.connected.add(conv)
            self.start_turn(conv)
        else:
            self.waiting.append(conv)

    def end(self, conv: _Conversation) -> None:
        """The conversation is over (answered, or given up): its connection goes to the
        conversation that has waited longest."""
        conv.over = True
        if conv in self.connected:
            self.connected.discard(conv)
            # Only a pool with a limit ever has conversations waiting.
            while self.waiting and len(self.connected) < (self.max_connections or 0):
                waiting = self.waiting.popleft()
                if not waiting.over:
                    self.connected.add(waiting)
                    self.start_turn(waiting)

    def give_up(self, conv: _Conversation, turn: int) -> None:
        """The turn's deadline passed: if it is still unanswered the client drops it (and its
        connection) and sends no further turn."""
        if not conv.over and conv.in_flight is not None and conv.in_flight.turn == turn:
            self.end(conv)

    def start_turn(self, conv: _Conversation) -> None:
        cluster, view = self.cluster, self.cluster.view
        # A first turn that waited for a connection was sent at its arrival: TTFT counts from it.
        sent_at = conv.conversation.arrival_s if conv.next_turn == 0 else cluster.now
        conversation = conv.conversation
        turn = conversation.turns[conv.next_turn]
        conv.next_turn += 1
        prompt, new_tokens = conv.prompts.next_prompt(turn)
        session = view.session_decode(conversation.conversation_id)
        features = SimRequestFeatures(
            conversation_id=conversation.conversation_id, turn=conv.next_turn, prompt_tokens=len(prompt),
            new_tokens=new_tokens, max_tokens=turn.max_tokens, decode_worker=session,
            cached_on_decode=view.cached_prefix_tokens(session, prompt) if session else 0,
            now=cluster.now, token_ids=prompt)
        assignment = self.router(features, view)
        cluster.dispatch(ClusterRequest(
            f"{conversation.conversation_id}/{conv.next_turn}", conversation.conversation_id, prompt,
            cluster.prompt_hashes(prompt), turn.max_tokens, sent_at, assignment,
            functools.partial(self.finish_turn, conv, features)))
        conv.in_flight = InFlightTurn(conversation.conversation_id, conv.next_turn, sent_at)
        if self.timeout_s is not None and conv.next_turn > 1:  # turn 1's deadline is set at arrival
            cluster.call_at(sent_at + self.timeout_s, self.give_up, conv, conv.next_turn)

    def finish_turn(self, conv: _Conversation, features: SimRequestFeatures, request: ClusterRequest) -> None:
        serving = request.serving
        assert serving is not None and serving.first_token_at is not None and serving.finished_at is not None
        outputs = len(serving.output)
        reporter = request.prefill if isinstance(request.assignment, ViaPrefill) else serving
        assert reporter is not None
        conv.in_flight = None
        self.records.append(RequestRecord(
            conversation_id=features.conversation_id, turn=features.turn,
            route=route_name(request.assignment), prefill_worker=request.prefill_worker,
            decode_worker=request.serving_worker,
            prompt_tokens=features.prompt_tokens, cached_tokens=reporter.cached_tokens,
            new_tokens=features.new_tokens, arrival_s=request.arrival_s,
            first_token_s=serving.first_token_at, finished_s=serving.finished_at,
            ttft_s=serving.first_token_at - request.arrival_s,
            tpot_s=(serving.finished_at - serving.first_token_at) / (outputs - 1) if outputs > 1 else None,
            output_tokens=outputs, transfer_bytes=request.transfer_bytes, transfer_s=request.transfer_s))
        if self.on_finish:
            self.on_finish(self.records[-1])
        if self.timeout_s is not None and serving.finished_at - request.arrival_s > self.timeout_s:
            self.end(conv)  # the user gave up on this turn: no further turn
            return
        conv.prompts.record_output(serving.output)
        turns = conv.conversation.turns
        if conv.next_turn < len(turns):
            self.cluster.call_at(self.cluster.now + turns[conv.next_turn].think_time_s, self.start_turn, conv)
        else:
            self.end(conv)

    def settled(self) -> bool:
        """Every conversation is over (answered, or given up at its deadline by `give_up`):
        nothing that happens from now on changes the outcome."""
        return all(c.over for c in self.conversations)


@contextlib.contextmanager
def _fewer_collections():
    """Collect cyclic garbage less often while a simulation runs. It allocates millions of
    short-lived objects (requests, iterations, token lists); at CPython's default thresholds the
    collector ran a full collection, over every token list alive, every second or so: a tenth of
    `sim compare`'s CPU time (measured on 2026-12-04). Garbage is still collected, in bigger
    batches, and the thresholds are restored after the run."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate(cluster: Cluster, conversations: list[Conversation], router: Router,
             until_s: float | None = None,
             on_finish: Callable[[RequestRecord], None] | None = None,
             timeout_s: float | None = None, max_connections: int | None = None) -> SimResult:
    """Run ``conversations`` on ``cluster`` (fresh: its clock at 0) with ``router`` until every
    conversation is over, or until the virtual clock passes ``until_s``. Deterministic for a given
    cluster seed and workload; only ``wall_s`` depends on the machine. ``on_finish`` sees each
    finished turn's record (a router that learns from outcomes, as the live one does).

    ``timeout_s``: a turn whose answer is not complete within it of the turn's arrival fails,
    and its conversation sends no further turn (the paper's client; None: never give up). The
    engine is not told: it goes on computing the turn to its end. vLLM would abort a request
    whose HTTP client disconnected, freeing its batch slot and KV earlier; we keep the
    simpler, pessimistic model (the late turn keeps loading its worker), which only matters
    once a run is already timing out. The run stops as soon as every conversation is over or has
    given up (checked every simulated second), so such leftovers do not prolong it.

    ``max_connections``: the client's connection pool (the paper's client: 50). A conversation
    holds one connection from its first turn to its end; a conversation arriving while all are
    taken waits for one, and its first turn's TTFT and deadline count from its arrival."""
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, not {max_connections}")
    driver = _Driver(cluster, router, on_finish, timeout_s, max_connections)
    for conversation in sorted(conversations, key=lambda c: (c.arrival_s, c.conversation_id)):
        if conversation.turns:
            conv = _Conversation(conversation)
            driver.conversations.append(conv)
            cluster.call_at(conversation.arrival_s, driver.arrive, conv)
    started = time.perf_counter()
    end = cluster.now
    with _fewer_collections():
        while True:
            stop = end + _CHECK_EVERY_S if until_s is None else min(end + _CHECK_EVERY_S, until_s)
            end = cluster.run(stop)
            if end < stop or (until_s is not None and end >= until_s) or driver.settled():
                break  # no events left, the clock reached until_s, or the outcome is decided
    wall = time.perf_counter() - started
    records = sorted(driver.records, key=lambda r: (r.arrival_s, r.conversation_id, r.turn))
    in_flight = sorted((c.in_flight for c in driver.conversations if c.in_flight is not None),
                       key=lambda t: (t.arrival_s, t.conversation_id, t.turn))
    return SimResult(records, end, wall, in_flight, timeout_s)
