"""What the PPD router's own state costs in CPU, in process: `python -m dynamo_ppd.bench.router_state`.

`bench relay` puts the PPD router at 1.15-1.18x the CPU per relayed token of ``relay-pd``, a bare
relay sending the same requests (turn 1 through the prefill worker, the follow-up decode-local),
and the extra is on Python's main thread. This measures, each against a real server started from
the wheels on loopback, the two pieces of the router's state that it spends most on per
conversation:

- **sessions**: `routing.sessions.EtcdSessions` doing what one conversation of the relay
  benchmark's load makes it do (turn 1: a read-through of its unknown header, the claim, the turn's
  record; turn 2: its record), with the watch delivering each write back, as it does live;
- **KV events**: messages in Dynamo's KV-event envelope (a msgpack envelope whose payload is a
  list of router events, one `stored` of 2 blocks each), published by a separate process and applied
  by this one as the router applies them (a nats-py callback calling `Residency.apply_envelope`),
  paced one message at a time (as the workers publish them) and in bursts.

CPU is this process's (``time.process_time``, every thread) less what it spends idle over the same
wall time (the etcd client's health check, the NATS client's pings). A KV-event message arriving
"one at a time" wakes an idle loop for itself: an upper bound. In the live router the loop is awake
for the stream anyway, and answering residency without nats-py there saved nothing measurable
(docs/bench/relay.md, "Against the same routes").
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from ..launch.launcher import wait_ready
from ..launch.process import free_port, stop_all
from ..launch.servers import etcd_process, nats_process
from ..routing.residency import Residency
from ..routing.sessions import EtcdSessions, SessionRecord

SUBJECT = "ppd-bench.kv-events"
IDLE_S = 2.0  # how long the idle CPU is measured before each part



def kv_event_message(i: int) -> bytes:
    """The ``i``-th message of a worker's stream in Dynamo's KV-event envelope: one `stored` of 2
    blocks whose parent is the last block of message ``i - 1``."""
    blocks = [{"block_hash": i * 8 + k, "tokens_hash": (i * 8 + k) * 7919} for k in range(2)]
    parent = i * 8 - 7 if i else None  # message i - 1's last block
    events = [{"worker_id": 11, "dp_rank": 0,
               "event": {"event_id": i, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}}]
    return msgspec.msgpack.encode({"publisher_id": 1, "sequence": i, "published_at": time.time_ns(),
                                   "topic": "kv-events", "payload": msgspec.msgpack.encode(events)})


async def publish(url: str, subject: str, messages: int, interval_s: float, burst: int) -> None:
    """Publish ``messages`` KV-event messages, ``burst`` back to back, then a pause of ``burst`` x
    ``interval_s``. Run in a separate process (`PUBLISHER`), so its CPU is not counted."""
    import nats

    client = await nats.connect(url)
    for i in range(messages):
        await client.publish(subject, kv_event_message(i))
        if (i + 1) % burst == 0:
            await asyncio.sleep(interval_s * burst)
    await client.flush()
    await client.close()


PUBLISHER = ("import asyncio, sys; from dynamo_ppd.bench.router_state import publish; "
             "asyncio.run(publish(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), "
             "int(sys.argv[5])))")


async def _idle_cpu_per_s() -> float:
    start = time.process_time()
    await asyncio.sleep(IDLE_S)
    return (time.process_time() - start) / IDLE_S


async def sessions_cost(etcd_url: str, conversations: int) -> dict[str, float]:
    """ms of CPU per conversation: in all (watch events included), and per call."""
    sessions = EtcdSessions(etcd_url, "ppd-bench", 3600.0)
    await sessions.start()
    try:
        idle = await _idle_cpu_per_s()
        calls: dict[str, float] = {}

        async def timed(name: str, call) -> None:
            start = time.process_time()
            await call
            calls[name] = calls.get(name, 0.0) + time.process_time() - start

        cpu0, wall0 = time.process_time(), time.perf_counter()
        for i in range(conversations):
            session_id = f"bench-{i}-{time.time_ns()}"
            record = SessionRecord(session_id, decode_worker=11, prefill_worker=1, last_access=time.time())
            await timed("read-through (header unknown)", sessions.read_through(session_id))
            await timed("claim (lease + transaction)", sessions.claim(record))
            for turn, context in ((1, 640), (2, 1184)):
                done = msgspec.structs.replace(record, turn=turn, context_tokens=context,
                                               history_hash=i + turn, history_digest=i + turn,
                                               last_access=time.time())
                await timed(f"turn {turn} record", sessions.commit(done))
            await asyncio.sleep(0.02)  # the watch delivers the writes meanwhile, as between turns live
        await asyncio.sleep(1.0)
        total = time.process_time() - cpu0 - idle * (time.perf_counter() - wall0)
    finally:
        await sessions.stop()
    return {"all, watch events included": total / conversations * 1e3,
            **{name: cpu / conversations * 1e3 for name, cpu in calls.items()}, "idle, ms per s": idle * 1e3}


async def kv_events_cost(nats_url: str, messages: int, interval_s: float, burst: int) -> tuple[float, int]:
    """us of CPU per KV-event message received and applied; and how many were applied."""
    import nats

    residency = Residency(32)

    async def on_message(msg) -> None:
        residency.apply_envelope(msg.data)

    client = await nats.connect(nats_url)
    try:
        await client.subscribe(SUBJECT, cb=on_message)
        idle = await _idle_cpu_per_s()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, nats_url, SUBJECT, str(messages),
                                      str(interval_s), str(burst)])
        while publisher.poll() is None:
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 5.0
        while residency.events_applied < messages and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cpu = time.process_time() - cpu0 - idle * (time.perf_counter() - wall0)
    finally:
        await client.close()
    if publisher.returncode:
        raise RuntimeError(f"the KV-event publisher exited with {publisher.returncode}")
    return cpu / max(residency.events_applied, 1) * 1e6, residency.events_applied


def apply_cost(messages: int) -> float:
    """us of CPU per message for `Residency.apply_envelope` alone (no NATS)."""
    residency, encoded = Residency(32), [kv_event_message(i) for i in range(messages)]
    start = time.process_time()
    for data in encoded:
        residency.apply_envelope(data)
    return (time.process_time() - start) / messages * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.router_state", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=200, help="conversations whose session work "
                        "is timed")
    parser.add_argument("--messages", type=int, default=2000, help="KV-event messages per pacing")
    parser.add_argument("--interval-ms", type=float, default=4.0, help="time between messages (the relay "
                        "benchmark's load brings ~46 a second; a burst waits burst x interval)")
    parser.add_argument("--burst", type=int, default=10, help="messages sent back to back in the burst "
                        "pacing")
    args = parser.parse_args(argv)
    if min(args.conversations, args.messages, args.burst) < 1 or args.interval_ms < 0:
        parser.error("--conversations, --messages and --burst must be >= 1, --interval-ms >= 0")
    import uvloop  # the router's event loop (Dynamo's runtime runs it)

    with tempfile.TemporaryDirectory(prefix="ppd-state-") as tmp:
        work = Path(tmp)
        etcd_port, nats_port = free_port(), free_port()
        servers = [etcd_process(etcd_port, work / "etcd", work / "etcd.log"),
                   nats_process(nats_port, work / "nats", work / "nats.log")]
        try:
            for server in servers:
                server.start()
            wait_ready(servers, log=lambda _message: None)
            sys.stderr.write(f"sessions: {args.conversations} conversations ...\n")
            sessions = uvloop.run(sessions_cost(f"http://127.0.0.1:{etcd_port}", args.conversations))
            kv = {}
            for label, burst in (("one at a time", 1), (f"bursts of {args.burst}", args.burst)):
                sys.stderr.write(f"KV events: {args.messages} messages, {label} ...\n")
                kv[label] = uvloop.run(kv_events_cost(f"nats://127.0.0.1:{nats_port}", args.messages,
                                                      args.interval_ms / 1e3, burst))
        finally:
            stop_all(servers)
    print(f"Sessions (etcd), {args.conversations} conversations, ms of CPU per conversation:\n")
    print("| what | ms |\n|---|---|")
    for name, ms in sessions.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"\nKV events (NATS -> nats-py -> Residency.apply_envelope), {args.messages} messages each, "
          f"{args.interval_ms:g} ms apart on average:\n")
    print("| pacing | messages applied | us of CPU per message |\n|---|---|---|")
    for label, (us, applied) in kv.items():
        print(f"| {label} | {applied} | {us:.0f} |")
    print(f"| `Residency.apply_envelope` alone | {args.messages} | {apply_cost(args.messages):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
