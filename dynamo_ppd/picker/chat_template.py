"""How Dynamo 1.6.1's frontend renders a chat template: the machinery behind
`prompt.PromptTokenizer.render`, which a user of that API does not need to read.

`ChatTemplate` compiles a model's template as the Rust preprocessor does, probes it once at load
for what it refuses, and renders a request's messages and tools (already validated and
re-serialized by `prompt.canonical_messages` and `prompt.canonical_tools`) after the rewrites
Dynamo applies to them.

Sources (ai-dynamo/dynamo; the 1.6.1 wheel links the chat-template code as the crate
``dynamo-renderer`` 8.0.3, newer than any copy of ``lib/renderer`` the code index holds, so every
behaviour below was also checked against the real frontend through a capture worker,
``tests/test_picker_prompt.py``, and where a stored source and the 1.6.1 binary disagreed the
binary won):

- ``lib/renderer/src/template/formatters.rs`` (``JinjaEnvironment::default``,
  ``HfTokenizerConfigJsonFormatter::with_options``, the load-time probes
  ``detect_content_array_usage``, ``detect_image_placeholder_template``,
  ``detect_passthrough_template``, ``normalize_dict_method_calls``,
  ``remove_known_non_jinja2_tags``, see `normalize_template_source`): minijinja with
  ``trim_blocks`` and ``lstrip_blocks``, pycompat methods, a ``length`` filter that counts none
  as 0, ``tojson``, ``raise_exception``, ``strftime_now``; templates ``default`` and ``tool_use``.
- ``lib/renderer/src/template/oai.rs`` (``render``, ``may_be_fix_msg_content``,
  ``normalize_system_messages``, ``normalize_tool_calls_arguments_in_messages``,
  ``inject_reasoning_content_into_messages``): the message normalization and the template
  context (``messages``, ``tools``, ``bos_token``, ``eos_token``, ``unk_token``,
  ``add_generation_prompt``, then ``chat_template_args``, which cannot override those six).
- ``lib/renderer/src/template/tokcfg.rs`` (``ChatTemplate``): bos/eos/unk tokens, given as a
  string or as an added-token object.

Established only by observing the 1.6.1 frontend (no matching source in the index): a field
removed from a message has its slot taken by the last field (serde_json's ``preserve_order``
``swap_remove``); ``{% generation %}`` tags act as empty blocks; ``tojson`` writes Python's
``json.dumps`` separators without HTML escaping; ``tool_choice`` is not in the template context;
an array of reasoning segments is joined by newlines for a template that reads
``reasoning_content``; lists and maps print in minijinja's JSON-like form with Python's
``True``/``None``.

Template engine: the ``minijinja`` Python package, the same engine the Rust preprocessor uses
(transformers' Jinja2 differs in details such as how undefined values, ``none`` and booleans
print, string methods and ``tojson``; no case needed Jinja2). One known divergence: a list or
map the template builds itself (``{{ "a b".split() }}``) prints as Python's repr here
(``['a', 'b']``) and in minijinja's JSON-like form in Dynamo (``["a", "b"]``); lists and maps
from the request (a content array, parsed tool arguments, ``tools``) print as Dynamo prints them
(`_display`). Real chat templates print containers through ``tojson``.

Errors in a request are `PromptError` (defined here, the lowest module of the prompt path;
`prompt` raises it too), errors in the model directory `model.ModelDirError`.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..model import ModelDirError


class PromptError(ValueError):
    """The request cannot be tokenized as Dynamo's frontend would (it answers such a request with
    HTTP 400); the message says why."""


class Unplaceable(Exception):
    """The frontend serves this request, but the picker does not mirror how it makes the prompt
    (an API it does not know, an image in an Anthropic message, a Responses ``previous_response_id``):
    the request goes to the frontend unrouted, Dynamo's own routing places it. The message is the
    reason, counted by the picker (``ppd_requests_unplaced_total{reason}``: ``reason``, one of a few
    fixed words)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# oai.rs DEFAULT_MEDIA_TYPE_CONVERSIONS
