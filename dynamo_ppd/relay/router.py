"""The PPD relay router component: the shared routing state (`routing.state.Routing`) plus the relay.

Behind Dynamo's frontend, per request: plan the turn (`Routing.plan_turn`: session, residency,
loads, the pure planner), dispatch it (via P then D, or decode-local on D), stream the answer
back chunk by chunk, and record the turn in the session. Workers that vanish are routed around: a
gone D re-homes the turn through a P to another D; a gone P makes the turn decode-local when D
holds the prefix (`planner.rehome`). For deployments with no ext_proc-capable gateway; with one,
the endpoint picker (`dynamo_ppd.picker`) wraps the same state and relays no token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ..engine.blocks import prefix_chain
from ..engine.handoff import BYPASS_REMOTE_PREFILL_ANNOTATION, FORCED_ROUTE_ANNOTATION
from ..policy.decision import Route
from ..routing import planner
from ..routing.planner import NoWorkers
from ..routing.state import Loads, Routing, Turn
from . import dispatch

__all__ = ["Loads", "PpdRouter", "Turn"]

log = logging.getLogger("dynamo_ppd.relay")

MAX_ATTEMPTS = 3  # workers tried per request: the first, then re-homes and migrations

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


class PpdRouter(Routing):
    """The relay router's handler (`generate`): the shared routing state (`Routing`), then it runs
    the plan (`dispatch`), re-homes or continues the turn when a worker fails, relays the answer,
    and records the turn."""

    async def generate(self, request: dict[str, Any], context=None) -> AsyncIterator[dict]:
        from dynamo.llm.exceptions import InvalidArgument, WorkerUnavailable

        tokens = request.get("token_ids")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
            self.metrics.errors.labels("bad_request").inc()
            raise InvalidArgument("the request has no prompt token ids")
        # A client cannot choose its route: drop a bypass annotation it sent (as Dynamo does), and
        # a forced route unless this router is a table-building one (--allow-forced-route).
        annotations = request.get("annotations") or []
        forced = next((a[len(FORCED_ROUTE_ANNOTATION):] for a in annotations
                       if a.startswith(FORCED_ROUTE_ANNOTATION)), None)
        request["annotations"] = [a for a in annotations if a != BYPASS_REMOTE_PREFILL_ANNOTATION
                                  and not a.startswith(FORCED_ROUTE_ANNOTATION)]
        if forced not in (None, Route.DECODE_LOCAL.value, Route.VIA_PREFILL.value):
            self.metrics.errors.labels("bad_request").inc()
            raise InvalidArgument(f"{FORCED_ROUTE_ANNOTATION}{forced}: the route must be decode_local or "
                                  "via_prefill")
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
            plan = await self.plan_turn(request, tokens, forced)
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
        except InvalidArgument:  # planning refused it: a session id over the limit, as the picker counts
            self.metrics.errors.labels("bad_request").inc()
            raise
        finally:  # once per request, not per chunk (tokens / chunks: how much coalescing merged)
            self.metrics.relayed_tokens.inc(len(output))
            self.metrics.relayed_chunks.inc(chunks)
        if _cancelled(context):
            return  # the client went away: its next turn will not carry this partial answer
        if first_at is not None and last_at is not None:  # online calibration, metrics (follow-ups only)
            tpot = (last_at - first_at) / (len(output) - 1) if len(output) > 1 else None
            self.observe_outcome(plan, first_at - started, tpot)
        await self.record_turn(plan, tokens, output)

    async def _run(self, plan: Turn, request: dict, context) -> AsyncIterator[dict]:
        """Stream the answer; when a worker fails, re-home the turn, and when it fails mid-answer,
        continue the answer elsewhere (the prompt plus the tokens already sent), so the client
        sees one uninterrupted stream. Bounded: `MAX_ATTEMPTS` workers per request."""
        failed: set[int] = set()
        sent: list[int] = []  # tokens already relayed to the client
        before_continuation = 0  # of which sent before the current attempt began
        attempt_request = request
        for attempt in range(MAX_ATTEMPTS):
            worker = plan.decode
            stop = request.get("stop_conditions") or {}
            outputs = stop.get("max_tokens") or self.config.default_max_tokens
            self.loads.add_decode(worker, plan.prompt_tokens, outputs)
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
                self.mark_unreachable(exc.worker)
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
                self.loads.add_decode(worker, plan.prompt_tokens, outputs, -1)

    def _stream(self, plan: Turn, request: dict, context) -> AsyncIterator[dict]:
        route = plan.decision.route
        if route is Route.REPLICA:
            return dispatch.replica(self.clients["replica"], request, plan.decode, context)
        sent = functools.partial(self._start_claim, plan)
        if route is Route.DECODE_LOCAL:
            return dispatch.decode_local(self.clients["decode"], request, plan.decode, context, sent=sent)
        assert plan.prefill is not None
        # The prefill worker carries this prompt from now until its prefill leg ends, whatever
        # happens after (the policy and the choice of prefill worker read this queue).
        prefill, charge = plan.prefill, len(request["token_ids"])
        self.loads.prefill_tokens[prefill] += charge

        def release() -> None:
            self.loads.prefill_tokens[prefill] = max(0, self.loads.prefill_tokens[prefill] - charge)

        return dispatch.prefill_then_decode(self.clients["prefill"], self.clients["decode"], request,
                                            prefill, lambda: self._settle_decode(plan), context,
                                            prefill_sent=sent, prefill_done=release)

    def _start_claim(self, plan: Turn) -> None:
        """Start a new session's etcd claim, once the turn's first request is with its worker.
        Started before, its Python (aetcd, gRPC) held the event loop while that request was being
        sent: the prefill worker got it ~0.9 ms later (`bench overhead`, docs/bench/relay.md)."""
        if plan.unclaimed is not None:
            plan.claim = asyncio.get_running_loop().create_task(self.sessions.claim(plan.unclaimed))
            plan.unclaimed = None

    async def _settle_decode(self, plan: Turn) -> int:
        """The decode worker, once a new session's claim is settled (the first claimant wins)."""
        self._start_claim(plan)  # not started if no request got as far as a worker
        if plan.claim is not None:
            claimed, plan.claim = await plan.claim, None
            if claimed.decode_worker is not None and claimed.decode_worker in plan.decode_ids:
                plan.decode = claimed.decode_worker
        return plan.decode

    def _rehome(self, plan: Turn, failed: set[int], tokens: list[int]) -> None:
        """After a worker failed: `planner.rehome` over the workers left (a live decode worker, the
        same one if only the prefill worker failed, and the policy's route to it for ``tokens``)."""
        self.metrics.rehomes.inc()
        replica = plan.decision.route is Route.REPLICA
        live = {role: [w for w in self.instances(role) if w not in failed]
                for role in (("replica",) if replica else ("prefill", "decode"))}
        chain = [] if replica else prefix_chain(self._hash(tokens, self.config.block_size))
        moved = planner.rehome(
            self.policy, planner.SessionView(plan.session_id, plan.turn), plan.decision, plan.decode,
            self._cluster(chain, **live),
            planner.TurnView(len(tokens), self.config.default_max_tokens, self.rate.rate(time.monotonic())))
        plan.decision, plan.prefill, plan.decode = moved.decision, moved.prefill, moved.decode
        if not replica:
            plan.prompt_tokens = len(tokens)
