"""The picker's frontends (`dynamo_ppd.picker.frontends`): fixed ip:port entries and names resolved
again and again (on Kubernetes, the headless Service over the InferencePool's frontend pods), and
what the picker answers when it knows none."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from dynamo_ppd.picker.args import parse_args
from dynamo_ppd.picker.frontends import Frontends, resolve_addresses, split_endpoint
from dynamo_ppd.picker.picker import Picker, Refusal

pytestmark = pytest.mark.unit


class FakeDns:
    """Answers from a table the test changes; a missing name fails as getaddrinfo does."""

    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.calls = 0

    async def __call__(self, host: str) -> list[str]:
        self.calls += 1
        if host not in self.table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return list(self.table[host])


def test_split_endpoint():
    assert split_endpoint("10.0.0.7:8000") == ("10.0.0.7", 8000)
    assert split_endpoint("ppd-frontend-pool.llm.svc.cluster.local:8000") == \
        ("ppd-frontend-pool.llm.svc.cluster.local", 8000)
    assert split_endpoint("[fd00::1]:8000") == ("fd00::1", 8000)
    for bad in ("frontend", ":8000", "host:0", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="is not host:port"):
            split_endpoint(bad)


def test_names_resolve_to_every_pod_and_round_robin_over_them():
    dns = FakeDns({"pool.llm.svc": ["10.0.0.9", "10.0.0.8"]})
    frontends = Frontends(["10.0.0.1:8000", "pool.llm.svc:8000"], resolve=dns)
    assert frontends.endpoints() == ["10.0.0.1:8000"]  # names count once resolved
    asyncio.run(frontends.refresh())
    assert frontends.endpoints() == ["10.0.0.1:8000", "10.0.0.8:8000", "10.0.0.9:8000"]
    picked = [frontends.next() for _ in range(6)]
    assert sorted(picked) == sorted(frontends.endpoints() * 2)


def test_a_subset_from_the_gateway_is_obeyed():
    frontends = Frontends(["10.0.0.1:8000"])
    subset = ["10.0.0.8:8000", "10.0.0.9:8000"]
    assert sorted(frontends.next(subset) for _ in range(4)) == sorted(subset * 2)
    assert frontends.next([]) is None  # the protocol: an empty subset leaves nothing to pick
    assert frontends.next() == "10.0.0.1:8000"


def test_a_pool_that_changes_is_followed_and_a_dns_failure_keeps_what_was_known():
    dns = FakeDns({"pool": ["10.0.0.8"]})
    frontends = Frontends(["pool:8000"], resolve=dns)
    asyncio.run(frontends.refresh())
    assert frontends.endpoints() == ["10.0.0.8:8000"]
    dns.table["pool"] = ["10.0.0.8", "10.0.0.12"]  # a frontend pod became ready
    asyncio.run(frontends.refresh())
    assert frontends.endpoints() == ["10.0.0.12:8000", "10.0.0.8:8000"]
    dns.table["pool"] = ["10.0.0.12"]  # one went away
    asyncio.run(frontends.refresh())
    assert frontends.endpoints() == ["10.0.0.12:8000"]
    del dns.table["pool"]  # NXDOMAIN (no ready pod, or DNS trouble): keep the last set
    asyncio.run(frontends.refresh())
    assert frontends.endpoints() == ["10.0.0.12:8000"]


def test_names_are_resolved_again_in_the_background():
    async def scenario():
        dns = FakeDns({"pool": ["10.0.0.8"]})
        frontends = Frontends(["pool:8000"], refresh_s=0.01, resolve=dns)
        await frontends.start()
        dns.table["pool"] = ["10.0.0.9"]
        for _ in range(200):
            if frontends.endpoints() == ["10.0.0.9:8000"]:
                break
            await asyncio.sleep(0.01)
        await frontends.stop()
        return frontends.endpoints(), dns.calls

    endpoints, calls = asyncio.run(scenario())
    assert endpoints == ["10.0.0.9:8000"] and calls >= 2


def test_the_real_resolver_answers_for_localhost():
    assert "127.0.0.1" in asyncio.run(resolve_addresses("localhost"))


def test_args_take_names_and_refuse_what_is_not_host_port():
    _, picker = parse_args(["--frontend", "ppd-frontend-pool.llm.svc.cluster.local:8000",
                            "--frontend-refresh", "2"])
    assert picker.frontends == ("ppd-frontend-pool.llm.svc.cluster.local:8000",)
    assert picker.frontend_refresh_s == 2.0
    for bad in (["--frontend", "frontend"], ["--frontend-refresh", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


class _Routing:
    def __init__(self):
        from dynamo_ppd.policy.qps import SlidingWindowRate
        from dynamo_ppd.routing.limits import RequestLimits
        from dynamo_ppd.routing.metrics import RoutingMetrics

        self.metrics, self.rate = RoutingMetrics(), SlidingWindowRate()
        self.limits = RequestLimits(context_window=100)
        self.planned = 0
        self.decode_chosen_downstream = False
        self.config = SimpleNamespace(block_size=16)

    async def plan_turn(self, request, tokens, forced=None, lap=None, known_hashes=None):
        self.planned += 1
        raise AssertionError("a request with no frontend to go to must not be planned")


class _Tokens:
    def tokens(self, body, path, lap=None):
        return [1, 2, 3]


def test_with_no_frontend_known_the_picker_refuses_with_503_and_plans_nothing():
    routing = _Routing()
    picker = Picker(routing, _Tokens(), Frontends(["pool:8000"], resolve=FakeDns({})), prompt_memo_mb=0)  # type: ignore[arg-type]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    with pytest.raises(Refusal) as refused:
        asyncio.run(picker.pick({"x-dynamo-session-id": "s1"}, body, "/v1/chat/completions"))
    assert refused.value.status == 503 and "pool:8000" in str(refused.value)
    assert routing.planned == 0
    errors = {s.labels["kind"]: s.value for s in routing.metrics.errors.collect()[0].samples
              if s.name.endswith("_total")}
    assert errors == {"no_frontends": 1.0}
    # A gateway that allows endpoints: the picker names one of them, even with no name resolved.
    picker = Picker(routing, _Tokens(), Frontends(["10.0.0.1:8000"]), prompt_memo_mb=0)  # type: ignore[arg-type]
    with pytest.raises(Refusal) as refused:
        asyncio.run(picker.pick({}, body, "/v1/chat/completions", subset=[]))
    assert refused.value.status == 503 and "gateway allowed no endpoint" in str(refused.value)
    assert picker.frontend(["10.0.0.7:8000"]) == "10.0.0.7:8000"
