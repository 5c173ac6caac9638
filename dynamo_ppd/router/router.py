"""The PPD router component: Dynamo I/O around the pure policy.

Per request: find the conversation's session (header, else longest known prefix), ask the
residency index how much of the prompt its decode worker (D) and each prefill worker (P) hold,
decide with the policy, dispatch (via P then D, or decode-local on D), stream the answer, and
record the turn in the session. Workers that vanish are routed around: a gone D re-homes the
turn through a P to another D; a gone P makes the turn decode-local when D holds the prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION
from ..engine.profile import load_profile
from ..policy import placement
from ..policy.decision import Decision, Policy, Route, WorkerLoad
from ..policy.qps import SlidingWindowRate
from ..policy.table import bundled_table, load_table
from . import dispatch
from .args import RouterConfig
from .kv_sync import KvSync
from .limits import RequestLimits, WorkerCards
from .load_reports import LoadReports
from .metrics import RouterMetrics, debug_line
from .rate_share import RatePublisher, SharedRate
from .residency import Residency, kv_events_subject, prefix_chain
from .sessions import (
    AUTO_PREFIX,
    FORK_SEPARATOR,
    EtcdSessions,
    SessionRecord,
    check_session_id,
    history_hashes,
    is_fork_of,
)

log = logging.getLogger("dynamo_ppd.router")

MAX_ATTEMPTS = 3  # workers tried per request: the first, then re-homes and migrations
UNREACHABLE_S = 30.0  # a worker that failed is skipped this long (Dynamo's discovery lease TTL)
FORCED_ROUTE = "x-ppd-route:"  # annotation prefix obeyed only with --allow-forced-route


def _cancelled(context) -> bool:
    """The client went away (Dynamo stops or kills the request's context)."""
    return context is not None and (context.is_stopped() or context.is_killed())


def _continuation(request: dict, sent: list[int]) -> dict:
    """The request that continues an answer cut off after ``sent`` tokens: those tokens join the
    prompt and count against ``max_tokens`` (as Dynamo's own request migration does)."""
    follow = dict(request)
    follow["token_ids"] = [*request["token_ids"], *sent]
    stop = dict(request.get("stop_conditions") or {})
    if stop.get("max_tokens"):
        stop["max_tokens"] = max(1, stop["max_tokens"] - len(sent))
    if stop.get("min_tokens"):
        stop["min_tokens"] = max(0, stop["min_tokens"] - len(sent))
    follow["stop_conditions"] = stop
    follow.pop("prefill_result", None)
    return follow


def _as_part_of_the_original(chunk: dict, already_sent: int) -> None:
    """A continuation's usage as the client's request sees it: its prompt was the original one,
    and the tokens sent before the failure are part of the completion."""
    usage = chunk.get("completion_usage")
    if usage:
        usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - already_sent
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + already_sent
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens"):
            details["cached_tokens"] = max(0, min(details["cached_tokens"], usage["prompt_tokens"]))


_NO_STATE: placement.ClusterState[int] = placement.ClusterState((), (), {}, {}, {})


class NoWorkers(Exception):
    """No worker of a needed kind: HTTP 503."""


class _Loads:
    """What this router has in flight per worker (the live load it routes new conversations by)."""

    def __init__(self) -> None:
        self.inflight: dict[int, int] = defaultdict(int)
        self.prefill_tokens: dict[int, int] = defaultdict(int)
        self.context_tokens: dict[int, int] = defaultdict(int)

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
                          decode_kv_tokens=max(self.context_tokens[worker], reported_kv))

    def routed(self, worker: int) -> placement.Routed:
        """This router's own counts, which placement ranks workers by."""
        return placement.Routed(requests=self.inflight[worker], prefill_tokens=self.prefill_tokens[worker],
                                context_tokens=self.context_tokens[worker])


