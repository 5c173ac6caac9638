"""The workers' KV events on a thread of their own, so that they never queue in front of a pick.

Workers publish a KV event message for every batch of blocks they store or remove: on the relay
benchmark's load about one message per eight answer tokens, and a burst at every long prefill.
The NATS client that delivers them (nats-py) runs on an asyncio loop; on the router's own loop
each message would be a callback between two requests, and a burst of them a queue that a request
waits behind. `KvEventThread` runs a loop and a NATS connection of its own on a daemon thread and
hands each message to ``apply`` there. Whoever shares state with ``apply`` guards it with a lock
(`kv_sync.KvSync` does: the residency index) and tells the router's loop, with
``call_soon_threadsafe``, only when something needs doing there.

The thread still takes the GIL to apply a message (a few microseconds each), so the router's loop
is never blocked behind a queue of them, only interleaved with one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("dynamo_ppd.routing.kv_sync")

START_TIMEOUT_S = 10.0  # how long `start` waits for the thread's connection and subscriptions
STOP_TIMEOUT_S = 2.0


class KvEventThread:
    """Subscribe to ``subjects`` on ``nats_url`` from a thread of its own; ``apply(data)`` gets
    every message's payload there, ``on_reconnect()`` is called there after a reconnection (what
    was published meanwhile is lost to the subscriber)."""

    def __init__(self, nats_url: str, subjects: Sequence[str], apply: Callable[[bytes], None],
                 on_reconnect: Callable[[], None], name: str = "ppd-kv-events"):
        self.nats_url = nats_url
        self.subjects = list(subjects)
        self._apply = apply
        self._on_reconnect = on_reconnect
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        """Start the thread and wait until it is subscribed; raise what kept it from connecting."""
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"KV events: not subscribed to NATS at {self.nats_url} within "
                               f"{START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Close the connection and end the thread (blocking, at most `STOP_TIMEOUT_S`)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 (reported to `start`, or logged once started)
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.exception("the KV event thread stopped")
        finally:
            loop.close()

    async def _main(self) -> None:
        import nats

        self._stop = asyncio.Event()

        async def reconnected() -> None:
            self._on_reconnect()

        connection: Any = await nats.connect(self.nats_url, max_reconnect_attempts=-1,
                                             reconnect_time_wait=1, reconnected_cb=reconnected)
        try:
            for subject in self.subjects:
                await connection.subscribe(subject, cb=self._on_message)
            self._ready.set()
            await self._stop.wait()
        finally:
            await connection.close()

    async def _on_message(self, msg: Any) -> None:
        try:
            self._apply(msg.data)
        except Exception:  # noqa: BLE001 (one bad message must not stop the subscription)
            log.exception("could not apply a KV event message")
