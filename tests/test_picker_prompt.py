"""`dynamo_ppd.picker.prompt.PromptTokenizer` against Dynamo 1.6.1's own frontend.

End to end: real NATS and etcd, ``python -m dynamo.frontend`` and a capture worker
(``tests/prompt_capture_worker.py``) that writes down the token ids the frontend sends it; every
request body's captured ids must equal ``PromptTokenizer.tokens(body, path)``. Besides the
project's model directory, the worker serves two copies of it with other chat templates: Meta's
Llama 3.2 Instruct template (tools as ``tojson(indent=4)``, ``trim``, ``strftime_now``, a tool
call's arguments, the ``{% generation %}`` tags Dynamo strips) and a strict one that refuses a
non-leading system turn and consecutive user turns (Dynamo rewrites the messages for it) and
reads ``reasoning_content``, raw tool-call arguments and the thinking arguments. Requests the
frontend refuses with a 400 must raise `PromptError`.

In process (unit): the `PromptError` cases and the message rewrites, on a tokenizer trained in
the test; and `PromptTokenizer.encode`, which encodes the text between added tokens piece by
piece (cached), against the tokenizer's own encoding of the whole text, on many random texts,
for the project's model directory and for tokenizers with added tokens of every kind.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import agent_api_cases
import pytest

from dynamo_ppd.picker import prompt as prompt_module
from dynamo_ppd.picker.chat_template import Unplaceable
from dynamo_ppd.picker.prompt import COMPLETIONS_PATH, PromptError, PromptTokenizer

CHAT = "/v1/chat/completions"
CAPTURE_WORKER = Path(__file__).with_name("prompt_capture_worker.py")

# meta-llama/Llama-3.2-1B-Instruct's chat template; the assistant turn wrapped in the
# `{% generation %}` tags some repositories add (Dynamo removes them before compiling).
LLAMA32_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{% generation %}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
{% endgeneration %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

# Refuses what Gemma/Mistral-style templates refuse, so Dynamo normalizes the messages for it.
STRICT_TEMPLATE = r"""{%- set ns = namespace(prev='') -%}
{%- for m in messages -%}
{%- if m.role == 'system' and not loop.first -%}{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}
{%- if m.role == 'user' and ns.prev == 'user' -%}{{ raise_exception('Conversation roles must alternate.') }}{%- endif -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}
{%- if m.reasoning_content is defined %} [reasoning: {{ m.reasoning_content }}]{% endif -%}
{%- for tc in m.tool_calls or [] %} [call {{ tc.function.name }}: {% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}]{% endfor -%}
<|eot_id|>
{%- set ns.prev = m.role -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}
{%- if enable_thinking is defined %}[thinking={{ enable_thinking }} mode={{ thinking_mode }}]{% endif -%}
{%- if note is defined %}[note={{ note }}]{% endif -%}
"""  # noqa: E501

EXTRA_MODELS = {"llama32-template": LLAMA32_TEMPLATE, "strict-template": STRICT_TEMPLATE}

SYSTEM = "You are a careful assistant for harbour logistics. Answer briefly and cite the log."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather at a port",
    "parameters": {"type": "object", "properties": {"port": {"type": "string", "description": "port name"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["port"]}}}
BERTH_TOOL = {"type": "function", "function": {"name": "free_berths", "parameters": {}}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _history(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Turn {t}: which ships arrive at berth {t}?"})
        if t < turns:
            messages.append({"role": "assistant", "content": f" The ships Aurora and Borealis, turn {t}."})
    return messages


def _tool_history() -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Is it windy in Rotterdam?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"port": "Rotterdam", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"wind_kn": 24, "temp_c": 9.5}'},
            {"role": "user", "content": "So, can the ferry leave?"}]


# (id, model: None for the project's, path, body)
CASES: list[tuple[str, str | None, str, dict]] = [
    ("system_and_user", None, CHAT, {"messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which berth is free today?"}]}),
    ("five_turn_history", None, CHAT, {"messages": _history(5)}),
    ("five_turn_follow_up", None, CHAT, {"messages": _history(6)}),  # the history's pieces cached
    ("content_parts", None, CHAT, {"messages": [
        {"role": "system", "content": [_text(SYSTEM), _text("Be kind.")]},
        {"role": "user", "content": [_text("First part."), _text("Second.")]}]}),
    ("tools_and_tool_choice", None, CHAT, {
        "messages": [{"role": "user", "content": "Weather in Hamburg?"}], "tools": [WEATHER_TOOL, BERTH_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("tool_choice_none", None, CHAT, {"messages": [{"role": "user", "content": "Weather?"}],
                                      "tools": [WEATHER_TOOL], "tool_choice": "none"}),
    ("tool_call_history", None, CHAT, {"messages": _tool_history(), "tools": [WEATHER_TOOL],
                                       "tool_choice": "auto"}),
    ("unicode", None, CHAT, {"messages": [
        {"role": "system", "content": "Réponds en français, s'il te plaît. Ça va très bien."},
        {"role": "user", "content": "Café crème, naïve façade, Ångström — 北京 東京 서울 "
                                    "😀👍🏽 👩‍💻 👨‍👩‍👧 a\u200db ü"}]}),
    ("whitespace", None, CHAT, {"messages": [
        {"role": "system", "content": "\n\n  Leading newlines and spaces.  \n"},
        {"role": "user", "content": "  \t Hello there!  \n\n\n"},
        {"role": "assistant", "content": "   Hi.\n\n"},
        {"role": "user", "content": "\n"}]}),
    ("add_generation_prompt_false", None, CHAT, {"messages": _history(2), "add_generation_prompt": False}),
    ("continue_final_message", None, CHAT, {
        "messages": [{"role": "user", "content": "Name a ship."},
                     {"role": "assistant", "content": "The ship is"}],
        "continue_final_message": True, "add_generation_prompt": False}),
    ("nul_and_special_text", None, CHAT, {"messages": [
        {"role": "user", "content": "a\u0000b and a typed <|eot_id|> marker"}]}),
    ("completions_prompt", None, COMPLETIONS_PATH, {"prompt": "The harbour master said the tide"}),
    ("completions_whitespace_unicode", None, COMPLETIONS_PATH, {"prompt": "  Ça 😀\n\n"}),
    ("completions_token_ids", None, COMPLETIONS_PATH, {"prompt": [1000, 1001, 1002, 8184, 42]}),
    ("completions_one_string_in_a_list", None, COMPLETIONS_PATH, {"prompt": ["Only one prompt"]}),
    ("nvext_token_data", None, COMPLETIONS_PATH, {"prompt": "ignored",
                                                  "nvext": {"token_data": [1000, 1003]}}),
    ("chat_nvext_token_data", None, CHAT, {"messages": [{"role": "user", "content": "ignored"}],
                                           "nvext": {"token_data": [1000, 1003, 1007]}}),
    ("llama32_tools", "llama32-template", CHAT, {
        "messages": [{"role": "system", "content": f"  {SYSTEM}\n"},
                     {"role": "user", "content": " Weather? "}],
        "tools": [WEATHER_TOOL, BERTH_TOOL], "tool_choice": "auto"}),
    ("llama32_tool_call_history", "llama32-template", CHAT, {"messages": _tool_history(),
                                                             "tools": [WEATHER_TOOL]}),
    ("llama32_multi_turn", "llama32-template", CHAT, {"messages": _history(3)}),
    ("strict_system_normalization", "strict-template", CHAT, {"messages": [
        {"role": "system", "content": "A"}, {"role": "system", "content": "B"},
        {"role": "user", "content": "hi"}, {"role": "system", "content": "reminder"},
        {"role": "user", "content": [_text("again")]}]}),
    ("strict_reasoning_and_raw_arguments", "strict-template", CHAT, {
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "ok", "reasoning_content": ["first", "second"],
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "free_berths", "arguments": '{"n":  2}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "[3, 7]"}],
        "reasoning_effort": "none", "chat_template_kwargs": {"note": "kw"}}),
    ("default_template_reasoning_injection", None, CHAT, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "done", "reasoning_content": "thought about it"},
        {"role": "user", "content": "and?"}]}),
]

CASES += agent_api_cases.CASES

# Requests the frontend answers with a 400; PromptTokenizer must refuse them too.
REFUSED: list[tuple[str, str, dict]] = [
    ("empty_messages", CHAT, {"messages": []}),
    ("unknown_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
    ("user_without_content", CHAT, {"messages": [{"role": "user"}]}),
    ("content_not_text", CHAT, {"messages": [{"role": "user", "content": 5}]}),
    ("image_in_system", CHAT, {"messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("empty_tools", CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": []}),
    ("required_without_tools", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                      "tool_choice": "required"}),
    ("arguments_not_json", CHAT, {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "not json"}}]}]}),
    ("continue_with_generation_prompt", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                               "continue_final_message": True}),
    ("template_args_with_template", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                           "chat_template_args": {"chat_template": "{{ x }}"}}),
    ("partial_assistant", CHAT, {"messages": [{"role": "user", "content": "x"},
                                              {"role": "assistant", "content": "y", "partial": True}]}),
    ("tools_on_a_user_message", CHAT, {"messages": [{"role": "user", "content": "x", "tools": []}]}),
    ("empty_prompt", COMPLETIONS_PATH, {"prompt": ""}),
    ("no_prompt", COMPLETIONS_PATH, {}),
    ("token_id_past_vocab", COMPLETIONS_PATH, {"prompt": [128256]}),
    ("generation_prompt_on_completions", COMPLETIONS_PATH, {"prompt": "x", "add_generation_prompt": True}),
]
REFUSED += agent_api_cases.REFUSED


class Capture:
    """The deployment, and the token ids the capture worker recorded."""

    def __init__(self, deployment, out: Path, tokenizers: dict[str | None, PromptTokenizer]):
        self.deployment, self.out, self.tokenizers = deployment, out, tokenizers

    def _lines(self) -> list[str]:
        return self.out.read_text().splitlines() if self.out.exists() else []

    def post(self, path: str, body: dict) -> tuple[int, str, list[list[int]]]:
        """POST ``body``; the status, the response text, and the ids of every backend request."""
        import httpx

        before = len(self._lines())
        response = httpx.post(self.deployment.base_url + path, json=body, timeout=30)
        # The worker writes its line before it answers, so it is there once the response is.
        return response.status_code, response.text, [json.loads(line)["token_ids"]
                                                     for line in self._lines()[before:]]


@pytest.fixture(scope="module")
def capture(model_dir, tmp_path_factory):
    import httpx

    from dynamo_ppd.launch import ServeOptions, start
    from dynamo_ppd.launch.process import free_port

    tmp = tmp_path_factory.mktemp("prompt_capture")
    models = {None: Path(model_dir)}
    for name, template in EXTRA_MODELS.items():
        copy = tmp / "models" / name
        shutil.copytree(model_dir, copy)
        config = json.loads((copy / "tokenizer_config.json").read_text())
        (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        models[name] = copy
    out = tmp / "captured.jsonl"
    frontend = ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}", "--namespace", "capture",
                "--router-mode", "round-robin", "--enable-anthropic-api"]
    worker = ["{python}", str(CAPTURE_WORKER), "--out", str(out), "--model", "{model_dir}={model_name}",
              *[arg for name, path in models.items() if name for arg in ("--model", f"{path}={name}")]]
    graph = tmp / "capture.yaml"
    graph.write_text("name: prompt-capture\nnamespace: capture\ncomponents:\n"
                     f"  - name: frontend\n    command: {json.dumps(frontend)}\n"
                     '    ready: {http: "http://127.0.0.1:{http_port}/health"}\n'
                     f"  - name: worker\n    command: {json.dumps(worker)}\n")
    deployment = start(ServeOptions(graph=str(graph), http_port=free_port(), nats_port=free_port(),
                                    etcd_port=free_port(), model_dir=Path(model_dir), run_dir=tmp / "run"),
                       log=lambda _message: None)
    try:
        deadline = time.monotonic() + 30
        while True:  # the launcher waited for the project's model; the worker registers all at once
            page = httpx.get(deployment.base_url + "/v1/models", timeout=10).json()
            listed = {m["id"] for m in page["data"]}
            if set(EXTRA_MODELS) <= listed:
                break
            assert time.monotonic() < deadline, f"models listed: {listed}"
            time.sleep(0.2)
        tokenizers = {name: PromptTokenizer.from_model_dir(path) for name, path in models.items()}
        yield Capture(deployment, out, tokenizers)
    finally:
        deployment.stop()


def _body(capture: Capture, model: str | None, body: dict, path: str = CHAT) -> dict:
    limit = "max_output_tokens" if path == agent_api_cases.RESPONSES else "max_tokens"
    return {"model": model or capture.deployment.model_name, limit: 1, **body}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case", ["five_turn_history", "unicode", "completions_prompt", "llama32_multi_turn",
                                  "completions_token_ids", "messages_tool_loop", "responses_tool_loop"])
def test_the_frontend_takes_the_pickers_token_ids_instead_of_tokenizing(capture, case):
    """The body the picker forwards (`Picker._body_to_send`: the ids spliced in as
    ``nvext.token_data``) reaches the worker as the same ids the client's body gives; and the
    frontend does use the ids it is sent, not its own tokenization (a marker id proves it)."""
    from dynamo_ppd.picker.picker import Picker

    model, path, body = next(c[1:] for c in CASES if c[0] == case)
    body = _body(capture, model, body, path)
    picker = Picker.__new__(Picker)  # only its body rewrite is exercised here
    picker.send_token_ids, picker.tokenizer = True, capture.tokenizers[model]
    mine = capture.tokenizers[model].tokens(body, path)
    raw = json.dumps(body).encode()
    forwarded = picker._body_to_send(raw, json.loads(raw), mine, path)
    if case == "completions_token_ids":
        assert forwarded is None  # a prompt of ids is not tokenized by the frontend: sent as is
        return
    assert forwarded is not None and json.loads(forwarded)["nvext"]["token_data"] == mine
    status, text, sent = capture.post(path, json.loads(forwarded))
    assert status == 200, text
    assert sent == [mine]
    marked = [*mine[:-1], 1234]  # not what the text tokenizes to: only token_data can give it
    status, text, sent = capture.post(path, {**body, "nvext": {"token_data": marked}})
    assert status == 200, text
    assert sent == [marked]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(("model", "path", "body"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_token_ids_match_the_frontend(capture, model, path, body):
    body = _body(capture, model, body, path)
    status, text, sent = capture.post(path, body)
    assert status == 200, text
    assert len(sent) == 1, sent
    mine = capture.tokenizers[model].tokens(body, path)
    if mine != sent[0]:
        tokenizer = capture.tokenizers[model].tokenizer
        pytest.fail(f"token ids differ\nfrontend: {tokenizer.decode(sent[0], skip_special_tokens=False)!r}\n"
                    f"ours:     {tokenizer.decode(mine, skip_special_tokens=False)!r}")
    # The picker's path (`prompt_memo`) gives the same ids, alone and after the request one
    # message shorter (its session's memo reused).
    assert _memo_ids(capture.tokenizers[model], path, body) == sent[0]


def _memo_ids(tokenizer: PromptTokenizer, path: str, body: dict) -> list[int]:
    from dynamo_ppd.picker.prompt_memo import ARRAY_KEYS, PromptMemos

    alone = PromptMemos(tokenizer).prompt(PromptMemos(tokenizer).parse(json.dumps(body).encode(), path, "s"))
    memos = PromptMemos(tokenizer)
    key = ARRAY_KEYS.get(path)
    if key is not None and isinstance(body.get(key), list) and len(body[key]) > 1:
        earlier = json.dumps({**body, key: body[key][:-1]}).encode()
        try:
            parsed = memos.parse(earlier, path, "s")
            memos.remember(parsed, memos.prompt(parsed), None)
        except (PromptError, Unplaceable):
            pass  # (the shorter request is not one the frontend takes: nothing kept)
    parsed = memos.parse(json.dumps(body).encode(), path, "s")
    after = memos.prompt(parsed)
    assert list(after.ids) == list(alone.ids)
    assert json.loads(after.ids_json()) == list(after.ids)
    return list(after.ids)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(("path", "body"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_requests_the_frontend_refuses_raise_prompt_error(capture, path, body):
    body = _body(capture, None, body, path)
    status, text, sent = capture.post(path, body)
    assert status == 400 and not sent, (status, text)
    with pytest.raises(PromptError):
        capture.tokenizers[None].tokens(body, path)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_batch_of_prompts_fans_out_in_the_frontend_and_is_refused_here(capture):
    body = _body(capture, None, {"prompt": ["one", "two"]})
    status, text, sent = capture.post(COMPLETIONS_PATH, body)
    assert status == 200 and len(sent) == 2, text  # one backend request per prompt: no single worker
    with pytest.raises(PromptError, match="batch of 2 prompts"):
        capture.tokenizers[None].tokens(body, COMPLETIONS_PATH)


# ---------------------------------------------------------------------------------------------
# Unit: in process, a tokenizer trained here.

UNIT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the harbour and its ships"] * 20, trainer=trainer)
    return tok


def _make(tok, template: str | list = UNIT_TEMPLATE, **kwargs) -> PromptTokenizer:
    return PromptTokenizer(tok, {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"},
                           vocab_size=kwargs.pop("vocab_size", 1000), **kwargs)


def _user(text: str = "hello") -> dict:
    return {"role": "user", "content": text}


BAD_REQUESTS: list[tuple[str, object, str, str]] = [
    ("body_not_object", ["not", "an", "object"], CHAT, "JSON object"),
    ("no_messages", {"model": "m"}, CHAT, "missing field `messages`"),
    ("messages_not_a_list", {"messages": "hello"}, CHAT, "array of messages"),
    ("empty_messages", {"messages": []}, CHAT, "cannot be empty"),
    ("message_not_object", {"messages": ["hello"]}, CHAT, r"messages\[0\] must be an object"),
    ("unknown_role", {"messages": [{"role": "wizard", "content": "x"}]}, CHAT, "role must be one of"),
    ("no_role", {"messages": [{"content": "x"}]}, CHAT, "role must be one of"),
    ("user_without_content", {"messages": [{"role": "user"}]}, CHAT, "needs `content`"),
    ("tool_without_call_id", {"messages": [{"role": "tool", "content": "x"}]}, CHAT, "needs `tool_call_id`"),
    ("content_a_number", {"messages": [{"role": "user", "content": 5}]}, CHAT, "string or an array"),
    ("unknown_part", {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, CHAT, "content part"),
    ("image_in_system", {"messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {}}]}]}, CHAT, "content part"),
    ("text_part_without_text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, CHAT,
     "text must be a string"),
    ("name_not_string", {"messages": [{"role": "user", "content": "x", "name": 3}]}, CHAT,
     "must be a string"),
    ("tools_not_a_list", {"messages": [_user()], "tools": {"name": "f"}}, CHAT, "array of tools"),
    ("empty_tools", {"messages": [_user()], "tools": []}, CHAT, "tools array cannot be empty"),
    ("tool_without_name", {"messages": [_user()], "tools": [{"type": "function", "function": {}}]}, CHAT,
     "string `name`"),
    ("required_without_tools", {"messages": [_user()], "tool_choice": "required"}, CHAT, "tools is empty"),
    ("arguments_not_json", {"messages": [_user(), {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, CHAT,
     "valid JSON object string"),
    ("arguments_not_an_object", {"messages": [_user(), {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, CHAT,
     "valid JSON object string"),
    ("template_args_not_object", {"messages": [_user()], "chat_template_args": ["x"]}, CHAT,
     "must be an object"),
    ("template_args_with_template", {"messages": [_user()], "chat_template_args": {"chat_template": "x"}},
     CHAT, "not supported inside"),
    ("args_and_kwargs", {"messages": [_user()], "chat_template_args": {}, "chat_template_kwargs": {}}, CHAT,
     "duplicate field"),
    ("generation_prompt_not_bool", {"messages": [_user()], "add_generation_prompt": "yes"}, CHAT,
     "must be a boolean"),
    ("continue_with_generation_prompt", {"messages": [_user()], "continue_final_message": True}, CHAT,
     "Cannot set both"),
    ("continue_empty_last_message", {"messages": [_user(), {"role": "assistant", "content": ""}],
                                     "continue_final_message": True, "add_generation_prompt": False}, CHAT,
     "Unable to continue the final message"),
    ("tools_on_a_user_message", {"messages": [{**_user(), "tools": []}]}, CHAT, "only accepted on system"),
    ("system_tools", {"messages": [{"role": "system", "content": "s", "tools": [{"type": "function"}]}]},
     CHAT, "tools on a system message"),
    ("partial_assistant", {"messages": [_user(), {"role": "assistant", "content": "a", "partial": True}]},
     CHAT, "partial assistant"),
    ("nvext_not_object", {"messages": [_user()], "nvext": "x"}, CHAT, "`nvext` must be an object"),
    ("token_data_not_ids", {"messages": [_user()], "nvext": {"token_data": ["a"]}}, CHAT,
     "array of token ids"),
    ("no_prompt", {"model": "m"}, COMPLETIONS_PATH, "missing field `prompt`"),
    ("empty_prompt", {"prompt": ""}, COMPLETIONS_PATH, "cannot be empty"),
    ("empty_prompt_list", {"prompt": []}, COMPLETIONS_PATH, "array cannot be empty"),
    ("prompt_a_number", {"prompt": 7}, COMPLETIONS_PATH, "must be a string"),
    ("prompt_mixed_list", {"prompt": ["a", 1]}, COMPLETIONS_PATH, "must be a string"),
    ("negative_token_id", {"prompt": [1, -2]}, COMPLETIONS_PATH, "non-negative"),
    ("token_id_past_vocab", {"prompt": [1, 1000]}, COMPLETIONS_PATH, "vocabulary size 1000"),
    ("bool_is_not_a_token_id", {"prompt": [True]}, COMPLETIONS_PATH, "must be a string"),
    ("batch_of_strings", {"prompt": ["a", "b"]}, COMPLETIONS_PATH, "batch of 2 prompts"),
    ("batch_of_id_lists", {"prompt": [[1], [2], [3]]}, COMPLETIONS_PATH, "batch of 3 prompts"),
    ("generation_prompt_on_completions", {"prompt": "x", "add_generation_prompt": True}, COMPLETIONS_PATH,
     "only supported on /v1/chat/completions"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("body", "path", "message"), [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_raise_prompt_error(tiny_tokenizer, body, path, message):
    with pytest.raises(PromptError, match=message):
        _make(tiny_tokenizer).tokens(body, path)  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(("body", "path", "reason"), [
    ({"input": "x"}, "/v1/embeddings", "unknown_api"),
    ({"input": "x", "previous_response_id": "resp_1"}, "/v1/responses", "previous_response_id"),
    ({"input": "x", "background": True}, "/v1/responses", "responses_unsupported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "/v1/responses", "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "/v1/messages", "image"),
])
def test_what_the_picker_does_not_mirror_is_unplaceable_not_refused(tiny_tokenizer, body, path, reason):
    from dynamo_ppd.picker.chat_template import Unplaceable

    with pytest.raises(Unplaceable) as raised:
        _make(tiny_tokenizer).tokens(body, path)
    assert raised.value.reason == reason and not isinstance(raised.value, PromptError)


@pytest.mark.unit
def test_prompt_error_is_a_value_error_and_a_template_raise_is_one(tiny_tokenizer):
    assert issubclass(PromptError, ValueError)
    strict = _make(tiny_tokenizer, "{% if messages|length > 1 %}{{ raise_exception('one message only') }}"
                                   "{% endif %}{{ messages[0].content }}")
    with pytest.raises(PromptError, match="one message only"):
        strict.tokens({"messages": [_user(), _user()]}, CHAT)


@pytest.mark.unit
def test_a_prompt_that_fills_the_context_window_is_refused(tiny_tokenizer):
    small = _make(tiny_tokenizer, context_length=8)
    assert len(small.tokens({"prompt": [1, 2, 3, 4, 5, 6, 7]}, COMPLETIONS_PATH)) == 7
    with pytest.raises(PromptError, match="maximum context length is 8 tokens"):
        small.tokens({"prompt": list(range(8))}, COMPLETIONS_PATH)


@pytest.mark.unit
def test_completions_are_encoded_without_a_template_or_special_tokens(tiny_tokenizer):
    prompts = _make(tiny_tokenizer)
    ids = prompts.tokens({"prompt": "hello world"}, COMPLETIONS_PATH)
    assert ids == tiny_tokenizer.encode("hello world", add_special_tokens=False).ids
    assert prompts.tokens({"prompt": "hel\0lo world"}, COMPLETIONS_PATH) == ids  # NULs dropped
    assert prompts.tokens({"prompt": ["hello world"]}, COMPLETIONS_PATH + "?x=1") == ids
    assert prompts.tokens({"prompt": [[5, 6]]}, COMPLETIONS_PATH) == [5, 6]
    assert prompts.tokens({"prompt": "hello", "nvext": {"token_data": [9]}}, COMPLETIONS_PATH) == [9]


@pytest.mark.unit
def test_chat_renders_and_encodes_the_template(tiny_tokenizer):
    prompts = _make(tiny_tokenizer)
    body = {"messages": [{"role": "system", "content": [_text("a"), _text("b")]},
                         {"role": "user", "content": "hello", "unknown_field": 1}]}
    assert prompts.render(body) == "<s><system>a\nb</><user>hello</><assistant>"
    encoded = tiny_tokenizer.encode(prompts.render(body), add_special_tokens=False).ids
    assert prompts.tokens(body, CHAT) == encoded
    assert prompts.tokens(body, CHAT)[0] == tiny_tokenizer.token_to_id("<s>")  # from the template, not added
    assert prompts.render({**body, "add_generation_prompt": False}).endswith("<user>hello</>")
    continued = {"messages": [_user(), {"role": "assistant", "content": "The ship"}],
                 "continue_final_message": True, "add_generation_prompt": False}
    assert prompts.render(continued) == "<s><user>hello</><assistant>The ship"


@pytest.mark.unit
def test_messages_are_rewritten_as_dynamo_does(tiny_tokenizer):
    shown = _make(tiny_tokenizer, "{{ messages | tojson }}")
    body = {"messages": [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": '{"a": 1e20}', "name": "f"},
                                              "type": "function", "id": "c1"}],
         "name": "bot", "content": None, "reasoning_content": "hmm"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url",
                                                                        "image_url": {"url": "http://i"}}]}]}
    # Field order of the Rust structs; the injected content took reasoning_content's slot (swap_remove).
    assert json.loads(shown.render(body)) == [
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "<think>hmm</think>", "name": "bot",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": {"a": 1e20}}}]},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]
    assert shown.render(body).index('"name": "bot"') < shown.render(body).index('"tool_calls"')
    printed = _make(tiny_tokenizer, "{% for m in messages %}{{ m.content }}|{% endfor %}"
                                    "{{ messages[1].tool_calls[0].function.arguments }}")
    assert printed.render(body) == ('sunny|<think>hmm</think>|[{"type": "text", "text": "look"}, '
                                    '{"type": "image"}]|{"a": 1e20}')


@pytest.mark.unit
def test_tools_are_fixed_and_dropped_for_tool_choice_none(tiny_tokenizer):
    shown = _make(tiny_tokenizer, "{{ tools | tojson }}|{{ tools | length }}")
    body = {"messages": [_user()],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    assert shown.render(body) == ('[{"type": "function", "function": {"name": "f", "parameters": '
                                  '{"type": "object", "properties": {}}, "description": ""}}]|1')
    assert shown.render({**body, "tool_choice": "none"}) == "null|0"
    kept = _make(tiny_tokenizer, "{{ tools | length }}", exclude_tools_when_tool_choice_none=False)
    assert kept.render({**body, "tool_choice": "none"}) == "1"
    both = _make(tiny_tokenizer, [{"default": "plain"}, {"tool_use": "with tools"}])
    assert (both.render({"messages": [_user()]}), both.render(body)) == ("plain", "with tools")


@pytest.mark.unit
def test_a_strict_template_gets_its_system_and_user_turns_merged(tiny_tokenizer):
    strict = _make(tiny_tokenizer, STRICT_TEMPLATE)
    body = {"messages": [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, _user("hi"),
                         {"role": "system", "content": "reminder"}, _user("again")]}
    rendered = strict.render(body)
    assert "<|start_header_id|>system<|end_header_id|>\n\nA\n\nB<|eot_id|>" in rendered
    assert "<|start_header_id|>user<|end_header_id|>\n\nhi\n\nreminder\n\nagain<|eot_id|>" in rendered
    permissive = _make(tiny_tokenizer)
    assert permissive.render(body).count("<system>") == 3  # only a template that refuses gets rewritten


GENERATION = "<|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.mark.unit
@pytest.mark.parametrize(("extra", "expected"), [
    ({}, ""),
    ({"thinking": {"type": "enabled"}}, "[thinking=True mode=enabled]"),
    ({"thinking": False}, "[thinking=False mode=disabled]"),
    ({"reasoning_effort": "none"}, "[thinking=False mode=disabled]"),
    ({"reasoning_effort": "low"}, "[thinking=True mode=enabled]"),
    ({"chat_template_args": {"enable_thinking": False}}, "[thinking=False mode=disabled]"),
    ({"thinking": {"type": "enabled"}, "reasoning_effort": "none"}, "[thinking=True mode=enabled]"),
    ({"chat_template_kwargs": {"note": "n", "add_generation_prompt": False}}, "[note=n]"),
], ids=["none", "thinking_enabled", "thinking_false", "effort_none", "effort_low", "args_disable",
        "thinking_wins", "args_do_not_override_the_base_context"])
def test_thinking_and_template_arguments(tiny_tokenizer, extra, expected):
    strict = _make(tiny_tokenizer, STRICT_TEMPLATE)
    rendered = strict.render({"messages": [_user("hi")], **extra})
    assert rendered.rsplit("<|eot_id|>", 1)[1] == GENERATION + expected


@pytest.mark.unit
@pytest.mark.slow  # the session's model directory is trained once (~10 s)
def test_from_model_dir_reads_the_project_model(model_dir):
    prompts = PromptTokenizer.from_model_dir(model_dir)
    body = {"messages": [{"role": "user", "content": "hello"}]}
    assert prompts.render(body) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                                    "hello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompts.vocab_size == 128256 and prompts.context_length == 131072


# ---------------------------------------------------------------------------------------------
# Unit: `encode` piece by piece, against the tokenizer's encoding of the whole text.

WORDS = ["hello", "world", "the", "harbour", "ships", "Aurora", "berth", "2024", "x", "I'm", "don't",
         "a.b", "(ok)", "[1, 2]", "{\"a\": 1}", "--", "...", "?!", "#", "<", ">", "|", "<>", "||"]
UNICODE = ["é", "Ça", "naïve", "北京", "東京", "서울", "😀", "👍🏽", "👩\u200d💻", "a\u200db", "\u0301", "ß",
           "İ", "\ufeff", "𝔘", "\u00a0", "\u2028", "\u3000", "Ångström"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\n\n\n  ", "\t \t"]


def _random_text(rng: random.Random, specials: list[str]) -> str:
    """Words, unicode, whitespace runs, added tokens (side by side, at the start or the end, with
    a NUL inside: removed, it completes them), and parts of them."""
    parts = []
    for _ in range(rng.randint(0, 24)):
        kind = rng.random()
        if kind < 0.3:
            parts.append(rng.choice(WORDS))
        elif kind < 0.4:
            parts.append(rng.choice(UNICODE))
        elif kind < 0.55:
            parts.append(rng.choice(SPACES))
        elif kind < 0.8:
            parts.append("".join(rng.choices(specials, k=rng.choice([1, 1, 1, 2, 3]))))
        elif kind < 0.95:
            special = rng.choice(specials)
            cut = rng.randrange(1, len(special)) if len(special) > 1 else 1
            parts.append(rng.choice([special[:cut], special[cut:], special[:cut] + rng.choice(specials),
                                     special[:cut] + " " + special[cut:], special + special[cut:]]))
        else:
            special = rng.choice(specials)
            cut = rng.randrange(len(special) + 1)
            parts.append(special[:cut] + "\0" + special[cut:])
    return "".join(p + rng.choice(["", "", " "]) for p in parts)


def _assert_encodes_like_the_tokenizer(prompts: PromptTokenizer, texts: list[str]) -> None:
    for text in texts:
        expected = prompts.tokenizer.encode(text.replace("\0", ""), add_special_tokens=False).ids
        assert prompts.encode(text) == expected, repr(text)


@pytest.mark.unit
@pytest.mark.slow  # the session's model directory is trained once (~10 s)
def test_encode_piece_by_piece_matches_the_model_tokenizer(model_dir):
    prompts = PromptTokenizer.from_model_dir(model_dir)
    assert prompts.piecewise and prompts.encoder == "fastokens"  # its pieces encoded by fastokens
    specials = [t.content for t in prompts.tokenizer.get_added_tokens_decoder().values()]
    assert "<|eot_id|>" in specials and "<|start_header_id|>" in specials
    rng = random.Random(7)
    texts = [_random_text(rng, specials) for _ in range(1500)]
    texts += ["", "\0", "<|eot_id|>", "<|eot_id|><|eot_id|>", " <|eot_id|> ", "<|eot_id|", "|eot_id|>",
              "<|eot_id|>\n\n", "<|eot_\0id|>", "<<|eot_id|>>", "<|begin_of_text|><|start_header_id|>user"
              "<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"]
    _assert_encodes_like_the_tokenizer(prompts, texts)
    _assert_encodes_like_the_tokenizer(prompts, texts[::-1])  # again, from the cache


class _OffByOne:
    """An encoder that agrees with the tokenizer except on texts with a digit in them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_batch(self, texts, add_special_tokens=False):
        out = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [type("E", (), {"ids": e.ids + [0] if any(c.isdigit() for c in t) else e.ids})()
                for t, e in zip(texts, out, strict=True)]


