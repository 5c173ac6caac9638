"""The picker's incremental prompt path (`prompt_memo`) against the whole one, id for id: 200
randomized multi-turn agent sessions over the three chat-like APIs (tools, tool calls and
results, thinking, Claude Code's billing line, a moved ``cache_control``, an edited or retried
turn, a request of another session with the same head), on the project model's template and on
one that rewrites earlier turns (it drops the reasoning of turns before the last user message,
as Qwen3's does). The whole path (`PromptTokenizer.tokens`) is itself checked against the real
frontend in tests/test_picker_prompt.py."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from dynamo_ppd.apis import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH
from dynamo_ppd.picker.prompt import PromptTokenizer
from dynamo_ppd.picker.prompt_memo import PromptMemos

pytestmark = pytest.mark.unit

# Drops the reasoning of assistant turns before the last user message (what Qwen3's template
# does with `last_query_index`): an earlier turn renders differently once a new one comes.
REWRITING_TEMPLATE = r"""{%- set ns = namespace(last=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor -%}
{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last -%}
<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% if m.tool_calls -%}
{% for c in m.tool_calls -%}
[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}<|eot_id|>{% endfor -%}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WORDS = ("the tide turned at dawn and the harbour filled with boats while gulls argued over nets "
         "def read(path): return open(path).read() {\"ok\": true} 42 3.14 Ünïcödé 東京 😀 \n\n  ").split(" ")


