"""The router's handler in process, with scripted worker clients: what it sends to which worker."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from dynamo_ppd.engine.blocks import dynamo_block_hasher
from dynamo_ppd.relay.router import PpdRouter
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.sessions import SessionRecord
from dynamo_ppd.routing.start import build_policy

pytestmark = pytest.mark.unit

PREFILL, D1, D2 = 1, 11, 12


class FakeClient:
    """Records requests; answers like a simulated worker (prefill: params; decode: tokens)."""

    def __init__(self, ids: list[int], role: str, dead: set[int] | None = None):
        self.ids, self.role, self.dead = ids, role, dead if dead is not None else set()
        self.sent: list[tuple[int, dict]] = []

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    async def direct(self, request, worker, annotated=False, context=None):
        if worker in self.dead:
            raise ConnectionError(f"worker {worker} is gone")
        self.sent.append((worker, request))
        return self._answer(request)

    async def _answer(self, request):
        if self.role == "prefill":
            yield {"token_ids": [1500], "finish_reason": "length",
                   "disaggregated_params": {"opaque_state": "x", "first_gen_tokens": [1500]},
                   "completion_usage": {"prompt_tokens_details": {"cached_tokens": 0}}}
            return
        for i in range(request["stop_conditions"]["max_tokens"]):
            yield {"token_ids": [1000 + i]}


def make_router(mode: str = "local", dead: set[int] | None = None, decode: FakeClient | None = None
                ) -> PpdRouter:
    """A router over one prefill and two decode workers (``decode``: another decode client)."""
    config = parse_args(["--mode", mode])
    return PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                     clients={"prefill": FakeClient([PREFILL], "prefill", dead),
                              "decode": decode or FakeClient([D1, D2], "decode", dead)})


def hold(router: PpdRouter, worker: int, tokens: list[int]) -> None:
    """Tell the router's residency index that ``worker`` stored these tokens' blocks."""
    local = dynamo_block_hasher()(tokens, 32)
    blocks = [{"block_hash": (worker << 32) + i, "tokens_hash": h} for i, h in enumerate(local)]
    stored = {"parent_hash": None, "blocks": blocks}
    router.residency.apply(worker, {"event_id": 0, "data": {"stored": stored}})


async def turn(router: PpdRouter, tokens: list[int], session: str = "s", annotations=None) -> list[int]:
    request = {"token_ids": tokens, "stop_conditions": {"max_tokens": 4},
               "annotations": annotations or [], "agent_context": {"session_id": session}}
    return [t for chunk in [c async for c in router.generate(request)] for t in chunk["token_ids"]]


def test_first_turn_hands_off_and_a_client_bypass_annotation_is_dropped():
    async def run():
        router = make_router()
        out = await turn(router, list(range(2000, 2300)), annotations=["x-bypass-remote-prefill"])
        assert out == [1000, 1001, 1002, 1003]
        [(p_worker, p_request)] = router.clients["prefill"].sent
        [(d_worker, d_request)] = router.clients["decode"].sent
        assert p_worker == PREFILL and p_request["stop_conditions"]["max_tokens"] == 1
        assert d_request["stop_conditions"]["max_tokens"] == 4
        assert d_request["prefill_result"]["disaggregated_params"]["first_gen_tokens"] == [1500]
        assert "x-bypass-remote-prefill" not in d_request["annotations"]
        assert "x-bypass-remote-prefill" not in p_request["annotations"]
        return router, d_worker

    router, decode = asyncio.run(run())
    assert router.sessions.get("s").decode_worker == decode


def test_follow_up_goes_to_the_session_decode_worker_with_the_annotation():
    async def run():
        router = make_router()
        first = list(range(2000, 2300))
        out = await turn(router, first)
        decode = router.clients["decode"].sent[0][0]
        hold(router, decode, first + out)
        await turn(router, first + out + list(range(3000, 3040)))
        worker, request = router.clients["decode"].sent[-1]
        assert worker == decode and request["annotations"] == ["x-bypass-remote-prefill"]
        assert "prefill_result" not in request and len(router.clients["prefill"].sent) == 1

    asyncio.run(run())


def _logging_claims(router: PpdRouter, log: list) -> None:
    """Log each worker request and each etcd claim in order; the claim is won by another replica
    that put the session on the other decode worker."""
    for role, client in router.clients.items():
        direct = client.direct

        async def logged(request, worker, annotated=False, context=None, role=role, direct=direct):
            await asyncio.sleep(0)  # the request is on its way (Dynamo sends it from Rust)
            log.append(f"sent to {role}")
            return await direct(request, worker, annotated, context)

        client.direct = logged

    async def claim(record: SessionRecord) -> SessionRecord:
        log.append("claim")
        await asyncio.sleep(0)
        return msgspec.structs.replace(record, decode_worker=D2 if record.decode_worker == D1 else D1)

    router.sessions.claim = claim


def test_a_new_sessions_claim_starts_once_the_first_request_is_sent_and_settles_the_decode_worker():
    # Started before the prefill request, the claim's Python held the event loop while that
    # request was being sent (~0.9 ms of TTFT measured); it still settles the decode worker.
    async def run():
        router, log = make_router(), []
        _logging_claims(router, log)
        await turn(router, list(range(2000, 2300)))
        assert log == ["sent to prefill", "claim", "sent to decode"]
        assert len(router.clients["prefill"].sent) == 1
        [(decode, _)] = router.clients["decode"].sent
        assert router.sessions.get("s").decode_worker == decode  # the claim's winner, not the plan's

        # A new session that goes decode-local: a session id etcd cannot be asked about (it is
        # away) whose prompt a decode worker holds, routed as a follow-up of that history.
        local, prompt = make_router(), list(range(4000, 4300))
        hold(local, D1, prompt[:288])
        assert not local.sessions.healthy
        log.clear()
        _logging_claims(local, log)
        await turn(local, prompt, session="t")
        assert local.clients["decode"].sent[0][1]["annotations"] == ["x-bypass-remote-prefill"]
        assert log == ["sent to decode", "claim"]

    asyncio.run(run())


def test_dead_decode_worker_is_rehomed_through_prefill():
    async def run():
        dead: set[int] = set()
        router = make_router(dead=dead)
        first = list(range(2000, 2300))
        out = await turn(router, first)
        decode = router.clients["decode"].sent[0][0]
        hold(router, decode, first + out)
        dead.add(decode)  # gone, but still listed (its registration has not expired yet)
        out2 = await turn(router, first + out + list(range(3000, 3040)))
        assert len(out2) == 4
        worker, request = router.clients["decode"].sent[-1]
        assert worker != decode and "prefill_result" in request
        assert router.sessions.get("s").decode_worker == worker
        assert router.metrics.rehomes._value.get() == 1

    asyncio.run(run())


def test_no_decode_worker_is_a_503_and_no_tokens_a_4xx():
    from dynamo.llm.exceptions import InvalidArgument, WorkerUnavailable

    async def run():
        router = make_router()
        router.clients["decode"].ids = []
        with pytest.raises(WorkerUnavailable, match="no decode worker"):  # HTTP 503
            await turn(router, list(range(2000, 2100)))
        with pytest.raises(InvalidArgument, match="no prompt token ids"):
            await turn(router, [])

    asyncio.run(run())


def test_hybrid_places_new_conversations_on_replicas_and_keeps_them_there():
    async def run():
        config = parse_args(["--mode", "ppd", "--replica-component", "replica", "--table", "none"])
        replica = FakeClient([5], "decode")  # the lowest id: the least loaded on a tie
        router = PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                           clients={"prefill": FakeClient([PREFILL], "prefill"),
                                    "decode": FakeClient([D1, D2], "decode"), "replica": replica})
        first = list(range(2000, 2300))
        out = await turn(router, first, session="h")
        await turn(router, first + out + list(range(3000, 3040)), session="h")
        assert [w for w, _ in replica.sent] == [5, 5]  # both turns, no P/D involved
        assert all("prefill_result" not in r and r["annotations"] == [] for _, r in replica.sent)
        assert router.clients["prefill"].sent == [] and router.clients["decode"].sent == []
        router.loads.inflight[5] = 3  # now busier than the decode workers
        await turn(router, list(range(4000, 4200)), session="other")
        assert router.clients["prefill"].sent  # a new conversation goes P -> D instead

    asyncio.run(run())