_MEDIA_PLACEHOLDERS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


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
# Message rewrites before rendering (oai.rs).

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


# ---------------------------------------------------------------------------------------------
# The compiled template.

class ChatTemplate:
    """A model's chat template as Dynamo compiles it (formatters.rs
    ``HfTokenizerConfigJsonFormatter::with_options``), with what the load-time probes found, and
    `render`, oai.rs ``render``.

    ``template`` is a string or tokcfg.rs's list of ``{name: source}`` maps; ``config`` is
    ``tokenizer_config.json`` (its ``bos_token``, ``eos_token`` and ``unk_token``).
    """

    def __init__(self, template: Any, config: Mapping[str, Any]):
        import minijinja

        self.bos_token = _special_token(config.get("bos_token"))
        self.eos_token = _special_token(config.get("eos_token"))
        self.unk_token = _special_token(config.get("unk_token"))
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

    def template_for(self, tools: list[dict] | None) -> _Template:
        """The template a request renders with: ``tool_use`` when it has tools, else ``default``."""
        name: str = "tool_use" if tools else "default"
        template = self._templates.get(name)
        if template is None:
            raise PromptError(f"the model's chat template has no {name!r} template")
        return template

    @staticmethod
    def per_message(template: _Template) -> bool:
        """Whether `prepare` gives each message's form from that message alone: not where the
        template merges or demotes system and user turns (`normalize_system_messages`), which
        reads its neighbours. Where it does, a request's messages are prepared one by one and
        the prepared forms kept (`prompt_memo`)."""
        rules = template.system_rules
        return not (rules.demote_nonleading_system or rules.coalesce_consecutive_users)

    def prepare(self, messages: list[dict], template: _Template) -> list[Any]:
        """Canonical ``messages`` after the rewrites Dynamo applies before rendering (oai.rs), as
        the template is given them; rewrites ``messages`` in place."""
        if not self.per_message(template):
            messages = normalize_system_messages(messages, template.system_rules)
        fix_message_content(messages, self.requires_content_arrays, self.image_placeholder)
        normalize_arguments(messages, tool_calls=not template.handles_arguments_string)
        if template.handles_reasoning:
            join_reasoning_segments(messages)
        else:
            inject_reasoning(messages)
        return _for_template(messages)

    def render_prepared(self, template: _Template, prepared: list[Any], tools: list[dict] | None,
                        args: dict[str, Any], add_generation_prompt: bool) -> str:
        """The prompt for `prepare`'d messages (the minijinja render itself)."""
        import minijinja

        # The six base variables win over chat_template_args (minijinja `context!` merge order).
        messages = prepared if isinstance(prepared, _DisplayList) else _DisplayList(prepared)
        # (Tools already wrapped are a memo's, `prompt_memo`: wrapping is ~100 us for a dozen schemas.)
        wrapped = tools if isinstance(tools, _DisplayList) else _for_template(tools)
        context = {**_for_template(args), "messages": messages, "tools": wrapped,
                   "bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                   "add_generation_prompt": add_generation_prompt}
        try:  # raise_exception's PromptError comes through as is (minijinja re-raises Python errors)
            return self._env.render_template(template.name, **context)
        except minijinja.TemplateError as exc:
            raise PromptError(f"chat template: {exc.message}") from None
        except PromptError:
            raise
        except (TypeError, ValueError) as exc:  # e.g. tojson of a value JSON cannot hold
            raise PromptError(f"chat template: {exc}") from None

    def render(self, messages: list[dict], tools: list[dict] | None, args: dict[str, Any],
               add_generation_prompt: bool) -> str:
        """The prompt for canonical ``messages`` and ``tools`` (None when the request has none or
        they were dropped for ``tool_choice: none``) with the template arguments ``args``;
        rewrites ``messages`` in place."""
        template = self.template_for(tools)
        return self.render_prepared(template, self.prepare(messages, template), tools, args,
                                    add_generation_prompt)
