"""Agent clients through the `ppd` graph (gateway -> endpoint picker -> Dynamo's frontend): the
`anthropic` SDK on ``/v1/messages`` (streamed and not, with tools and tool results) and the `openai`
SDK on ``/v1/responses``, several turns each, every answer a 200; a conversation's first turn goes
through the prefill worker and its follow-ups run decode-local on the decode worker holding it,
named by Claude Code's session header or by nothing at all (its prompt's prefix). A request the
picker does not read (another API, a ``previous_response_id`` Dynamo 1.6.1 keeps no response for)
reaches the frontend, which gives its own answer, and is counted. That the ids a worker receives
through the picker equal those the frontend alone would send, on these paths too, is
`tests/test_picker_prompt.py` (`agent_api_cases`)."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
from test_passthrough_e2e import _served_by_worker
from test_picker_e2e import _decisions, _up
from test_router import metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSTEM = "You are a coding agent working in the harbour repository. Use the tools. " * 8
TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def _decode_local(dep) -> dict[str, int]:
    return {label: counts.get("decode_local", 0) for label, counts in _served_by_worker(dep).items()
            if label.startswith("decode")}


def _claude_code_loop(client: anthropic.Anthropic, model: str, steps: int, stream_every: int) -> None:
    """A Claude Code-like loop: the task, then tool calls answered with tool results."""
    messages: list[dict] = [{"role": "user", "content": "Find where the tide tables are parsed."}]
    for step in range(steps):
        kwargs = {"model": model, "max_tokens": 12, "system": SYSTEM, "tools": TOOLS, "messages": messages}
        if step % stream_every == 1:
            with client.messages.stream(**kwargs) as stream:
                reply = stream.get_final_message()
        else:
            reply = client.messages.create(**kwargs)
        assert reply.type == "message" and reply.content, reply
        text = "".join(block.text for block in reply.content if block.type == "text")
        call_id = f"toolu_{step}"
        messages += [{"role": "assistant", "content": [
                          {"type": "text", "text": text},
                          {"type": "tool_use", "id": call_id, "name": "read_file",
                           "input": {"path": f"src/tides_{step}.py"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call_id,
                          "content": [{"type": "text", "text": f"def parse_{step}(rows): return rows"}]}]}]
        time.sleep(0.3)  # the decode worker's KV events reach the picker


def test_agent_clients_talk_through_the_picker_and_stay_on_their_decode_worker(model_dir, tmp_path):
    dep = _up(tmp_path, model_dir, "agents")
    try:
        before = _decode_local(dep)
        named = anthropic.Anthropic(base_url=dep.base_url, api_key="none", max_retries=0,
                                    default_headers={"X-Claude-Code-Session-Id": "cc-session-1"})
        _claude_code_loop(named, dep.model_name, steps=4, stream_every=2)
        assert _decisions(dep, "via_prefill", "first") == 1
        assert _decisions(dep, "decode_local", "follow_up") == 3
        grew = {w: n - before.get(w, 0) for w, n in _decode_local(dep).items()}
        assert sorted(grew.values()) == [0, 0, 3]  # one decode worker holds the session

        # No session header: the conversation is recognised by its prompt's prefix.
        headerless = anthropic.Anthropic(base_url=dep.base_url, api_key="none", max_retries=0)
        _claude_code_loop(headerless, dep.model_name, steps=3, stream_every=2)
        assert _decisions(dep, "via_prefill", "first") == 2
        assert _decisions(dep, "decode_local", "follow_up") == 5

        # The Responses API (Codex, the Agents SDK): the history sent as input items each turn.
        client = openai.OpenAI(base_url=f"{dep.base_url}/v1", api_key="none", max_retries=0)
        items: list = [{"role": "user", "content": "List the berths of the harbour. " * 20}]
        for turn in range(3):
            # (incomplete: it stopped at max_output_tokens, as the simulated model always does)
            if turn == 1:
                events = list(client.responses.create(model=dep.model_name, input=items, max_output_tokens=12,
                                                      instructions=SYSTEM, stream=True))
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
            else:
                response = client.responses.create(model=dep.model_name, input=items, max_output_tokens=12,
                                                   instructions=SYSTEM)
                assert response.status in ("completed", "incomplete")
                text = response.output_text
            assert text
            items += [{"role": "assistant", "content": text},
                      {"role": "user", "content": f"And berth {turn}?"}]
            time.sleep(0.3)
        assert _decisions(dep, "via_prefill", "first") == 3
        assert _decisions(dep, "decode_local", "follow_up") == 7

        # What the picker does not read goes to the frontend, which answers as it would alone.
        chained = httpx.post(f"{dep.base_url}/v1/responses", timeout=30, json={
            "model": dep.model_name, "input": "again", "previous_response_id": "resp_1"})
        assert chained.status_code == 501 and "previous_response_id" in chained.text
        tokens = httpx.post(f"{dep.base_url}/v1/messages/count_tokens", timeout=30, json={
            "model": dep.model_name, "messages": [{"role": "user", "content": "how long is this?"}]})
        assert tokens.status_code == 200 and tokens.json()["input_tokens"] > 0
        unplaced = {k: v for k, v in metrics(dep, "picker").items()
                    if k.startswith("ppd_requests_unplaced_total")}
        assert unplaced == {'ppd_requests_unplaced_total{reason="previous_response_id"}': 1.0,
                            'ppd_requests_unplaced_total{reason="unknown_api"}': 1.0}
        # A Messages request the frontend refuses is refused by the picker first, in Anthropic's shape.
        with pytest.raises(anthropic.BadRequestError) as refused:
            named.messages.create(model=dep.model_name, max_tokens=8,
                                  messages=[{"role": "user", "content": []}])
        assert refused.value.body["error"]["type"] == "invalid_request_error"
    finally:
        dep.stop()
