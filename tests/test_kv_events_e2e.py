"""The KV events' own thread against a real NATS server: every message is applied there, not on
the router's loop; a burst of them does not hold up that loop; a NATS restart is reported so
the residency is rebuilt; stop ends the thread."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import pytest

from dynamo_ppd.launch.launcher import wait_ready
from dynamo_ppd.launch.process import free_port, stop_all
from dynamo_ppd.launch.servers import nats_process
from dynamo_ppd.routing.kv_events import KvEventThread

pytestmark = pytest.mark.e2e


def _nats(tmp_path, port: int):
    proc = nats_process(port, tmp_path / "nats-data", tmp_path / "nats.log")
    proc.start()
    wait_ready([proc], log=lambda _message: None)  # LaunchError if it exits or is not up in 20 s
    return proc


def test_kv_events_are_applied_on_their_own_thread_and_never_queue_on_the_loop(tmp_path):
    port = free_port()
    server = _nats(tmp_path, port)
    url = f"nats://127.0.0.1:{port}"
    applied: list[tuple[bytes, str]] = []
    reconnects: list[str] = []
    burst = 3000

    def apply(data: bytes) -> None:
        applied.append((data, threading.current_thread().name))
        time.sleep(0.0002)  # a message's worth of work, GIL released as a real one partly is

    events = KvEventThread(url, ["kv.a", "kv.b"], apply,
                           lambda: reconnects.append(threading.current_thread().name))

    async def scenario() -> float:
        await asyncio.to_thread(events.start)
        publisher = await nats.connect(url)
        try:
            for i in range(burst):
                await publisher.publish("kv.a" if i % 2 else "kv.b", str(i).encode())
            await publisher.flush()
            # While the burst is applied (~0.6 s of work), this loop answers within milliseconds.
            worst = 0.0
            deadline = time.monotonic() + 20
            while len(applied) < burst and time.monotonic() < deadline:
                started = time.perf_counter()
                await asyncio.sleep(0)
                worst = max(worst, time.perf_counter() - started)
                await asyncio.sleep(0.001)
            return worst
        finally:
            await publisher.close()

    try:
        worst = asyncio.run(scenario())
        assert len(applied) == burst
        assert {name for _, name in applied} == {"ppd-kv-events"}
        assert sorted(int(data) for data, _ in applied) == list(range(burst))
        assert worst < 0.05, f"the loop waited {worst * 1e3:.1f} ms behind the KV events"
        # NATS restarts: the thread's connection comes back and says so (a rebuild is due).
        stop_all([server])
        server = _nats(tmp_path, port)
        deadline = time.monotonic() + 15
        while not reconnects and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reconnects == ["ppd-kv-events"]
    finally:
        events.stop()
        stop_all([server])
    assert not events._thread.is_alive()


def test_a_thread_that_cannot_connect_says_so_at_start(tmp_path):
    events = KvEventThread(f"nats://127.0.0.1:{free_port()}", ["kv.a"], lambda data: None, lambda: None)
    with pytest.raises(Exception):  # noqa: B017 (nats-py's own connection error)
        events.start()