@pytest.mark.unit
@pytest.mark.slow  # the session's model directory is trained once (~10 s)
def test_a_fast_encoder_is_used_only_where_its_ids_are_the_tokenizers(model_dir):
    exact = PromptTokenizer.from_model_dir(model_dir)
    plain = PromptTokenizer.from_model_dir(model_dir, fast=False)
    assert (exact.encoder, plain.encoder) == ("fastokens", "tokenizers")
    wrong = PromptTokenizer(plain.tokenizer, {"chat_template": UNIT_TEMPLATE},
                            fast_encoder=_OffByOne(plain.tokenizer))
    assert wrong.encoder == "tokenizers" and wrong.fast_encoder is None  # a probe has digits
    body = {"messages": [{"role": "system", "content": "You guide ships. " * 40},
                         {"role": "user", "content": "Berth 12 at 06:30, the Ça va 😀 tide?"}]}
    assert exact.tokens(body, "/v1/chat/completions") == plain.tokens(body, "/v1/chat/completions")


def _added_tokens_tokenizer(normalizer=None):
    """A tiny BPE with special tokens, a non-special raw-matched token, tokens that are prefixes
    of others or overlap them, and ``normalized`` tokens (matched after the normalizer)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the harbour and its ships"] * 20, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|eot|>", "<|eot|>x", "<|e", "ab", "abc", "b|>")])
    tok.add_tokens([AddedToken("<tool>", normalized=False), AddedToken("Hello", normalized=True),
                    AddedToken("d<|e", normalized=True)])  # only inside a piece: never across <|e
    return tok


@pytest.mark.unit
@pytest.mark.parametrize("lowercase", [False, True], ids=["raw", "lowercase_normalizer"])
def test_encode_piece_by_piece_with_every_kind_of_added_token(lowercase):
    from tokenizers import normalizers

    tok = _added_tokens_tokenizer(normalizers.Lowercase() if lowercase else None)
    prompts = PromptTokenizer(tok, {"chat_template": "x"})
    assert prompts.piecewise
    specials = ["<s>", "</s>", "<|eot|>", "<|eot|>x", "<|e", "ab", "abc", "b|>", "<tool>", "Hello", "hello",
                "d<|e", "world"]
    rng = random.Random(3)
    texts = [_random_text(rng, specials) for _ in range(400)]
    _assert_encodes_like_the_tokenizer(prompts, [*texts, "<|eot|>xy", "<|eo", "abc|>", "HELLO<tool>hello"])


@pytest.mark.unit
def test_tokenizers_that_cannot_be_split_encode_whole_texts():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    def trained(pre_tokenizer):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizer
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False)
        tok.train_from_iterator(["hello world, the harbour and its ships"] * 20, trainer=trainer)
        return tok

    stripped = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    stripped.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, special=True)])
    first_only = trained(pre_tokenizers.Metaspace(prepend_scheme="first"))  # found by the load-time check
    always = trained(pre_tokenizers.Metaspace(prepend_scheme="always"))
    truncating = trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    truncating.enable_truncation(8)
    rng = random.Random(5)
    for tok, piecewise in [(stripped, False), (first_only, False), (always, True), (truncating, False)]:
        prompts = PromptTokenizer(tok, {"chat_template": "x"})
        assert prompts.piecewise is piecewise
        _assert_encodes_like_the_tokenizer(
            prompts, ["hello <mask> world </s>ships", "<s>the<s> harbour </s>", "a  <mask>\n<mask>b"]
            + [_random_text(rng, ["<s>", "</s>", "<mask>"]) for _ in range(100)])


class _Recording:
    """A tokenizer that writes down every text it encodes."""

    def __init__(self, tok):
        self._tok, self.encoded = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode_batch_fast(self, texts, add_special_tokens):
        self.encoded.extend(texts)
        return self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


SPECIAL_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>{% endfor %}"
                    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.mark.unit
def test_a_follow_up_turn_encodes_only_its_new_messages(tiny_tokenizer):
    recording = _Recording(tiny_tokenizer)
    prompts = _make(recording, SPECIAL_TEMPLATE)
    assert prompts.piecewise
    history = [{"role": "system", "content": "the harbour"}, _user("hello world"),
               {"role": "assistant", "content": "its ships"}, _user("and the world")]
    recording.encoded.clear()
    first = prompts.tokens({"messages": history}, CHAT)
    assert recording.encoded == ["system\nthe harbour", "user\nhello world", "assistant\nits ships",
                                 "user\nand the world", "assistant\n"]  # one batch
    recording.encoded.clear()
    follow_up = {"messages": [*history, {"role": "assistant", "content": "hello ships"}, _user("the end")]}
    ids = prompts.tokens(follow_up, CHAT)
    assert recording.encoded == ["assistant\nhello ships", "user\nthe end"]
    generation = len(tiny_tokenizer.encode("<s>assistant\n", add_special_tokens=False).ids)
    assert ids[:len(first) - generation] == first[:-generation]  # the history's ids
    assert ids == tiny_tokenizer.encode(prompts.render(follow_up), add_special_tokens=False).ids


@pytest.mark.unit
def test_the_encode_cache_keeps_the_least_recently_used_pieces(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_module, "ENCODE_CACHE_PIECES", 2)
    recording = _Recording(tiny_tokenizer)
    prompts = _make(recording)
    recording.encoded.clear()
    for text in ("<s>a", "<s>b", "<s>a", "<s>c", "<s>b", "<s>a"):
        assert prompts.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False).ids
    # a, b; a from the cache; c drops b; b again drops a; a again.
    assert recording.encoded == ["a", "b", "c", "b", "a"]


@pytest.mark.unit
def test_the_encode_cache_keeps_many_conversations_and_is_bounded_by_ids(model_dir, monkeypatch):
    """A follow-up of any of thousands of conversations in flight finds its history cached
    (4-byte ids, not Python ints); past the ids bound the least recently used pieces go."""
    from dynamo_ppd.picker import prompt as prompt_module

    prompts = PromptTokenizer.from_model_dir(model_dir)
    rng = random.Random(3)
    histories = [" ".join(f"w{rng.randrange(5000)}" for _ in range(40)) for _ in range(9000)]
    ids = [prompts.encode(text) for text in histories]
    assert len(prompts._cache) >= 9000  # the old 8,192-piece bound would have dropped some
    assert all(type(v).__name__ == "array" for v in prompts._cache.values())
    encoded: list[str] = []
    real = prompts._encode_batch
    monkeypatch.setattr(prompts, "_encode_batch", lambda texts: encoded.extend(texts) or real(texts))
    assert [prompts.encode(text) for text in histories[:100]] == ids[:100]
    assert encoded == []  # every one from the cache, none encoded again
    monkeypatch.setattr(prompt_module, "ENCODE_CACHE_IDS", 2000)
    prompts.encode("one more message to cache")
    assert prompts._cache_ids <= 2000 and len(prompts._cache) < 100
