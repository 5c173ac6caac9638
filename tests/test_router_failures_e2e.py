"""Failures end to end (Dynamo's frontend -> router -> simulated workers, real NATS/etcd/HTTP): a
prompt over the model's context window is a 400 that no worker sees, and a decode worker killed
mid-answer does not cut the client's stream."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from test_router import _log, chat, deploy, metrics, sessions_in

pytestmark = pytest.mark.e2e


def requests_seen_by_workers(dep) -> float:
    """Requests every worker's generate endpoint received (Dynamo's own per-endpoint counter)."""
    total = 0.0
    for proc in dep.workers:
        if proc.label.startswith(("prefill", "decode")):
            text = httpx.get(f"http://127.0.0.1:{proc.env['DYN_SYSTEM_PORT']}/metrics", timeout=10).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("dynamo_component_requests_total")
                         and 'dynamo_endpoint="generate"' in line)
    return total


@pytest.fixture(scope="module")
def dep(model_dir, tmp_path_factory):
    deployment = deploy(tmp_path_factory.mktemp("failures"), model_dir, mode="local", decode=2)
    yield deployment
    deployment.stop()


def test_a_prompt_over_the_context_window_is_a_400_that_no_worker_sees(dep):
    chat(dep, [{"role": "user", "content": "warm up"}], "warm-up")  # counters exist
    before = requests_seen_by_workers(dep)
    assert before >= 2  # the warm-up went through the prefill and a decode worker
    url = f"{dep.base_url}/v1/chat/completions"
    huge = " ".join(["harbour"] * 150_000)  # a 150k-word chat message
    started = time.monotonic()
    response = httpx.post(url, json={"model": dep.model_name, "max_tokens": 16,
                                     "messages": [{"role": "user", "content": huge}]}, timeout=120)
    assert response.status_code == 400, response.text
    assert "maximum context length is 131072 tokens" in response.text
    print(f"150k-word message: HTTP {response.status_code} after {time.monotonic() - started:.2f} s")
    endless = httpx.post(url, json={"model": dep.model_name, "max_tokens": 200_000,
                                    "messages": [{"role": "user", "content": "hello"}]}, timeout=30)
    assert endless.status_code == 400 and "in the completion" in endless.text
    assert requests_seen_by_workers(dep) == before  # no worker received any part of either
    assert chat(dep, [{"role": "user", "content": "still fine?"}], "after-limits")["usage"]


def test_a_decode_worker_killed_mid_answer_does_not_cut_the_stream(dep):
    messages = [{"role": "user", "content": "Tell me about the harbour and its ships. " * 20}]
    first = chat(dep, messages, "migrate")
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Go on."}]
    time.sleep(0.3)
    [record] = [r for r in sessions_in(dep.endpoints.etcd_url).values() if r.session_id == "migrate"]
    victim = next(p for p in dep.workers if p.label.startswith("decode")
                  and f"as instance {record.decode_worker:x}" in _log(p))
    chunks: list[dict] = []
    halfway = threading.Event()

    def stream() -> None:
        body = {"model": dep.model_name, "messages": messages, "max_tokens": 600, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{dep.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"x-dynamo-session-id": "migrate"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 50:
                        halfway.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert halfway.wait(30)
    victim.signal_group(signal.SIGKILL)  # no deregistration: the stream just breaks
    reader.join(60)
    assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == 600  # one uninterrupted answer of the asked length
    finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert finish == ["length"]
    assert metrics(dep)["ppd_migrations_total"] == 1


def test_no_decode_worker_left_is_a_503_with_a_message(dep):
    """Runs last in this module: it stops the deployment's decode workers."""
    for proc in dep.workers:
        if proc.label.startswith("decode") and proc.exit_code() is None:
            proc.signal_group(signal.SIGTERM)  # they deregister at once
    deadline = time.monotonic() + 20
    while any(p.exit_code() is None for p in dep.workers if p.label.startswith("decode")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(0.5)
    response = httpx.post(f"{dep.base_url}/v1/chat/completions", timeout=30, json={
        "model": dep.model_name, "max_tokens": 4, "messages": [{"role": "user", "content": "anyone?"}]})
    assert response.status_code == 503, response.text
    # Dynamo 1.6.1's frontend answers every 5xx with a generic text: the reason is in the router's log.
    router = next(p for p in dep.workers if p.label.startswith("router"))
    assert "HTTP 503: no decode worker is available" in _log(router)


@pytest.mark.slow
def test_a_prompt_no_decode_worker_can_hold_is_a_400_before_any_work(model_dir, tmp_path):
    # 80 blocks of 32 tokens: 2,560 tokens of KV per decode worker, from their model cards in etcd.
    small = deploy(tmp_path, model_dir, mode="local", decode=1, decode_args=("--kv-capacity-blocks", "80"))
    try:
        chat(small, [{"role": "user", "content": "warm up"}], "warm-up")
        before = requests_seen_by_workers(small)
        response = httpx.post(f"{small.base_url}/v1/chat/completions", timeout=60, json={
            "model": small.model_name, "max_tokens": 16,
            "messages": [{"role": "user", "content": "Tell me about the harbour. " * 300}]})
        assert response.status_code == 400, response.text
        assert "more than any decode worker's KV cache holds (2560 tokens)" in response.text
        assert requests_seen_by_workers(small) == before
    finally:
        small.stop()
