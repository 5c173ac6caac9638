"""A conversation's prompt work done once: each request costs what is new in it, not its context.

An agent's request carries its whole session (a coding agent's median: a 119K-token prefix, 875
new tokens), and the picker must give the ids the frontend will (`prompt.PromptTokenizer`). Done
from scratch, that is ~8 ms of Python at 100K tokens (parse, conversion, template, tokenization,
block hashes, the ids' JSON). `PromptMemos` keeps, per session (and per shared request head, a
system prompt and tools that many sessions start with), what the last request computed, and
redoes only what follows the part a new request shares with it, exactly:

- **Body.** The new body's bytes are compared with the last body's up to the end of each element
  of its message array (``messages``; ``input`` on ``/v1/responses``): the longest such shared
  prefix means those elements, and every top-level field before the array, are the same values.
  Only the rest is parsed (`_tail`), as ``{"<key>":[0`` + the rest, a JSON document exactly when
  the whole body is one. A body whose bytes differ before its first message (a client that
  re-serializes, Claude Code's per-request billing line in ``system``) is parsed whole:
  ``ppd_prompt_memo_total{outcome="head_changed"}``.
- **Conversion and rewrites.** Each API message's chat messages, validated and rewritten as the
  template is given them (`ChatTemplate.prepare`), are kept in order; a new request prepares only
  its new messages (chat and Messages APIs; a Responses API body, whose items merge across
  messages, is converted whole). Not where the template merges neighbouring turns
  (`ChatTemplate.per_message`) or the last message is continued (``continue_final_message``).
- **Template.** Rendered whole, every request: its cost is minijinja's alone (~0.3 ms at 100K
  tokens, the messages already prepared), and a template that rewrites earlier turns (Qwen3 drops
  old reasoning) is exact with no special case: the splice below starts where the texts differ.
- **Tokens.** `PromptTokenizer.encode_marked` reuses the last encoding's ids up to the last
  added token at which both texts agree.
- **Block hashes.** The reused ids' full blocks keep their hashes (`Prompt.known_hashes`,
  `Routing.plan_turn`), and the ids' JSON its serialized segments (`Prompt.ids_json`).

Memos are bounded by a byte budget (least recently used dropped first). Pure: no I/O; a lock
guards the memo table (a large body is tokenized on a worker thread, `budget`).
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from ..apis import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH, normalized_path
from . import messages as anthropic_messages
from . import responses as openai_responses
from .chat_template import _for_template
from .prompt import (
    ChatHead,
    Encoded,
    PromptError,
    PromptTokenizer,
    _append_continue_tag,
    canonical_message,
    canonical_messages,
    last_holding,
)

# The array each API's conversation grows in.
ARRAY_KEYS = {CHAT_PATH: "messages", MESSAGES_PATH: "messages", RESPONSES_PATH: "input"}
DEFAULT_MEMO_MB = 256  # ~120 sessions of 100K tokens, ~15,000 of 2K
_TAIL_KEY = "\x00ppd-tail"  # the wrapper key `_tail` parses the rest of a body under
# ppd_prompt_memo_total's outcomes: how much of a request's work an earlier one saved.
OUTCOMES = ("session", "shared_head", "none", "head_changed", "other_api", "tail_unparsed")


@dataclass(eq=False)
class Memo:
    """What one request's prompt computed, kept for the next (see the module docstring)."""

    endpoint: str
    body: bytes
    cuts: list[int]  # cuts[k]: the offset in body just past the array's first k elements
    head_keys: tuple[str, ...]  # the request's top-level keys before its array
    request: dict
    template: Any  # the chat template `prepared` was made for (None: not kept)
    prepared: list[Any]  # the API messages' prepared chat messages, in order (the head's not included)
    counts: list[int]  # counts[k]: how many of `prepared` the first k API messages made
    encoded: Encoded | None
    ids_json: list[tuple[int, bytes]] = field(default_factory=list)  # (ids up to, their JSON, no brackets)
    hashes: tuple[list[int], list[int]] | None = None  # the prompt's full blocks: local hashes, prefix ids
    # The chat's head (`PromptTokenizer.chat_head`, tools wrapped for the template), the prepared
    # messages of its system, and how many chat messages that system made: kept for a request
    # whose fields other than the array are these (`_same_head`).
    head: tuple[ChatHead, list[Any], int] | None = None

    @property
    def nbytes(self) -> int:
        """About what it holds: the body, its parse and prepared copies, text, ids, JSON, hashes."""
        text = sys.getsizeof(self.encoded.text) if self.encoded is not None else 0
        ids = 4 * len(self.encoded.ids) if self.encoded is not None else 0
        hashes = 80 * len(self.hashes[0]) if self.hashes is not None else 0
        return 3 * len(self.body) + text + ids + sum(len(b) for _, b in self.ids_json) + hashes


