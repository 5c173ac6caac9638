"""What the session writes cost against a real etcd: `python -m dynamo_ppd.bench.sessions`.

A turn's record is written to etcd before the answer's stream ends (`EtcdSessions.commit`: one
put and one lease keep-alive, concurrently), so it adds to end-of-stream latency, not to TTFT. A
header whose session this replica has not seen costs one etcd get (`read_through`) before the
route is decided: that one adds to the TTFT of a new conversation's first turn. Starts its own
etcd on a free loopback port (or uses --etcd-url) and prints percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from ..routing.sessions import EtcdSessions, SessionRecord


async def measure(etcd_url: str, n: int) -> dict[str, list[float]]:
    sessions = EtcdSessions(etcd_url, prefix="bench-sessions")
    await sessions.start()
    out: dict[str, list[float]] = {"first-turn claim": [], "commit (end of stream)": [],
                                   "read-through, miss": [], "read-through, hit": []}
    try:
        for i in range(n):
            record = SessionRecord(f"bench-{i}", decode_worker=1, turn=1, context_tokens=2048,
                                   history_hash=i, history_digest=i, last_access=time.time())
            steps = (("read-through, miss", sessions.read_through, record.session_id),
                     ("first-turn claim", sessions.claim, record),
                     ("commit (end of stream)", sessions.commit, record),
                     ("read-through, hit", sessions.read_through, record.session_id))
            for label, call, arg in steps:
                start = time.perf_counter()
                await call(arg)  # type: ignore[operator,arg-type]
                out[label].append((time.perf_counter() - start) * 1e3)
    finally:
        await sessions.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.sessions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etcd-url", help="an etcd to use (default: start one on loopback)")
    parser.add_argument("--sessions", type=int, default=500, help="sessions to write and read")
    args = parser.parse_args(argv)
    proc = None
    url = args.etcd_url
    if url is None:
        from ..launch.launcher import wait_ready
        from ..launch.process import free_port, stop_all
        from ..launch.servers import etcd_process

        port, tmp = free_port(), Path(tempfile.mkdtemp(prefix="bench-sessions-"))
        proc = etcd_process(port, tmp / "data", tmp / "etcd.log")
        proc.start()
        wait_ready([proc], log=lambda _message: None)
        url = f"http://127.0.0.1:{port}"
    try:
        results = asyncio.run(measure(url, args.sessions))
    finally:
        if proc is not None:
            stop_all([proc])
    print(f"{args.sessions} sessions, etcd at {url}")
    print(f"{'operation':<26}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}")
    for label, samples in results.items():
        q = statistics.quantiles(samples, n=100)
        print(f"{label:<26}{q[49]:>9.2f}{q[89]:>9.2f}{q[98]:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
