"""Coalescing end to end (the OpenAI client's view through Dynamo's frontend -> router -> simulated
workers, real NATS/etcd/HTTP): decode workers 20x faster than real time send tokens faster than the
router relays them one by one, so waiting chunks go out merged (the frontend then sends their text
as one SSE event); every answer still has all its tokens, in order (the client's text, sent back
and tokenized again by the frontend, continues the history the router recorded token for token:
the follow-up is no fork and runs decode-local on the cached prefix), one finish reason at its end
and its usage; a decode worker killed mid-answer while chunks wait still gives one uninterrupted
answer."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_router import _log, chat, deploy, metrics, sessions_in

pytestmark = pytest.mark.e2e

TOKENS = 400


@pytest.fixture(scope="module")
def fast(model_dir, tmp_path_factory):
    dep = deploy(tmp_path_factory.mktemp("coalesce"), model_dir, mode="local", decode=2,
                 decode_args=("--speedup", "20"))
    yield dep
    dep.stop()


def stream(dep, messages: list[dict], session: str, max_tokens: int, on_event=None) -> list[dict]:
    """Every SSE data object of one streamed chat completion."""
    body = {"model": dep.model_name, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events: list[dict] = []
    with httpx.stream("POST", f"{dep.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"x-dynamo-session-id": session}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if on_event:
                    on_event(len(events))
    return events


def check_answer(events: list[dict], tokens: int) -> str:
    """One answer of exactly ``tokens`` tokens: no error, at most one content piece per token, one
    finish reason (``length``) and it is the last choice event, usage once, after it; its text."""
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    choices = [c for e in events for c in e.get("choices", [])]
    pieces = [c["delta"]["content"] for c in choices if (c.get("delta") or {}).get("content")]
    finishes = [(i, c["finish_reason"]) for i, c in enumerate(choices) if c.get("finish_reason")]
    usages = [(i, e["usage"]) for i, e in enumerate(events) if e.get("usage")]
    assert 0 < len(pieces) <= tokens
    assert [f for _, f in finishes] == ["length"] and finishes[0][0] == len(choices) - 1
    assert len(usages) == 1 and usages[0][0] == len(events) - 1
    assert usages[0][1]["completion_tokens"] == tokens
    return "".join(pieces)


def test_concurrent_answers_are_exact_while_chunks_are_merged(fast):
    before = metrics(fast)
    sessions = [f"co-{n}" for n in range(8)]
    prompts = [[{"role": "user", "content": f"Conversation {n}: the harbour and its ships. " * 10}]
               for n in range(len(sessions))]
    with ThreadPoolExecutor(len(sessions)) as pool:
        answers = list(pool.map(lambda n: stream(fast, prompts[n], sessions[n], TOKENS),
                                range(len(sessions))))
    texts = [check_answer(events, TOKENS) for events in answers]
    # Each follow-up carries the merged answer back as history: it must continue the session's
    # record (prompt + the very token ids the router relayed) to run decode-local on its cache.
    with ThreadPoolExecutor(len(sessions)) as pool:
        follow_ups = list(pool.map(
            lambda n: stream(fast, [*prompts[n], {"role": "assistant", "content": texts[n]},
                                    {"role": "user", "content": "Go on."}], sessions[n], TOKENS),
            range(len(sessions))))
    for events in follow_ups:
        check_answer(events, TOKENS)
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > TOKENS
    after = metrics(fast)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    local = sum(v - before.get(k, 0.0) for k, v in after.items()
                if k.startswith("ppd_decisions_total") and 'route="decode_local"' in k
                and 'turn="follow_up"' in k)
    assert grew("ppd_session_forks_total") == 0 and local == len(sessions)
    tokens, chunks = grew("ppd_relayed_tokens_total"), grew("ppd_relayed_chunks_total")
    events = sum(1 for a in answers + follow_ups for e in a for c in e.get("choices", [])
                 if (c.get("delta") or {}).get("content"))
    print(f"\n{tokens:.0f} tokens relayed in {chunks:.0f} chunks; the client saw {events} content events")
    assert tokens == TOKENS * 2 * len(sessions)
    assert chunks < 0.9 * tokens  # the router did merge waiting chunks
    # The workers' load reports reach the router through Dynamo's tracker, not parsed one by one.
    router = next(p for p in fast.workers if p.label.startswith("router"))
    assert "over NATS in Python" not in _log(router)


def test_a_decode_worker_killed_while_chunks_wait_does_not_cut_the_answer(fast):
    messages = [{"role": "user", "content": "Tell me about the harbour and its ships. " * 20}]
    first = chat(fast, messages, "co-migrate")
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Go on."}]
    [record] = [r for r in sessions_in(fast.endpoints.etcd_url).values() if r.session_id == "co-migrate"]
    victim = next(p for p in fast.workers if p.label.startswith("decode")
                  and f"as instance {record.decode_worker:x}" in _log(p))
    started, before = threading.Event(), metrics(fast)
    box: dict[str, list[dict]] = {}

    def read() -> None:
        box["events"] = stream(fast, messages, "co-migrate", 4000,
                               on_event=lambda n: n == 200 and started.set())

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    victim.signal_group(signal.SIGKILL)  # the stream just breaks
    reader.join(120)
    check_answer(box["events"], 4000)
    assert metrics(fast)["ppd_migrations_total"] == before.get("ppd_migrations_total", 0) + 1
