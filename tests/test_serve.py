"""`dynamo-ppd serve` end to end: real NATS, etcd, Dynamo frontend and workers on loopback,
real HTTP requests, then a stop that must leave no process and no etcd registration behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from dynamo_ppd.launch.launcher import wait_ready
from dynamo_ppd.launch.process import ManagedProcess, ReadySpec, free_port, stop_all
from dynamo_ppd.launch.servers import etcd_process, live_dynamo_keys

pytestmark = pytest.mark.e2e


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd the test owns, so it can be inspected after `serve` has stopped."""
    port = free_port()
    proc = etcd_process(port, tmp_path / "etcd-data", tmp_path / "etcd.log")
    proc.start()
    wait_ready([proc], log=lambda _message: None)  # LaunchError if it exits or is not up in 20 s
    yield f"http://127.0.0.1:{port}"
    stop_all([proc])


def stream_chat(base_url: str, model: str, messages: list[dict], max_tokens: int = 16) -> dict:
    """Send a streamed chat completion; return the text, usage, the frontend's worker ids and the
    SSE event names it sent (conditional disaggregation announces `x-bypass-remote-prefill`)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "nvext": {"extra_fields": ["worker_id"]}}
    text, usage, workers, chunks, events = "", None, None, 0, []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                events.append(line[len("event: "):])
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            chunks += 1
            for choice in chunk.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
            usage = chunk.get("usage") or usage
            workers = (chunk.get("nvext") or {}).get("worker_id") or workers
    return {"text": text, "usage": usage, "workers": workers, "chunks": chunks, "events": events}


@pytest.mark.slow
def test_pd_request_goes_prefill_then_decode_and_stop_leaves_nothing(serve_run, own_etcd):
    run = serve_run("pd", "--etcd-url", own_etcd)
    record = run.wait_ready()
    assert {p["label"] for p in record["processes"]} >= {"nats-server", "frontend", "prefill",
                                                        "decode-0", "decode-1", "decode-2"}
    keys = [k.decode() for k, _ in live_dynamo_keys(own_etcd, "dynamo")]

    def instance_ids(component: str) -> set[int]:  # instance keys end in the id, in hex
        prefix = f"v1/instances/dynamo/{component}/generate/"
        return {int(k.rsplit("/", 1)[1], 16) for k in keys if k.startswith(prefix)}

    prefill_ids, decode_ids = instance_ids("prefill"), instance_ids("backend")
    assert len(prefill_ids) == 1 and len(decode_ids) == 3

    result = stream_chat(run.base_url, record["model"],
                         [{"role": "user", "content": "Tell me about disaggregated serving."}])
    assert result["chunks"] > 1 and result["text"]
    assert result["usage"]["completion_tokens"] == 16
    # The frontend reports which workers served the request: the prefill one, then a decode one.
    assert result["workers"]["prefill_worker_id"] in prefill_ids
    assert result["workers"]["decode_worker_id"] in decode_ids
    prefill_log = Path(next(p["log"] for p in record["processes"] if p["label"] == "prefill"))
    assert "request received" in prefill_log.read_text()

    assert run.stop() == 0
    assert "stopped" in run.output()
    assert run.leftover_pids() == []
    assert live_dynamo_keys(own_etcd, "dynamo") == []  # every worker deregistered
    assert run.record()["state"] == "stopped"
    # The logs are files to read: no colour codes, and the launcher's readiness polls (503 from a
    # worker's /health until it serves) are not ERROR lines.
    for proc in record["processes"]:
        text = Path(proc["log"]).read_text()
        assert "\x1b[" not in text, proc["label"]
        assert "503 Service Unavailable" not in text, proc["label"]


@pytest.mark.slow
def test_agg_second_turn_reports_cached_tokens(serve_run):
    run = serve_run("agg")
    record = run.wait_ready()
    assert sum(p["label"].startswith("worker-") for p in record["processes"]) == 4
    messages = [{"role": "user", "content": "Describe the harbour at dawn, the boats, the gulls. " * 12}]
    first = stream_chat(run.base_url, record["model"], messages, max_tokens=24)
    assert first["usage"]["prompt_tokens"] > 64
    messages += [{"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": "And then?"}]
    time.sleep(0.5)  # KV events travel over NATS to the router
    second = stream_chat(run.base_url, record["model"], messages, max_tokens=24)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt, in full 32-token blocks, is reused on the worker that holds it.
    assert cached >= first["usage"]["prompt_tokens"] // 32 * 32
    assert second["workers"]["decode_worker_id"] == first["workers"]["decode_worker_id"]
    assert run.stop() == 0
    assert run.leftover_pids() == []


@pytest.mark.slow
def test_killed_worker_stops_the_run_and_its_lease_is_revoked(serve_run, own_etcd):
    run = serve_run("pd", "--etcd-url", own_etcd)
    record = run.wait_ready()
    victim = next(p for p in record["processes"] if p["label"] == "decode-1")
    os.killpg(victim["pid"], signal.SIGKILL)  # no chance to deregister: its keys stay in etcd
    assert run.proc.wait(60) == 1
    assert "decode-1 exited" in run.output()
    assert "revoked the leases of" in run.output()  # the launcher cleaned up after it
    assert run.leftover_pids() == []
    assert live_dynamo_keys(own_etcd, "dynamo") == []


def test_sigint_during_startup_stops_everything(model_dir, tmp_path):
    from conftest import ServeRun

    run = ServeRun("pd", tmp_path / "run")
    deadline = time.monotonic() + 30
    while not (tmp_path / "run" / "run.json").exists():  # written once workers start
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output()
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(60) == 130
    assert run.leftover_pids() == []


# A stand-in frontend: lists the model on /v1/models, as serve's readiness check wants.
FAKE_FRONTEND = """
import http.server, json, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": sys.argv[2]}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.slow
def test_ctrl_c_of_a_ready_graph_stops_it_and_exits_0(model_dir, tmp_path):
    """Ctrl-C is how a user ends `serve`: a clean stop, not an error (exit 0, one "stopped" line).
    (`uv run just serve` still ends with just's own "error: interrupted by SIGINT" and 130:
    just reports any signal it saw while a recipe ran, whatever the recipe's exit code.)"""
    from conftest import ServeRun

    script = tmp_path / "frontend.py"
    script.write_text(FAKE_FRONTEND)
    graph = tmp_path / "tiny.yaml"
    graph.write_text(f"""
name: tiny
components:
  - name: frontend
    command: ["{{python}}", "{script}", "{{http_port}}", "{{model_name}}"]
""")
    run = ServeRun(str(graph), tmp_path / "run")
    run.wait_ready()
    run.proc.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
    assert run.proc.wait(60) == 0
    lines = run.output().strip().splitlines()
    assert lines[-1] == "stopped: no process of the run is left"
    assert sum(line.startswith("stopped") for line in lines) == 1
    assert not any("error" in line.lower() or "Traceback" in line for line in lines), lines
    assert run.leftover_pids() == []


