"""A request's prompt token ids, computed exactly as Dynamo 1.6.1's frontend computes them.

The endpoint picker hashes the prompt's token blocks to find the worker that holds a
conversation's KV cache, before it forwards the OpenAI request to ``python -m dynamo.frontend``;
the ids must therefore be the ones the frontend will send the worker. `PromptTokenizer` mirrors
the frontend's default (``--dyn-chat-processor dynamo``, the Rust preprocessor):

- `PromptTokenizer.from_model_dir` reads a model directory (``tokenizer.json``,
  ``tokenizer_config.json`` and its chat template, ``config.json``).
- `PromptTokenizer.tokens` gives the ids for a ``/v1/chat/completions`` body (the chat template
  rendered, `PromptTokenizer.render`, then encoded without special tokens added), a
  ``/v1/completions`` body (the prompt encoded as is, or its token ids), or an agent API's body
  made into a chat first as the frontend makes it (``/v1/messages``: `messages`, Anthropic's;
  ``/v1/responses``: `responses`, OpenAI's); ``nvext.token_data`` replaces tokenization (on all
  four paths); a prompt that fills the context window is refused. Another path, or a request
  whose prompt the picker does not mirror, raises `Unplaceable`.
- A request the frontend answers with HTTP 400 raises `PromptError`, which says why. So does a
  completions batch (several prompts): the frontend fans it out into one backend request per
  prompt, which the picker cannot place on one worker. Not mirrored (the frontend still refuses
  these after the picker routed them): validation that does not change the tokens, e.g.
  unsupported top-level parameters or ``strict`` tool schemas without
  ``additionalProperties: false``.
- Encoding is cached by the text between added tokens: a chat's next turn encodes only its new
  messages (`PromptTokenizer.encode`).

Every behaviour was checked against the real frontend through a capture worker
(``tests/test_picker_prompt.py``); the ai-dynamo/dynamo sources mirrored (``lib/llm``'s
preprocessor and OpenAI protocols, ``lib/tokenizers``) are cited where they are. The
chat-template machinery (the minijinja environment, template source normalization, Dynamo's
message rewrites, what was only observed in the frontend) is in ``chat_template.py``.

Pure: the constructor reads the model directory; `PromptTokenizer.tokens` does no I/O.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..apis import CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH, normalized_path
from ..model import ModelDirError
from . import messages as anthropic_messages
from . import responses as openai_responses
from .chat_template import ChatTemplate, PromptError, Unplaceable

log = logging.getLogger("dynamo_ppd.picker")

# What a fast encoder must encode exactly as the tokenizer does before it is used: words,
# contractions, numbers (Llama 3 splits digits in threes), runs of spaces, tabs and newlines,
# punctuation, code, JSON, accents, CJK, emoji, and a long text of random characters.
_RANDOM = random.Random(0)
FAST_ENCODER_PROBES = (
    "The harbour master said the tide would turn at dawn.",
    "I'll go, you'd stay, they've left, it's done, don't, won't, CAN'T",
    "1 22 333 4444 55555 123456789 3.14159 -42 1e10 0x1F 2026-12-07",
    "  two  spaces   three    four\n\n\nnewlines\t\ttabs \r\n crlf   ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n\n\tif x != None: pass",
    '{"name": "read_file", "arguments": {"path": "src/tides.py", "n": 3}}',
    "Ça va? Über naïve façade, Ωμέγα, Москва, 東京都 漢字, 😀👍🏽 مرحبا",
    " leading space", "trailing space ", "\n", " ", "a",
    "".join(_RANDOM.choice("abcdefghij klmnopqrstuvwxyzÇé漢 \n\t0123456789.,;:!?'\"()[]{}<>=+-*/_#@$%&")
            for _ in range(20_000)),
)

# The paths whose prompt is a chat (the agent APIs' bodies are made into one first).
CHAT_LIKE_PATHS = (CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH)

# lib/llm/src/preprocessor/prompt.rs
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
CONTINUE_FINAL_MESSAGE_NOT_FOUND = ("Unable to continue the final message because it was not found in the "
                                    "rendered chat template.")

# `PromptTokenizer.encode`'s cache of the ids of the text between added tokens: at most this
# many pieces (whole messages, mostly) and this many ids in all, least recently used dropped first.
# A follow-up finds its history here and encodes only its new messages; once the conversations in
# flight hold more than the cache, every follow-up encodes its whole history again (at 8,192
# pieces, 256 conversations of ~48 messages did: 0.36 -> 2.9 ms a pick, docs/bench/picker-path.md).
# So the bound is the ids, kept as 4-byte arrays: 8M ids are 32 MB (plus their text as keys),
# the histories of ~4,000 conversations of 2K tokens.
ENCODE_CACHE_PIECES = 1 << 18
ENCODE_CACHE_IDS = 1 << 23

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



# ---------------------------------------------------------------------------------------------
# The request as the frontend parses it (serde types of dynamo-protocols): a 400 there is a
# `PromptError` here, and the messages come out as Dynamo hands them to the template.

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
    and null fields dropped (observed in 1.6.1, like a function message's missing content being
    ``null`` and a system message keeping its own, empty, ``tools``)."""
    if not isinstance(messages, list):
        raise PromptError("`messages` must be an array of messages")
    if not messages:
        raise PromptError("The 'messages' field cannot be empty. At least one message is required.")
    return [canonical_message(i, message) for i, message in enumerate(messages)]


