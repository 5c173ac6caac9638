"""Sessions end to end (frontend -> router replicas -> simulated workers, real NATS and etcd):
users sharing a system prompt are never merged; turns alternating between two router replicas
stay on their conversation's decode worker with the right turn number; the replicas' request
rates add up; an overlong session id is a 400."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from test_router import chat, decisions, deploy, metrics, prefill_tokens_by_decode, sessions_in

pytestmark = pytest.mark.e2e
SYSTEM = "You are a careful assistant for harbour logistics. Answer briefly and cite the log. " * 62


@pytest.mark.slow
def test_two_users_with_the_same_1000_token_system_prompt_and_no_header_are_never_merged(model_dir,
                                                                                           tmp_path):
    dep = deploy(tmp_path, model_dir, mode="local", decode=3)
    try:
        # The system prompt's length steps over a whole block (4 tokens a step), so for some
        # pairs A's short first exchange ends inside the block after the last shared one: A's
        # history then has no full block of its own (the case that merged B into A).
        pairs = 8
        conversations = []
        for i in range(pairs):
            system = {"role": "system", "content": SYSTEM + "x " * (2 * i)}
            for user in ("a", "b"):
                conversations.append([system, {"role": "user", "content": f"hi {user}{i}"}])
        results = []
        for turn in range(2):  # all first turns (A then B, per pair), then all second turns
            for messages in conversations:
                before = prefill_tokens_by_decode(dep)
                result = chat(dep, messages, None, max_tokens=1)
                after = prefill_tokens_by_decode(dep)
                assert result["usage"]["prompt_tokens"] > 1000
                charged = [k for k in after if after[k] != before[k]]
                results.append((turn, result, charged))
                messages += [{"role": "assistant", "content": result["text"]},
                             {"role": "user", "content": f"and then {turn}?"}]
                time.sleep(0.2)  # KV events reach the router
        first_turns = len(conversations)
        assert decisions(dep, "via_prefill", "first") == first_turns  # no B was A's turn 2
        assert decisions(dep, "decode_local", "follow_up") == first_turns
        stored = [r for r in sessions_in(dep.endpoints.etcd_url).values() if r.session_id.startswith("auto-")]
        assert len(stored) == first_turns  # one session per user...
        assert sorted(r.turn for r in stored) == [2] * first_turns  # ...with both its turns
        # Each follow-up ran where its own first turn's KV went: the conversation's decode worker
        # holds its history (decode-local appends charge only that worker).
        assert all(len(charged) == 1 for turn, _, charged in results if turn == 1)
    finally:
        dep.stop()


def _router_decisions(dep) -> list[dict]:
    """The routers' per-decision debug lines (JSON), in log order per router."""
    out = []
    for proc in dep.workers:
        if proc.label.startswith("router"):
            for line in Path(proc.log_path).read_text(errors="replace").splitlines():
                start = line.find('{"session"')
                if start >= 0:
                    out.append({**json.loads(line[start:]), "router": proc.label})
    return out


@pytest.mark.slow
def test_turns_alternating_between_two_router_replicas_stay_on_their_decode_worker(model_dir, tmp_path,
                                                                                  monkeypatch):
    import test_router

    # The routers log each decision (DYN_LOG=debug); the frontend alternates them round-robin.
    marker = "      DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '[\"generate\"]'"
    graph = test_router.GRAPH.replace("    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '[\"generate\"]'}\n"
                                      "    ready: {http: \"http://127.0.0.1:{system_port}/health\"}\n"
                                      "    metrics:",
                                      "    env: {DYN_LOG: debug, DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: "
                                      "'[\"generate\"]'}\n    ready: {http: \"http://127.0.0.1:{system_port}"
                                      "/health\"}\n    metrics:")
    assert graph != test_router.GRAPH and marker
    monkeypatch.setattr(test_router, "GRAPH", graph)
    dep = deploy(tmp_path, model_dir, mode="local", decode=3, routers=2)
    try:
        conversations, turns = 50, 3
        for c in range(conversations):  # one after the other, each turn right after the last answer
            messages = [{"role": "user", "content": f"Conversation {c}: the harbour, its ships. " * 8}]
            for t in range(turns):
                result = chat(dep, messages, f"alt-{c}", max_tokens=8)
                messages += [{"role": "assistant", "content": result["text"]},
                             {"role": "user", "content": f"And part {t + 2}?"}]
        per_router = [metrics(dep, name) for name in dep.metrics_urls]
        lines = _router_decisions(dep)
        by_session: dict[str, list[dict]] = {}
        for line in lines:
            by_session.setdefault(line["session"], []).append(line)
        assert all(s.startswith("alt-") and "#" not in s for s in by_session)  # no forks
        follow_ups = right = switched = 0
        for c in range(conversations):
            seen = sorted(by_session[f"alt-{c}"], key=lambda d: d["turn"])
            assert [d["turn"] for d in seen] == list(range(1, turns + 1))
            home = seen[0]["decode"]
            for previous, decision in zip(seen, seen[1:], strict=False):
                follow_ups += 1
                right += decision["decode"] == home
                switched += decision["router"] != previous["router"]
        print(f"\nfollow-ups on their conversation's decode worker with the right turn number: "
              f"{right}/{follow_ups} ({switched} of them on the other router replica than the turn before)")
        assert (right, follow_ups) == (conversations * (turns - 1),) * 2
        assert switched >= follow_ups // 3  # the frontend's round robin did alternate them
        stored = sessions_in(dep.endpoints.etcd_url)
        assert all(stored[f"ppd/sessions/alt-{c}"].turn == turns for c in range(conversations))
        # Each replica reads the table at the rate of both together.
        local = [m["ppd_request_rate_local"] for m in per_router]
        for m in per_router:
            assert m["ppd_request_rate"] > 1.5 * m["ppd_request_rate_local"] > 0
            assert abs(m["ppd_request_rate"] - sum(local)) <= 0.35 * sum(local)
        # An overlong session id is refused with a message, before any work.
        body = {"model": dep.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        before = prefill_tokens_by_decode(dep)
        response = httpx.post(f"{dep.base_url}/v1/chat/completions", json=body,
                              headers={"x-dynamo-session-id": "s" * 10_000}, timeout=30)
        assert response.status_code == 400 and "x-dynamo-session-id" in response.text
        assert prefill_tokens_by_decode(dep) == before
    finally:
        dep.stop()
