"""The Anthropic Messages API (``POST /v1/messages``: Claude Code, the Anthropic SDK) as Dynamo 1.6.1's
frontend turns it into a prompt: a chat-completions body, which `prompt.PromptTokenizer` then renders
and encodes as it does any chat.

Dynamo serves the path behind ``--enable-anthropic-api`` (``lib/llm/src/http/service/anthropic.rs``,
``handler_anthropic_messages`` -> ``anthropic_messages``): the request is validated, the system
prompt's Claude Code billing line stripped (``strip_billing_preamble``, ``--strip-anthropic-preamble``,
on by default), and the request converted (``AnthropicCreateMessageRequest`` -> ``UnifiedRequest`` ->
``NvCreateChatCompletionRequest``) and run on the model's chat-completions engine, through the same
chat template. The 1.6.1 tag's source was not readable here (its repository is over the fetch
limit); every rule below was observed on the 1.6.1 wheel's frontend with a capture worker and a
template that prints what it is given (``tests/test_picker_prompt.py`` checks each against the
real frontend), and follows the closest source read (anthropic.rs at 024f0ae, its conversion in
``protocols/anthropic/types.rs``):

- ``system``: a string, or text blocks joined with ``"\\n"``, then the billing line stripped: when the
  text (leading whitespace dropped) starts with ``x-anthropic-billing-header:`` and has a newline,
  everything through the first newline goes. The result is the first message, role ``system``.
- A user message's text blocks are joined with ``""`` (empty ones vanish); a ``tool_result`` block
  first ends the user text before it (a user message of its own), then becomes a ``tool`` message
  (``tool_call_id`` = ``tool_use_id``; its text blocks joined with ``""``; ``is_error`` dropped); text
  after it starts a new user message.
- An assistant message's text blocks are joined with ``""``; ``tool_use`` blocks become its
  ``tool_calls`` (arguments: the ``input`` object as JSON); ``thinking`` blocks its
  ``reasoning_content`` (one segment per tool call and a trailing one when it calls tools,
  consecutive blocks joined with ``"\\n"``); ``redacted_thinking`` and the server tools' blocks are
  dropped.
- ``tools`` (client tools: no ``type`` or ``custom``) become functions (``input_schema`` as
  ``parameters``); ``tool_choice`` ``auto``/``any``/``none``/``tool`` become ``auto``/``required``/
  ``none``/the named function; ``thinking: {type: enabled}`` sets the template's ``enable_thinking``.
- Refused as the frontend refuses them (HTTP 400, `PromptError`, with its message): no messages, a
  message without content blocks, an unknown block type, a server tool, a client tool without
  ``input_schema``, ``max_tokens`` missing or 0.

Images (user ``image`` blocks, images in a tool result) raise `Unplaceable`: the frontend accepts
them, but the picker does not mirror how it hands them to the template, so such a request goes to
the frontend unrouted rather than on a guessed prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .chat_template import PromptError, Unplaceable

BILLING_PREAMBLE = "x-anthropic-billing-header:"  # anthropic.rs strip_billing_preamble
_IGNORED_BLOCKS = frozenset({"redacted_thinking", "server_tool_use", "web_search_tool_result"})
_USER_BLOCKS = frozenset({"text", "image", "tool_result"})
_ASSISTANT_BLOCKS = frozenset({"text", "tool_use", "thinking"}) | _IGNORED_BLOCKS


def strip_billing_preamble(system: str) -> str:
    """anthropic.rs ``strip_billing_preamble``: Claude Code's first system line, when the text
    (leading whitespace dropped) starts with it and goes on past it; else the text unchanged."""
    trimmed = system.lstrip()
    if trimmed.startswith(BILLING_PREAMBLE) and "\n" in trimmed:
        return trimmed[trimmed.index("\n") + 1:]
    return system


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    """A message's content as blocks (a string is one text block), validated as anthropic.rs
    ``validate_anthropic_messages`` does."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise PromptError(f"{where}: must be a string or an array of content blocks")
    if not content:
        raise PromptError(f"{where}: must contain at least one content block")
    for j, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise PromptError(f"{where}[{j}]: content blocks must be objects")
        kind = block.get("type")
        if not isinstance(kind, str) or not kind:
            raise PromptError(f"{where}[{j}].type: must be a non-empty string")
    return content


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise PromptError(f"{where}.text: must be a string")
    return text


def _system(system: Any, strip_preamble: bool) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        texts = []
        for j, block in enumerate(system):
            if not isinstance(block, Mapping) or block.get("type") != "text":
                raise PromptError(f"system[{j}]: system content blocks must be text blocks")
            texts.append(_text(block, f"system[{j}]"))
        text = "\n".join(texts)
    else:
        raise PromptError("system: must be a string or an array of text blocks")
    return strip_billing_preamble(text) if strip_preamble else text


