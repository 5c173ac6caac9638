"""The `ppd` graph end to end: gateway -> (ext_proc) endpoint picker; Dynamo's frontend serving
every token. What the relay router guarantees still holds through the picker: a conversation's
first turn goes through the prefill worker and its follow-ups run decode-local on the decode worker
holding the history; picker replicas share sessions; headerless users sharing a system prompt
never merge; a spoofed session id does not move the owner; a restarted picker recovers residency
from the workers; the session table is bounded; bad requests get the frontend's own 4xx and plan
nothing; with no picker answering, the gateway fails open to the frontend; the picker learns from the
follow-ups' answers it watches, as the relay router does from those it relays."""

from __future__ import annotations

import time

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_passthrough_e2e import _served_by_worker
from test_router import chat, conversation, metrics

from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSTEM = "You are a patient harbour guide who answers in long sentences. " * 12


def _up(tmp_path, model_dir, name: str, **options):
    return start(ServeOptions(graph="ppd", http_port=free_port(), nats_port=free_port(),
                              etcd_port=free_port(), model_dir=model_dir, run_dir=tmp_path / name,
                              **options), log=lambda _m: None)


def _decisions(dep, route: str, turn: str) -> float:
    return sum(v for k, v in metrics(dep, "picker").items()
               if k.startswith("ppd_decisions_total") and f'route="{route}"' in k and f'turn="{turn}"' in k)


def _decode_counts(dep) -> dict[str, dict[str, int]]:
    return {label: counts for label, counts in _served_by_worker(dep).items() if label.startswith("decode")}


def _gateway(dep, name: str) -> float:
    return sum(v for k, v in metrics(dep, "gateway").items() if k.startswith(name))