@dataclass
class Parsed:
    """A request body parsed, with the memo it continues (`PromptMemos.parse`)."""

    request: dict
    endpoint: str
    key: str | None  # the session's memo key (None: no session id)
    body: bytes
    memo: Memo | None  # the earlier request this one continues
    shared: int  # how many of the memo's array elements this body starts with
    outcome: str  # ppd_prompt_memo_total's outcome
    head: tuple[ChatHead, list[Any], int] | None = None  # its chat's head (`Memo.head`), once prepared

    @property
    def new_bytes(self) -> int:
        """The body's bytes past what the memo shares: the work left to do."""
        return len(self.body) - (self.memo.cuts[self.shared] if self.memo is not None else 0)


@dataclass
class Prompt:
    """A request's prompt ids and what they reuse."""

    ids: Any  # array("I") (or the client's token_data, a list)
    memo: Memo  # this request's memo, kept once the picker has planned it (`PromptMemos.remember`)
    known_hashes: tuple[list[int], list[int]] | None  # hashes of the reused ids' full blocks

    def ids_json(self) -> bytes:
        """The ids as a JSON array, from the serialized segments the reused ids kept."""
        if not self.memo.ids_json:  # (a completions prompt: no memo)
            return msgspec.json.encode(list(self.ids))
        return b"[" + b",".join(b for _, b in self.memo.ids_json if b) + b"]"


def _cuts_in(document: bytes, key: str, count: int) -> list[int] | None:
    """Where each of the ``count`` elements of ``document``'s top-level array ``key`` ends
    (cuts[0]: just past its ``[``), found from the elements' raw JSON; None where they cannot be
    placed (the memo is then not kept)."""
    try:
        raw = msgspec.json.decode(document, type=dict[str, msgspec.Raw]).get(key)
        items = msgspec.json.decode(raw, type=list[msgspec.Raw]) if raw is not None else None
    except (msgspec.DecodeError, TypeError):
        return None
    if raw is None or items is None or len(items) != count:
        return None
    at = document.find(bytes(raw))
    if at < 0:
        return None
    cuts = [at + 1]
    for item in items:
        piece = bytes(item)
        start = document.find(piece, cuts[-1])
        between = document[cuts[-1]:start]
        if start < 0 or between.strip(b" \t\r\n,") or between.count(b",") > (1 if len(cuts) > 1 else 0):
            return None
        cuts.append(start + len(piece))
    return cuts


HEAD_KEY_BYTES = 2048


def _head_key(body: bytes, length: int) -> tuple[int, bytes, bytes]:
    """The key of a request head (``body[:length]``) among the kept ones: its length and its first
    and last bytes, not the whole (a 20K-token system prompt and tools are ~150 KB, ~25 us to
    hash). Heads that differ only in the middle share a key, and the one kept is compared byte
    for byte before use (`PromptMemos._find`)."""
    return length, body[:min(length, HEAD_KEY_BYTES)], body[max(0, length - HEAD_KEY_BYTES):length]


_SCALARS = (str, int, float, bool, type(None))


def _same_head(request: dict, old: dict) -> bool:
    """Whether ``request``'s fields other than ``messages`` are ``old``'s, so that its chat head
    is: each the same object (a value before the array, kept from the memo's parse, `_tail`), or
    an equal scalar of the same type (a value after it, parsed anew). A container parsed anew
    (tools after the messages) is not compared: its head is made again."""
    if request.keys() != old.keys():
        return False
    for k, value in request.items():
        if k == "messages":
            continue
        was = old[k]
        if value is not was and not (type(value) is type(was) and isinstance(value, _SCALARS)
                                     and value == was):
            return False
    return True


