"""`picker.budget.TokenizeBudget`: one request's tokenization is bounded on the picker's path. A
large one runs off the event loop (other requests are answered meanwhile), gives up at the
deadline, and one predicted from the measured throughput to miss it is not started."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dynamo_ppd.picker.budget import PROBE_EVERY_S, OverBudget, TokenizeBudget

pytestmark = pytest.mark.unit


def slow(seconds: float, result: str = "ids"):
    def work() -> str:
        time.sleep(seconds)  # as tokenizers' encode: the GIL is released while it works
        return result
    return work


async def test_small_bodies_run_inline_and_large_ones_on_the_worker_thread():
    budget = TokenizeBudget(deadline_s=1.0, offload_bytes=1000)
    assert await budget.run(999, threading.current_thread) is threading.current_thread()
    assert await budget.run(1000, threading.current_thread) is not threading.current_thread()
    budget.close()


async def test_a_tokenization_past_the_deadline_gives_up_and_the_loop_kept_answering():
    budget = TokenizeBudget(deadline_s=0.2, offload_bytes=1)
    ticks = 0

    async def other_requests():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(other_requests())
    started = time.monotonic()
    with pytest.raises(OverBudget) as info:
        await budget.run(10_000, slow(0.6))
    took = time.monotonic() - started
    ticker.cancel()
    assert info.value.reason == "over_deadline" and 0.2 <= took < 0.4
    assert ticks >= 10  # the event loop was free while the worker thread tokenized
    budget.close()


async def test_a_measured_throughput_predicts_and_refuses_what_cannot_fit_but_probes_again():
    now = [0.0]
    budget = TokenizeBudget(deadline_s=0.2, offload_bytes=1, now=lambda: now[0])
    assert await budget.run(100_000, slow(0.1)) == "ids"  # ~1 MB/s measured
    assert budget.bytes_per_s is not None and 0.5e6 < budget.bytes_per_s <= 1.0e6
    calls = []

    def quick() -> str:
        calls.append(1)
        return "ids"

    # ~1 s predicted: the first such body, the thread idle, is a probe (measured again)...
    assert await budget.run(1_000_000, quick) == "ids" and calls == [1]
    assert budget.bytes_per_s is not None and budget.bytes_per_s > 1.0e6  # it was quick: the estimate rose
    budget.bytes_per_s = 1e6  # (as if the probe had been slow too)
    with pytest.raises(OverBudget) as info:  # ...the next, within PROBE_EVERY_S, is refused
        await budget.run(1_000_000, quick)
    assert info.value.reason == "predicted_over_deadline" and calls == [1]
    assert await budget.run(50_000, slow(0.05)) == "ids"  # predicted to fit: run
    now[0] += PROBE_EVERY_S + 1
    assert await budget.run(1_000_000, quick) == "ids" and calls == [1, 1]  # probed again
    budget.close()


async def test_no_deadline_runs_everything_inline():
    budget = TokenizeBudget(deadline_s=0)
    assert await budget.run(10 << 20, threading.current_thread) is threading.current_thread()
