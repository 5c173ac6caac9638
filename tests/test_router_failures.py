"""Failures get the right answer (in process, scripted worker clients): a worker's validation error
is the client's 4xx and is not retried, a cancelled client is no worker failure, every no-worker
path is a 503, a re-home with no prefill worker left goes decode-local, an answer cut off
mid-stream continues on another decode worker, prefill load is charged while the prefill runs."""

from __future__ import annotations

import asyncio

import pytest
from test_router_dispatch import D1, D2, PREFILL, FakeClient, hold, make_router, turn

from dynamo_ppd.routing.limits import RequestLimits, parse_card

pytestmark = pytest.mark.unit


class Scripted(FakeClient):
    """A decode client whose workers misbehave as told: ``reject`` raise the worker's validation
    error, ``die_after[w] = n`` break off after n tokens (the way Dynamo reports a dead worker)."""

    def __init__(self, ids, role, reject=(), die_after=None, dead=None):
        super().__init__(ids, role, dead)
        self.reject, self.die_after = set(reject), dict(die_after or {})

    async def direct(self, request, worker, annotated=False, context=None):
        if worker in self.reject:
            self.sent.append((worker, request))
            raise ValueError("InvalidRequest: ValueError: max_tokens must be at least 1")
        stream = await super().direct(request, worker, annotated, context)
        if worker not in self.die_after:
            return stream
        return self._dying(stream, self.die_after[worker])

    async def _answer(self, request):
        if self.role != "decode":
            async for chunk in super()._answer(request):
                yield chunk
            return
        n = request["stop_conditions"]["max_tokens"]
        for i in range(n):
            chunk = {"token_ids": [1000 + i]}
            if i == n - 1:  # the last chunk carries the usage, as a worker's does
                chunk["completion_usage"] = {"prompt_tokens": len(request["token_ids"]),
                                             "completion_tokens": n}
            yield chunk

    async def _dying(self, stream, after: int):
        n = 0
        async for chunk in stream:
            if n == after:
                raise ValueError("Unavailable: Stream ended before generation completed")
            n += len(chunk["token_ids"])
            yield chunk


class StoppedContext:
    def is_stopped(self) -> bool:
        return True

    def is_killed(self) -> bool:
        return False


def test_a_worker_validation_error_is_a_400_and_is_not_retried():
    from dynamo.llm.exceptions import InvalidArgument

    async def run():
        router = make_router(decode=Scripted([D1, D2], "decode", reject={D1, D2}))
        with pytest.raises(InvalidArgument, match="max_tokens must be at least 1"):  # HTTP 400
            await turn(router, list(range(2000, 2300)))
        assert len(router.clients["decode"].sent) == 1  # once, not three times
        assert router.metrics.rehomes._value.get() == 0

    asyncio.run(run())


def test_a_cancelled_client_is_not_a_worker_failure():
    async def run():
        router = make_router(mode="pd", decode=Scripted([D1, D2], "decode", die_after={D1: 0, D2: 0}))
        request = {"token_ids": list(range(2000, 2300)), "stop_conditions": {"max_tokens": 4},
                   "annotations": [], "agent_context": {"session_id": "gone"}}
        chunks = [c async for c in router.generate(request, StoppedContext())]
        assert chunks == []
        record = router.sessions.get("gone")
        assert record is None or record.turn == 0  # no turn recorded for an answer nobody got
        assert len(router.clients["decode"].sent) == 1  # no retry on another worker
        assert router.metrics.rehomes._value.get() == 0
        assert not any(s.samples[0].value for s in router.metrics.errors.collect()
                       if s.samples and s.samples[0].labels.get("kind") == "workers_failed")

    asyncio.run(run())


def test_no_decode_worker_left_while_re_homing_is_a_503():
    from dynamo.llm.exceptions import WorkerUnavailable

    async def run():
        dead: set[int] = set()
        router = make_router(dead=dead)
        first = list(range(2000, 2300))
        out = await turn(router, first)
        dead.update({D1, D2})  # both gone, both still listed
        with pytest.raises(WorkerUnavailable, match="decode worker"):  # HTTP 503
            await turn(router, first + out + list(range(3000, 3040)))

    asyncio.run(run())


def test_re_home_without_a_prefill_worker_goes_decode_local_on_a_worker_holding_the_prefix():
    async def run():
        dead: set[int] = set()
        router = make_router(mode="pd", dead=dead)
        first = list(range(2000, 2300))
        out = await turn(router, first)
        decode = router.clients["decode"].sent[0][0]
        hold(router, decode, first + out)
        dead.add(PREFILL)  # the only prefill worker dies, still listed
        out2 = await turn(router, first + out + list(range(3000, 3040)))
        assert len(out2) == 4
        worker, request = router.clients["decode"].sent[-1]
        assert worker == decode and request["annotations"] == ["x-bypass-remote-prefill"]
        assert "prefill_result" not in request

    asyncio.run(run())