def canonical_message(i: int, message: Any) -> dict:
    """``messages[i]`` as `canonical_messages` gives it (each message stands alone)."""
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
    return canonical


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


@dataclass(frozen=True)
class ChatHead:
    """What a chat's prompt depends on besides its messages (`PromptTokenizer.chat_head`)."""

    tools: list[dict] | None  # canonical, or None (none, or dropped for tool_choice none)
    args: dict[str, Any]  # the template arguments
    add_generation_prompt: bool
    continue_final: bool  # continue_final_message: the last message marked, the render cut there
    template: Any  # chat_template._Template: which template, and how messages are prepared for it


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


# ---------------------------------------------------------------------------------------------
# Encoding piece by piece (HF tokenizers: AddedVocabulary::extract_and_normalize, find_matches).

def _added_token_split(tokenizer: Any) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """Where ``tokenizer`` first cuts a text: a regex that finds its added tokens as HF
    ``tokenizers`` does (leftmost, then longest), and their ids. Each piece between them is then
    normalized, pre-tokenized and encoded on its own: a text's ids are its pieces' ids and the
    tokens' ids, concatenated. Only tokens matched on the raw text (``normalized=False``, special
    tokens by default) are cut at; a ``normalized`` one is found inside a piece after normalizing
    it, which encoding the piece alone does too.

    None (whole texts encoded) where a piece could encode differently alone: a raw-matched token
    that is ``single_word`` (it matches by the characters around it) or ``lstrip``/``rstrip``
    (it takes in whitespace around it); ``encode_special_tokens``; truncation or padding (they
    apply to a whole encoding); BPE dropout. `PromptTokenizer._splits_like_the_tokenizer` finds
    the rest at load (a ``Metaspace`` pre-tokenizer with ``prepend_scheme: first``, say)."""
    settings = (getattr(tokenizer, name, None) for name in ("encode_special_tokens", "truncation", "padding"))
    if not hasattr(tokenizer, "get_added_tokens_decoder") or any(settings) \
            or getattr(getattr(tokenizer, "model", None), "dropout", None):
        return None
    ids: dict[str, int] = {}
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.normalized or not token.content:
            continue
        if token.single_word or token.lstrip or token.rstrip:  # its match depends on its neighbours
            return None  # so this tokenizer's texts are encoded whole
        ids[token.content] = tokenizer.token_to_id(token.content)  # the id the tokenizer gives it
    if not ids:
        return None
    try:
        return re.compile(f"({_trie_pattern(list(ids))})"), ids
    except RecursionError:  # a token thousands of characters long
        return None


