"""`serve --planner external`: the launcher as Dynamo's VirtualConnectorClient. A stand-in for the
planner (tests/planner_decisions.py) publishes decisions through the runtime's real
VirtualConnectorCoordinator, as Dynamo 1.6.1's planner does, and waits for each to be done; the
graph scales, PPD routes new conversations to the worker that joined, and a scale-in retires the
decode worker holding the least KV. Dynamo's planner itself (`--planner`, the `planner` extra) is
measured in docs/planner.md; CI does not install its ~550 MB of dependencies."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from dynamo_ppd.launch.planner import DECISIONS_FILE
from dynamo_ppd.launch.scaler import read_decisions

HERE = Path(__file__).parent
_SERVED = re.compile(r'^dynamo_ppd_worker_served_requests_total\{route="([^"]+)"\}\s+(\S+)', re.MULTILINE)


def served(record: dict, label: str) -> dict[str, float]:
    """A worker's requests served by route, from its system port's metrics."""
    port = next(p["system_port"] for p in record["processes"] if p["label"] == label)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return {route: float(n) for route, n in _SERVED.findall(response.read().decode())}


class Planner:
    """tests/planner_decisions.py: one coordinator publishing ``steps`` one at a time."""

    def __init__(self, record: dict, *steps: str):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "planner_decisions.py"), record["etcd_url"],
                                      record["nats_url"], record["namespace"], *steps],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.first = True

    def next(self) -> list[str]:
        """Publish the next decision; its ``done`` line once the coordinator saw it completed."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if not self.first:
            self.proc.stdin.write("next\n")
            self.proc.stdin.flush()
        self.first = False
        line = self.proc.stdout.readline()
        assert line.startswith("done "), f"no decision done: {line!r} (exit {self.proc.poll()})"
        return line.split()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


def wait_for(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return value


def conversation(base_url: str, session: str, turns: int = 2) -> None:
    messages: list[dict] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} of {session}: " + "words " * 60})
        body = {"model": "llama-3.1-8b-sim", "max_tokens": 16, "messages": messages}
        answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60,
                            headers={"x-dynamo-session-id": session})
        assert answer.status_code == 200, answer.text
        messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})


def decode_labels(record: dict) -> list[str]:
    return sorted(p["label"] for p in record["processes"] if p["label"].startswith("decode"))


@pytest.mark.slow
@pytest.mark.e2e
def test_the_planners_decisions_scale_the_graph_and_ppd_routes_to_the_new_worker(serve_run):
    run = serve_run("ppd", "--planner", "external", "--replicas", "prefill=1,decode=1")
    record = run.wait_ready()
    assert "scaler" in {p["label"] for p in record["processes"]}
    assert "planner" not in {p["label"] for p in record["processes"]}  # external: someone else's
    conversation(run.base_url, "before-0")

    # Scale-out: the planner asks for a second decode worker; it is started, ready, reported done.
    planner = Planner(record, "decode=2", "decode=1")
    assert planner.next()[1:4] == ["0", "-1", "2"]
    record = run.record()
    assert decode_labels(record) == ["decode", "decode-1"]
    first = read_decisions(run.run_dir / DECISIONS_FILE)[0]
    assert first.added == ["decode-1"] and first.retired == [] and not first.errors
    assert first.before == {"prefill": 1, "decode": 1} and first.completed_at >= first.received_at

    # PPD routes to it: new conversations land on the worker that joined, follow-ups stay there.
    for i in range(6):
        conversation(run.base_url, f"after-{i}")
    joined = served(run.record(), "decode-1")
    assert sum(joined.values()) >= 2, joined

    # Scale-in: back to one decode worker; the one holding less KV leaves, and the graph serves on.
    assert planner.next()[1:4] == ["1", "-1", "1"]
    planner.close()
    second = read_decisions(run.run_dir / DECISIONS_FILE)[1]
    assert second.decision_id == 1 and len(second.retired) == 1 and second.added == [], second
    assert decode_labels(run.record()) == sorted({"decode", "decode-1"} - set(second.retired))
    conversation(run.base_url, "after-scale-in")
    assert "planner decision 1 done" in (run.run_dir / "logs" / "scaler.log").read_text()

    # A restarted planner numbers its decisions from 0 again, and 1.6.1's coordinator takes the
    # old acknowledgement of 0 for the new one: the client still scales, since it reconciles the
    # graph with the decision rather than skipping an id it has seen.
    # (Its decisions live under its etcd lease: they are gone once it exits, so it stays up.)
    restarted = Planner(record, "decode=2")
    assert restarted.next()[1:4] == ["0", "-1", "2"]
    wait_for(lambda: len(decode_labels(run.record())) == 2, 60)
    restarted.close()
    conversation(run.base_url, "after-restart")
    started = time.monotonic()
    assert run.stop() == 0 and time.monotonic() - started < 30
    assert not run.leftover_pids()