def _tail_document(body: bytes, cut: int, first: bool) -> tuple[bytes, int]:
    """``body`` from ``cut`` on as a JSON document whose `_TAIL_KEY` array holds a ``0`` and then
    the elements after the cut, and the offset in it that ``cut`` maps to."""
    prefix = json.dumps({_TAIL_KEY: [0]}).encode()[:-2] + (b"," if first else b"")
    return prefix + body[cut:], len(prefix)


def _segments(ids: Any, start: int, encoded: Encoded) -> list[tuple[int, bytes]]:
    """``ids[start:]`` as JSON segments, cut where a later prompt may splice (at added tokens:
    `PromptTokenizer.encode_marked`): at each of the last `TAIL_SEGMENTS` marks, and before
    that every `SEGMENT_IDS` ids or more, so a follow-up serializes only what it added."""
    bounds = [before for _, _, before in encoded.marks if before > start]
    cut_at = [b for k, b in enumerate(bounds) if k >= len(bounds) - TAIL_SEGMENTS]
    far = [b for b in bounds[:max(0, len(bounds) - TAIL_SEGMENTS)]]
    chosen: list[int] = []
    for b in far:
        if b - (chosen[-1] if chosen else start) >= SEGMENT_IDS:
            chosen.append(b)
    out, at = [], start
    for end in [*chosen, *cut_at, len(ids)]:
        if end > at:
            out.append((end, msgspec.json.encode(ids[at:end].tolist())[1:-1]))
            at = end
    return out


TAIL_SEGMENTS = 16
SEGMENT_IDS = 4096