def test_process_group_is_stopped_with_its_children(tmp_path):
    """Stopping a process also stops what it spawned (its whole session)."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")

    proc = ManagedProcess("parent", [sys.executable, "-c", script], env=dict(os.environ),
                          log_path=tmp_path / "p.log", stop_timeout_s=5)
    proc.start()
    time.sleep(0.5)
    assert stop_all([proc]) == []
    from dynamo_ppd.launch.process import group_alive

    assert not group_alive(proc.pid)


@pytest.mark.slow
def test_killed_launcher_leaves_no_orphans(serve_run, own_etcd):
    """Even a SIGKILLed launcher leaves nothing running: children get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and deregister as on a normal stop."""
    run = serve_run("pd", "--etcd-url", own_etcd)
    run.wait_ready()
    run.proc.kill()
    run.proc.wait(10)
    deadline = time.monotonic() + 30
    while run.leftover_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.leftover_pids() == []
    assert live_dynamo_keys(own_etcd, "dynamo") == []


def _prefill_tokens_charged(record: dict, label: str) -> int:
    """A simulated worker's count of prompt tokens it computed, from its Prometheus metrics."""
    port = next(p["system_port"] for p in record["processes"] if p["label"] == label)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("dynamo_ppd_engine_prefill_tokens_total"))


@pytest.mark.slow
def test_cond_disagg_bypasses_prefill_and_charges_the_append(serve_run):
    """Dynamo's own conditional disaggregation sends the follow-up turn straight to the decode
    worker holding the history, which computes only the tokens it does not hold."""
    run = serve_run("cond-disagg")
    record = run.wait_ready()
    messages = [{"role": "user", "content": "Describe the harbour at dawn, the boats, the gulls. " * 12}]
    first = stream_chat(run.base_url, record["model"], messages, max_tokens=24)
    assert "prefill_worker_id" in first["workers"]  # turn 1 went through the prefill worker
    decode_labels = [p["label"] for p in record["processes"] if p["label"].startswith("decode")]
    before = {label: _prefill_tokens_charged(record, label) for label in decode_labels}
    assert sum(before.values()) == 0  # turn 1's KV arrived by transfer, nothing computed on D

    messages += [{"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": "And then?"}]
    time.sleep(0.5)  # the decode worker's KV events reach the frontend's router
    second = stream_chat(run.base_url, record["model"], messages, max_tokens=24)
    assert "x-bypass-remote-prefill" in second["events"]
    assert "prefill_worker_id" not in second["workers"]
    assert second["workers"]["decode_worker_id"] == first["workers"]["decode_worker_id"]
    usage = second["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] // 32 * 32
    charged = sum(_prefill_tokens_charged(record, label) for label in decode_labels)
    assert charged == usage["prompt_tokens"] - cached  # only the append was computed
    assert run.stop() == 0


@pytest.mark.e2e
def test_a_restarted_process_is_ready_by_its_own_log_line_not_the_last_runs(tmp_path):
    """The log is appended across restarts: a log-ready process started again is ready only once
    this start has printed the line (the picker's restart test read the old one and raced)."""
    script = "import sys, time; time.sleep(float(sys.argv[1])); print('up now', flush=True); time.sleep(60)"
    proc = ManagedProcess("late", [sys.executable, "-c", script, "0"], env=dict(os.environ),
                          log_path=tmp_path / "late.log", ready=ReadySpec(log="up now"), stop_timeout_s=5)
    proc.start()
    deadline = time.monotonic() + 20
    while not proc.is_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.is_ready()
    stop_all([proc])
    proc.argv[-1] = "3"  # the next start prints its line only after 3 s
    proc.start()
    try:
        assert not proc.is_ready()
    finally:
        stop_all([proc])
