"""The OpenAI Responses API (``POST /v1/responses``: Codex, the OpenAI Agents SDK) as Dynamo 1.6.1's
frontend turns it into a prompt: a chat-completions body, which `prompt.PromptTokenizer` then renders
and encodes as it does any chat.

Dynamo 1.6.1 serves the path always (``http::service::openai::responses``; the conversion is
``protocols::openai::responses::convert_input_items_to_messages`` with ``PendingAssistant``,
``convert_tools_and_choice``, symbols of the 1.6.1 binary). No 1.6.1-era source of it was readable
here; every rule below was observed on the 1.6.1 wheel's frontend with a capture worker and a
template that prints what it is given, and ``tests/test_picker_prompt.py`` checks them against it:

- ``input`` a string: one user message. ``instructions`` is the first, system, message, merged with
  the system and developer messages that lead the input (joined with ``"\\n\\n"``); a system or
  developer message later on stays a system message of its own. Their ``input_text`` parts are
  joined with ``""``.
- A user message's parts stay an array of text parts (the chat path joins them with ``"\\n"``).
- A run of assistant items (``message`` with ``output_text`` parts joined with ``""``,
  ``reasoning``: its ``reasoning_text`` content, else its ``summary_text`` parts joined with ``""``,
  one segment each; ``function_call``: a tool call with its ``call_id``) is one assistant message;
  ``function_call_output`` is a ``tool`` message (text parts joined with ``""``).
- ``tools``: function tools only; ``tool_choice`` ``none``/``auto``/``required``, a named function,
  or ``allowed_tools`` (the tools filtered to its names); ``max_output_tokens`` is ``max_tokens``;
  ``chat_template_args`` (alias ``chat_template_kwargs``) passes through.

1.6.1 keeps no responses: ``previous_response_id`` (and ``background``, ``prompt``,
``max_tool_calls``) are answered 501 "not supported". The picker cannot resolve them either: such a
request, and one with an image, raises `Unplaceable` and goes to the frontend unrouted, which gives
its own answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .chat_template import PromptError, Unplaceable

_UNSUPPORTED = ("previous_response_id", "background", "prompt", "max_tool_calls")  # 501 in 1.6.1
_SYSTEM_ROLES = ("system", "developer")


def _parts_text(content: Any, kinds: tuple[str, ...], where: str) -> str:
    """A string, or the text of its parts of ``kinds`` joined with ``""``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"{where}: must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            _refuse_part(kind, f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _refuse_part(kind: Any, where: str) -> None:
    if kind == "input_image":
        raise Unplaceable("image", "an image in a Responses input")
    if kind == "input_file":
        raise PromptError("Validation: Failed to convert responses request: File input content is not yet "
                          "supported")
    raise PromptError(f"{where}: unsupported content part {kind!r}")


def _user_content(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"{where}: must be a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "input_text" or not isinstance(part.get("text"), str):
            _refuse_part(kind, f"{where}[{j}]")
        parts.append({"type": "text", "text": part["text"]})
    return parts


class _Assistant:
    """``PendingAssistant``: consecutive assistant items collected into one message."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def flush_into(self, messages: list[dict]) -> None:
        if not (self.texts or self.reasoning or self.calls):
            return
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts)}
        if self.reasoning:
            message["reasoning_content"] = list(self.reasoning)
        if self.calls:
            message["tool_calls"] = list(self.calls)
        messages.append(message)
        self.__init__()  # type: ignore[misc]


def _reasoning(item: Mapping[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, list) and content:
        return _parts_text(content, ("reasoning_text",), f"{where}.content")
    return _parts_text(item.get("summary") or [], ("summary_text",), f"{where}.summary")


def _messages(body: Mapping[str, Any]) -> list[dict]:
    items = body.get("input")
    if items is None:
        raise PromptError("missing field `input`")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise PromptError("`input` must be a string or an array of input items")
    system: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise PromptError("`instructions` must be a string")
        system.append(instructions)
    messages: list[dict] = []
    pending = _Assistant()
    leading = True  # still in the system and developer messages the input starts with
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise PromptError(f"{where}: must be an object")
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "message" and role in _SYSTEM_ROLES:
            text = _parts_text(item.get("content"), ("input_text",), f"{where}.content")
            if leading:
                system.append(text)
                continue
            pending.flush_into(messages)
            messages.append({"role": "system", "content": text})
            continue
        leading = False
        if kind == "message" and role == "user":
            pending.flush_into(messages)
            content = _user_content(item.get("content"), f"{where}.content")
            messages.append({"role": "user", "content": content})
        elif kind == "message" and role == "assistant":
            pending.texts.append(_parts_text(item.get("content"), ("output_text",), f"{where}.content"))
        elif kind == "reasoning":
            pending.reasoning.append(_reasoning(item, where))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise PromptError(f"{where}: a function_call needs string `call_id`, `name` and `arguments`")
            pending.calls.append({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise PromptError(f"{where}.call_id: must be a string")
            pending.flush_into(messages)
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _parts_text(item.get("output"), ("input_text", "output_text"),
                                                    f"{where}.output")})
        elif kind == "message":
            raise PromptError(f"{where}.role: must be user, assistant, system or developer, not {role!r}")
        else:
            raise Unplaceable("responses_item", f"a Responses input item of type {kind!r}")
    pending.flush_into(messages)
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _tools(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise PromptError("`tools` must be an array")
        converted = []
        for j, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            if kind != "function":
                raise PromptError(
                    f"Failed to convert responses request: Unsupported Responses tools type {kind!r}: "
                    "the Chat Completions adapter supports only function tools and none, auto, required, "
                    "named function, or function-only allowed_tools choices")
            if not isinstance(tool.get("name"), str):
                raise PromptError(f"tools[{j}].name: must be a string")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                        if tool.get(k) is not None}
            converted.append({"type": "function", "function": function})
        chat["tools"] = converted
    if choice is None:
        return
    if choice in ("none", "auto", "required"):
        chat["tool_choice"] = choice
        return
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind == "allowed_tools" and isinstance(choice.get("tools"), list):
        allowed = {t.get("name") for t in choice["tools"] if isinstance(t, Mapping)}
        chat["tools"] = [t for t in chat.get("tools", []) if t["function"]["name"] in allowed]
        chat["tool_choice"] = choice.get("mode", "auto")
    else:
        raise PromptError(f"Invalid tool_choice: {choice!r:.80}")


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body Dynamo's frontend makes of a Responses API body (the module
    docstring); `PromptError` where it answers 400, `Unplaceable` where the picker cannot mirror it
    or the frontend answers 501."""
    if not isinstance(body, Mapping):
        raise PromptError("the request body must be a JSON object")
    for field in _UNSUPPORTED:
        if body.get(field) not in (None, False):
            raise Unplaceable(field if field == "previous_response_id" else "responses_unsupported",
                              f"`{field}` (Dynamo 1.6.1 keeps no responses and answers 501)")
    chat: dict[str, Any] = {"messages": _messages(body)}
    _tools(body, chat)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("chat_template_args", "chat_template_kwargs"):
        if key in body:
            chat[key] = body[key]
    return chat
