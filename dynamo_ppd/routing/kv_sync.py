"""Keeps the residency index true: the I/O around the pure `Residency`.

- Live events: the workers' KV events over NATS, applied as they come, on a thread of their own
  (`kv_events.KvEventThread`) so that they never queue in front of a request on the router's
  loop. The index is changed there and here (rebuilds, forgotten workers) under `KvSync.lock`;
  a request's reads take no lock (each is a dict lookup, atomic under the GIL).
- Rebuilds: a worker's view is rebuilt from the worker's own state when this router starts, when
  NATS reconnects, when the worker's event ids jump, when it stores a block under a parent the index
  never saw (an orphan), and when it appears in discovery. Workers that leave discovery are
  forgotten. A rebuild that still leaves orphans is retried, then the worker is reported as
  "residency unknown" (log and `ppd_residency_unknown_workers`), never taken as final.
- Silent workers: a decode worker that serves turns but never publishes a KV event (TensorRT-LLM
  started without ``--publish-kv-events``) makes every follow-up go through prefill; that is said
  once per worker in the log and in `ppd_kv_silent_workers`.

Where a worker's state comes from. Every `KvEventPublisher` built with ``enable_local_indexer``
(TensorRT-LLM's and vLLM's publishers, and our simulated worker) keeps a worker-local indexer and
serves it on the endpoint ``worker_kv_query_source_<publisher id hex>`` of its component (Dynamo
1.6.1, lib/llm/src/kv_router/indexer/recovery/worker_query_endpoint.rs), advertised in discovery
under ``v1/event_sources/...`` with a ``recovery_target``. Its answer (``WorkerKvQueryResponse``:
``Events``/``TreeDump``/``TooNew``/``InvalidRange``/...) is a bare serde enum, not an ``Annotated``
frame, and the Python request-plane client drops it (``client.direct`` yields
``Annotated(data=<no_data>)``; verified on 1.6.1). So we let Dynamo's own router do the query: a
`dynamo._core.KvRouter` per worker component subscribes to the same events, recovers every worker
it discovers from that endpoint (and again on its own event-id gaps), and ``dump_events()`` returns
its tree as KV events, which `Residency.replace_worker` rebuilds our view from. That is exactly the
recovery Dynamo's frontend does, so it works wherever Dynamo's KV routing does, TensorRT-LLM
included (what it needs from the workers: README, "Residency recovery").
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .kv_events import KvEventThread
from .metrics import RoutingMetrics
from .residency import Residency, kv_events_subject

log = logging.getLogger("dynamo_ppd.routing.kv_sync")

POLL_S = 0.5  # discovery poll: how soon a new worker is rebuilt and a gone one forgotten
SILENT_AFTER_S = 30.0  # a decode worker busy this long with no KV event ever is "silent"
# Rebuild schedule (seconds to wait before each try). Two tries even when the first leaves no orphan:
# Dynamo's router may itself still be recovering the worker when the first dump is taken.
FIRST_DELAY_S = {"start": 0.5, "discovered": 0.5, "nats_reconnect": 0.5}
DEFAULT_FIRST_DELAY_S = 0.2
CONFIRM_DELAY_S = 1.5
RETRY_DELAYS_S = (1.0, 2.0, 4.0)  # further tries while orphans are left
DUMP_REUSE_S = 0.05  # one dump serves every worker of the component rebuilt at the same moment


class SilenceWatch:
    """Pure: which decode workers served turns for a while without a single KV event."""

    def __init__(self, after_s: float = SILENT_AFTER_S):
        self.after_s = after_s
        self._busy_since: dict[int, float] = {}
        self.silent: set[int] = set()

    def observe(self, worker: int, now: float, busy: bool, has_state: bool) -> str | None:
        """``busy``: the worker is serving (or has served) turns; ``has_state``: any KV event or
        any recovered block. Returns "silent" the first time the worker is found silent, "heard"
        when a silent one is heard from, else None."""
        if has_state:
            self._busy_since.pop(worker, None)
            if worker in self.silent:
                self.silent.discard(worker)
                return "heard"
            return None
        if busy:
            self._busy_since.setdefault(worker, now)
        since = self._busy_since.get(worker)
        if since is not None and worker not in self.silent and now - since >= self.after_s:
            self.silent.add(worker)
            return "silent"
        return None

    def forget(self, worker: int) -> None:
        self._busy_since.pop(worker, None)
        self.silent.discard(worker)


class KvSync:
    def __init__(self, runtime, residency: Residency, metrics: RoutingMetrics, namespace: str,
                 components: dict[str, str], clients: dict[str, Any], busy: Callable[[int], bool],
                 poll_s: float = POLL_S, silent_after_s: float = SILENT_AFTER_S, recovery: bool = True,
                 event_source: Callable[..., Any] = KvEventThread):
        self.runtime = runtime
        self.residency = residency
        self.metrics = metrics
        self.namespace = namespace
        self.components = components  # role -> component name
        self.clients = clients  # role -> Dynamo client of the component's generate endpoint
        self.busy = busy
        self.poll_s = poll_s
        self.recovery = recovery  # False: no rebuilds, live events only (--no-residency-recovery)
        self.silence = SilenceWatch(silent_after_s)
        self._sources: dict[str, Any] = {}  # component -> Dynamo KvRouter (the recovery source)
        self._dumps: dict[str, tuple[float, list[dict]]] = {}
        self._known: dict[str, set[int]] = {role: set() for role in components}
        self._component_of: dict[int, str] = {}
        self._pending: dict[int, asyncio.Task] = {}
        self._again: dict[int, str] = {}  # worker -> a rebuild asked for while one was running
        self._unknown: set[int] = set()
        self._counted = (0, 0)  # residency.orphans, residency.gaps already in the metrics
        self._tasks: list[asyncio.Task] = []
        self._first_poll = True
        self.lock = threading.Lock()  # the residency index's writers: the event thread and this loop
        self._events: Any = None  # the KvEventThread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_asked = False  # a `_drain` is scheduled on the loop and has not run yet
        self._event_source = event_source  # `KvEventThread`'s signature (tests pass a stand-in)

    async def start(self, nats_url: str) -> None:
        from dynamo._core import KvRouter, KvRouterConfig

        self._loop = asyncio.get_running_loop()

        block_size = self.residency.block_size
        if not self.recovery:
            log.info("--no-residency-recovery: residency is what KV events say from now on")
        for component in self.components.values() if self.recovery else ():
            try:
                # Indexing only: no load tracking (we never route through it), one indexer thread;
                # conditional_disagg_enabled makes it index a decode endpoint's events too.
                config = KvRouterConfig(conditional_disagg_enabled=True, router_track_active_blocks=False,
                                        router_track_prefill_tokens=False, router_event_threads=1)
                self._sources[component] = KvRouter(
                    self.runtime.endpoint(f"{self.namespace}.{component}.generate"), block_size, config)
            except Exception as exc:  # noqa: BLE001 (recovery off is said, routing goes on)
                log.warning("no worker-local indexer recovery for %s.%s (%s): residency there is "
                            "only what events say after this router started", self.namespace, component, exc)
        self._events = self._event_source(
            nats_url, [kv_events_subject(self.namespace, c) for c in self.components.values()],
            self._on_kv_event, self._reconnected_elsewhere)
        await asyncio.to_thread(self._events.start)
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_loop()))

    async def settled(self, timeout_s: float = 10.0) -> bool:
        """Wait (at most ``timeout_s``) until the workers discovery lists now have had their
        residency rebuilt from their own indexers: a restarted shell that serves before then
        sends follow-ups through prefill although their decode workers hold them. True if so."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = any(client.instance_ids() for role, client in self.clients.items()
                         if role in self._known)
            if not self._first_poll and not self._pending and (listed or not self._sources):
                self.poll(time.monotonic())  # whatever discovery added since the last poll
                if not self._pending:
                    return True
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        if self._events is not None:
            await asyncio.to_thread(self._events.stop)
        for task in [*self._tasks, *self._pending.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pending.values(), return_exceptions=True)
        self._tasks.clear()
        self._pending.clear()
        self._sources.clear()

    def reconnected(self) -> None:
        """NATS came back: what was published meanwhile is lost to us; rebuild every worker."""
        for worker in list(self._component_of):
            self.request(worker, "nats_reconnect")

    # -- live events -----------------------------------------------------------------------------
    def _on_kv_event(self, data: bytes) -> None:
        """One NATS message, on the event thread: applied under the lock; the loop is told only
        when the index asks for a rebuild or counted a gap or an orphan."""
        with self.lock:
            applied = self.residency.apply_envelope(data)
            news = (bool(self.residency.resync_requests)
                    or (self.residency.orphans, self.residency.gaps) != self._counted)
        self.metrics.kv_events.inc(applied)
        if news:
            self._on_loop(self._drain)

    def _on_loop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the router's loop (from the event thread), once per burst."""
        if self._loop is None or self._drain_asked:
            return
        self._drain_asked = True

        def run() -> None:
            self._drain_asked = False
            callback()

        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop is closed: the router is stopping
            pass

    def _reconnected_elsewhere(self) -> None:
        """The event thread's NATS connection came back (on the event thread)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.reconnected)
            except RuntimeError:
                pass

    def _drain(self) -> None:
        with self.lock:
            orphans, gaps = self.residency.orphans, self.residency.gaps
            requests = self.residency.take_resync_requests()
        if orphans > self._counted[0]:
            self.metrics.residency_orphans.inc(orphans - self._counted[0])
        if gaps > self._counted[1]:
            self.metrics.residency_gaps.inc(gaps - self._counted[1])
        self._counted = (orphans, gaps)
        for worker, reason in requests.items():
            self.request(worker, reason)

    # -- rebuilds --------------------------------------------------------------------------------
    def request(self, worker: int, reason: str) -> None:
        """Rebuild ``worker``'s view soon (one rebuild in flight per worker; an ask while one runs
        starts another when it ends, so no trigger is lost)."""
        if not self._sources:
            return
        if worker in self._pending:
            self._again.setdefault(worker, reason)
            return
        task = asyncio.get_running_loop().create_task(self._rebuild(worker, reason))
        self._pending[worker] = task
        task.add_done_callback(lambda _task: self._forget_task(worker, _task))

    def _forget_task(self, worker: int, task: asyncio.Task) -> None:
        if self._pending.get(worker) is task:
            del self._pending[worker]
            again = self._again.pop(worker, None)
            if again is not None and not task.cancelled():
                self.request(worker, again)

    async def _rebuild(self, worker: int, reason: str) -> None:
        delays = [FIRST_DELAY_S.get(reason, DEFAULT_FIRST_DELAY_S), CONFIRM_DELAY_S, *RETRY_DELAYS_S]
        left = 0
        try:
            for attempt, delay in enumerate(delays):
                # Events from now on are replayed over the dump; those before are the dump's to
                # tell (what the trigger says we may have missed happened before it).
                with self.lock:
                    since = self.residency.mark()
                await asyncio.sleep(delay)
                dump = await self._dump_for(worker)
                if dump is None:
                    return  # no source for it (recovery off, said at start)
                with self.lock:
                    left = self.residency.replace_worker(worker, dump, since)
                if attempt == 0:
                    self.metrics.residency_resyncs.labels(reason).inc()
                    log.info("rebuilt the residency of worker %x from its local indexer (%s): %d "
                             "blocks", worker, reason, self.residency.block_count(worker))
                if left == 0 and attempt >= 1:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (a failed rebuild is retried by the next trigger)
            log.warning("could not rebuild the residency of worker %x (%s): %s", worker, reason, exc)
            return
        if left:
            if worker not in self._unknown:
                log.warning("residency of worker %x unknown: %d blocks were stored under parents "
                            "neither its events nor its local indexer place; turns there are "
                            "routed as if it held only what it proved", worker, left)
            self._unknown.add(worker)
        else:
            self._unknown.discard(worker)
        self.metrics.residency_unknown.set(len(self._unknown))

    async def _dump_for(self, worker: int) -> list[dict] | None:
        component = self._component_of.get(worker)
        components = [component] if component in self._sources else list(self._sources)
        if not components:
            return None
        events: list[dict] = []
        for name in components:
            for router_event in await self._dump(name):
                if router_event.get("worker_id") == worker:
                    events.append(router_event["event"])
        return events

    async def _dump(self, component: str) -> list[dict]:
        cached = self._dumps.get(component)
        now = time.monotonic()
        if cached and now - cached[0] < DUMP_REUSE_S:
            return cached[1]
        text = await self._sources[component].dump_events()
        # A big tree is megabytes of JSON: parse it off the event loop that routes requests.
        events = await asyncio.to_thread(json.loads, text) if len(text) > 1 << 20 else json.loads(text)
        self._dumps[component] = (time.monotonic(), events)
        return events

    # -- discovery and silence -------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            try:
                self.poll(time.monotonic())
            except Exception:  # noqa: BLE001 (the loop must outlive one bad poll)
                log.exception("residency discovery poll failed")
            await asyncio.sleep(self.poll_s)

    def poll(self, now: float) -> None:
        reason = "start" if self._first_poll else "discovered"
        self._first_poll = False
        for role, client in self.clients.items():
            if role not in self._known:
                continue
            ids = set(client.instance_ids())
            for worker in ids - self._known[role]:
                self._component_of[worker] = self.components[role]
                self.request(worker, reason)
            for worker in self._known[role] - ids:
                self._forget(worker)
            self._known[role] = ids
        self._drain()
        for worker in self._known.get("decode", ()):
            has_state = self.residency.has_events(worker) or self.residency.block_count(worker) > 0
            change = self.silence.observe(worker, now, self.busy(worker), has_state)
            if change == "silent":
                log.warning("decode worker %x has served turns for %.0f s without publishing one KV "
                            "event, and its local indexer holds nothing: its follow-ups cannot run "
                            "decode-local (every turn goes through prefill). Start it with KV events "
                            "on (TensorRT-LLM: --publish-kv-events; README, Residency recovery)",
                            worker, self.silence.after_s)
            elif change == "heard":
                log.info("decode worker %x publishes KV events now", worker)
        self.metrics.kv_silent_workers.set(len(self.silence.silent))

    def _forget(self, worker: int) -> None:
        """The worker left discovery: forget its residency (a restarted engine has a new id)."""
        self._again.pop(worker, None)
        task = self._pending.pop(worker, None)
        if task is not None:
            task.cancel()
        with self.lock:
            self.residency.forget_worker(worker)
        self.silence.forget(worker)
        self._component_of.pop(worker, None)
        self._unknown.discard(worker)
        self.metrics.residency_unknown.set(len(self._unknown))
        log.info("worker %x left discovery: its residency is forgotten", worker)