class PromptMemos:
    """The prompt path with memos (module docstring): `parse`, then `prompt`, then `remember`."""

    def __init__(self, tokenizer: PromptTokenizer, budget_mb: float = DEFAULT_MEMO_MB):
        self.tokenizer = tokenizer
        self.budget_bytes = int(budget_mb * (1 << 20))
        self._memos: OrderedDict[tuple, Memo] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._head_lengths: Counter[int] = Counter()  # the byte lengths of the heads kept
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()  # for tests and the metric
        self.on_outcome: Callable[[str], None] | None = None

    # -- lookup ------------------------------------------------------------------------------------

    def _get(self, key: tuple) -> Memo | None:
        with self._lock:
            memo = self._memos.get(key)
            if memo is not None:
                self._memos.move_to_end(key)
            return memo

    def _find(self, endpoint: str, session: str | None, body: bytes) -> tuple[Memo | None, str]:
        if endpoint not in ARRAY_KEYS or not self.budget_bytes:
            return None, "other_api"
        if session is not None and (memo := self._get(("session", endpoint, session))) is not None:
            return memo, "session"
        for length in list(self._head_lengths):
            if len(body) > length:
                memo = self._get(("head", endpoint, _head_key(body, length)))
                if memo is not None and body.startswith(memoryview(memo.body)[:length]):
                    return memo, "shared_head"
        return None, "none"

    @staticmethod
    def _shared(body: bytes, memo: Memo) -> int:
        """How many of the memo's array elements ``body`` starts with, byte for byte (-1: not even
        the head)."""
        cuts, old = memo.cuts, memoryview(memo.body)

        def same(k: int) -> bool:
            return body.startswith(old[:cuts[k]])

        return last_holding(len(cuts), same)

    @staticmethod
    def _tail(body: bytes, memo: Memo, shared: int) -> dict | None:
        """The request: the memo's head and first ``shared`` elements, and the rest of ``body``
        parsed; None where the rest does not parse as one (the whole body then parses alone)."""
        key = ARRAY_KEYS[memo.endpoint]
        document, _ = _tail_document(body, memo.cuts[shared], shared == 0)
        try:
            rest = json.loads(document)
        except (ValueError, RecursionError):
            return None
        elements = rest.pop(_TAIL_KEY, None) if isinstance(rest, dict) else None
        if not isinstance(elements, list) or not elements or elements[0] != 0 or key in rest \
                or any(k in rest for k in memo.head_keys):
            return None
        request = {k: memo.request[k] for k in memo.head_keys}
        request[key] = memo.request[key][:shared] + elements[1:]
        request.update(rest)
        return request

    def parse(self, body: bytes, path: str, session: str | None = None) -> Parsed:
        """The request in ``body`` (ValueError: not JSON; RecursionError: nested too deep), parsed
        past what the memo of its session (or of a request with the same head) shares."""
        endpoint = normalized_path(path)
        memo, outcome = self._find(endpoint, session, body)
        key = session
        if memo is not None:
            shared = self._shared(body, memo)
            if shared < 0:
                outcome = "head_changed"
            else:
                request = self._tail(body, memo, shared)
                if request is not None:
                    return Parsed(request, endpoint, key, body, memo, shared, outcome)
                outcome = "tail_unparsed"
        return Parsed(json.loads(body), endpoint, key, body, None, 0, outcome)

    # -- the prompt ------------------------------------------------------------------------------

    def prompt(self, parsed: Parsed) -> Prompt:
        """The ids Dynamo's frontend sends the worker for this request, as
        `PromptTokenizer.tokens` gives them (its errors too), with the memo reused."""
        tok, request, endpoint, memo = self.tokenizer, parsed.request, parsed.endpoint, parsed.memo
        if not isinstance(request, dict):
            raise PromptError("the request body must be a JSON object")
        if endpoint not in ARRAY_KEYS or not self.budget_bytes:  # (memos off: the whole prompt path)
            return Prompt(tok.tokens(request, endpoint), self._new_memo(parsed, None, [], [], None), None)
        template, prepared, counts, head_prepared, head = self._prepared(parsed)
        text = tok.render_prepared(head, head_prepared + prepared)
        if "\0" in text:  # (preprocessor.rs removes NULs before encoding, `PromptTokenizer.encode`)
            text = text.replace("\0", "")
        data = tok._token_data(request)
        base = memo.encoded if memo is not None else None
        if data is not None:
            encoded = None
            ids: Any = data
        else:
            encoded = tok.encode_marked(text, base)
            ids = encoded.ids
        if tok.context_length and len(ids) >= tok.context_length:
            raise PromptError(f"This model's maximum context length is {tok.context_length} tokens. "
                              f"However, your messages resulted in {len(ids)} tokens. "
                              f"Please reduce the length of the messages.")
        new = self._new_memo(parsed, template, prepared, counts, encoded)
        known = None
        if encoded is not None:
            reused = encoded.reused
            kept = [(end, b) for end, b in (memo.ids_json if memo is not None else []) if end <= reused]
            new.ids_json = kept + _segments(ids, kept[-1][0] if kept else 0, encoded)
            if memo is not None and memo.hashes is not None and reused:
                blocks = reused // self.block_size
                known = (memo.hashes[0][:blocks], memo.hashes[1][:blocks])
        return Prompt(ids, new, known)

    block_size = 16  # the routing's block size (set by the picker)

    def _prepared(self, parsed: Parsed) -> tuple[Any, list, list[int], list, ChatHead]:
        """The request's chat messages as the template is given them, the memo's reused: (the
        template they were prepared for, or None where they cannot be kept; the API messages'
        prepared messages; counts; the head's prepared messages; the chat's head)."""
        tok, request, endpoint, memo = self.tokenizer, parsed.request, parsed.endpoint, parsed.memo
        if endpoint == RESPONSES_PATH:
            chat = openai_responses.chat_body(request)
            head = tok.chat_head(chat)
            messages = canonical_messages(chat["messages"])
            if head.continue_final:
                _append_continue_tag(messages)
            return None, tok.chat_template.prepare(messages, head.template), [], [], head
        kept = memo.head if memo is not None and memo.endpoint == endpoint else None
        if kept is not None and memo is not None and _same_head(request, memo.request):
            head, head_prepared, system_count = kept
        else:
            if endpoint == MESSAGES_PATH:
                chat, system = anthropic_messages.chat_head(request, tok.strip_anthropic_preamble)
            else:
                chat, system = request, []
            head = tok.chat_head(chat)
            head = replace(head, tools=_for_template(head.tools)) if head.tools else head
            head_prepared = tok.chat_template.prepare(
                [canonical_message(k, m) for k, m in enumerate(system)], head.template) if system else []
            system_count = len(system)
        elements = request.get("messages")
        if not isinstance(elements, list):
            raise PromptError("`messages` must be an array of messages" if endpoint == CHAT_PATH
                              else "messages: field required")
        if not elements:
            raise PromptError("The 'messages' field cannot be empty. At least one message is required."
                              if endpoint == CHAT_PATH else "messages: field required")
        template = head.template
        keep = tok.chat_template.per_message(template) and not head.continue_final
        reuse = keep and memo is not None and memo.template is template
        shared = parsed.shared if reuse else 0
        prepared = memo.prepared[:memo.counts[shared]] if reuse and memo is not None else []
        counts = memo.counts[:shared + 1] if reuse and memo is not None else [0]
        chat_index = system_count + len(prepared)
        parsed.head = (head, head_prepared, system_count)
        fresh: list[dict] = []
        for i in range(shared, len(elements)):
            made: list[dict] = []
            if endpoint == MESSAGES_PATH:
                anthropic_messages.convert_message(i, elements[i], made)
            else:
                made.append(elements[i])
            canonical = [canonical_message(chat_index + j, m) for j, m in enumerate(made)]
            chat_index += len(canonical)
            if keep:
                prepared.extend(tok.chat_template.prepare(canonical, template))
                counts.append(len(prepared))
            else:
                fresh.extend(canonical)
        if not keep:
            if head.continue_final:
                _append_continue_tag(fresh)
            return None, tok.chat_template.prepare(fresh, template), [], head_prepared, head
        return template, prepared, counts, head_prepared, head

    def _new_memo(self, parsed: Parsed, template: Any, prepared: list, counts: list[int],
                  encoded: Encoded | None) -> Memo:
        memo, request, endpoint = parsed.memo, parsed.request, parsed.endpoint
        key = ARRAY_KEYS.get(endpoint)
        head_keys: tuple[str, ...] = ()
        cuts: list[int] = []
        if key is not None and isinstance(request.get(key), list):
            keys = list(request)
            head_keys = tuple(keys[:keys.index(key)])
            elements = len(request[key])
            if memo is not None:
                # The shared elements' cuts hold (same bytes); the rest are found in the new bytes
                # (a shared head's alone: the bytes after it, not the whole body).
                cut = memo.cuts[parsed.shared]
                document, offset = _tail_document(parsed.body, cut, parsed.shared == 0)
                found = _cuts_in(document, _TAIL_KEY, elements - parsed.shared + 1)
                cuts = [*memo.cuts[:parsed.shared + 1], *(c - offset + cut for c in found[2:])] \
                    if found is not None else []
            else:
                cuts = _cuts_in(parsed.body, key, elements) or []
        return Memo(endpoint, parsed.body, cuts, head_keys, request, template, prepared,
                    counts, encoded, head=parsed.head)

    # -- keeping ---------------------------------------------------------------------------------

    def remember(self, parsed: Parsed, prompt: Prompt, hashes: tuple[list[int], list[int]] | None) -> None:
        """Keep this request's work for the next request of its session (and of its head)."""
        self.outcomes[parsed.outcome] += 1
        if self.on_outcome is not None:
            self.on_outcome(parsed.outcome)
        memo = prompt.memo
        if not memo.cuts or memo.endpoint not in ARRAY_KEYS or not self.budget_bytes:
            return
        if self._tail(memo.body, memo, len(memo.cuts) - 1) != memo.request:
            return  # the cuts are not where the parse says (never seen; a memo must be exact)
        memo.hashes = hashes
        head = ("head", memo.endpoint, _head_key(memo.body, memo.cuts[0]))
        with self._lock:
            if parsed.key is not None:
                self._put(("session", memo.endpoint, parsed.key), memo)
            if head not in self._memos:
                self._head_lengths[memo.cuts[0]] += 1
                self._put(head, memo)
            while self._memos and self._bytes > self.budget_bytes:
                dropped_key, dropped = self._memos.popitem(last=False)
                self._bytes -= dropped.nbytes
                if dropped_key[0] == "head":
                    self._head_lengths[dropped.cuts[0]] -= 1
                    if self._head_lengths[dropped.cuts[0]] <= 0:
                        del self._head_lengths[dropped.cuts[0]]

    def _put(self, key: tuple, memo: Memo) -> None:
        old = self._memos.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._memos[key] = memo
        self._bytes += memo.nbytes

    def __len__(self) -> int:
        return len(self._memos)
