"""Coalescing the relayed stream (`dispatch.coalesced`): chunks already waiting go out as one,
with the same tokens in the same order and the answer's end fields on the last; nothing is held
back for a chunk that has not arrived; a worker's failure comes after every chunk it sent."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from dynamo_ppd.relay import dispatch
from dynamo_ppd.relay.dispatch import coalesced, merge_waiting

pytestmark = pytest.mark.unit

END = {"token_ids": [9], "index": 0, "finish_reason": "length",
       "completion_usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}


def tok(*ids: int) -> dict:
    return {"token_ids": list(ids), "index": 0}


def test_waiting_token_chunks_fold_into_one_with_the_end_fields_last():
    waiting = deque([tok(1), tok(2, 3), tok(4), dict(END), tok(5)])
    assert merge_waiting(waiting) == {**END, "token_ids": [1, 2, 3, 4, 9]}
    assert list(waiting) == [tok(5)]  # nothing crosses the answer's end


@pytest.mark.parametrize("other", [
    {"token_ids": [], "index": 0, "finish_reason": {"error": "engine failed"}},  # an error stays its own
    {"token_ids": [2], "index": 0, "log_probs": [-0.1]},  # a field that would be lost in a merge
    {"token_ids": [2], "index": 1},  # another choice
    {"token_ids": [2], "disaggregated_params": {"x": 1}},  # a prefill's hand-off
])
def test_chunks_that_cannot_merge_go_out_as_they_came(other):
    waiting = deque([tok(1), other])
    assert merge_waiting(waiting) == tok(1)
    assert merge_waiting(waiting) == other and not waiting


def test_a_chunk_with_extra_fields_is_never_the_head_of_a_merge():
    first = {"token_ids": [1], "index": 0, "log_probs": [-0.5]}
    waiting = deque([first, tok(2)])
    assert merge_waiting(waiting) == first and list(waiting) == [tok(2)]


async def _fast_source(n: int):
    for i in range(n):
        yield tok(i)
    yield {**END, "token_ids": [n]}


async def _drain(stream, pause: float = 0.0) -> list[dict]:
    out = []
    async for chunk in stream:
        out.append(chunk)
        await asyncio.sleep(pause)  # a busy consumer: the worker's chunks pile up meanwhile
    return out


def test_a_slow_consumer_gets_fewer_chunks_with_every_token_in_order():
    out = asyncio.run(_drain(coalesced(_fast_source(200)), pause=0.001))
    tokens = [t for chunk in out for t in chunk["token_ids"]]
    assert tokens == list(range(201))
    assert len(out) < 50  # merged
    assert [c.get("finish_reason") for c in out].count("length") == 1 and out[-1]["finish_reason"] == "length"
    assert out[-1]["completion_usage"] == END["completion_usage"]
    assert all(set(c) == {"token_ids", "index"} for c in out[:-1])


def test_no_chunk_waits_for_one_that_has_not_arrived():
    """The worker sends its next chunk only after the client received the previous one: a relay
    that held a chunk back to merge it with the next would never deliver (the guard fails it)."""

    async def main() -> list[dict]:
        seen = asyncio.Event()

        async def lockstep():
            for i in range(5):
                seen.clear()
                yield tok(i)
                await seen.wait()
            yield dict(END)

        out = []
        async for chunk in coalesced(lockstep()):
            out.append(chunk)
            seen.set()
        return out

    out = asyncio.run(asyncio.wait_for(main(), 30))
    assert out == [tok(0), tok(1), tok(2), tok(3), tok(4), END]


class _Client:
    """A Dynamo endpoint client whose worker sends ``chunks`` then fails (``error``) or ends."""

    def __init__(self, chunks: list[dict], error: Exception | None = None):
        self.chunks, self.error, self.closed = chunks, error, False

    async def direct(self, request, worker, annotated=False, context=None):
        async def stream():
            try:
                for chunk in self.chunks:
                    yield chunk
                if self.error is not None:
                    raise self.error
            finally:
                self.closed = True
        return stream()


def test_a_failure_mid_answer_comes_after_every_chunk_already_sent():
    client = _Client([tok(i) for i in range(30)],
                     ValueError("Unavailable: Stream ended before generation completed"))

    async def main():
        out = []
        with pytest.raises(dispatch.WorkerFailed) as failed:
            async for chunk in dispatch.decode_local(client, {"token_ids": [1]}, 7, None):
                out.append(chunk)
                await asyncio.sleep(0.001)
        return out, failed.value

    out, failure = asyncio.run(main())
    assert [t for c in out for t in c["token_ids"]] == list(range(30))
    assert failure.started and failure.worker == 7  # the router continues the answer elsewhere


def test_a_rejection_before_any_chunk_is_the_clients_error():
    client = _Client([], ValueError("InvalidRequest: ValueError: bad stop condition"))

    async def main():
        async for _chunk in dispatch.decode_local(client, {"token_ids": [1]}, 7, None):
            pass

    with pytest.raises(dispatch.WorkerRejected, match="bad stop condition"):
        asyncio.run(main())


def test_a_consumer_that_goes_away_stops_reading_the_worker():
    async def endless():
        i = 0
        try:
            while True:
                yield tok(i)
                i += 1
                await asyncio.sleep(0)
        finally:
            stopped.set()

    async def main():
        stream = coalesced(endless())
        async for chunk in stream:
            if chunk["token_ids"][-1] >= 10:
                break
        await stream.aclose()
        await asyncio.wait_for(stopped.wait(), 30)

    stopped = asyncio.Event()
    asyncio.run(main())
    assert stopped.is_set()


class _Tracker:
    """Dynamo's FpmEventSubscriber in tracking mode: the latest raw report per (worker, rank)."""

    def __init__(self, stats: dict):
        self.stats, self.calls = stats, 0

    def get_recent_stats(self) -> dict:
        self.calls += 1
        return dict(self.stats)