def _post(dep, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{dep.base_url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def test_the_picker_routes_turns_shares_sessions_and_keeps_conversations_apart(model_dir, tmp_path):
    # Two picker replicas behind one gateway (round robin): every follow-up lands on the other
    # replica than its previous turn, so it is found through the sessions they share (etcd).
    dep = _up(tmp_path, model_dir, "run", replicas={"picker": 2},
              extra_args={"picker": ["--max-sessions", "6"]})
    try:
        results = conversation(dep, turns=3, session="owner")
        assert all(r["text"] for r in results)
        assert results[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _decisions(dep, "via_prefill", "first") == 1
        assert _decisions(dep, "decode_local", "follow_up") == 2
        served = _decode_counts(dep)
        owner_worker = next(label for label, c in served.items() if c.get("via_prefill"))
        assert served[owner_worker].get("decode_local") == 2  # where its first turn's answer is
        # Headerless users sharing a long system prompt: each one's turn 1 is a new conversation
        # (its own history, not the other's), each one's turn 2 a follow-up of its own.
        for user in ("Where do the ferries leave from?", "Which ships carry grain?"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
            first = chat(dep, messages, None)
            time.sleep(0.3)
            chat(dep, [*messages, {"role": "assistant", "content": first["text"]},
                       {"role": "user", "content": "Tell me more."}], None)
            time.sleep(0.3)
        assert _decisions(dep, "via_prefill", "first") == 3
        assert _decisions(dep, "decode_local", "follow_up") == 4
        # A spoofed id: another history under the owner's id is a fork; the owner keeps its worker.
        other = "Something else entirely, about lighthouses. " * 15
        chat(dep, [{"role": "user", "content": other}], "owner")
        time.sleep(0.3)
        before = _decode_counts(dep)[owner_worker].get("decode_local", 0)
        history = [{"role": "user", "content": "Tell me about the harbour and its ships. " * 20}]
        for i, r in enumerate(results):
            history += [{"role": "assistant", "content": r["text"]},
                        {"role": "user", "content": f"And then, part {i + 2}?"}]
        chat(dep, history, "owner")
        assert _decode_counts(dep)[owner_worker].get("decode_local", 0) == before + 1
        # The session table is bounded (--max-sessions 6, 9 sessions so far with the forks).
        for i in range(4):
            question = f"Question number {i} about tides. " * 10
            chat(dep, [{"role": "user", "content": question}], f"filler-{i}")
        evicted = metrics(dep, "picker").get("ppd_sessions_evicted_total", 0.0)
        assert evicted > 0
    finally:
        dep.stop()


def test_bad_requests_get_the_frontends_answer_and_plan_nothing(model_dir, tmp_path):
    # Every bad input, on every API, against the frontend's own answer: tests/test_errors_e2e.py.
    dep = _up(tmp_path, model_dir, "run")
    try:
        before = _served_by_worker(dep)
        huge = _post(dep, {"model": dep.model_name, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "word " * 150_000}]})
        # The frontend's own refusal (the workers register their max_seq_len, as dynamo.trtllm does).
        assert huge.status_code == 400 and huge.json()["details"]["type"] == "context_length"
        too_many = _post(dep, {"model": dep.model_name, "max_tokens": 10_000_000, "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]})
        assert too_many.status_code == 400  # a streamed request's error is its HTTP status
        assert "must not exceed 1048576" in too_many.json()["message"]
        bad_id = _post(dep, {"model": dep.model_name, "max_tokens": 8, "stream": True,
                             "messages": [{"role": "user", "content": "hi"}]},
                       {"x-dynamo-session-id": "x" * 1000})
        assert bad_id.status_code == 400
        not_json = httpx.post(f"{dep.base_url}/v1/chat/completions", content=b"{nope",
                              headers={"content-type": "application/json"}, timeout=30)
        assert not_json.status_code == 400 and "Failed to deserialize" in not_json.json()["message"]
        assert _served_by_worker(dep) == before  # no worker saw any of them
        assert _gateway(dep, "ppd_gateway_immediate_responses_total") == 0  # all the frontend's answers
        assert sum(v for k, v in metrics(dep, "picker").items()
                   if k.startswith("ppd_decisions_total")) == 0  # and no decision was made
        # A client's own routing pin is dropped: a pin to a worker id nobody has is not a 400.
        hi = [{"role": "user", "content": "hi"}]
        ok = _post(dep, {"model": dep.model_name, "max_tokens": 4, "messages": hi},
                   {"x-dynamo-worker-instance-id": "12345"})
        assert ok.status_code == 200, ok.text
        # gRPC health, as a gateway's health check (and a Kubernetes probe) asks it.
        argv = dep.process("picker").argv
        with grpc.insecure_channel(f"127.0.0.1:{argv[argv.index('--grpc-port') + 1]}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING
        models = httpx.get(f"{dep.base_url}/v1/models", timeout=10)  # no body: served unrouted
        assert models.json()["data"][0]["id"] == dep.model_name
        # The openai SDK, unmodified: a streamed chat, and a refused one raising with its status.
        client = openai.OpenAI(base_url=f"{dep.base_url}/v1", api_key="unused")
        stream = client.chat.completions.create(model=dep.model_name, messages=hi, max_tokens=6, stream=True,
                                                extra_headers={"x-dynamo-session-id": "sdk"})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=dep.model_name, messages=hi, max_tokens=6, stream=True,
                                           extra_headers={"x-dynamo-session-id": "y" * 1000})
        assert refused.value.status_code == 400
    finally:
        dep.stop()


def test_a_restarted_picker_recovers_residency_and_the_gateway_fails_open_without_one(model_dir, tmp_path):
    dep = _up(tmp_path, model_dir, "run", supervise=True)
    try:
        messages = [{"role": "user", "content": "Tell me about the harbour and its ships. " * 20}]
        first = chat(dep, messages, None)  # headerless: found again by its history alone
        time.sleep(0.3)
        dep.kill("picker")  # SIGKILL; the supervisor starts it again
        _wait_restarted(dep, "picker")
        follow = [*messages, {"role": "assistant", "content": first["text"]},
                  {"role": "user", "content": "More?"}]
        chat(dep, follow, None)
        # The new picker read the session from etcd at start and the decode worker's blocks from
        # the workers' own indexers: the follow-up runs decode-local.
        assert _decisions(dep, "decode_local", "follow_up") == 1
        dep.supervisor.halt()  # no more restarts: with no picker, the gateway fails open
        dep.kill("picker")
        time.sleep(0.5)
        again = chat(dep, [{"role": "user", "content": "Still there? " * 10}], None)
        assert again["text"]
        assert _gateway(dep, "ppd_gateway_picker_fail_open_total") >= 1
    finally:
        dep.stop()


def test_the_picker_learns_from_the_follow_ups_answers_it_watches(model_dir, tmp_path):
    # Every follow-up watched: the gateway (--allow-mode-override, as the graph runs it) streams
    # those answers' bodies through the picker, which times their first and last tokens.
    dep = _up(tmp_path, model_dir, "run", extra_args={"picker": ["--observe-share", "1"]})
    try:
        for i in range(3):
            results = conversation(dep, turns=2, session=f"learn-{i}")
            assert all(r["text"] for r in results)
        picker = metrics(dep, "picker")
        observed = sum(v for k, v in picker.items() if k.startswith("ppd_outcomes_observed_total"))
        assert observed == 3  # the three follow-ups; no first turn
        ratios = {k: v for k, v in picker.items() if k.startswith("ppd_ttft_prediction_ratio_count")}
        assert sum(ratios.values()) == 3, ratios
        # Only those answers' bodies went through the picker (the first turns' and the start-up
        # check's did not).
        assert _gateway(dep, "ppd_gateway_picker_response_bodies_total") == 3
        assert _gateway(dep, "ppd_gateway_requests_total{outcome=\"routed\"}") >= 6
    finally:
        dep.stop()


def _wait_restarted(dep, label: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e.label == label and e.ready_at is not None for e in dep.supervisor.events):
            return
        time.sleep(0.2)
    raise AssertionError(f"{label} not ready again {timeout_s:.0f} s after it was killed")
