"""The endpoint picker learning of failures from the gateway, in process: the status the gateway
reports for a routed request (ext_proc response headers) reaches `Picker.answered`, and a 5xx for a
turn pinned to a prefill worker leaves that worker out of plans at once (`Routing.instances`),
without waiting for Dynamo's discovery to drop it. The gateway side and a killed prefill worker
end to end: tests/test_gateway.py and tests/test_picker_failures_e2e.py."""

from __future__ import annotations

import pytest
from test_router_dispatch import FakeClient

from dynamo_ppd.picker.picker import Pick, Picker
from dynamo_ppd.policy.decision import Decision, Route
from dynamo_ppd.routing import state as routing_module
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.routing.state import Routing, Turn

pytestmark = pytest.mark.unit

P1, P2, D1, D2 = 1, 2, 11, 12


def _picker() -> Picker:
    """A picker over an unstarted routing state: two prefill and two decode workers listed."""
    config = parse_args(["--mode", "ppd"])
    routing = Routing(None, config, build_policy(config), RoutingMetrics(),
                      clients={"prefill": FakeClient([P1, P2], "prefill"),
                               "decode": FakeClient([D1, D2], "decode")})
    return Picker(routing, tokenizer=None, frontends=["127.0.0.1:8001"])  # type: ignore[arg-type]


def _pick(route: Route, prefill: int | None, decode: int = D1) -> Pick:
    turn = Turn("s", 1, 300, [], None, decision=Decision(route, "test"), prefill=prefill, decode=decode)
    return Pick("127.0.0.1:8001", {}, (), None, turn)


def _prefill_failed(picker: Picker) -> float:
    """ppd_request_errors_total{kind="prefill_failed"}."""
    return sum(s.value for s in picker.routing.metrics.errors.collect()[0].samples
               if s.name.endswith("_total") and s.labels["kind"] == "prefill_failed")


def test_a_5xx_for_a_via_prefill_turn_leaves_its_prefill_worker_out_at_once():
    picker = _picker()
    routing = picker.routing
    assert routing.instances("prefill") == [P1, P2]
    picker.answered(_pick(Route.VIA_PREFILL, P1), 503)
    assert routing.instances("prefill") == [P2]  # while discovery still lists P1
    assert routing.instances("decode") == [D1, D2]  # the decode worker was not to blame
    assert _prefill_failed(picker) == 1
    picker.answered(_pick(Route.VIA_PREFILL, P2), 500)
    # Every prefill worker failed lately: all are tried again rather than none.
    assert routing.instances("prefill") == [P1, P2] and _prefill_failed(picker) == 2


def test_success_a_client_error_or_a_decode_local_turn_marks_nothing():
    picker = _picker()
    picker.answered(_pick(Route.VIA_PREFILL, P1), 200)
    picker.answered(_pick(Route.VIA_PREFILL, P1), 400)  # the request's fault, not the worker's
    picker.answered(_pick(Route.VIA_PREFILL, P1), None)  # no :status in the message
    picker.answered(_pick(Route.DECODE_LOCAL, None), 503)  # no prefill worker on its path
    picker.answered(Pick("127.0.0.1:8001", {}, (), None), 503)  # not planned (no body: unrouted)
    assert picker.routing.instances("prefill") == [P1, P2]
    assert _prefill_failed(picker) == 0


def test_a_worker_marked_unreachable_is_back_once_the_period_is_over(monkeypatch):
    picker = _picker()
    picker.answered(_pick(Route.VIA_PREFILL, P2), 502)
    assert picker.routing.instances("prefill") == [P1]
    monkeypatch.setattr(routing_module, "UNREACHABLE_S", -1.0)  # the 30 s are over
    assert picker.routing.instances("prefill") == [P1, P2]


def _plan(routing: Routing, bound: int | None, placed: int, route: Route = Route.VIA_PREFILL) -> Turn:
    """What `plan_turn` does after the planner chose ``placed``, for a session bound to ``bound``."""
    from dynamo_ppd.routing.sessions import SessionRecord

    record = None if bound is None else SessionRecord("s", decode_worker=D1, prefill_worker=bound, turn=1)
    turn = Turn("s", 2, 300, [], None, decision=Decision(route, "test"), prefill=placed, decode=D1)
    routing._keep_bound_prefill(turn, record, routing.instances("prefill"))
    return turn


def test_a_session_keeps_the_prefill_worker_the_frontend_bound_it_to():
    """Dynamo's frontend (soft session affinity) refuses, with HTTP 400, a turn of a session
    pinned to another prefill worker than the one it bound the session to (seen in chaos
    prefill-kill on 2P2D: "session ... is bound to worker A, not B"). Behind it a session's turns
    via prefill go to its bound worker while that one is live and reachable; once it has failed,
    elsewhere, naming no session; and the record keeps the binding."""
    picker = _picker()
    routing = picker.routing
    kept = _plan(routing, bound=P1, placed=P2)
    assert kept.prefill == P1 and not kept.unbound
    first = _plan(routing, bound=None, placed=P2)  # a first turn: placement's choice binds
    assert first.prefill == P2 and not first.unbound
    local = _plan(routing, bound=P1, placed=P2, route=Route.DECODE_LOCAL)
    assert local.prefill == P2 and not local.unbound  # no pin on a decode-local turn
    assert routing._record(local, [1] * 40, []).prefill_worker == P1  # the binding stays
    assert routing._record(kept, [1] * 40, []).prefill_worker == P1
    picker.answered(_pick(Route.VIA_PREFILL, P1), 503)  # P1 is gone
    moved = _plan(routing, bound=P1, placed=P2)
    assert moved.prefill == P2 and moved.unbound
    assert routing._record(moved, [1] * 40, []).prefill_worker == P1
    from dynamo_ppd.picker.route import AGENT_SESSION_HEADERS, SESSION_HEADER, route_headers

    headers = route_headers(moved.decision.route, moved.prefill, None if moved.unbound else moved.session_id)
    assert SESSION_HEADER not in headers.set
    # Nor the client's own: the frontend reads every one of them (seen in chaos ratio-change, a
    # session whose prefill worker had been scaled in got the frontend's 400 through the client's
    # x-dynamo-session-id).
    assert set(AGENT_SESSION_HEADERS) <= set(headers.remove)
    named = route_headers(kept.decision.route, kept.prefill, kept.session_id)
    assert named.set[SESSION_HEADER] == "s" and not set(AGENT_SESSION_HEADERS) & set(named.remove)


def test_the_relay_router_records_the_prefill_worker_it_used():
    config = parse_args(["--mode", "ppd"])
    routing = Routing(None, config, build_policy(config), RoutingMetrics(),
                      clients={"prefill": FakeClient([P1, P2], "prefill"),
                               "decode": FakeClient([D1], "decode")})
    turn = Turn("s", 2, 300, [], None, decision=Decision(Route.DECODE_LOCAL, "test"), prefill=P2, decode=D1)
    assert not routing.prefill_bound_downstream
    assert routing._record(turn, [1] * 40, []).prefill_worker == P2  # as before: not the picker's rule
