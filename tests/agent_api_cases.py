# ruff: noqa: E501  (request bodies read better one item a line)
"""Agent API bodies (`/v1/messages`, `/v1/responses`) for `tests/test_picker_prompt.py`: each is
POSTed to the real frontend, whose token ids `PromptTokenizer.tokens` must equal (or, for the
refused ones, whose 400 it must raise as `PromptError`)."""

from __future__ import annotations

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"

SYSTEM = "You are a coding agent. Use the tools; keep answers short."
BILLING = "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli;"
READ_TOOL = {"name": "read_file", "description": "Read a file of the repository",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                              "required": ["path"]}}
BASH_TOOL = {"name": "bash", "input_schema": {"type": "object",
                                              "properties": {"command": {"type": "string"}}}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def agent_messages(steps: int) -> list[dict]:
    """An Anthropic tool loop: the task, then ``steps`` rounds of a tool call and its result."""
    messages: list[dict] = [{"role": "user", "content": [_text("Fix the failing test in tests/test_io.py.")]}]
    for k in range(steps):
        messages.append({"role": "assistant", "content": [
            _text(f"Step {k}: reading."),
            {"type": "tool_use", "id": f"toolu_{k}", "name": "read_file", "input": {"path": f"src/io_{k}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k}",
             "content": [_text(f"def read_{k}(path):\n"), _text("    return open(path).read()\n")]}]})
    return messages


# (id, model: None for the project's, path, body)
CASES: list[tuple[str, str | None, str, dict]] = [
    ("messages_string_system", None, MESSAGES, {
        "system": SYSTEM, "messages": [{"role": "user", "content": "Which files changed?"}]}),
    ("messages_empty_string_user", None, MESSAGES, {
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": ""}]}),
    ("messages_system_blocks_and_billing_line", None, MESSAGES, {
        "system": [_text(BILLING), _text(SYSTEM), _text("Repository: harbour.")],
        "messages": [{"role": "user", "content": [_text("Run "), _text(""), _text("the tests.")]}]}),
    ("messages_billing_line_only", None, MESSAGES, {
        "system": "  " + BILLING, "messages": [{"role": "user", "content": "hi"}]}),
    ("messages_tool_loop", None, MESSAGES, {"system": SYSTEM, "tools": [READ_TOOL, BASH_TOOL],
                                            "messages": agent_messages(3)}),
    ("messages_tool_result_string_error_and_text_after", None, MESSAGES, {
        "tools": [BASH_TOOL], "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "ls"},
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}]},
                     {"role": "user", "content": [
                         _text("before"),
                         {"type": "tool_result", "tool_use_id": "t1", "content": "no such dir", "is_error": True},
                         _text("after "), _text("that")]}]}),
    ("messages_thinking_and_tool_choice_none", None, MESSAGES, {
        "tools": [READ_TOOL], "tool_choice": {"type": "none"}, "thinking": {"type": "enabled", "budget_tokens": 64},
        "messages": [{"role": "user", "content": "plan"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "first idea", "signature": "s"},
                         {"type": "thinking", "thinking": "second idea", "signature": "s"},
                         _text("Plan: "), _text("two steps.")]},
                     {"role": "user", "content": "go"}]}),
    ("messages_thinking_between_tool_calls", "strict-template", MESSAGES, {
        "tools": [READ_TOOL],
        "messages": [{"role": "user", "content": "read both"},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "a first", "signature": "s"},
                         {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a"}},
                         {"type": "thinking", "thinking": "then b", "signature": "s"},
                         {"type": "tool_use", "id": "t2", "name": "read_file", "input": {"path": "b"}},
                         {"type": "thinking", "thinking": "done", "signature": "s"}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": "A"},
                         {"type": "tool_result", "tool_use_id": "t2", "content": "B"}]}]}),
    ("messages_named_tool_unicode", "llama32-template", MESSAGES, {
        "system": "Réponds en français.", "tools": [READ_TOOL],
        "tool_choice": {"type": "tool", "name": "read_file"},
        "messages": [{"role": "user", "content": "Lis « 北京.txt » 😀"}]}),
    ("responses_string", None, RESPONSES, {"input": "Which files changed?"}),
    ("responses_instructions_and_leading_system", None, RESPONSES, {
        "instructions": SYSTEM,
        "input": [{"role": "developer", "content": "dev rules"},
                  {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s1"},
                                                                    {"type": "input_text", "text": "s2"}]},
                  {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_text", "text": "b"}]},
                  {"role": "developer", "content": "later rule"},
                  {"role": "user", "content": "c"}]}),
    ("responses_tool_loop", None, RESPONSES, {
        "instructions": SYSTEM,
        "tools": [{"type": "function", "name": "read_file", "description": "Read a file",
                   "parameters": READ_TOOL["input_schema"]}],
        "input": [{"role": "user", "content": "fix it"},
                  {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "S1"},
                                                                  {"type": "summary_text", "text": "S2"}]},
                  {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path":"a.py"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "print(1)"},
                  {"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "p1"}, {"type": "output_text", "text": "p2"}]},
                  {"type": "function_call", "call_id": "c2", "name": "read_file", "arguments": '{"path": "b.py"}'},
                  {"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "o2a"}, {"type": "input_text", "text": "o2b"}]},
                  {"role": "user", "content": "and now?"}]}),
    ("responses_allowed_tools", "strict-template", RESPONSES, {
        "tools": [{"type": "function", "name": "read_file", "parameters": READ_TOOL["input_schema"]},
                  {"type": "function", "name": "bash", "parameters": BASH_TOOL["input_schema"]}],
        "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "bash"}]},
        "input": [{"role": "user", "content": "list"},
                  {"type": "reasoning", "id": "r", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "think"}]},
                  {"type": "function_call", "call_id": "c", "name": "bash", "arguments": '{"command":"ls"}'},
                  {"type": "function_call_output", "call_id": "c", "output": "x"}]}),
    ("responses_nvext_token_data", None, RESPONSES, {"input": "ignored",
                                                     "nvext": {"token_data": [1000, 1003, 1009]}}),
    ("messages_nvext_token_data", None, MESSAGES, {"messages": [{"role": "user", "content": "ignored"}],
                                                   "nvext": {"token_data": [1000, 1004]}}),
]

# Requests the frontend answers with a 400.
REFUSED: list[tuple[str, str, dict]] = [
    ("messages_empty", MESSAGES, {"messages": []}),
    ("messages_no_blocks", MESSAGES, {"messages": [{"role": "user", "content": []}]}),
    ("messages_document_block", MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}),
    ("messages_server_tool", MESSAGES, {"messages": [{"role": "user", "content": "x"}],
                                        "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("messages_tool_without_schema", MESSAGES, {"messages": [{"role": "user", "content": "x"}],
                                                "tools": [{"name": "f"}]}),
    ("messages_max_tokens_zero", MESSAGES, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("messages_tool_result_document", MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]}),
    ("responses_file_input", RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file-1"}]}]}),
    ("responses_web_search_tool", RESPONSES, {"input": "x", "tools": [{"type": "web_search"}]}),
]
