"""What the picker's metrics mean, in process: a decode worker the frontend chose for a turn
through prefill (Dynamo's KV router places those) is not a divergence, one it chose against a
decode-local plan is (`ppd_decode_divergence_total`); the picker's own charges do not make a
decode worker "serving" for the KV-silence warning, its load reports do (`Routing._serving`)."""

from __future__ import annotations

import asyncio

import pytest
from test_router_dispatch import FakeClient

from dynamo_ppd.picker.picker import Picker
from dynamo_ppd.policy.decision import Route
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.routing.state import Routing

pytestmark = pytest.mark.unit

P1, D1, D2, D3 = 1, 11, 12, 13


def _routing(picker: bool = True) -> Routing:
    config = parse_args(["--mode", "ppd"])
    routing = Routing(None, config, build_policy(config), RoutingMetrics(),
                      clients={"prefill": FakeClient([P1], "prefill"),
                               "decode": FakeClient([D1, D2, D3], "decode")})
    if picker:
        Picker(routing, tokenizer=None, frontends=["127.0.0.1:8001"])  # type: ignore[arg-type]
    return routing


def _holds(routing: Routing, worker: int, hashes: list[int], event_id: int) -> None:
    """The worker's KV events say it stores the blocks of these local hashes (a whole chain)."""
    blocks = [{"block_hash": 10_000 * worker + i, "tokens_hash": h} for i, h in enumerate(hashes)]
    routing.residency.apply(worker, {"event_id": event_id, "data": {"stored": {"parent_hash": None,
                                                                               "blocks": blocks}}})


def _divergence(routing: Routing) -> float:
    return routing.metrics.decode_divergence._value.get()


def test_the_frontend_placing_a_turn_through_prefill_is_not_a_divergence_but_moving_a_local_one_is():
    routing = _routing()

    def plan(prompt: list[int]):
        return routing.plan_turn({"token_ids": prompt, "agent_context": {"session_id": "s"}}, prompt)

    async def turns():
        prompt = list(range(100, 420))  # 10 full blocks
        first = await plan(prompt)
        assert first.decision.route is Route.VIA_PREFILL
        routing.record_routed(first, prompt)
        other = next(w for w in (D1, D2, D3) if w != first.decode)
        _holds(routing, other, first.local_hashes, 0)  # the frontend's KV router put it elsewhere
        prompt2 = prompt + list(range(1000, 1100))
        second = await plan(prompt2)
        assert second.decode == other and _divergence(routing) == 0  # found where it is: no divergence
        assert second.decision.route is Route.DECODE_LOCAL
        routing.record_routed(second, prompt2)
        third_worker = next(w for w in (D1, D2, D3) if w not in (first.decode, other))
        _holds(routing, third_worker, second.local_hashes, 0)  # the frontend left the planned worker
        prompt3 = prompt2 + list(range(2000, 2040))
        third = await plan(prompt3)
        assert third.decode == third_worker and _divergence(routing) == 1

    asyncio.run(turns())


def test_behind_the_picker_only_load_reports_make_a_decode_worker_serving():
    routing = _routing()
    routing.loads.add_decode(D1, 300, 16)  # the picker's charge for a turn it planned there
    assert not routing._serving(D1)
    routing.reports[D1] = {"scheduled_requests": {"num_decode_requests": 2}}  # its own word
    assert routing._serving(D1)
    relay = _routing(picker=False)
    relay.loads.add_decode(D1, 300, 16)
    assert relay._serving(D1)  # the relay router's own turns: it dispatched them there