def _text(rng: random.Random, low: int = 3, high: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


class Session:
    """One agent session: its messages in the API's own shape, grown a step at a time."""

    def __init__(self, rng: random.Random, api: str, system: str, tools: bool):
        self.rng, self.api, self.system, self.tools = rng, api, system, tools
        self.items: list[dict] = []
        self.calls = 0
        self.ascii = rng.random() < 0.5  # how this client writes JSON
        self.tools_first = rng.random() < 0.5  # Claude Code's order (tools, system, messages), or last
        self._user()

    def _user(self) -> None:
        text = _text(self.rng)
        if self.api == RESPONSES_PATH:
            self.items.append({"role": "user", "content": text})
        elif self.api == MESSAGES_PATH:
            blocks: list[dict] = [{"type": "text", "text": text}]
            if self.rng.random() < 0.5:  # Claude Code marks the newest user turn for caching
                for item in self.items:
                    for block in item["content"] if isinstance(item["content"], list) else []:
                        block.pop("cache_control", None)
                blocks[-1]["cache_control"] = {"type": "ephemeral"}
            self.items.append({"role": "user", "content": blocks})
        else:
            self.items.append({"role": "user", "content": text})

    def step(self) -> None:
        """The assistant's reply (a tool call and its result, or a plain answer and a new user turn)."""
        rng = self.rng
        self.calls += 1
        call_id, reply = f"call_{self.calls}", _text(rng)
        thinking = _text(rng, 1, 20) if rng.random() < 0.5 else None
        tool = self.tools and rng.random() < 0.7
        arguments = {"path": f"src/{self.calls}.py", "n": rng.randint(1, 9)}
        if self.api == MESSAGES_PATH:
            blocks: list[dict] = [{"type": "thinking", "thinking": thinking, "signature": "s"}] \
                if thinking else []
            blocks.append({"type": "text", "text": reply})
            if tool:
                blocks.append({"type": "tool_use", "id": call_id, "name": "read", "input": arguments})
            self.items.append({"role": "assistant", "content": blocks})
            if tool:
                self.items.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call_id, "content": _text(rng, 5, 120)}]})
                return
        elif self.api == RESPONSES_PATH:
            self.items.append({"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": reply}]})
            if tool:
                self.items.append({"type": "function_call", "call_id": call_id, "name": "read",
                                   "arguments": json.dumps(arguments)})
                self.items.append({"type": "function_call_output", "call_id": call_id,
                                   "output": _text(rng, 5, 120)})
                return
        else:
            message: dict = {"role": "assistant", "content": reply}
            if thinking:
                message["reasoning_content"] = thinking
            if tool:
                message["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                    "name": "read", "arguments": json.dumps(arguments)}}]
            self.items.append(message)
            if tool:
                self.items.append({"role": "tool", "tool_call_id": call_id, "content": _text(rng, 5, 120)})
                return
        self._user()

    def body(self, billing: str | None) -> bytes:
        rng = self.rng
        if self.api == MESSAGES_PATH:
            system = f"x-anthropic-billing-header: cc_version=2.0; cch={billing}\n{self.system}" \
                if billing else self.system
            tools = [{"name": "read", "description": "read a file",
                      "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
            body: dict = {"model": "m", "max_tokens": 64, "stream": True}
            if self.tools and self.tools_first:
                body["tools"] = tools
            body.update(system=system, messages=self.items)
            if self.tools and not self.tools_first:
                body["tools"] = tools
            if rng.random() < 0.2:
                body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        elif self.api == RESPONSES_PATH:
            body = {"model": "m", "max_output_tokens": 64, "instructions": self.system, "input": self.items}
            if self.tools:
                body["tools"] = [{"type": "function", "name": "read", "parameters": {"type": "object"}}]
        else:
            body = {"model": "m", "max_tokens": 64, "messages": [{"role": "system", "content": self.system},
                                                                   *self.items]}
            if self.tools:
                body["tools"] = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
        if rng.random() < 0.3:  # fields after the conversation, which may change every request
            body["temperature"] = rng.random()
        if rng.random() < 0.05:  # re-serialized another way: every byte may move
            return json.dumps(body, ensure_ascii=not self.ascii, indent=1).encode()
        return json.dumps(body, ensure_ascii=self.ascii).encode()


@pytest.fixture(scope="module")
def tokenizers(model_dir) -> dict[str, PromptTokenizer]:
    project = PromptTokenizer.from_model_dir(model_dir)
    rewriting = PromptTokenizer(project.tokenizer, {"chat_template": REWRITING_TEMPLATE,
                                                     "bos_token": "<|begin_of_text|>"})
    return {"llama-3.1": project, "rewrites-earlier-turns": rewriting}


@pytest.mark.parametrize("template", ["llama-3.1", "rewrites-earlier-turns"])
def test_the_incremental_path_equals_the_whole_one_on_randomized_agent_sessions(tokenizers, template):
    tok = tokenizers[template]
    memos = PromptMemos(tok)
    rng = random.Random(7 if template == "llama-3.1" else 8)
    systems = [_text(rng, 50, 200) for _ in range(3)]  # shared by many sessions, as agents' are
    compared, reused = 0, Counter()
    for n in range(100):
        api = rng.choice([CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH])
        session = Session(rng, api, rng.choice(systems), tools=rng.random() < 0.7)
        for _turn in range(rng.randint(2, 7)):
            billing = f"{rng.getrandbits(32):08x}" if api == MESSAGES_PATH and rng.random() < 0.3 else None
            body = session.body(billing)
            parsed = memos.parse(body, api, f"s{n}" if rng.random() < 0.9 else None)
            whole = tok.tokens(json.loads(body), api)
            prompt = memos.prompt(parsed)
            assert parsed.request == json.loads(body)
            assert list(prompt.ids) == whole, (template, api, n, parsed.outcome)
            assert json.loads(prompt.ids_json()) == whole
            memos.remember(parsed, prompt, None)
            compared += 1
            reused[parsed.outcome] += 1
            if prompt.memo.encoded is not None and prompt.memo.encoded.reused:
                reused["ids_reused"] += 1
            roll = rng.random()
            if roll < 0.1 and len(session.items) > 2:  # a retried or edited step: a branch
                del session.items[-1]
            elif roll < 0.15:
                session.items[0] = {**session.items[0]}  # same value, re-sent
            session.step()
    # The memo was used, not just consulted: most requests reused an earlier one's work (not where
    # a billing line changed or the body was re-serialized: head_changed, whole path).
    assert compared >= 300
    assert reused["session"] + reused["shared_head"] > compared / 2, reused
    assert reused["head_changed"] > 0, reused
    assert reused["ids_reused"] > compared / 2, reused
    assert reused["shared_head"] > 0, reused


def test_a_memo_is_dropped_least_recently_used_first_within_its_budget(tokenizers):
    tok = tokenizers["llama-3.1"]
    memos = PromptMemos(tok, budget_mb=0.05)  # ~50 KB
    rng = random.Random(3)
    for n in range(20):
        message = {"role": "user", "content": _text(rng, 200, 300)}
        body = json.dumps({"model": "m", "messages": [message]}).encode()
        parsed = memos.parse(body, CHAT_PATH, f"s{n}")
        memos.remember(parsed, memos.prompt(parsed), None)
        assert memos._bytes <= memos.budget_bytes or len(memos) == 0
    assert 0 < len(memos) < 20 * 2


def test_bad_json_after_a_memo_is_still_refused_as_the_whole_body_is(tokenizers):
    tok = tokenizers["llama-3.1"]
    memos = PromptMemos(tok)
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    parsed = memos.parse(good, CHAT_PATH, "s")
    memos.remember(parsed, memos.prompt(parsed), None)
    for bad in (good[:-1] + b',{"role":"user","content":"x"}]}', good[:-2] + b',]}', good + b"x",
                good[:-2] + b',{"role":"user","content":"x"}]} {}'):
        with pytest.raises(ValueError):
            memos.parse(bad, CHAT_PATH, "s")