class PpdRouter:
    def __init__(self, runtime, config: RouterConfig, policy: Policy, metrics: RouterMetrics):
        self.runtime = runtime
        self.config = config
        self.policy = policy
        self.metrics = metrics
        self.residency = Residency(config.block_size)
        self.sessions = EtcdSessions(config.etcd_url, config.session_prefix, config.session_ttl_s,
                                     on_health=lambda up: metrics.etcd_up.set(1 if up else 0),
                                     block_size=config.block_size, max_sessions=config.max_sessions,
                                     on_evict=metrics.sessions_evicted.inc)
        self.loads = _Loads()
        self.reports = LoadReports()  # latest forward-pass metrics per worker
        # The policy reads the rate of all router replicas together (each publishes its own).
        self.rate = SharedRate(SlidingWindowRate(window_s=10.0))
        self._rate_publisher = RatePublisher(self.rate, config.namespace, on_publish=metrics.set_rates)
        self.clients: dict[str, Any] = {}
        self._unreachable: dict[int, float] = {}  # worker -> when a request to it last failed
        self.limits = RequestLimits()  # context window set by the service, KV capacity by cards
        self._cards: WorkerCards | None = None
        self._nats: Any = None
        self.kv_sync: KvSync | None = None
        self._table_config: str | None = None
        self._background: set[asyncio.Task] = set()  # session writes in flight

    async def start(self) -> None:
        import nats
        from dynamo._core import compute_block_hash_for_seq

        self._hash = compute_block_hash_for_seq
        ns, cfg = self.config.workers_namespace, self.config
        components = {"prefill": cfg.prefill_component, "decode": cfg.decode_component}
        if cfg.replica_component:
            components["replica"] = cfg.replica_component
        for role, component in components.items():
            self.clients[role] = await self.runtime.endpoint(f"{ns}.{component}.generate").client()

        # Residency: live KV events, and rebuilds from the workers themselves (kv_sync).
        kv_sync = self.kv_sync = KvSync(self.runtime, self.residency, self.metrics, ns, components,
                                        self.clients, busy=self._serving,
                                        silent_after_s=cfg.kv_silent_after_s)

        async def nats_down() -> None:
            self.metrics.nats_up.set(0)

        async def nats_up() -> None:
            self.metrics.nats_up.set(1)
            kv_sync.reconnected()

        self._nats = await nats.connect(cfg.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=1,
                                        disconnected_cb=nats_down, reconnected_cb=nats_up)
        self.metrics.nats_up.set(1)
        await self.kv_sync.start(self._nats)
        for component in components.values():
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
        """The worker is serving turns now (ours, or any router's as its load reports say)."""
        report = self.reports.get(worker) or {}
        scheduled = report.get("scheduled_requests") or {}
        return self.loads.inflight.get(worker, 0) > 0 or bool(scheduled.get("num_decode_requests"))

    async def stop(self) -> None:
        if self.kv_sync is not None:
            await self.kv_sync.stop()
        await self._rate_publisher.stop()
        self.reports.shutdown()
        await self.sessions.stop()  # flushes pending session writes
        if self._nats is not None:
            await self._nats.close()

    # -- the handler -----------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict]:
        from dynamo.llm.exceptions import InvalidArgument, WorkerUnavailable

        tokens = request.get("token_ids")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            self.metrics.errors.labels("bad_request").inc()
            raise InvalidArgument("the request has no prompt token ids")
        # A client cannot choose its route: drop a bypass annotation it sent (as Dynamo does), and
        # a forced route unless this router is a table-building one (--allow-forced-route).
        annotations = request.get("annotations") or []
        forced = next((a[len(FORCED_ROUTE):] for a in annotations if a.startswith(FORCED_ROUTE)), None)
        request["annotations"] = [a for a in annotations
                                  if a != BYPASS_REMOTE_PREFILL_ANNOTATION and not a.startswith(FORCED_ROUTE)]
        if forced not in (None, Route.DECODE_LOCAL.value, Route.VIA_PREFILL.value):
            raise InvalidArgument(f"{FORCED_ROUTE}{forced}: the route must be decode_local or via_prefill")
        forced = forced if self.config.allow_forced_route else None
        too_big = self.limits.check(len(tokens), (request.get("stop_conditions") or {}).get("max_tokens"))
        if too_big:  # before any worker does any work (a 150k-word message ran 2.9 s, then a 500)
            self.metrics.errors.labels("too_large").inc()
            raise InvalidArgument(too_big)
        started = time.monotonic()
        self.rate.record(started)
        output: list[int] = []
        first_at = last_at = None
        chunks = 0
        try:
            plan = await self._plan(request, tokens, forced)
            async for chunk in self._run(plan, request, context):
                new = chunk.get("token_ids") or []
                if new:
                    last_at = time.monotonic()
                    first_at = first_at or last_at
                output.extend(new)
                chunks += 1
                yield chunk
        except NoWorkers as exc:  # wherever it was found out: planning, re-homing, migrating
            self.metrics.errors.labels("no_workers").inc()
            # HTTP 503. Dynamo 1.6.1's frontend shows clients a generic text for every 5xx, so
            # the reason is logged here too.
            log.warning("HTTP 503: %s", exc)
            raise WorkerUnavailable(str(exc)) from None
        except dispatch.WorkerRejected as exc:  # the worker's validation: the client's 4xx
            self.metrics.errors.labels("rejected").inc()
            raise InvalidArgument(str(exc)) from None
        finally:  # once per request, not per chunk (tokens / chunks: how much coalescing merged)
            self.metrics.relayed_tokens.inc(len(output))
            self.metrics.relayed_chunks.inc(chunks)
        if _cancelled(context):
            return  # the client went away: its next turn will not carry this partial answer
        if (plan.turn > 1 and first_at is not None and last_at is not None
                and not plan.decision.reason.startswith("rehome")):  # a failure's timing says nothing
            tpot = (last_at - first_at) / (len(output) - 1) if len(output) > 1 else None
            self.policy.observe(plan.decision, first_at - started, tpot)  # online calibration
        await self._record_turn(plan, tokens, output)

    async def _plan(self, request: dict, tokens: list[int], forced: str | None = None) -> _Plan:
        """Decide the route and workers; ``forced``: a table-building client's route."""
        started = time.perf_counter()
        cfg = self.config
        local_hashes = self._hash(tokens, cfg.block_size)
        residency_chain = prefix_chain(local_hashes)
        header_id = (request.get("agent_context") or {}).get("session_id")
        record, session_id, turn = await self._find_session(header_id, tokens, residency_chain)
        by_residency = record is None and turn > 1  # a fork: routed by residency (`_find_session`)
        plan = _Plan(session_id=session_id, turn=turn, prompt_tokens=len(tokens),
                     local_hashes=local_hashes, chained=residency_chain)

        if cfg.mode.value == "replica":
            plan.decode = self._pick_replica(residency_chain)
            turn_request = self._turn(plan, request, None, None)
            plan.decision = self.policy.decide(placement.features(turn_request, _NO_STATE, None, None), 0)
            return self._decided(plan, started)
        if await self._hybrid(plan, record, session_id):
            return self._decided(plan, started)

        decode_ids = self._instances("decode")
        if not decode_ids:
            raise NoWorkers("no decode worker is available; start one (or wait for it to register)")
        session_decode = record.decode_worker if record and record.decode_worker in decode_ids else None
        if by_residency:
            session_decode = self._residency_home(decode_ids, residency_chain)
        rehome = record is not None and record.decode_worker is not None and session_decode is None
        prefill_ids = self._instances("prefill")
        self._select_table(len(prefill_ids), len(decode_ids))
        state = self._state(prefill_ids, decode_ids, residency_chain, session_decode)
        placed = placement.place(self.policy, state, self._turn(plan, request, session_decode, record),
                                 Route(forced) if forced else None)
        decision = plan.decision = placed.decision
        plan.prefill, plan.decode = placed.prefill, placed.decode
        if decision.reason == "history_evicted":
            self.metrics.residency_misses.inc()
        if rehome:
            self.metrics.rehomes.inc()
        if placed.moved:  # its KV comes by transfer anyway: it left the hot decode worker
            self.metrics.session_moves.inc()
        self._decided(plan, started)
        if record is None:
            # A new session: claim it in etcd (another router replica may be placing it right now)
            # while the prefill runs; the decode worker is settled when the prefill is done.
            plan.claim = asyncio.get_running_loop().create_task(self.sessions.claim(SessionRecord(
                session_id=session_id, decode_worker=plan.decode, prefill_worker=plan.prefill,
                last_access=time.time())))
            plan.decode_ids = decode_ids
        debug_line(session=session_id, turn=turn, prompt_tokens=len(tokens),
                   cached_on_decode=placed.features.cached_on_decode,
                   cached_on_prefill=placed.features.cached_on_prefill, decode=plan.decode,
                   prefill=plan.prefill,
                   route=decision.route.value, reason=decision.reason, score=decision.score,
                   rehome=rehome, local=decision.local, via_prefill=decision.via_prefill)
        return plan

    def _decided(self, plan: _Plan, started: float) -> _Plan:
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self.metrics.count_decision(plan.decision.route.value, "first" if plan.turn == 1 else "follow_up",
                                    plan.decision.reason)
        return plan

    def _state(self, prefill_ids: list[int], decode_ids: list[int], chain: list[int],
               session_decode: int | None) -> placement.ClusterState[int]:
        """What placement reads: how much of the prompt each prefill worker and the session's
        decode worker hold (the residency index), this router's own counts, and the loads the
        policy reads (own counts merged with the workers' reports)."""
        bs = self.config.block_size
        cached = {w: blocks * bs for w, blocks in self.residency.held_by_worker(chain, prefill_ids).items()}
        if session_decode is not None:
            cached[session_decode] = self.residency.held_blocks(session_decode, chain) * bs
        workers = [*prefill_ids, *decode_ids]
        return placement.ClusterState(
            prefill_ids, decode_ids, loads={w: self.loads.of(w, self.reports.get(w)) for w in workers},
            routed={w: self.loads.routed(w) for w in workers}, cached_tokens=cached)

    def _routed_state(self, decode_ids: list[int]) -> placement.ClusterState[int]:
        """Enough for `placement.pick_decode`: this router's own counts on these workers."""
        return placement.ClusterState((), decode_ids, {}, {w: self.loads.routed(w) for w in decode_ids}, {})

    def _turn(self, plan: _Plan, request: dict, session_decode: int | None,
              record: SessionRecord | None) -> placement.TurnRequest[int]:
        stop = request.get("stop_conditions") or {}
        return placement.TurnRequest(
            decision_key=f"{plan.session_id}:{plan.turn}", turn=plan.turn, prompt_tokens=plan.prompt_tokens,
            expected_output_tokens=stop.get("max_tokens") or self.config.default_max_tokens,
            session_decode=session_decode, history_tokens=record.context_tokens if record else 0,
            qps=self.rate.rate(time.monotonic()))

    def _select_table(self, prefill_workers: int, decode_workers: int) -> None:
        """``--table auto``: the table shipped for the profile and the live P:D configuration
        (none: cold-start predictions), switched when workers come or go."""
        if self.config.table != "auto" or self.policy.predictor is None:
            return
        config = f"{prefill_workers}P{decode_workers}D"
        if config == self._table_config:
            return
        self._table_config = config
        path = bundled_table(config)
        table = None
        if path.is_file():
            table = load_table(path)
            if table.profile != load_profile(self.config.profile).name:
                table = None
        self.policy.set_table(table)
        log.info("P:D configuration %s: %s", config, f"table {path.name}" if table else
                 "no shipped table, deciding from the engine profile's predictions")

    def _pick_decode(self, ids: list[int]) -> int:
        """A new conversation's decode worker (`placement.pick_decode`: the least loaded now)."""
        if not ids:
            raise NoWorkers("no decode worker is available")
        return placement.pick_decode(ids, self._routed_state(ids))

    async def _hybrid(self, plan: _Plan, record: SessionRecord | None, session_id: str) -> bool:
        """Hybrid (aggregated "replica" workers beside P/D, ``--replica-component``): a conversation
        placed on a replica stays there (prefill and decode with prefix reuse, no transfers); a new
        one goes to the least loaded of the replicas and the decode workers. True: the plan is set."""
        replica_ids = self._instances("replica")
        if not replica_ids:
            return False
        if record is not None and record.decode_worker is not None and record.decode_worker in replica_ids:
            plan.decode, plan.decision = record.decode_worker, Decision(Route.REPLICA, "replica_session")
            return True
        if record is not None:
            return False
        candidates = replica_ids + self._instances("decode")
        chosen = placement.pick_decode(candidates, self._routed_state(candidates))
        if chosen not in replica_ids:
            return False
        plan.decode, plan.decision = chosen, Decision(Route.REPLICA, "hybrid_new_conversation")
        await self.sessions.claim(SessionRecord(session_id=session_id, decode_worker=chosen,
                                                last_access=time.time()))
        return True

    def _pick_replica(self, chain: list[int]) -> int:
        ids = self._instances("replica")
        if not ids:
            raise NoWorkers("no aggregated (replica) worker is available")
        cached = self.residency.held_by_worker(chain, ids)
        return max(ids, key=lambda w: (cached.get(w, 0), -self.loads.inflight[w], -w))

    def _instances(self, role: str) -> list[int]:
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

    # -- running a plan --------------------------------------------------------------------------
    async def _run(self, plan: _Plan, request: dict, context) -> AsyncIterator[dict]:
        """Stream the answer; when a worker fails, re-home the turn, and when it fails mid-answer,
        continue the answer elsewhere (the prompt plus the tokens already sent), so the client
        sees one uninterrupted stream. Bounded: `MAX_ATTEMPTS` workers per request."""
        failed: set[int] = set()
        sent: list[int] = []  # tokens already relayed to the client
        before_continuation = 0  # of which sent before the current attempt began
        attempt_request = request
        for attempt in range(MAX_ATTEMPTS):
            worker = plan.decode
            self.loads.inflight[worker] += 1
            self.loads.context_tokens[worker] += plan.prompt_tokens
            try:
                async for chunk in self._stream(plan, attempt_request, context):
                    if before_continuation:
                        _as_part_of_the_original(chunk, before_continuation)
                    sent.extend(chunk.get("token_ids") or [])
                    yield chunk
                return
            except dispatch.WorkerFailed as exc:
                if _cancelled(context):
                    return  # the client went away: not the worker's failure, nothing to retry
                failed.add(exc.worker)
                self._unreachable[exc.worker] = time.monotonic()
                if attempt == MAX_ATTEMPTS - 1:
                    self.metrics.errors.labels("workers_failed").inc()
                    from dynamo.llm.exceptions import WorkerUnavailable

                    raise WorkerUnavailable(f"{MAX_ATTEMPTS} workers failed for this request, the "
                                            f"last: {exc}") from None
                if sent:
                    log.warning("worker %x failed after %d tokens (%s); continuing the answer on "
                                "another worker", exc.worker, len(sent), exc)
                    attempt_request = _continuation(request, sent)
                    before_continuation = len(sent)
                    self.metrics.migrations.inc()
                else:
                    log.warning("worker %x failed before answering (%s); re-homing the turn",
                                exc.worker, exc)
                self._rehome(plan, failed, attempt_request["token_ids"])
            finally:
                self.loads.inflight[worker] -= 1
                self.loads.context_tokens[worker] -= plan.prompt_tokens

    def _stream(self, plan: _Plan, request: dict, context) -> AsyncIterator[dict]:
        route = plan.decision.route
        if route is Route.REPLICA:
            return dispatch.replica(self.clients["replica"], request, plan.decode, context)
        if route is Route.DECODE_LOCAL:
            return dispatch.decode_local(self.clients["decode"], request, plan.decode, context)
        assert plan.prefill is not None
        # The prefill worker carries this prompt from now until its prefill leg ends, whatever
        # happens after (the policy and the choice of prefill worker read this queue).
        prefill, charge = plan.prefill, len(request["token_ids"])
        self.loads.prefill_tokens[prefill] += charge

        def release() -> None:
            self.loads.prefill_tokens[prefill] = max(0, self.loads.prefill_tokens[prefill] - charge)

        return dispatch.prefill_then_decode(self.clients["prefill"], self.clients["decode"], request,
                                            prefill, lambda: self._settle_decode(plan), context,
                                            prefill_done=release)

    async def _settle_decode(self, plan: _Plan) -> int:
        """The decode worker, once a new session's claim is settled (the first claimant wins)."""
        if plan.claim is not None:
            claimed, plan.claim = await plan.claim, None
            if claimed.decode_worker is not None and claimed.decode_worker in plan.decode_ids:
                plan.decode = claimed.decode_worker
        return plan.decode

    def _rehome(self, plan: _Plan, failed: set[int], tokens: list[int]) -> None:
        """After a worker failed: a live decode worker (the same one if only the prefill worker
        failed), and the policy's route to it for ``tokens``; decode-local when no prefill worker
        is left (the decode worker recomputes what it does not hold)."""
        self.metrics.rehomes.inc()
        if plan.decision.route is Route.REPLICA:
            replicas = [w for w in self._instances("replica") if w not in failed]
            if not replicas:
                raise NoWorkers("no aggregated worker is left to serve this request; start one")
            plan.decode = min(replicas, key=lambda w: (self.loads.inflight[w], w))
            return
        decode_ids = [w for w in self._instances("decode") if w not in failed]
        prefill_ids = [w for w in self._instances("prefill") if w not in failed]
        if plan.decode in failed or plan.decode not in decode_ids:
            plan.decode = self._pick_decode(decode_ids)  # NoWorkers: none left (503)
        plan.prompt_tokens = len(tokens)
        if not prefill_ids:
            plan.prefill = None
            plan.decision = Decision(Route.DECODE_LOCAL, "rehome_no_prefill_worker")
            return
        state = self._state(prefill_ids, decode_ids, prefix_chain(self._hash(tokens, self.config.block_size)),
                            plan.decode)
        plan.prefill, _ = placement.pick_prefill(prefill_ids, len(tokens), state)
        # A follow-up of the history ``tokens`` hold, on the decode worker it now has.
        turn = placement.TurnRequest(
            decision_key=f"{plan.session_id}:{plan.turn}", turn=max(2, plan.turn), prompt_tokens=len(tokens),
            expected_output_tokens=self.config.default_max_tokens, session_decode=plan.decode,
            history_tokens=len(tokens), qps=self.rate.rate(time.monotonic()))
        decision = self.policy.decide(placement.features(turn, state, plan.decode, plan.prefill),
                                      history_tokens=len(tokens))
        plan.decision = Decision(decision.route, f"rehome_{decision.reason}", decision.score)

    async def _find_session(self, header_id: str | None, tokens: list[int], chain: list[int]
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
        record = self.sessions.get(header_id) or await self.sessions.read_through(header_id)
        if record is None:
            if self.sessions.healthy:
                return None, header_id, 1  # etcd has no such session: a new conversation
            # etcd is away, so another replica's record of it may exist unseen: when a decode
            # worker holds most of the prompt, this is a follow-up of the history it holds.
            held = self.residency.held_by_worker(chain, self._instances("decode"))
            share = max(held.values(), default=0) * self.config.block_size / len(tokens)
            return None, header_id, 2 if share >= self.config.min_resident_fraction else 1
        if self.sessions.table.continues(record, chain, tokens):
            return record, header_id, record.turn + 1
        self.metrics.session_forks.inc()
        fork = self.sessions.find_by_prefix(chain, tokens, accept=lambda s: is_fork_of(s, header_id))
        if fork is not None:
            return fork, fork.session_id, fork.turn + 1
        return None, f"{header_id}{FORK_SEPARATOR}{uuid.uuid4().hex[:12]}", record.turn + 1

    def _residency_home(self, decode_ids: list[int], chain: list[int]) -> int | None:
        """The decode worker holding the longest prefix of the prompt (None: none holds any)."""
        held = self.residency.held_by_worker(chain, decode_ids)
        best = max(decode_ids, key=lambda w: (held[w], -self.loads.inflight[w], -w), default=None)
        return best if best is not None and held[best] > 0 else None

    async def _record_turn(self, plan: _Plan, prompt: list[int], output: list[int]) -> None:
        """The turn is done: its decode worker now holds prompt + output; remember that."""
        history = prompt + output
        bs = self.config.block_size
        known = len(plan.local_hashes)
        # The history's blocks: the prompt's full blocks, then those the output completed.
        local = plan.local_hashes + self._hash(history[known * bs:len(history) // bs * bs], bs)
        history_hash, digest = history_hashes(prefix_chain(local), history, bs)
        record = SessionRecord(session_id=plan.session_id, decode_worker=plan.decode,
                               prefill_worker=plan.prefill, turn=plan.turn, context_tokens=len(history),
                               history_hash=history_hash, history_digest=digest, last_access=time.time())
        # In etcd before the answer's stream ends (unless etcd is slow: `commit`), so a follow-up
        # the client sends to another router replica finds it there; this costs end-of-stream
        # latency, not TTFT.
        await self.sessions.commit(record)
        self.metrics.sessions_active.set(len(self.sessions.table))


@dataclass
class _Plan:
    """One request's route and the workers it uses (a re-home changes them)."""

    session_id: str
    turn: int
    prompt_tokens: int
    local_hashes: list[int]  # Dynamo's per-block token hashes of the prompt
    chained: list[int] | None  # prefix ids (`residency.prefix_chain`) of the prompt's full blocks
    decision: Decision = Decision(Route.VIA_PREFILL, "undecided")
    prefill: int | None = None
    decode: int = 0  # the decode (or aggregated) worker
    claim: asyncio.Task | None = None  # a new session's etcd claim, settled before decode
    decode_ids: list[int] = field(default_factory=list)