def _trie_pattern(words: list[str]) -> str:
    """A regex that matches the longest of ``words`` at a position, as a trie: each character
    tried once, however many words (a flat ``a|b|...`` tries every word at every ``<``)."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict[str, dict]) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        if "" not in node:
            return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{'|'.join(branches)})?"  # greedy: a longer word first, then the one ending here

    return pattern(trie)


def _nested_tokens(added: Mapping[str, int]) -> bool:
    """Whether an added token contains another (its match may start before or run past the other)."""
    tokens = sorted(added, key=len)
    if len(tokens) > 4096:  # not checked (quadratic): treated as nested, so never spliced
        return True
    return any(short in long for i, short in enumerate(tokens) for long in tokens[i + 1:])


def _join(pieces: list[str], known: Mapping[str, Sequence[int]], added: Mapping[str, int]) -> list[int]:
    """The ids of ``pieces`` (text, added token, text, ..., text, as ``re.split`` gives them)."""
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids.append(added[piece])
        elif piece:
            ids.extend(known[piece])
    return ids


@dataclass(frozen=True)
class Encoded:
    """A prompt's text and ids (`PromptTokenizer.encode_marked`): ``marks`` are (start, end in
    ``text``, ids before it) of each added token, in order; ``reused``, how many leading ids came
    from an earlier encoding."""

    text: str
    ids: array  # array("I"): 4 bytes an id (a list of 100K ints costs ~1 ms to copy, ~5 to make)
    marks: list[tuple[int, int, int]]
    reused: int


def _shared_mark(text: str, base: Encoded) -> int | None:
    """The last of ``base``'s marks whose added token ``text`` has at the same place with the
    same text before it (both texts equal up to the token's end); None if none is. The usual
    case, a conversation grown at its end, is the last mark and one comparison; else a binary
    search (equal up to a mark implies equal up to every earlier one)."""
    marks, old = base.marks, base.text

    def same(k: int) -> bool:
        stop = marks[k][1]
        return len(text) >= stop and text.startswith(old[:stop])

    last = last_holding(len(marks), same)
    return last if last >= 0 else None


def last_holding(count: int, holds: Callable[[int], bool]) -> int:
    """The last k < ``count`` for which ``holds(k)``, where it holds for every k up to some point
    and for none after (-1: for none). The last first (a conversation grown at its end), else a
    binary search."""
    last = count - 1
    if last < 0 or holds(last):
        return last
    low, high = -1, last  # holds(low) (or low is -1), not holds(high)
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            low = middle
        else:
            high = middle
    return low


class PromptTokenizer:
    """The frontend's prompt tokens for a request body: `tokens(body, path)`.

    Built from a model directory (`from_model_dir`): ``tokenizer.json`` (HF ``tokenizers``) and
    ``tokenizer_config.json``'s ``chat_template`` (or a ``chat_template.jinja`` /
    ``chat_template.json`` beside it), ``bos_token``, ``eos_token``, ``unk_token`` and special
    ``added_tokens_decoder`` entries; ``config.json``'s ``vocab_size`` (bound on client token
    ids) and ``max_position_embeddings`` (the context window). The tokenizer must not change
    after the constructor: how to split texts is decided there, and encodings are cached.

    ``fast_encoder``: another encoder of the same tokenizer.json (``fastokens``, 10-25x faster
    than ``tokenizers`` here), used for the text between added tokens only where it gives the
    tokenizer's own ids, id for id, on every probe of `FAST_ENCODER_PROBES` and of the added-token
    check; else it is not used (`encoder` says which is).
    """

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], *, chat_template: Any = None,
                 vocab_size: int | None = None, context_length: int = 0,
                 exclude_tools_when_tool_choice_none: bool = True, strip_anthropic_preamble: bool = True,
                 fast_encoder: Any = None):

        self.tokenizer = tokenizer
        self._fast_encode = hasattr(tokenizer, "encode_batch_fast")
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(True)
        self.context_length = context_length
        # ModelRuntimeConfig.exclude_tools_when_tool_choice_none: true unless the worker says not.
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        # The frontend's --strip-anthropic-preamble (on by default): `messages.strip_billing_preamble`.
        self.strip_anthropic_preamble = strip_anthropic_preamble
        self.chat_template: ChatTemplate = ChatTemplate(
            chat_template if chat_template is not None else config.get("chat_template"), config)
        self._split = _added_token_split(tokenizer)
        if self._split is not None and not self._splits_like_the_tokenizer(self._split):
            self._split = None
        # Whether `encode` works piece by piece (else it encodes whole texts, uncached).
        self.piecewise = self._split is not None
        # Whether an encoding may reuse another's ids up to a shared added token (`encode_marked`).
        self.splices = self.piecewise and not _nested_tokens(self._split[1])  # type: ignore[index]
        # Pieces hold no added token, so an encoder without them sees the same text the tokenizer does.
        self.fast_encoder = fast_encoder if self.piecewise and self._encodes_alike(fast_encoder) else None
        self.encoder = "fastokens" if self.fast_encoder is not None else "tokenizers"
        self._cache: OrderedDict[str, array[int]] = OrderedDict()  # least recently used first
        self._cache_ids = 0
        self._cache_lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, path: str | Path, *, exclude_tools_when_tool_choice_none: bool = True,
                       strip_anthropic_preamble: bool = True, fast: bool = True) -> PromptTokenizer:
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
        fast_encoder = None
        if fast:
            try:
                import fastokens

                fast_encoder = fastokens.Tokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as exc:  # noqa: BLE001 (an optional speed-up: say why, go on without)
                log.warning("fastokens cannot load %s (%s): tokenizing with tokenizers", directory, exc)
        return cls(tokenizer, config, chat_template=chat_template,
                   vocab_size=vocab if isinstance(vocab, int) else None,
                   context_length=context if isinstance(context, int) else 0,
                   exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
                   strip_anthropic_preamble=strip_anthropic_preamble, fast_encoder=fast_encoder)

    # -- per request -----------------------------------------------------------------------------

    def chat_head(self, body: Mapping[str, Any]) -> ChatHead:
        """Everything of a ``/v1/chat/completions`` body the prompt depends on but its messages,
        validated as the frontend does. prompt.rs (``OAIChatLikeRequest``): ``add_generation_prompt``
        is the request's field (default true, whatever the last role); ``continue_final_message``
        marks the last message and cuts the rendering there. chat_completions.rs:
        ``chat_template_kwargs`` is an alias of ``chat_template_args``; ``thinking`` and
        ``reasoning_effort`` become template arguments."""
        if not isinstance(body, Mapping):
            raise PromptError("the request body must be a JSON object")
        if "messages" not in body:
            raise PromptError("missing field `messages`")
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
        if self.exclude_tools_when_tool_choice_none and tool_choice == "none":
            tools = None
        return ChatHead(tools, args, not continue_final and add_generation_prompt is not False,
                        continue_final, self.chat_template.template_for(tools))

    def render(self, body: Mapping[str, Any]) -> str:
        """The chat prompt the frontend renders for a ``/v1/chat/completions`` body (`chat_head`,
        then the messages, `canonical_messages`)."""
        head = self.chat_head(body)
        messages = canonical_messages(body["messages"])
        if head.continue_final:
            _append_continue_tag(messages)
        return self.render_prepared(head, self.chat_template.prepare(messages, head.template))

    def render_prepared(self, head: ChatHead, prepared: list[Any]) -> str:
        """The prompt for a chat's head and its `ChatTemplate.prepare`'d messages."""
        rendered = self.chat_template.render_prepared(head.template, prepared, head.tools, head.args,
                                                      head.add_generation_prompt)
        return _cut_at_continue_tag(rendered) if head.continue_final else rendered

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """preprocessor.rs ``encode_with_timing``: NULs removed, then exactly
        ``tokenizer.encode(text, add_special_tokens=False).ids`` (hf.rs ``HuggingFaceTokenizer``),
        computed piece by piece where the tokenizer allows (`_added_token_split`): the ids of the
        text between added tokens (in a chat, mostly a whole message) come from an LRU cache,
        those not there encoded in one batch, so a follow-up turn encodes only its new messages."""
        text = text.replace("\0", "")
        if self._split is None:
            return self._encode_batch([text])[0]
        pattern, added = self._split
        pieces = pattern.split(text)  # text, added token, text, ..., text
        return _join(pieces, self._piece_ids(pieces[0::2]), added)

    def encode_marked(self, text: str, base: Encoded | None = None) -> Encoded:
        """`encode`'s ids as an array, with where each added token starts (`Encoded`), reusing
        ``base`` (an earlier prompt's encoding) up to the last added token that both texts have
        at the same place with the same text before it: only the text from it on is split and
        encoded. Exact: the ids of the text before an added token do not depend on what follows
        it (pieces between added tokens encode alone, `_added_token_split`), and the split
        before it is the same in both texts, unless an added token contains another (a longer
        match could then start before the token or run past it), where ``base`` is not used
        (`splices`). ``text`` has its NULs removed already."""
        if self._split is None:
            return Encoded(text, array("I", self._encode_batch([text])[0]), [], 0)
        pattern, added = self._split
        start, ids = 0, array("I")
        marks: list[tuple[int, int, int]] = []
        mark = _shared_mark(text, base) if base is not None and self.splices else None
        if mark is not None:
            start, _, before = base.marks[mark]  # type: ignore[union-attr]
            ids = base.ids[:before]  # type: ignore[union-attr]
            marks = base.marks[:mark]  # type: ignore[union-attr]
        reused = len(ids)
        pieces = pattern.split(text[start:] if start else text)
        known = self._piece_ids(pieces[0::2])
        position = start
        for k, piece in enumerate(pieces):
            if k % 2:
                marks.append((position, position + len(piece), len(ids)))
                ids.append(added[piece])
            elif piece:
                piece_ids = known[piece]
                ids.extend(piece_ids if isinstance(piece_ids, array) else array("I", piece_ids))
            position += len(piece)
        return Encoded(text, ids, marks, reused)

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``tokenizer.encode(text, add_special_tokens=False).ids`` of each text (``encode_batch_fast``,
        tokenizers >= 0.21, is the same encoding without the offsets, about a third faster, and
        encodes a batch's texts in parallel)."""
        if self._fast_encode:
            return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        return [self.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]

    def _encode_pieces(self, texts: list[str]) -> Sequence[Sequence[int]]:
        """The ids of texts with no added token in them: the fast encoder's where it is used."""
        if self.fast_encoder is not None:
            return [e.ids for e in self.fast_encoder.encode_batch(texts, add_special_tokens=False)]
        return self._encode_batch(texts)

    def _encodes_alike(self, encoder: Any) -> bool:
        """Whether ``encoder`` gives the tokenizer's ids on every probe (None: no encoder)."""
        if encoder is None:
            return False
        probes = list(FAST_ENCODER_PROBES)
        if self._split is not None:  # the added-token check's text pieces too
            pattern, added = self._split
            text = "".join(f"a {t} b\n{t}" for t in list(added)[:512])
            probes += [p for p in pattern.split(text)[0::2] if p]
        try:
            ids = [list(e.ids) for e in encoder.encode_batch(probes, add_special_tokens=False)]
        except Exception as exc:  # noqa: BLE001 (another library's failure: not used, said why)
            log.warning("the fast encoder failed on its probes (%s): tokenizing with tokenizers", exc)
            return False
        if ids != [list(i) for i in self._encode_batch(probes)]:
            log.warning("the fast encoder's ids differ from the tokenizer's on its probes: tokenizing "
                        "with tokenizers")
            return False
        return True

    def _piece_ids(self, pieces: list[str]) -> dict[str, Sequence[int]]:
        """The ids of each non-empty piece: cached, or encoded (one batch) and then cached."""
        known: dict[str, Sequence[int]] = {}
        cache = self._cache
        with self._cache_lock:
            for piece in pieces:
                if piece and piece not in known and (ids := cache.get(piece)) is not None:
                    cache.move_to_end(piece)
                    known[piece] = ids
        missing = list(dict.fromkeys(p for p in pieces if p and p not in known))
        if missing:
            encoded = self._encode_pieces(missing)
            with self._cache_lock:
                for piece, fresh in zip(missing, encoded, strict=True):
                    known[piece] = fresh
                    if piece not in cache:  # (another thread may have just added it)
                        cache[piece] = array("I", fresh)  # 4 bytes an id, not a 28-byte int object
                        self._cache_ids += len(fresh)
                while cache and (len(cache) > ENCODE_CACHE_PIECES or self._cache_ids > ENCODE_CACHE_IDS):
                    self._cache_ids -= len(cache.popitem(last=False)[1])
        return known

    def _splits_like_the_tokenizer(self, split: tuple[re.Pattern[str], dict[str, int]]) -> bool:
        """Whether piece-by-piece encoding gives the tokenizer's ids for a text with each added
        token (the first 512) side by side, at the start and end, next to words and whitespace,
        and cut in two: what `_added_token_split` reasons from the ``tokenizers`` source, checked;
        it also catches a pre-tokenizer that treats the first piece apart, and internal token
        lists that differ from the one a tokenizer shows (0.22 can keep a stale entry)."""
        pattern, added = split
        tokens = list(added)[:512]
        probe = tokens[0] + "".join(f"{t}{t}a {t}\n{t[:len(t) // 2]}b{t[len(t) // 2:]} c{t}" for t in tokens)
        pieces = pattern.split(probe)
        texts = list(dict.fromkeys(p for p in pieces[0::2] if p))
        return _join(pieces, dict(zip(texts, self._encode_batch(texts), strict=True)), added) == \
            self._encode_batch([probe])[0]

    # -- the token ids ---------------------------------------------------------------------------

    def tokens(self, body: Mapping[str, Any], path: str,
               lap: Callable[[str], None] | None = None) -> list[int]:
        """The token ids Dynamo's frontend sends the worker for ``body`` POSTed to ``path``
        (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, ``/v1/responses``);
        `PromptError` for a request it refuses (or, for a batch of several completions prompts, one
        the picker cannot route as one); `Unplaceable` for another path, or a request it serves
        whose prompt the picker does not mirror. preprocessor.rs ``preprocess_request``,
        ``validate_token_count``. ``lap``: told "template" once a chat is rendered (the picker's
        stage clock)."""
        if not isinstance(body, Mapping):
            raise PromptError("the request body must be a JSON object")
        endpoint = normalized_path(path)
        if endpoint in CHAT_LIKE_PATHS:
            chat = body
            if endpoint == MESSAGES_PATH:
                chat = anthropic_messages.chat_body(body, self.strip_anthropic_preamble)
            elif endpoint == RESPONSES_PATH:
                chat = openai_responses.chat_body(body)
            prompt = self.render(chat)  # rendered even with token_data: its errors are the frontend's too
            if lap is not None:
                lap("template")
            data = self._token_data(body)
            ids = data if data is not None else self.encode(prompt)
        elif endpoint == COMPLETIONS_PATH:
            ids = self._completion_tokens(body)
        else:
            raise Unplaceable("unknown_api", f"the picker finds no prompt in a request to {path!r}: it reads "
                              f"{', '.join((*CHAT_LIKE_PATHS, COMPLETIONS_PATH))}")
        if self.context_length and len(ids) >= self.context_length:
            raise PromptError(f"This model's maximum context length is {self.context_length} tokens. "
                              f"However, your messages resulted in {len(ids)} tokens. "
                              f"Please reduce the length of the messages.")
        return ids

    @staticmethod
    def tokenized_text(body: Mapping[str, Any], path: str) -> bool:
        """Whether the frontend tokenizes text for this (valid) request: a chat, or a completion
        whose prompt is a string (alone or as a one-item list), not token ids."""
        endpoint = normalized_path(path)
        if endpoint in CHAT_LIKE_PATHS:
            return True
        prompt = body.get("prompt")
        if endpoint != COMPLETIONS_PATH:
            return False
        return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                           and isinstance(prompt[0], str))

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