def test_without_prefill_workers_a_new_conversation_is_prefilled_on_a_decode_worker():
    async def run():
        router = make_router(mode="ppd")
        router.clients["prefill"].ids = []
        out = await turn(router, list(range(2000, 2300)))
        assert len(out) == 4
        [(worker, request)] = router.clients["decode"].sent
        assert request["annotations"] == ["x-bypass-remote-prefill"] and "prefill_result" not in request

    asyncio.run(run())


def test_an_answer_cut_off_mid_stream_continues_on_another_decode_worker():
    async def run():
        router = make_router(mode="local", decode=Scripted([D1, D2], "decode", die_after={D1: 3}))
        prompt = list(range(2000, 2300))
        request = {"token_ids": prompt, "stop_conditions": {"max_tokens": 10},
                   "annotations": [], "agent_context": {"session_id": "cut"}}
        router.loads.inflight[D2] = 1  # D1 is the least loaded: the session starts there
        chunks = [c async for c in router.generate(request)]
        tokens = [t for c in chunks for t in c["token_ids"]]
        assert len(tokens) == 10  # one uninterrupted answer of the asked length
        (w1, r1), (w2, r2) = router.clients["decode"].sent
        assert (w1, w2) == (D1, D2)
        assert r2["token_ids"] == prompt + tokens[:3]  # the tokens already sent join the prompt
        assert r2["stop_conditions"]["max_tokens"] == 7
        assert "prefill_result" in r2  # D2 holds nothing: through the prefill worker
        assert router.metrics.migrations._value.get() == 1
        assert router.sessions.get("cut").decode_worker == D2
        assert router.loads.inflight[D1] == 0 and router.loads.inflight[D2] == 1
        usage = chunks[-1]["completion_usage"]  # as if one worker had answered the request
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (300, 10)

    asyncio.run(run())


def test_prefill_load_is_charged_while_the_prefill_runs_and_only_then():
    async def run():
        router = make_router(mode="local")
        seen: list[int] = []

        async def watching(request):
            seen.append(router.loads.prefill_tokens[PREFILL])  # while the prefill leg runs
            yield {"token_ids": [1500], "disaggregated_params": {"opaque_state": "x"},
                   "completion_usage": {"prompt_tokens_details": {"cached_tokens": 0}}}

        during_decode: list[int] = []
        decode_answer = router.clients["decode"]._answer

        async def decoding(request):
            async for chunk in decode_answer(request):
                during_decode.append(router.loads.prefill_tokens[PREFILL])
                yield chunk

        router.clients["prefill"]._answer = watching
        router.clients["decode"]._answer = decoding
        first = list(range(2000, 2300))
        out = await turn(router, first)
        assert seen == [300]
        assert set(during_decode) == {0}  # released when the prefill ended, not with the answer
        decode = router.clients["decode"].sent[0][0]
        hold(router, decode, first + out)
        await turn(router, first + out + list(range(3000, 3040)))  # decode-local
        assert router.loads.prefill_tokens[PREFILL] == 0 and len(seen) == 1

    asyncio.run(run())


def test_request_limits_name_the_limit():
    limits = RequestLimits(context_window=131072)
    assert limits.check(1000, 256) is None
    message = limits.check(150_000, None)
    assert message and "maximum context length is 131072 tokens" in message and "150000" in message
    assert "200100 tokens" in (limits.check(100, 200_000) or "")
    limits.decode_capacity_tokens = {D1: 4096, D2: 8192}
    assert limits.check(8000, 16) is None  # D2 can hold it
    assert "8192 tokens" in (limits.check(9000, 16) or "")
    limits.decode_context_tokens = {D1: 4096}  # a worker started with a shorter window
    assert "maximum context length is 4096" in (limits.check(4000, 200) or "")


def test_model_cards_give_capacity_and_window():
    card = (b'{"instance_id": 7, "card_json": {"kv_cache_block_size": 32, "context_length": 131072,'
            b' "runtime_config": {"total_kv_blocks": 100}}}')
    assert parse_card(card) == (7, 3200, 131072)
    assert parse_card(b'{"instance_id": 7, "card_json": {"runtime_config": {}}}') == (7, None, None)
    assert parse_card(b"not json") is None


def test_a_worker_that_failed_is_skipped_while_discovery_still_lists_it():
    from dynamo.llm.exceptions import WorkerUnavailable

    class Counting(FakeClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tried: list[int] = []

        async def direct(self, request, worker, annotated=False, context=None):
            self.tried.append(worker)
            return await super().direct(request, worker, annotated, context)

    async def run():
        # D1 was killed and is still listed
        router = make_router(mode="pd", decode=Counting([D1, D2], "decode", dead={D1}))
        for session in ("a", "b", "c"):
            assert len(await turn(router, list(range(2000, 2300)), session=session)) == 4
        assert router.clients["decode"].tried == [D1, D2, D2, D2]  # one failed connect, not three
        router.clients["decode"].ids = [D1]  # only the failed one is left: tried again, then a 503
        with pytest.raises(WorkerUnavailable, match="no decode worker"):
            await turn(router, list(range(2000, 2300)), session="d")
        assert router.clients["decode"].tried[4:] == [D1]

    asyncio.run(run())
