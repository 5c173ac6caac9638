"""The routing state the relay router and the endpoint picker share, and the turn's plan.

`Routing` keeps what a PPD router knows between turns: the residency index (KV events over NATS,
`kv_sync`), the sessions (etcd), its own loads and the workers' load reports, the request rate.
Per turn, `Routing.plan_turn` hashes the prompt, finds its session, reads the residency index and
the loads into `planner`'s views and returns the pure planner's decision as a `Turn`;
`Routing.record_turn` writes the turn to its session. Two shells wrap it:

- `relay.router.PpdRouter` (the relay, `python -m dynamo_ppd.relay`): behind Dynamo's frontend, it
  dispatches the plan to the workers itself and relays every chunk;
- `picker.Picker` (the endpoint picker, `python -m dynamo_ppd.picker`): in front of Dynamo's
  frontend, it turns the plan into the headers that pin the frontend's route, and never sees a
  token of the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..engine.blocks import dynamo_block_hasher, prefix_chain
from ..engine.profile import load_profile
from ..policy import placement
from ..policy.decision import Decision, Observed, Policy, Route, WorkerLoad
from ..policy.qps import SlidingWindowRate
from ..policy.table import bundled_table, load_table
from . import planner
from .args import RoutingConfig
from .kv_sync import KvSync
from .limits import RequestLimits, WorkerCards
from .load_reports import LoadReports
from .metrics import RoutingMetrics, debug_line
from .rate_share import RatePublisher, SharedRate
from .residency import Residency, kv_events_subject
from .sessions import (
    AUTO_PREFIX,
    FORK_SEPARATOR,
    EtcdSessions,
    SessionRecord,
    check_session_id,
    history_hashes,
    is_fork_of,
)

log = logging.getLogger("dynamo_ppd.routing")

UNREACHABLE_S = 30.0  # a worker that failed is skipped this long (Dynamo's discovery lease TTL)

class Loads:
    """What this router has in flight per worker (the live load it routes new conversations by)."""

    def __init__(self) -> None:
        self.inflight: dict[int, int] = defaultdict(int)
        self.prefill_tokens: dict[int, int] = defaultdict(int)
        self.context_tokens: dict[int, int] = defaultdict(int)
        # The sum of 1 / max_tokens of the requests in flight (who pays a stall: `predictor`).
        self.inverse_outputs: dict[int, float] = defaultdict(float)

    def add_decode(self, worker: int, prompt_tokens: int, max_tokens: int, sign: int = 1) -> None:
        """Count a request on a decode worker (``sign`` -1: its end)."""
        self.inflight[worker] = max(0, self.inflight[worker] + sign)
        self.context_tokens[worker] = max(0, self.context_tokens[worker] + sign * prompt_tokens)
        self.inverse_outputs[worker] = max(0.0, self.inverse_outputs[worker] + sign / max(1, max_tokens))

    def of(self, worker: int | None, report: dict | None = None) -> WorkerLoad:
        """This router's own count, or what the worker last reported in its forward-pass metrics
        (which include other routers' traffic), whichever is larger."""
        if worker is None:
            return WorkerLoad()
        reported_decode = reported_kv = reported_prefill = 0
        if report:
            scheduled, queued = report.get("scheduled_requests", {}), report.get("queued_requests", {})
            reported_decode = scheduled.get("num_decode_requests", 0) + queued.get("num_decode_requests", 0)
            reported_kv = scheduled.get("sum_decode_kv_tokens", 0) + queued.get("sum_decode_kv_tokens", 0)
            reported_prefill = scheduled.get("sum_prefill_tokens", 0) + queued.get("sum_prefill_tokens", 0)
        return WorkerLoad(inflight_requests=self.inflight[worker],
                          pending_prefill_tokens=max(self.prefill_tokens[worker], reported_prefill),
                          decode_requests=max(self.inflight[worker], reported_decode),
                          decode_kv_tokens=max(self.context_tokens[worker], reported_kv),
                          inverse_outputs=self.inverse_outputs[worker])

    def routed(self, worker: int) -> placement.Routed:
        """This router's own counts, which placement ranks workers by."""
        return placement.Routed(requests=self.inflight[worker], prefill_tokens=self.prefill_tokens[worker],
                                context_tokens=self.context_tokens[worker],
                                inverse_outputs=self.inverse_outputs[worker])


class Routing:
    """The state a PPD router keeps between turns and the turn's plan (see the module docstring).
    A shell calls `start`, then per request `plan_turn` (and `record_turn` when the turn's history
    is known), and `stop`.

    ``clients``: the Dynamo endpoint client per role ("prefill", "decode", "replica"); `start`
    makes them from ``runtime`` (tests pass their own and never start)."""

    def __init__(self, runtime, config: RoutingConfig, policy: Policy, metrics: RoutingMetrics,
                 clients: dict[str, Any] | None = None):
        self.runtime = runtime
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.residency = Residency(config.block_size)
        self.sessions = EtcdSessions(config.etcd_url, config.session_prefix, config.session_ttl_s,
                                     on_health=lambda up: metrics.etcd_up.set(1 if up else 0),
                                     block_size=config.block_size, max_sessions=config.max_sessions,
                                     on_evict=metrics.sessions_evicted.inc)
        self.loads = Loads()
        self.reports = LoadReports()  # latest forward-pass metrics per worker
        # The policy reads the rate of all router replicas together (each publishes its own).
        self.rate = SharedRate(SlidingWindowRate(window_s=10.0))
        self._rate_publisher = RatePublisher(self.rate, config.namespace, on_publish=metrics.set_rates)
        self.clients: dict[str, Any] = dict(clients or {})
        self._hash = dynamo_block_hasher()  # Dynamo's per-block token hash, as the workers' events carry
        self._unreachable: dict[int, float] = {}  # worker -> when a request to it last failed
        self.limits = RequestLimits()  # context window set by the service, KV capacity by cards
        self._cards: WorkerCards | None = None
        self._nats: Any = None
        self.kv_sync: KvSync | None = None
        self._table_config: str | None = None  # the live P:D configuration ("1P3D"), once seen
        self.decision_basis = ""  # what decides its turns: a table's file name, "profile" or "none"
        self._background: set[asyncio.Task] = set()  # session writes in flight
        # True behind an endpoint picker: Dynamo's frontend, not this process, picks the decode
        # worker of a turn it does not pin, so a session's home is where its history is
        # (`planner.served_home`), whatever decode worker the plan that placed it named.
        self.decode_chosen_downstream = False
        # True behind an endpoint picker too: the frontend's session affinity binds a session to
        # the prefill worker of its first turn via prefill and refuses (HTTP 400, "session X is
        # bound to worker A, not B") a later turn of it pinned to another prefill worker. So a
        # session keeps its prefill worker while that one is live and reachable
        # (`_keep_bound_prefill`).
        self.prefill_bound_downstream = False
        # Behind the picker: sessions whose last turn ran decode-local, the one route on which the
        # frontend is expected to use the planner's decode worker (`ppd_decode_divergence`).
        self._pinned_decode: OrderedDict[str, bool] = OrderedDict()
        self.last_observed: Observed | None = None  # the latest outcome's prediction error (debug line)

    async def start(self) -> None:
        import nats
        ns, cfg = self.config.workers_namespace, self.config
        components = {"prefill": cfg.prefill_component, "decode": cfg.decode_component}
        if cfg.replica_component:
            components["replica"] = cfg.replica_component
        for role, component in components.items():
            self.clients[role] = await self.runtime.endpoint(f"{ns}.{component}.generate").client()

        # Residency: live KV events, and rebuilds from the workers themselves (kv_sync).
        self.kv_sync = KvSync(self.runtime, self.residency, self.metrics, ns, components,
                                        self.clients, busy=self._serving,
                                        silent_after_s=cfg.kv_silent_after_s,
                                        recovery=cfg.residency_recovery)

        async def nats_down() -> None:
            self.metrics.nats_up.set(0)

        async def nats_up() -> None:
            self.metrics.nats_up.set(1)  # (the KV events' own connection triggers the rebuilds)

        self._nats = await nats.connect(cfg.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=1,
                                        disconnected_cb=nats_down, reconnected_cb=nats_up)
        self.metrics.nats_up.set(1)
        await self.kv_sync.start(cfg.nats_url)
        if not cfg.load_reports:
            log.info("--no-load-reports: routing by this router's own counts only")
        for component in components.values() if cfg.load_reports else ():
            try:  # the latest report per worker, kept in Rust (`load_reports`)
                from dynamo.llm import FpmEventSubscriber

                tracker = FpmEventSubscriber(self.runtime.endpoint(f"{ns}.{component}.generate"))
                tracker.start_tracking()
                self.reports.track(tracker)
            except Exception as exc:  # noqa: BLE001 (another Dynamo build: parse every report here)
                log.info("forward-pass metrics of %s over NATS in Python (%s)", component, exc)
                await self._nats.subscribe(kv_events_subject(ns, component, topic="forward-pass-metrics"),
                                           cb=self.reports.on_nats_message)
        await self.sessions.start()
        await self._rate_publisher.start(self._nats)

    def _serving(self, worker: int) -> bool:
        """The worker is serving turns now (ours, or any router's as its load reports say).
        Behind the endpoint picker only its load reports say so: the picker charges a first turn
        to the decode worker it planned, but Dynamo's frontend places that turn itself, maybe on
        another worker (a worker charged that way is not one that served turns without KV events)."""
        report = self.reports.get(worker) or {}
        scheduled = report.get("scheduled_requests") or {}
        ours = not self.decode_chosen_downstream and self.loads.inflight.get(worker, 0) > 0
        return ours or bool(scheduled.get("num_decode_requests"))

    async def stop(self) -> None:
        if self.kv_sync is not None:
            await self.kv_sync.stop()
        await self._rate_publisher.stop()
        self.reports.shutdown()
        await self.sessions.stop()  # flushes pending session writes
        if self._nats is not None:
            await self._nats.close()

    # -- a turn's plan ---------------------------------------------------------------------------
    async def plan_turn(self, request: dict, tokens: Sequence[int], forced: str | None = None,
                        lap: Callable[[str], None] | None = None,
                        known_hashes: tuple[list[int], list[int]] | None = None) -> Turn:
        """Decide the route and workers; ``forced``: a table-building client's route. The I/O
        around `planner.plan`: hash the prompt, find its session (etcd), read the residency index
        and the loads into the planner's views; then count, log and claim what the plan says.
        ``lap``: told "hashes" once the prompt is hashed (the picker's stage clock)."""
        started = time.perf_counter()
        cfg = self.config
        if known_hashes is not None and known_hashes[0]:
            # The first blocks' hashes are known (the picker's prompt memo: the same ids as an
            # earlier prompt's): only the blocks after them are hashed.
            known_local, known_chain = known_hashes
            rest = self._hash(tokens[len(known_local) * cfg.block_size:], cfg.block_size)
            local_hashes = known_local + rest
            residency_chain = known_chain + prefix_chain(rest, known_chain[-1])
        else:
            local_hashes = self._hash(tokens, cfg.block_size)
            residency_chain = prefix_chain(local_hashes)
        if lap is not None:
            lap("hashes")
        header_id = (request.get("agent_context") or {}).get("session_id")
        record, session_id, turn = await self._find_session(header_id, tokens, residency_chain)
        replica_mode = cfg.mode.value == "replica"
        cluster = (self._cluster(residency_chain, replica=self.instances("replica")) if replica_mode else
                   self._cluster(residency_chain, self.instances("prefill"), self.instances("decode"),
                                 self.instances("replica")))
        if cluster.decode:  # the policy's table for the live P:D configuration
            self._select_table(len(cluster.prefill), len(cluster.decode))
        if record is not None and self.decode_chosen_downstream:
            home = planner.served_home(record, cluster)
            if home != record.decode_worker:
                # Divergence only where the planner's worker was the frontend's to follow (a
                # decode-local turn); a turn through prefill is placed by the frontend's KV router.
                if self._pinned_decode.pop(record.session_id, False):
                    self.metrics.decode_divergence.inc()
                record = msgspec.structs.replace(record, decode_worker=home)
        stop = request.get("stop_conditions") or {}
        decided = planner.plan(
            self.policy, planner.SessionView(session_id, turn, record), cluster,
            planner.TurnView(len(tokens), stop.get("max_tokens") or cfg.default_max_tokens,
                             self.rate.rate(time.monotonic()), Route(forced) if forced else None),
            replica_mode=replica_mode)
        plan = Turn(session_id=session_id, turn=turn, prompt_tokens=len(tokens), local_hashes=local_hashes,
                     chained=residency_chain, decision=decided.decision, prefill=decided.prefill,
                     decode=decided.decode)
        if self.prefill_bound_downstream:
            self._keep_bound_prefill(plan, record, cluster.prefill)
        decision = decided.decision
        if decided.residency_miss:
            self.metrics.residency_misses.inc()
        if decided.rehome:
            self.metrics.rehomes.inc()
        if decided.moved:  # its KV comes by transfer anyway: it left the hot decode worker
            self.metrics.session_moves.inc()
        if decided.claim:
            # A new session: claim it in etcd (another router replica may be placing it right now).
            record = SessionRecord(session_id=session_id, decode_worker=plan.decode,
                                   prefill_worker=plan.prefill, last_access=time.time())
            if decision.route is Route.REPLICA:
                await self.sessions.claim(record)  # no prefill leg to overlap it with
            else:  # while the prefill runs (`_start_claim`); the decode worker is settled after it
                plan.unclaimed = record
                plan.decode_ids = list(cluster.decode)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self.metrics.count_decision(decision.route.value, "first" if turn == 1 else "follow_up",
                                    decision.reason)
        if decided.features is not None:
            debug_line(session=session_id, turn=turn, prompt_tokens=len(tokens),
                       cached_on_decode=decided.features.cached_on_decode,
                       cached_on_prefill=decided.features.cached_on_prefill, decode=plan.decode,
                       prefill=plan.prefill,
                       route=decision.route.value, reason=decision.reason, score=decision.score,
                       configuration=self._table_config, basis=self.decision_basis,
                       rehome=decided.rehome, local=decision.local, via_prefill=decision.via_prefill,
                       **_last_error(self.last_observed))
        return plan

    # -- what a turn's outcome teaches ------------------------------------------------------------
    @staticmethod
    def learns_from(plan: Turn) -> bool:
        """Whether the policy learns from this turn's TTFT and TPOT: a follow-up the policy routed
        with a prediction (turn 1 always goes through a prefill worker; a re-homed turn's timing
        includes a worker's failure). The picker observes an answer only when this holds."""
        decision = plan.decision
        return plan.turn > 1 and decision.raw is not None and not decision.reason.startswith("rehome")

    def observe_outcome(self, plan: Turn, ttft_s: float, tpot_s: float | None) -> Observed | None:
        """A turn's answer is over: its TTFT and TPOT (None: one token) on the wall clock. The
        policy learns from them (`Policy.observe`: online correction; a dilated benchmark's policy
        puts them on the model's clock first), and the metrics count the outcome and the
        prediction's error by route and calibration bucket. Both shells call this: the relay
        router for every follow-up it relays, the endpoint picker for those it samples. Returns
        what the policy reported (None for a turn it does not learn from, `learns_from`)."""
        if not self.learns_from(plan):
            return None
        observed = self.policy.observe(plan.decision, ttft_s, tpot_s)
        self.metrics.count_outcome(plan.decision.route.value, observed)
        if observed is not None:
            self.last_observed = observed
        return observed

    @staticmethod
    def _keep_bound_prefill(plan: Turn, record: SessionRecord | None, live_prefill: Sequence[int]) -> None:
        """Behind a frontend that binds a session to its prefill worker (`prefill_bound_downstream`):
        a turn via prefill goes to the session's bound worker when that one is live and reachable
        (the placement's choice otherwise only when the session has none yet). When the bound
        worker is gone or has just failed, the turn goes where placement put it, `unbound`: the
        frontend may still hold the binding to the dead worker, so the shell does not name the
        session on this turn (the frontend would refuse the pin)."""
        plan.bound_prefill = record.prefill_worker if record is not None else None
        if plan.decision.route is not Route.VIA_PREFILL or plan.bound_prefill is None:
            return
        if plan.bound_prefill in live_prefill:
            plan.prefill = plan.bound_prefill
        else:  # (placement chose among the live ones, so not the bound worker)
            plan.unbound = True

    def _cluster(self, chain: list[int], prefill: Sequence[int] = (), decode: Sequence[int] = (),
                 replica: Sequence[int] = ()) -> planner.WorkersView:
        """The planner's view of these workers: how much of the prompt (``chain``: its prefix ids)
        each holds and how much KV each decode worker holds in all (the residency index), this
        router's own counts, and the loads the policy reads (own counts merged with the workers'
        reports)."""
        bs = self.config.block_size
        disaggregated = [*prefill, *decode]
        every = [*disaggregated, *replica]
        reports = self.reports.latest(disaggregated)
        return planner.WorkersView(
            prefill, decode, replica,
            cached_tokens={w: self.residency.held_blocks(w, chain) * bs for w in every},
            loads={w: self.loads.of(w, reports[w]) for w in disaggregated},
            routed={w: self.loads.routed(w) for w in every},
            resident_tokens={w: self.residency.block_count(w) * bs for w in decode})

    def _select_table(self, prefill_workers: int, decode_workers: int) -> None:
        """Follow the live P:D configuration (workers come and go: a scale-out, a drain, a ratio
        change). ``--table auto``: the table shipped for the profile and the configuration (none:
        the engine profile's predictions), switched at once. Every mode: what decides turns now,
        as ``ppd_pd_configuration{configuration, basis}`` (1 for the current one) and on each
        decision's debug line."""
        config = f"{prefill_workers}P{decode_workers}D"
        if config == self._table_config:
            return
        previous, self._table_config = self._table_config, config
        basis = "profile" if self.policy.predictor is not None else "none"
        if self.config.table not in ("auto", "none"):
            basis = Path(self.config.table).name  # a fixed table, whatever the configuration
        elif self.config.table == "auto" and self.policy.predictor is not None:
            path = bundled_table(config)
            table = None
            if path.is_file():
                table = load_table(path)
                if table.profile != load_profile(self.config.profile).name:
                    table = None
            self.policy.set_table(table)
            basis = path.name if table is not None else "profile"
        self.decision_basis = basis
        self.metrics.set_configuration(config, basis)
        log.info("P:D configuration %s%s: deciding with %s", config,
                 f" (was {previous})" if previous else "",
                 f"table {basis}" if basis not in ("profile", "none") else
                 "the engine profile's predictions" if basis == "profile" else "the mode's fixed rule")

    def instances(self, role: str) -> list[int]:
        """The live instances of a role, less those that just failed: a SIGKILLed worker stays in
        Dynamo's discovery until its lease expires (30 s in 1.6.1), and every turn sent there
        meanwhile would fail its connect first (cheap on loopback, seconds to a dead pod's IP). If
        every listed instance failed lately, all are tried again rather than none."""
        client = self.clients.get(role)
        if client is None:
            return []
        ids = client.instance_ids()
        if not self._unreachable:
            return ids
        now = time.monotonic()
        for worker, since in list(self._unreachable.items()):
            if now - since > UNREACHABLE_S:
                del self._unreachable[worker]
        reachable = [w for w in ids if w not in self._unreachable]
        return reachable or ids

    def mark_unreachable(self, worker: int) -> None:
        """A request to ``worker`` just failed: leave it out of plans for `UNREACHABLE_S`
        (see `instances`). The relay router calls this when a worker fails under it, the picker
        when the gateway reports a 5xx for a turn it pinned there."""
        self._unreachable[worker] = time.monotonic()

    async def _find_session(self, header_id: str | None, tokens: Sequence[int], chain: list[int]
                            ) -> tuple[SessionRecord | None, str, int]:
        """The turn's session: (its record, None for a new one; its id; the turn's number).

        Without a header: the session whose whole history the prompt continues, else a new one.
        With header X: X's record (from etcd when this replica has not seen it yet: another
        replica may have recorded the previous turn a moment ago) when the prompt continues its
        history; else the prompt is another conversation under X's id (a spoofed or reused id, an
        edited or regenerated turn): a fork ``X#...`` whose history it continues, else a new fork.
        A new fork has no record (X's is never touched, so X's owner keeps its decode worker and
        its next turn matches) and is routed by residency, as a follow-up of whatever history the
        decode workers hold (turn X's + 1: the number the client implied); its own record is then
        written under the fork's id, where its next turn finds it. A header nobody has recorded
        is a new conversation, unless etcd is away (then residency decides: see below).
        Record None with turn > 1: route by residency."""
        check_session_id(header_id)
        if header_id is None:
            record = self.sessions.find_by_prefix(chain, tokens)
            if record is None:
                return None, f"{AUTO_PREFIX}{uuid.uuid4().hex}", 1
            return record, record.session_id, record.turn + 1
        record = self.sessions.get(header_id)
        held: dict[int, int] | None = None
        if record is None:
            # Unseen here. Another replica may have recorded its previous turn a moment ago
            # (etcd's watch not yet delivered): then a decode worker holds most of the prompt.
            # A prompt no decode worker holds much of is a first turn: no etcd round trip for it
            # (2-3 ms of every new conversation's TTFT).
            held = dict(self._cluster(chain, decode=self.instances("decode")).cached_tokens)
            if planner.follow_up_turn(held, len(tokens), self.config.min_resident_fraction) > 1:
                record = await self.sessions.read_through(header_id)
        if record is None:
            if self.sessions.healthy:
                return None, header_id, 1  # etcd has no such session: a new conversation
            # etcd is away, so another replica's record of it may exist unseen: when a decode
            # worker holds most of the prompt, this is a follow-up of the history it holds.
            assert held is not None
            turn = planner.follow_up_turn(held, len(tokens), self.config.min_resident_fraction)
            return None, header_id, turn
        if self.sessions.table.continues(record, chain, tokens):
            return record, header_id, record.turn + 1
        self.metrics.session_forks.inc()
        fork = self.sessions.find_by_prefix(chain, tokens, accept=lambda s: is_fork_of(s, header_id))
        if fork is not None:
            return fork, fork.session_id, fork.turn + 1
        return None, f"{header_id}{FORK_SEPARATOR}{uuid.uuid4().hex[:12]}", record.turn + 1

    async def record_turn(self, plan: Turn, prompt: list[int], output: list[int]) -> None:
        """The turn is done: its decode worker now holds prompt + output; remember that."""
        record = self._record(plan, prompt, output)
        # In etcd before the answer's stream ends (unless etcd is slow: `commit`), so a follow-up
        # the client sends to another router replica finds it there; this costs end-of-stream
        # latency, not TTFT.
        await self.sessions.commit(record)
        self.metrics.sessions_active.set(len(self.sessions.table))

    def record_routed(self, plan: Turn, prompt: list[int]) -> None:
        """The turn is routed and its answer will not be seen (the endpoint picker): its decode
        worker will hold the prompt (the next prompt repeats the answer). In the local table now,
        in etcd with the next write-behind batch (`EtcdSessions.record_later`): nothing on the
        request's path waits for etcd, and the follow-up comes seconds later."""
        self.sessions.record_later(self._record(plan, prompt, []))
        self.metrics.sessions_active.set(len(self.sessions.table))
        if self.decode_chosen_downstream:
            self._pinned_decode.pop(plan.session_id, None)
            if plan.decision.route is Route.DECODE_LOCAL:
                self._pinned_decode[plan.session_id] = True
                while len(self._pinned_decode) > self.config.max_sessions:
                    self._pinned_decode.popitem(last=False)

    def _record(self, plan: Turn, prompt: list[int], output: list[int]) -> SessionRecord:
        history = prompt + output if output else prompt
        bs = self.config.block_size
        known = len(plan.local_hashes)
        if output or plan.chained is None:
            # The history's blocks: the prompt's full blocks, then those the output completed.
            local = plan.local_hashes + self._hash(history[known * bs:len(history) // bs * bs], bs)
            chain = prefix_chain(local)
        else:
            chain = plan.chained  # the prompt's own prefix ids, computed when it was planned
        history_hash, digest = history_hashes(chain, history, bs)
        prefill = plan.prefill
        if self.prefill_bound_downstream and (plan.decision.route is not Route.VIA_PREFILL or plan.unbound):
            prefill = plan.bound_prefill  # the frontend's binding did not change
        return SessionRecord(session_id=plan.session_id, decode_worker=plan.decode,
                             prefill_worker=prefill, turn=plan.turn, context_tokens=len(history),
                             history_hash=history_hash, history_digest=digest, last_access=time.time())


def _last_error(observed: Observed | None) -> dict[str, Any]:
    """The latest prediction error, as fields of the decision's debug line (none before one)."""
    if observed is None:
        return {}
    tpot = None if observed.tpot_error is None else round(observed.tpot_error, 3)
    return {"last_error": {"route": observed.route.value, "bucket": observed.bucket or "all",
                           "ttft": round(observed.ttft_error, 3), "tpot": tpot}}


@dataclass
class Turn:
    """One turn in flight: its session, route and workers (`planner.Plan`'s to start with; a
    re-home or a settled claim changes them), the state the streaming code reads and updates."""

    session_id: str
    turn: int
    prompt_tokens: int
    local_hashes: list[int]  # Dynamo's per-block token hashes of the prompt
    chained: list[int] | None  # prefix ids (`blocks.prefix_chain`) of the prompt's full blocks
    decision: Decision = Decision(Route.VIA_PREFILL, "undecided")
    prefill: int | None = None
    decode: int = 0  # the decode (or aggregated) worker
    unclaimed: SessionRecord | None = None  # a new session to claim once a request is sent
    claim: asyncio.Task | None = None  # that claim, under way; settled before decode
    decode_ids: list[int] = field(default_factory=list)
    bound_prefill: int | None = None  # the session's prefill worker before this turn (`_keep_bound_prefill`)
    unbound: bool = False  # via a prefill worker other than the session's, which is gone