def _tool_result_text(content: Any, where: str) -> str:
    """A tool result's content: a string, or text blocks joined with ``""`` (none: ``""``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"{where}: must be a string or an array of content blocks")
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "image":
            raise Unplaceable("image", "an image in an Anthropic tool result")
        if kind != "text":
            raise PromptError("Failed to convert request: unsupported Anthropic tool_result content block; "
                              "only text and image are supported")
        texts.append(_text(block, where))
    return "".join(texts)


def _user(blocks: list[Mapping[str, Any]], where: str, out: list[dict]) -> None:
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        kind, at = block["type"], f"{where}[{j}]"
        if kind not in _USER_BLOCKS:
            raise PromptError(f'{at}: content block type "{kind}" is not supported')
        if kind == "text":
            if text := _text(block, at):
                texts.append(text)
        elif kind == "image":
            raise Unplaceable("image", "an image in an Anthropic user message")
        else:  # tool_result
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise PromptError(f"{at}.tool_use_id: must be a string")
            flush()
            out.append({"role": "tool", "tool_call_id": tool_use_id,
                        "content": _tool_result_text(block.get("content"), f"{at}.content")})
    flush()


def _assistant(blocks: list[Mapping[str, Any]], where: str) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    segments: list[list[str]] = [[]]  # thinking: one segment per tool call, then a trailing one
    for j, block in enumerate(blocks):
        kind, at = block["type"], f"{where}[{j}]"
        if kind not in _ASSISTANT_BLOCKS:
            raise PromptError(f'{at}: content block type "{kind}" is not supported')
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise PromptError(f"{at}.thinking: must be a string")
            segments[-1].append(thinking)
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise PromptError(f"{at}: a tool_use block needs a string `id` and `name`")
            if not isinstance(arguments, Mapping):
                raise PromptError(f"`{where.split('.')[0]}.tool_calls[{len(calls)}].function.arguments` "
                                  f"must be a valid JSON object string")
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)}})
            segments.append([])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    joined = ["\n".join(s) for s in segments]
    if calls:
        message["tool_calls"] = calls
        if any(joined):
            message["reasoning_content"] = joined
    elif joined[0]:
        message["reasoning_content"] = joined[0]
    return message


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("tools: must be an array")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise PromptError(f"tools[{j}]: must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise PromptError(f'tools[{j}]: server tool type "{kind}" is not supported')
        if tool.get("input_schema") is None:
            raise PromptError(f"tools[{j}].input_schema: field required for client tools")
        if not isinstance(tool.get("name"), str):
            raise PromptError(f"tools[{j}].name: must be a string")
        function: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    """types.rs ``convert_anthropic_tool_choice``."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "tool":
        name = choice.get("name")
        return {"type": "function", "function": {"name": name}} if isinstance(name, str) else "required"
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if mapped is None:
        raise PromptError(f"Invalid tool_choice: {choice!r:.80}")
    return mapped


def chat_body(body: Mapping[str, Any], strip_preamble: bool = True) -> dict[str, Any]:
    """The chat-completions body Dynamo's frontend makes of a Messages API body (the module
    docstring); `PromptError` where it answers 400, `Unplaceable` where the picker cannot mirror it."""
    if not isinstance(body, Mapping):
        raise PromptError("the request body must be a JSON object")
    chat, messages = chat_head(body, strip_preamble)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise PromptError("messages: field required")
    for i, message in enumerate(raw):
        convert_message(i, message, messages)
    chat["messages"] = messages
    return chat


def convert_message(i: int, message: Any, out: list[dict]) -> None:
    """``messages[i]`` of a Messages API body made into chat messages, appended to ``out``
    (each message converts alone: `prompt_memo` keeps a session's converted messages)."""
    where = f"messages[{i}].content"
    if not isinstance(message, Mapping):
        raise PromptError(f"messages[{i}]: must be an object")
    role, content = message.get("role"), message.get("content")
    if role == "system" and isinstance(content, str):
        out.append({"role": "system", "content": content})
    elif role == "user" and isinstance(content, str):
        out.append({"role": "user", "content": content})
    elif role == "user":
        _user(_blocks(content, where), where, out)
    elif role == "assistant":
        if isinstance(content, str):
            out.append({"role": "assistant", "content": content})
        else:
            out.append(_assistant(_blocks(content, where), f"messages[{i}].content"))
    else:
        raise PromptError(f"messages[{i}].role: must be \"user\" or \"assistant\", not {role!r}")


def chat_head(body: Mapping[str, Any], strip_preamble: bool = True) -> tuple[dict[str, Any], list[dict]]:
    """The chat body of a Messages API body but for its messages (``messages`` empty), and the
    chat messages its ``system`` makes (none or one), validated as `chat_body` validates them."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise PromptError("missing field `max_tokens`")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise PromptError("max_tokens: must be a non-negative integer")
    if max_tokens == 0:
        raise PromptError("max_tokens: must be greater than 0")
    messages: list[dict] = []
    system = _system(body.get("system"), strip_preamble)
    if system is not None:
        messages.append({"role": "system", "content": system})
    chat: dict[str, Any] = {"messages": [], "max_tokens": max_tokens}
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "enabled":
        chat["chat_template_args"] = {"enable_thinking": True}
    return chat, messages