def test_load_reports_are_the_workers_latest_decoded_when_read():
    import msgspec

    from dynamo_ppd.routing.load_reports import LoadReports

    def raw(worker: int, decode: int) -> bytes:
        return msgspec.msgpack.encode({"worker_id": str(worker), "dp_rank": 0,
                                       "scheduled_requests": {"num_decode_requests": decode}})

    prefill = _Tracker({("11", 0): raw(11, 0)})
    decode = _Tracker({("22", 0): raw(22, 3), ("22", 1): raw(22, 9)})
    reports = LoadReports()
    reports.track(prefill)
    reports.track(decode)
    assert reports.get(22)["scheduled_requests"]["num_decode_requests"] == 3  # the lowest rank
    assert reports.get(11)["worker_id"] == "11" and reports.get(33) is None and reports.get(33, {}) == {}
    decode.stats[("22", 0)] = raw(22, 5)  # a newer report replaces the old one
    assert reports.get(22)["scheduled_requests"]["num_decode_requests"] == 5
    reports[44] = {"worker_id": "44"}  # set directly (the NATS fallback, tests)
    assert reports.get(44) == {"worker_id": "44"}


def test_a_decisions_reports_read_every_tracker_once_whatever_the_number_of_workers():
    import msgspec

    from dynamo_ppd.routing.load_reports import LoadReports

    def raw(worker: int, decode: int) -> bytes:
        return msgspec.msgpack.encode({"worker_id": str(worker),
                                       "scheduled_requests": {"num_decode_requests": decode}})

    prefill = _Tracker({("11", 0): raw(11, 0)})
    decode = _Tracker({("22", 1): raw(22, 9), ("22", 0): raw(22, 3), ("33", 0): raw(33, 4)})
    reports = LoadReports()
    reports.track(prefill)
    reports.track(decode)
    reports[44] = {"worker_id": "44"}
    latest = reports.latest([11, 22, 33, 44, 55])
    assert (prefill.calls, decode.calls) == (1, 1)
    ids = {w: r and r["worker_id"] for w, r in latest.items()}
    assert ids == {11: "11", 22: "22", 33: "33", 44: "44", 55: None}
    assert latest[22]["scheduled_requests"]["num_decode_requests"] == 3  # the lowest rank, whatever the order
    reports.latest([44])
    assert (prefill.calls, decode.calls) == (1, 1)  # set directly: no tracker read
