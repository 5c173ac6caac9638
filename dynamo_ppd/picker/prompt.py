"""A request's prompt token ids, computed exactly as Dynamo 1.6.1's frontend computes them.

The endpoint picker hashes the prompt's token blocks to find the worker that holds a
conversation's KV cache, before it forwards the OpenAI request to ``python -m dynamo.frontend``;
the ids must therefore be the ones the frontend will send the worker. `PromptTokenizer` mirrors
the frontend's default (``--dyn-chat-processor dynamo``, the Rust preprocessor) for
``/v1/chat/completions`` and ``/v1/completions``.

Sources (ai-dynamo/dynamo; the 1.6.1 wheel links the chat-template code as the crate
``dynamo-renderer`` 8.0.3, newer than any copy of ``lib/renderer`` the code index holds, so every
behaviour below was also checked against the real frontend through a capture worker,
``tests/test_picker_prompt.py``, and where a stored source and the 1.6.1 binary disagreed the
binary won):

- ``lib/llm/src/preprocessor.rs`` (``preprocess_request``, ``apply_template``, ``gather_tokens``,
  ``encode_with_timing``, ``validate_token_count``): chat requests are rendered then encoded,
  completions are encoded without any template; ``nvext.token_data`` replaces tokenization; NUL
  characters are removed before encoding; a prompt that fills the context window is refused.
- ``lib/llm/src/preprocessor/prompt.rs`` (the ``OAIChatLikeRequest`` impls,
  ``append_continue_final_message_tag``, ``apply_continue_final_message``):
  ``add_generation_prompt`` is the request's field (default true, whatever the last role),
  ``continue_final_message`` marks the last message and cuts the rendering there.
- ``lib/renderer/src/template/formatters.rs`` (``JinjaEnvironment::default``,
  ``HfTokenizerConfigJsonFormatter::with_options``, the load-time probes
  ``detect_content_array_usage``, ``detect_image_placeholder_template``,
  ``detect_passthrough_template``, ``normalize_dict_method_calls``,
  ``remove_known_non_jinja2_tags``, see `normalize_template_source`): minijinja with
  ``trim_blocks`` and ``lstrip_blocks``, pycompat methods, a ``length`` filter that counts none
  as 0, ``tojson``, ``raise_exception``, ``strftime_now``; templates ``default`` and ``tool_use``.
- ``lib/renderer/src/template/oai.rs`` (``render``, ``may_be_fix_tool_schema``,
  ``may_be_fix_msg_content``, ``normalize_system_messages``,
  ``normalize_tool_calls_arguments_in_messages``, ``inject_reasoning_content_into_messages``):
  the message and tool normalization and the template context (``messages``, ``tools``,
  ``bos_token``, ``eos_token``, ``unk_token``, ``add_generation_prompt``, then
  ``chat_template_args``, which cannot override those six).
- ``lib/renderer/src/template/tokcfg.rs`` (``ChatTemplate``): bos/eos/unk tokens, given as a
  string or as an added-token object.
- ``lib/tokenizers/src/hf.rs`` (``HuggingFaceTokenizer``): ``encode(text, add_special_tokens =
  false)``, after promoting ``tokenizer_config.json``'s special ``added_tokens_decoder`` entries.
- ``lib/llm/src/protocols/openai/chat_completions.rs``: ``chat_template_kwargs`` is an alias of
  ``chat_template_args``; the ``thinking`` field (and ``reasoning_effort``) are normalized into
  ``thinking`` / ``enable_thinking`` / ``thinking_mode`` template arguments.

Established only by observing the 1.6.1 frontend (no matching source in the index): messages are
re-serialized in the Rust structs' field order, unknown fields dropped, and a removed field's
slot is taken by the last field (serde_json's ``preserve_order`` ``swap_remove``); a function
message's missing content is ``null``; a system message keeps its own (empty) ``tools``;
``{% generation %}`` tags act as empty blocks; ``tojson`` writes Python's ``json.dumps``
separators without HTML escaping; ``tool_choice`` is not in the template context; an array of
reasoning segments is joined by newlines for a template that reads ``reasoning_content``; lists
and maps print in minijinja's JSON-like form with Python's ``True``/``None``; the ``thinking``
rules in `_thinking_args`.

Not mirrored (the frontend still refuses these after the picker routed them): validation that
does not change the tokens, e.g. unsupported top-level parameters or ``strict`` tool schemas
without ``additionalProperties: false``. A completions batch (several prompts) is a
`PromptError` here although the frontend accepts it: it fans out into one backend request per
prompt, which the picker cannot place on one worker.

Template engine: the ``minijinja`` Python package, the same engine the Rust preprocessor uses
(transformers' Jinja2 differs in details such as how undefined values, ``none`` and booleans
print, string methods and ``tojson``; no case needed Jinja2). One known divergence: a list or
map the template builds itself (``{{ "a b".split() }}``) prints as Python's repr here
(``['a', 'b']``) and in minijinja's JSON-like form in Dynamo (``["a", "b"]``); lists and maps
from the request (a content array, parsed tool arguments, ``tools``) print as Dynamo prints them
(`_display`). Real chat templates print containers through ``tojson``.

Pure: the constructor reads the model directory; `PromptTokenizer.tokens` does no I/O.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model import ModelDirError

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# lib/llm/src/preprocessor/prompt.rs
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
CONTINUE_FINAL_MESSAGE_NOT_FOUND = ("Unable to continue the final message because it was not found in the "
                                    "rendered chat template.")

# The Rust message structs' fields, in serialization order (dynamo-protocols, observed in 1.6.1).
_ROLE_FIELDS: dict[str, tuple[str, ...]] = {
    "system": ("content", "name", "tools"),
    "developer": ("content", "name"),
    "user": ("content", "name"),
    "assistant": ("content", "reasoning_content", "refusal", "name", "audio", "tool_calls", "function_call",
                  "partial"),
    "tool": ("content", "tool_call_id"),
    "function": ("content", "name"),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "system": ("content",), "developer": ("content",), "user": ("content",),
    "assistant": (), "tool": ("content", "tool_call_id"), "function": ("name",),
}
# Content part types each role accepts (an array of any other part is a 400 in Dynamo).
_PART_TYPES: dict[str, frozenset[str]] = {
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "user": frozenset({"text", "image_url", "video_url", "audio_url", "input_audio"}),
    "assistant": frozenset({"text", "refusal"}),
    "tool": frozenset({"text"}),
}
# oai.rs DEFAULT_MEDIA_TYPE_CONVERSIONS
_MEDIA_PLACEHOLDERS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


class PromptError(ValueError):
    """The request cannot be tokenized as Dynamo's frontend would (it answers such a request with
    HTTP 400); the message says why."""


@dataclass(frozen=True)
class _SystemRules:
    """oai.rs ``SystemNormalization``: what the template refuses, found by probing it at load."""

    demote_nonleading_system: bool = False
    coalesce_consecutive_users: bool = False


@dataclass(frozen=True)
class _Template:
    name: str
    handles_arguments_string: bool  # source branches on `arguments is string`: keep raw JSON strings
    handles_reasoning: bool  # source reads `reasoning_content`: no <think> injection
    system_rules: _SystemRules


# ---------------------------------------------------------------------------------------------
# Template environment (formatters.rs, tokcfg.rs).

def _tojson(value: Any, indent: int | None = None, **_ignored: Any) -> str:
    """``tojson`` as Dynamo 1.6.1 renders it: Python's ``json.dumps`` separators, non-ASCII kept,
    no HTML escaping (observed; the older tokcfg.rs escaped ``<>&'``)."""
    if indent is None:
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _length(value: Any) -> int:
    """formatters.rs: ``length`` of none or undefined is 0, of a value without a length 0."""
    try:
        return len(value)
    except TypeError:
        return 0


def _raise_exception(message: Any) -> str:
    raise PromptError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _find_tag_end(src: str, start: int, close: str) -> int | None:
    found = src.find(close, start)
    return None if found < 0 else found + len(close)


def _is_block(inner: str, name: str) -> bool:
    text = inner.lstrip()
    if text[:1] in "-+":
        text = text[1:].lstrip()
    if not text.startswith(name):
        return False
    rest = text[len(name):]
    return not rest or rest[0].isspace() or rest[0] in "-+"


def _normalize_segment(segment: str) -> str:
    """``.items()`` outside string literals becomes ``|items`` (a schema's ``items`` key would
    otherwise shadow the method)."""
    out: list[str] = []
    i, quote, escaped = 0, "", False
    while i < len(segment):
        ch = segment[i]
        if quote:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            i += 1
        elif ch in "'\"":
            quote = ch
            out.append(ch)
            i += 1
        elif segment.startswith(".items()", i):
            out.append("|items")
            i += len(".items()")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


_GENERATION_TAG = re.compile(r"\{%([-+]?)\s*(end)?generation\s*([-+]?)%\}")


def _generation_as_block(match: re.Match) -> str:
    before, end, after = match.groups()
    return "{%" + before + (" endif " if end else " if true ") + after + "%}"


def normalize_template_source(src: str) -> str:
    """formatters.rs ``remove_known_non_jinja2_tags`` then ``normalize_dict_method_calls``.

    vLLM's ``{% generation %}`` / ``{% endgeneration %}`` tags (any spacing, ``-`` or ``+``) act
    as empty blocks in 1.6.1, block whitespace control included (observed: the stored
    formatters.rs deleted the exact ``{% generation %}`` text instead, which would keep a newline
    ``trim_blocks`` removes), so they become ``{% if true %}`` / ``{% endif %}``."""
    src = _GENERATION_TAG.sub(_generation_as_block, src)
    out: list[str] = []
    i = 0
    while i < len(src):
        if src.startswith("{#", i):
            end = _find_tag_end(src, i + 2, "#}")
            if end is None:
                out.append(src[i:])
                break
            out.append(src[i:end])
            i = end
        elif src.startswith("{{", i):
            end = _find_tag_end(src, i + 2, "}}")
            if end is None:
                out.append(src[i:])
                break
            out.append("{{" + _normalize_segment(src[i + 2:end - 2]) + "}}")
            i = end
        elif src.startswith("{%", i):
            end = _find_tag_end(src, i + 2, "%}")
            if end is None:
                out.append(src[i:])
                break
            inner = src[i + 2:end - 2]
            if _is_block(inner, "raw"):
                raw_end = _raw_block_end(src, end)
                if raw_end is None:
                    out.append(src[i:])
                    break
                out.append(src[i:raw_end])
                i = raw_end
            else:
                out.append("{%" + _normalize_segment(inner) + "%}")
                i = end
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def _raw_block_end(src: str, start: int) -> int | None:
    i = start
    while (open_at := src.find("{%", i)) >= 0:
        end = _find_tag_end(src, open_at + 2, "%}")
        if end is None:
            return None
        if _is_block(src[open_at + 2:end - 2], "endraw"):
            return end
        i = end
    return None


def _special_token(value: Any) -> str | None:
    """tokcfg.rs ``BeginEndUnkTok``: a string or an added-token object's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _debug_str(text: str) -> str:
    """A string as Rust's ``{:?}`` writes it (minijinja shows strings in containers that way)."""
    out = ['"']
    for k, ch in enumerate(text):
        if ch in _DEBUG_ESCAPES:
            out.append(_DEBUG_ESCAPES[ch])
        elif unicodedata.category(ch) in _UNPRINTABLE or (k == 0 and unicodedata.category(ch) in _EXTENDING):
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_DEBUG_ESCAPES = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"', "\0": "\\0"}
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_EXTENDING = frozenset({"Mn", "Me"})  # escaped as the first character only (Rust's escape_debug)


def _display(value: Any) -> str:
    """How Dynamo 1.6.1 prints a value inside a list or map (observed): minijinja's JSON-like
    form with Python's ``True``/``False``/``None``."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return _debug_str(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_debug_str(str(k))}: {_display(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_display(v) for v in value) + "]"
    return str(value)


class _DisplayList(list):
    """A list from the request, printed by the template as Dynamo prints it."""

    def __str__(self) -> str:
        return _display(self)

    __repr__ = __str__


class _DisplayDict(dict):
    """A map from the request, printed by the template as Dynamo prints it."""

    def __str__(self) -> str:
        return _display(self)

    __repr__ = __str__


def _for_template(value: Any) -> Any:
    """``value`` with every list and map wrapped so that printing one directly matches Dynamo
    (minijinja-py would print Python's repr, ``{'a': 1}``, where Dynamo prints ``{"a": 1}``)."""
    if isinstance(value, dict):
        return _DisplayDict((k, _for_template(v)) for k, v in value.items())
    if isinstance(value, list):
        return _DisplayList(_for_template(v) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# Request validation and the messages as Dynamo re-serializes them.

def _swap_remove(d: dict, key: str) -> Any:
    """serde_json ``Map::remove`` under ``preserve_order``: the last entry takes the removed one's
    place (which is why Dynamo's messages come out in a shuffled key order after a rewrite)."""
    if key not in d:
        return None
    keys = list(d)
    index = keys.index(key)
    value = d.pop(key)
    if index < len(keys) - 1:
        last_key = keys[-1]
        last_value = d.pop(last_key)
        items = list(d.items())
        items.insert(index, (last_key, last_value))
        d.clear()
        d.update(items)
    return value


def _where(i: int, field: str | None = None) -> str:
    return f"messages[{i}]" + (f".{field}" if field else "")


def _content(role: str, value: Any, where: str) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PromptError(f"{where} must be a string or an array of content parts, "
                          f"not {type(value).__name__}")
    allowed = _PART_TYPES.get(role, frozenset())
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed:
            raise PromptError(f"{where}[{j}] must be a content part of type "
                              f"{' or '.join(sorted(allowed))} for a {role} message, not {part!r:.80}")
        if kind in ("text", "refusal"):
            if not isinstance(part.get(kind), str):
                raise PromptError(f"{where}[{j}].{kind} must be a string")
            parts.append({"type": kind, kind: part[kind]})
        else:
            if not isinstance(part.get(kind), Mapping):
                raise PromptError(f"{where}[{j}].{kind} must be an object")
            parts.append({"type": kind, kind: dict(part[kind])})
    return parts


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise PromptError(f"{where} must be an array")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(call.get("id"), str):
            raise PromptError(f"{at} must be an object with an `id` and a `function`")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise PromptError(f"{at}.function must have a string `name` and string `arguments`")
        if arguments:
            try:
                parsed = json.loads(arguments)
            except ValueError as exc:
                raise PromptError(f"`{at}.function.arguments` must be a valid JSON object string: "
                                  f"{exc}") from None
            if not isinstance(parsed, dict):
                raise PromptError(f"`{at}.function.arguments` must be a valid JSON object string")
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


def canonical_messages(messages: Any) -> list[dict]:
    """The request's messages as Dynamo's frontend hands them to the template: validated like its
    serde types (a 400 there is a `PromptError` here), in the Rust structs' field order, unknown
    and null fields dropped."""
    if not isinstance(messages, list):
        raise PromptError("`messages` must be an array of messages")
    if not messages:
        raise PromptError("The 'messages' field cannot be empty. At least one message is required.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"{_where(i)} must be an object")
        role = message.get("role")
        if role not in _ROLE_FIELDS:
            raise PromptError(f"{_where(i)}.role must be one of {', '.join(_ROLE_FIELDS)}, not {role!r}")
        for field in _REQUIRED[role]:
            if message.get(field) is None:
                raise PromptError(f"{_where(i)}: a {role} message needs `{field}`")
        if role != "system" and "tools" in message:
            raise PromptError(f"`tools` is only accepted on system messages, not on role {role}")
        canonical: dict[str, Any] = {"role": role}
        for field in _ROLE_FIELDS[role]:
            value = message.get(field)
            if value is None:
                if role == "function" and field == "content":
                    canonical[field] = None  # Option<String> serialized as null, not skipped
                continue
            at = _where(i, field)
            if field == "content" and role == "function":
                if not isinstance(value, str):
                    raise PromptError(f"{at} must be a string")
            elif field == "content":
                value = _content(role, value, at)
            elif field == "tool_calls":
                value = _tool_calls(value, at)
            elif field == "function_call":
                if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) \
                        or not isinstance(value.get("arguments"), str):
                    raise PromptError(f"{at} must be an object with string `name` and `arguments`")
                value = {"name": value["name"], "arguments": value["arguments"]}
            elif field == "reasoning_content":
                if not (isinstance(value, str) or (isinstance(value, list)
                                                   and all(isinstance(s, str) for s in value))):
                    raise PromptError(f"{at} must be a string or an array of strings")
                value = list(value) if isinstance(value, list) else value
            elif field == "tools":  # a system message's own tools: only an empty list renders here
                if not isinstance(value, list):
                    raise PromptError(f"{at} must be an array")
                if value:
                    raise PromptError(f"{at}: tools on a system message are not supported by this "
                                      f"chat template")
                value = []
            elif field == "partial":
                if not isinstance(value, bool):
                    raise PromptError(f"{at} must be a boolean")
                if value:
                    raise PromptError(f"{at}: a partial assistant message is not supported by this "
                                      f"chat template")
            elif field == "audio":
                if not isinstance(value, Mapping) or not isinstance(value.get("id"), str):
                    raise PromptError(f"{at} must be an object with a string `id`")
                value = {"id": value["id"]}
            elif not isinstance(value, str):
                raise PromptError(f"{at} must be a string")
            canonical[field] = value
        out.append(canonical)
    return out


def canonical_tools(tools: Any) -> list[dict] | None:
    """``tools`` as oai.rs ``may_be_fix_tool_schema`` gives them to the template: a missing
    ``description`` becomes ``""`` (appended), ``parameters`` gets ``type: object`` and
    ``properties: {}`` when missing."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("`tools` must be an array of tools")
    if not tools:
        raise PromptError("tools array cannot be empty; omit the field entirely to disable tool use")
    out = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise PromptError(f"tools[{j}] must be an object with a `function` that has a string `name`")
        fixed: dict[str, Any] = {"name": function["name"]}
        for field in ("description", "parameters", "strict"):
            if function.get(field) is not None:
                fixed[field] = function[field]
        if not isinstance(fixed.get("description"), str):
            fixed["description"] = ""
        parameters = fixed.get("parameters")
        if isinstance(parameters, Mapping):
            parameters = dict(parameters)
            if "type" not in parameters:
                parameters["type"] = "object"
            if "properties" not in parameters:
                parameters["properties"] = {}
            fixed["parameters"] = parameters
        out.append({"type": "function", "function": fixed})
    return out


# ---------------------------------------------------------------------------------------------
# Message rewrites before rendering (oai.rs).

def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def _merge_content(target: Any, source: Any) -> Any:
    if isinstance(target, str) and isinstance(source, str):
        return target + ("\n\n" if target and source else "") + source
    if isinstance(target, list) and isinstance(source, list):
        return target + source
    if isinstance(target, list) and isinstance(source, str):
        return target + ([_text_part(source)] if source else [])
    if isinstance(target, str) and isinstance(source, list):
        return ([_text_part(target)] if target else []) + source
    if target is None:
        return source
    return target


def _append_content(target: dict, source: Any) -> None:
    merged = _merge_content(_swap_remove(target, "content"), source)
    target["content"] = merged


def normalize_system_messages(messages: list[dict], rules: _SystemRules) -> list[dict]:
    """oai.rs ``normalize_system_messages``, for a template that refuses a non-leading system turn
    (the leading run merges into one, later ones become user turns) or consecutive user turns
    (they merge)."""
    if rules.demote_nonleading_system:
        leading = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
        if leading > 1:
            for trailing in messages[1:leading]:
                _append_content(messages[0], trailing.get("content"))
            del messages[1:leading]
        leading = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
        for m in messages[leading:]:
            if m["role"] == "system":
                m["role"] = "user"
    if rules.coalesce_consecutive_users:
        coalesced: list[dict] = []
        for m in messages:
            if m["role"] == "user" and coalesced and coalesced[-1]["role"] == "user":
                _append_content(coalesced[-1], m.get("content"))
            else:
                coalesced.append(m)
        messages = coalesced
    return messages


def fix_message_content(messages: list[dict], preserve_arrays: bool, placeholder: str | None) -> None:
    """oai.rs ``may_be_fix_msg_content``: media parts become placeholders (``image_url`` ->
    ``{"type": "image"}``), a text-only array becomes its texts joined by newlines (or, for a
    template that needs arrays, a string becomes a one-part array)."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            if preserve_arrays:
                m["content"] = [_text_part(content)]
            continue
        if not isinstance(content, list):
            continue
        parts = [{"type": _MEDIA_PLACEHOLDERS[p.get("type")]} if p.get("type") in _MEDIA_PLACEHOLDERS else p
                 for p in content]
        text_only = bool(parts) and all(p.get("type") == "text" for p in parts)
        if text_only and not preserve_arrays:
            m["content"] = "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str))
        elif not preserve_arrays and parts and placeholder is not None:
            m["content"] = _flatten_mixed(parts, placeholder)
        else:
            m["content"] = parts


def _flatten_mixed(parts: list[dict], placeholder: str) -> str:
    out, index = [], 1
    for part in parts:
        kind = part.get("type") or ""
        if kind == "text":
            if isinstance(part.get("text"), str):
                out.append(part["text"])
        elif kind:
            out.append(placeholder.replace("{n}", str(index)))
            index += 1
    return "".join(out)


class _JsonFloat(float):
    """A float that prints as it was written (serde_json's ``arbitrary_precision`` in Dynamo keeps
    ``1e20`` as ``1e20``, where Python would print ``1e+20``)."""

    text: str

    def __new__(cls, text: str) -> _JsonFloat:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def _parse_arguments(holder: dict) -> None:
    arguments = holder.get("arguments")
    if isinstance(arguments, str):
        try:
            holder["arguments"] = json.loads(arguments, parse_float=_JsonFloat)
        except ValueError:
            pass


def normalize_arguments(messages: list[dict], tool_calls: bool) -> None:
    """oai.rs: JSON-string ``arguments`` become objects (``tool_calls`` unless the template
    handles strings itself; the legacy ``function_call`` always)."""
    for m in messages:
        if tool_calls:
            for call in m.get("tool_calls") or ():
                if isinstance(call.get("function"), dict):
                    _parse_arguments(call["function"])
        if isinstance(m.get("function_call"), dict):
            _parse_arguments(m["function_call"])


def inject_reasoning(messages: list[dict]) -> None:
    """oai.rs ``inject_reasoning_content_into_messages``: an assistant's ``reasoning_content``
    goes in front of its content as ``<think>...</think>`` (for templates that ignore it)."""
    for m in messages:
        if m["role"] != "assistant":
            continue
        reasoning = m.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            think = f"<think>{reasoning}</think>"
        elif isinstance(reasoning, list):
            think = "".join(f"<think>{s}</think>" for s in reasoning if isinstance(s, str) and s)
            if not think:
                continue
        else:
            continue
        content = m.get("content")
        if isinstance(content, str) and content:
            m["content"] = think + content
        elif content is None or isinstance(content, str):
            m["content"] = think
        elif isinstance(content, list):
            content.insert(0, _text_part(think))
        else:
            continue
        _swap_remove(m, "reasoning_content")


def join_reasoning_segments(messages: list[dict]) -> None:
    """For a template that reads ``reasoning_content`` itself: an array of segments becomes one
    string, the segments joined by newlines (observed in 1.6.1)."""
    for m in messages:
        reasoning = m.get("reasoning_content")
        if m["role"] == "assistant" and isinstance(reasoning, list):
            m["reasoning_content"] = "\n".join(s for s in reasoning if isinstance(s, str))


def _append_continue_tag(messages: list[dict]) -> None:
    """prompt.rs ``append_continue_final_message_tag``."""
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, str) and content:
        last["content"] = content + CONTINUE_FINAL_MESSAGE_TAG
        return
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part.get("text"), str) and part["text"]:
                part["text"] += CONTINUE_FINAL_MESSAGE_TAG
                return
    raise PromptError(CONTINUE_FINAL_MESSAGE_NOT_FOUND)


def _cut_at_continue_tag(rendered: str) -> str:
    """prompt.rs ``apply_continue_final_message``."""
    tag_name = CONTINUE_FINAL_MESSAGE_TAG.rstrip()
    at = rendered.rfind(tag_name)
    if at < 0:
        raise PromptError(CONTINUE_FINAL_MESSAGE_NOT_FOUND)
    if rendered.startswith(CONTINUE_FINAL_MESSAGE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()


def _thinking_args(body: Mapping[str, Any], args: dict[str, Any]) -> None:
    """The ``thinking`` control normalized into template arguments, as 1.6.1 does it (observed):
    the request's ``thinking`` (a bool or ``{"type": "enabled"|"disabled"|"adaptive"}``), else
    ``reasoning_effort`` (``"none"`` is off, anything else on), else a ``thinking`` or
    ``enable_thinking`` bool already in the arguments, sets ``thinking``, ``enable_thinking`` and
    ``thinking_mode``; ``adaptive`` sets only ``thinking_mode``."""
    thinking = body.get("thinking")
    enabled: bool | None = None
    if isinstance(thinking, bool):
        enabled = thinking
    elif isinstance(thinking, Mapping):
        kind = thinking.get("type")
        if kind == "adaptive":
            args["thinking_mode"] = "adaptive"
            return
        enabled = {"enabled": True, "disabled": False}.get(kind) if isinstance(kind, str) else None
    if enabled is None and isinstance(body.get("reasoning_effort"), str):
        enabled = body["reasoning_effort"] != "none"
    if enabled is None:
        for key in ("thinking", "enable_thinking"):
            if isinstance(args.get(key), bool):
                enabled = args[key]
                break
    if enabled is not None:
        args.update(thinking=enabled, enable_thinking=enabled,
                    thinking_mode="enabled" if enabled else "disabled")


# ---------------------------------------------------------------------------------------------

def _normalized_path(path: str) -> str:
    return path.split("?", 1)[0].rstrip("/")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class PromptTokenizer:
    """The frontend's prompt tokens for a request body: `tokens(body, path)`.

    Built from a model directory (`from_model_dir`): ``tokenizer.json`` (HF ``tokenizers``) and
    ``tokenizer_config.json``'s ``chat_template`` (or a ``chat_template.jinja`` /
    ``chat_template.json`` beside it), ``bos_token``, ``eos_token``, ``unk_token`` and special
    ``added_tokens_decoder`` entries; ``config.json``'s ``vocab_size`` (bound on client token
    ids) and ``max_position_embeddings`` (the context window).
    """

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], *, chat_template: Any = None,
                 vocab_size: int | None = None, context_length: int = 0,
                 exclude_tools_when_tool_choice_none: bool = True):
        import minijinja

        self.tokenizer = tokenizer
        self._fast_encode = hasattr(tokenizer, "encode_batch_fast")
        self.bos_token = _special_token(config.get("bos_token"))
        self.eos_token = _special_token(config.get("eos_token"))
        self.unk_token = _special_token(config.get("unk_token"))
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(True)
        self.context_length = context_length
        # ModelRuntimeConfig.exclude_tools_when_tool_choice_none: true unless the worker says not.
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        template = chat_template if chat_template is not None else config.get("chat_template")
        if template is None:
            raise ModelDirError("chat_template field is required in the tokenizer_config.json file")
        env = minijinja.Environment(trim_blocks=True, lstrip_blocks=True, pycompat=True)
        env.add_filter("length", _length)
        env.add_filter("tojson", _tojson)
        env.add_global("raise_exception", _raise_exception)
        env.add_global("strftime_now", _strftime_now)
        sources: dict[str, str] = {}
        if isinstance(template, str):
            sources = {"default": template, "tool_use": template}
        elif isinstance(template, list):  # tokcfg.rs: every key of every map is a template name
            for entry in template:
                if isinstance(entry, Mapping):
                    sources.update({str(k): str(v) for k, v in entry.items()})
            if not sources:
                raise ModelDirError("Chat template does not contain a `tool_use` or `default` key.")
        else:
            raise ModelDirError(f"chat_template must be a string or a list of maps, "
                                f"not {type(template).__name__}")
        for name, source in sources.items():
            try:
                env.add_template(name, normalize_template_source(source))
            except minijinja.TemplateError as exc:
                raise ModelDirError(f"chat template {name!r} does not compile: {exc}") from None
        self._env = env
        self._sources = sources
        self.requires_content_arrays = self._detect_content_arrays()
        self.image_placeholder = None if self.requires_content_arrays else self._detect_image_placeholder()
        self._templates: dict[str, _Template] = {
            name: self._describe(name) for name in ("default", "tool_use") if name in sources}

    @classmethod
    def from_model_dir(cls, path: str | Path, *, exclude_tools_when_tool_choice_none: bool = True
                       ) -> PromptTokenizer:
        from tokenizers import AddedToken, Tokenizer

        directory = Path(path)
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text())
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # OSError, ValueError, or the tokenizers library's own Exception
            raise ModelDirError(f"{directory}: cannot load tokenizer.json / tokenizer_config.json: "
                                f"{exc}") from None
        # lib/tokenizers/src/hf.rs merge_special_tokens_from_config
        specials = [AddedToken(spec["content"], single_word=bool(spec.get("single_word", False)),
                               lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                               normalized=bool(spec.get("normalized", False)), special=True)
                    for spec in (config.get("added_tokens_decoder") or {}).values()
                    if isinstance(spec, Mapping) and spec.get("special") is True
                    and isinstance(spec.get("content"), str) and spec["content"]]
        if specials:
            tokenizer.add_special_tokens(specials)
        chat_template: Any = None
        if (directory / "chat_template.jinja").is_file():
            chat_template = (directory / "chat_template.jinja").read_text()
        elif (directory / "chat_template.json").is_file():
            chat_template = json.loads((directory / "chat_template.json").read_text()).get("chat_template")
        model_config: dict[str, Any] = {}
        if (directory / "config.json").is_file():
            model_config = json.loads((directory / "config.json").read_text())
        vocab = model_config.get("vocab_size")
        context = model_config.get("max_position_embeddings")
        return cls(tokenizer, config, chat_template=chat_template,
                   vocab_size=vocab if isinstance(vocab, int) else None,
                   context_length=context if isinstance(context, int) else 0,
                   exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)

    # -- load-time probes (formatters.rs) ------------------------------------------------------

    def _probe(self, name: str, messages: list[dict], **extra: Any) -> str | None:
        """``name`` rendered with ``messages`` and ``add_generation_prompt=false``; None if it fails."""
        try:
            return self._env.render_template(name, messages=messages, add_generation_prompt=False, **extra)
        except Exception:  # a template error, or raise_exception's PromptError
            return None

    def _detect_content_arrays(self) -> bool:
        as_array = self._probe("default", [{"role": "user", "content": [_text_part("template_test")]}]) or ""
        as_string = self._probe("default", [{"role": "user", "content": "template_test"}]) or ""
        return "template_test" in as_array and "template_test" not in as_string

    def _detect_image_placeholder(self) -> str | None:
        source = self._sources.get("default", "")
        if "<|end|>" in source and "<|assistant|>" in source:
            return "<|image_{n}|>"
        if "USER:" in source and "ASSISTANT:" in source:
            return "<image>"
        probe = "\x01dynamo_passthrough_probe\x01"
        if (self._probe("default", [{"role": "user", "content": probe}]) or "").strip() == probe:
            return ""
        return None

    def _describe(self, name: str) -> _Template:
        source = self._sources[name]
        tools = [{"type": "function", "function": {"name": "probe", "description": "",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        context = {"tools": tools if name == "tool_use" else None, "bos_token": self.bos_token,
                   "eos_token": self.eos_token, "unk_token": self.unk_token}
        rules = _SystemRules()

        def shape(*roles: str) -> list[dict]:
            return [{"role": role, "content": f"{role}{k}"} for k, role in enumerate(roles)]

        if self._probe(name, shape("system", "user"), **context) is not None:
            refused = [self._probe(name, shape("system", "user", role), **context) is None
                       for role in ("system", "user")]
            rules = _SystemRules(demote_nonleading_system=refused[0], coalesce_consecutive_users=refused[1])
        return _Template(name, "arguments is string" in source, "reasoning_content" in source, rules)

    # -- per request -----------------------------------------------------------------------------

    def render(self, body: Mapping[str, Any]) -> str:
        """The chat prompt the frontend renders for a ``/v1/chat/completions`` body."""
        import minijinja

        if not isinstance(body, Mapping):
            raise PromptError("the request body must be a JSON object")
        if "messages" not in body:
            raise PromptError("missing field `messages`")
        messages = canonical_messages(body["messages"])
        tools = canonical_tools(body.get("tools"))
        tool_choice = body.get("tool_choice")
        if tool_choice == "required" and not tools:
            raise PromptError('tool_choice is "required" but tools is empty')
        if "chat_template_args" in body and "chat_template_kwargs" in body:
            raise PromptError("duplicate field `chat_template_args` (chat_template_kwargs is its alias)")
        args = body.get("chat_template_args", body.get("chat_template_kwargs"))
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise PromptError("`chat_template_args` must be an object")
        if "chat_template" in args:
            raise PromptError("`chat_template` is not supported inside `chat_template_args`")
        args = dict(args)
        _thinking_args(body, args)
        continue_final = body.get("continue_final_message") is True
        add_generation_prompt = body.get("add_generation_prompt")
        if add_generation_prompt is not None and not isinstance(add_generation_prompt, bool):
            raise PromptError("`add_generation_prompt` must be a boolean")
        if continue_final and add_generation_prompt is not False:
            raise PromptError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if continue_final:
            _append_continue_tag(messages)

        if self.exclude_tools_when_tool_choice_none and tool_choice == "none":
            tools = None
        name: str = "tool_use" if tools else "default"
        template = self._templates.get(name)
        if template is None:
            raise PromptError(f"the model's chat template has no {name!r} template")
        if template.system_rules.demote_nonleading_system or template.system_rules.coalesce_consecutive_users:
            messages = normalize_system_messages(messages, template.system_rules)
        fix_message_content(messages, self.requires_content_arrays, self.image_placeholder)
        normalize_arguments(messages, tool_calls=not template.handles_arguments_string)
        if template.handles_reasoning:
            join_reasoning_segments(messages)
        else:
            inject_reasoning(messages)
        # The six base variables win over chat_template_args (minijinja `context!` merge order).
        context = {**_for_template(args), "messages": _for_template(messages), "tools": _for_template(tools),
                   "bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                   "add_generation_prompt": not continue_final and add_generation_prompt is not False}
        try:  # raise_exception's PromptError comes through as is (minijinja re-raises Python errors)
            rendered = self._env.render_template(name, **context)
        except minijinja.TemplateError as exc:
            raise PromptError(f"chat template: {exc.message}") from None
        except PromptError:
            raise
        except (TypeError, ValueError) as exc:  # e.g. tojson of a value JSON cannot hold
            raise PromptError(f"chat template: {exc}") from None
        return _cut_at_continue_tag(rendered) if continue_final else rendered

    def encode(self, text: str) -> list[int]:
        """preprocessor.rs ``encode_with_timing``: NULs removed, no special tokens added.
        (``encode_batch_fast``, tokenizers >= 0.21, is the same encoding without the offsets,
        about a third faster.)"""
        text = text.replace("\0", "")
        if self._fast_encode:
            return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tokens(self, body: Mapping[str, Any], path: str) -> list[int]:
        """The token ids Dynamo's frontend sends the worker for ``body`` POSTed to ``path``
        (``/v1/chat/completions`` or ``/v1/completions``); `PromptError` for a request it refuses
        (or, for a batch of several completions prompts, one the picker cannot route as one)."""
        if not isinstance(body, Mapping):
            raise PromptError("the request body must be a JSON object")
        endpoint = _normalized_path(path)
        if endpoint == CHAT_PATH:
            prompt = self.render(body)  # rendered even with token_data: its errors are the frontend's too
            data = self._token_data(body)
            ids = data if data is not None else self.encode(prompt)
        elif endpoint == COMPLETIONS_PATH:
            ids = self._completion_tokens(body)
        else:
            raise PromptError(f"cannot tokenize a request to {path!r}: only {CHAT_PATH} and "
                              f"{COMPLETIONS_PATH} carry a prompt")
        if self.context_length and len(ids) >= self.context_length:
            raise PromptError(f"This model's maximum context length is {self.context_length} tokens. "
                              f"However, your messages resulted in {len(ids)} tokens. "
                              f"Please reduce the length of the messages.")
        return ids

    @staticmethod
    def _token_data(body: Mapping[str, Any]) -> list[int] | None:
        """preprocessor.rs ``gather_tokens``: ``nvext.token_data`` (pre-tokenized by a component
        in front of the frontend) is used as is."""
        nvext = body.get("nvext")
        if nvext is None:
            return None
        if not isinstance(nvext, Mapping):
            raise PromptError("`nvext` must be an object")
        data = nvext.get("token_data")
        if data is None:
            return None
        if not _is_token_ids(data) or any(t < 0 for t in data):
            raise PromptError("`nvext.token_data` must be an array of token ids")
        return list(data)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise PromptError("prompt token ids must be non-negative integers")
        if any(t >= self.vocab_size for t in ids):
            raise PromptError(f"prompt token ids must be below the vocabulary size {self.vocab_size}")
        return list(ids)

    def _completion_tokens(self, body: Mapping[str, Any]) -> list[int]:
        for key in ("add_generation_prompt", "continue_final_message"):
            if key in body:
                raise PromptError("`add_generation_prompt` and `continue_final_message` are only supported "
                                  "on /v1/chat/completions")
        if "prompt" not in body:
            raise PromptError("missing field `prompt`")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("Prompt string cannot be empty")
            data = self._token_data(body)
            return data if data is not None else self.encode(prompt)
        if not isinstance(prompt, list):
            raise PromptError("`prompt` must be a string, an array of strings, an array of token ids "
                              "or an array of token id arrays")
        if not prompt:
            raise PromptError("Prompt string array cannot be empty")
        if _is_token_ids(prompt):
            return self._checked_ids(prompt)
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
            if len(prompt) > 1:
                # The frontend fans a batch out into one backend request per prompt; the picker
                # sends a request to one worker, so it cannot place a batch.
                raise PromptError(f"a batch of {len(prompt)} prompts cannot be routed as one request; "
                                  f"send one prompt per request")
            first = prompt[0]
            if isinstance(first, str):
                if not first:
                    raise PromptError("Prompt string cannot be empty")
                return self.encode(first)
            return self._checked_ids(first)
        raise PromptError("`prompt` must be a string, an array of strings, an array of token ids or an "
                          "array of token id arrays")
