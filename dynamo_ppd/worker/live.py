"""The engine model on a wall clock: an asyncio loop that runs `Engine` iterations in real time.

The model clock is ``time.time() * speedup``, shared by every worker on the machine, so a
transfer's ``kv_ready_at`` computed on a prefill worker means the same instant on a decode worker.
While the engine stays busy, each iteration starts exactly where the previous one ended on the
model timeline (sleep overshoot does not accumulate into drift); after an idle spell the timeline
resumes at the current time. Nothing here knows about Dynamo.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..engine.kv_cache import KvEvent
from ..engine.scheduler import Engine, EngineRequest, Iteration, TokenOutput
from ..runtime import stop_task

log = logging.getLogger(__name__)

# Further behind the model timeline than this (CPU starvation), resynchronise instead of catching up.
MAX_LAG_S = 0.5


class WallClockEngine:
    def __init__(self, engine: Engine, speedup: float = 1.0,
                 on_kv_events: Callable[[list[KvEvent]], None] | None = None,
                 on_iteration: Callable[[Iteration], None] | None = None):
        self.engine = engine
        self.speedup = speedup
        self._on_kv_events = on_kv_events
        self._on_iteration = on_iteration
        self._queues: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wakeup = asyncio.Event()
        self._free_at = 0.0  # model time at which the last iteration ended
        self._busy = False
        self._task: asyncio.Task | None = None

    def model_now(self) -> float:
        return time.time() * self.speedup

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        await stop_task(self._task)

    def submit(self, request: EngineRequest) -> asyncio.Queue[TokenOutput]:
        """Queue a request (RequestRejected if it can never run); its outputs arrive on the queue."""
        self.engine.submit(request, self.model_now())
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wakeup.set()
        return queue

    def cancel(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        if self.engine.cancel(request_id):
            self._flush_kv_events()

    async def _run(self) -> None:
        while True:
            now = self.model_now()
            if self._busy and now - self._free_at < MAX_LAG_S * self.speedup:
                now = self._free_at
            outputs, iteration = self.engine.step(now)
            self._deliver(outputs)
            self._flush_kv_events()
            if iteration is None:
                self._busy = False
                await self._idle()
                continue
            end = iteration.started_at + iteration.duration_s
            delay = (end - self.model_now()) / self.speedup
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let handlers run even when we are behind
            self._free_at, self._busy = end, True
            self._deliver(self.engine.finish(iteration, end))
            self._flush_kv_events()
            if self._on_iteration:
                self._on_iteration(iteration)

    async def _idle(self) -> None:
        """Sleep until a request arrives or a transfer lands."""
        self._wakeup.clear()
        wake = self.engine.next_wakeup()
        timeout = None if wake is None else max(0.0, (wake - self.model_now()) / self.speedup)
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]

    def _flush_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if events and self._on_kv_events:
            try:
                self._on_kv_events(events)
            except Exception:  # noqa: BLE001 (a publisher hiccup must not stop serving)
                log.exception("publishing %d KV events failed", len(events))
