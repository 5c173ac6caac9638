"""The benchmark manifest: which conversations arrive when, and what each of their turns sends.

A manifest is a JSONL file, one `ManifestConversation` per line, optionally led by a
`ManifestHeader` line (docs/manifest.md). It is the single description of a workload: the live
benchmark replays it over HTTP and `to_sim` turns it into the virtual-clock simulator's
conversations, so a simulated and a measured run see the same traffic. It is a file, not code, so
a run can be repeated from what was saved next to its results, and a user can bring their own
traffic (a converted ShareGPT dump, a production trace) without writing a generator.

Turns carry either a token count (synthetic traffic: sizes are the experiment) or a text (real
traffic: the client sends it verbatim); `max_tokens` is the reply length the benchmark asks for.
Loading validates every line against one schema and names the line and field of the first error,
because a manifest that fails halfway through a benchmark wastes the run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from dynamo_ppd.sim import conversation as sim

MANIFEST_MAGIC = "dynamo-ppd"
MANIFEST_VERSION = 2  # 2 added the header's `protocol`; version 1 files (no protocol) still load
READABLE_VERSIONS = (1, 2)

TokenCounter = Callable[[str], int]


class ManifestError(ValueError):
    """A manifest that does not validate; the message names the file, line and field."""


class ManifestTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One user message: its size in tokens or its text (exactly one), the reply length to ask
    for, and the user's think time before sending it (from the end of the previous reply;
    ignored on the first turn)."""

    max_tokens: Annotated[int, Meta(ge=1)]
    user_tokens: Annotated[int, Meta(ge=1)] | None = None
    user_text: str | None = None
    think_time_s: Annotated[float, Meta(ge=0)] = 0.0

    def __post_init__(self) -> None:
        if self.user_tokens is None and self.user_text is None:
            raise ValueError("exactly one of user_tokens and user_text must be set (got neither)")
        if self.user_tokens is not None and self.user_text is not None:
            raise ValueError("exactly one of user_tokens and user_text must be set (got both)")


class ManifestConversation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A conversation: its first turn arrives at ``arrival_s`` (seconds from the run's start);
    each later turn is sent after the previous reply and the turn's think time (closed loop)."""

    conversation_id: Annotated[str, Meta(min_length=1)]
    arrival_s: Annotated[float, Meta(ge=0)]
    turns: Annotated[list[ManifestTurn], Meta(min_length=1)]


class ManifestProtocol(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How the manifest must be run to be comparable with where it came from (the paper's
    protocol for its workloads): a replay that ignores these measures something else.

    ``arrival`` names the arrival process the arrivals were drawn from (``poisson``: a Poisson
    process over the duration; ``paper-poisson``: the authors' ``int(rate x window)`` draws kept
    below the window) over ``arrival_window_s``; ``turns`` is every conversation's turn count
    (None: they vary); ``request_timeout_s`` fails a request not finished that long after it
    was issued, waiting for a connection included; ``kill_after_s`` abandons the whole point
    that long after its start; ``max_connections`` caps the client's requests in flight (a new
    conversation waits for a free one; None: no cap)."""

    arrival: Literal["poisson", "paper-poisson", "trace"] = "poisson"
    arrival_window_s: Annotated[float, Meta(gt=0)] | None = None
    turns: Annotated[int, Meta(ge=1)] | None = None
    request_timeout_s: Annotated[float, Meta(gt=0)] | None = None
    kill_after_s: Annotated[float, Meta(gt=0)] | None = None
    max_connections: Annotated[int, Meta(ge=1)] | None = None


class ManifestHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The optional first line: what made the manifest, so a report can say what it ran.
    ``rate_conv_per_s`` and ``duration_s`` are the arrival process it was generated (or
    rescaled) for, when known; ``protocol`` how it must be run, when it matters."""

    manifest: str = MANIFEST_MAGIC
    version: int = MANIFEST_VERSION
    workload: str = ""
    seed: int = 0
    description: str = ""
    rate_conv_per_s: float | None = None
    duration_s: float | None = None
    protocol: ManifestProtocol | None = None
    # A system prompt (and tool schemas) of this many tokens that every conversation's first message
    # follows, the same for all: an agent's. 0: none.
    shared_prefix_tokens: Annotated[int, Meta(ge=0)] = 0


def approx_tokens(text: str) -> int:
    """Token count of a text without a tokenizer: its whitespace-separated words."""
    return len(text.split())


def turn_user_tokens(turn: ManifestTurn, count_tokens: TokenCounter | None = None) -> int:
    """A turn's user tokens: the given count, or the text's counted (at least 1)."""
    if turn.user_tokens is not None:
        return turn.user_tokens
    return max(1, (count_tokens or approx_tokens)(turn.user_text or ""))


def context_tokens(conversation: ManifestConversation, count_tokens: TokenCounter | None = None) -> int:
    """Tokens the conversation holds after its last reply (what a KV transfer of the whole
    history moves): user tokens and replies of every turn plus the chat template's tokens,
    counted as the simulator's template adds them (BOS and a user header per turn)."""
    return sum(turn_user_tokens(t, count_tokens) + t.max_tokens + sim.TEMPLATE_TOKENS
               for t in conversation.turns)


class Manifest(msgspec.Struct):
    """A whole manifest. Conversations are kept in arrival order (stable for ties) and their ids
    are unique, whether loaded or built in code."""

    header: ManifestHeader | None = None
    conversations: list[ManifestConversation] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        arrivals = [c.arrival_s for c in self.conversations]
        if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
            self.conversations = sorted(self.conversations, key=lambda c: c.arrival_s)
        seen: set[str] = set()
        for c in self.conversations:
            if c.conversation_id in seen:
                raise ManifestError(f"duplicate conversation_id {c.conversation_id!r}")
            seen.add(c.conversation_id)

    def summary(self, count_tokens: TokenCounter | None = None) -> dict[str, Any]:
        """Sizes for a report: counts, mean turns, and p50/p90 of user tokens per turn, output
        tokens per turn and final context per conversation; span and rate of the arrivals."""
        convs = self.conversations
        turns = [t for c in convs for t in c.turns]
        out: dict[str, Any] = {
            "workload": self.header.workload if self.header else "",
            "conversations": len(convs),
            "turns": len(turns),
            "mean_turns": len(turns) / len(convs) if convs else 0.0,
        }
        series = {
            "user_tokens": [turn_user_tokens(t, count_tokens) for t in turns],
            "output_tokens": [t.max_tokens for t in turns],
            "context_tokens": [context_tokens(c, count_tokens) for c in convs],
        }
        for name, values in series.items():
            for q in (50, 90):
                out[f"{name}_p{q}"] = float(np.percentile(values, q)) if values else 0.0
        span = max((c.arrival_s for c in convs), default=0.0)
        out["span_s"] = span
        out["rate_conv_per_s"] = len(convs) / span if span > 0 else 0.0
        return out


_AT_PATH = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")


def _describe(err: msgspec.ValidationError) -> str:
    """msgspec's 'Expected `int` >= 1 - at `$.turns[1].max_tokens`' as
    'turns[1].max_tokens: Expected int >= 1'."""
    text = str(err)
    m = _AT_PATH.match(text)
    msg, path = (m["msg"], m["path"].lstrip(".")) if m else (text, "")
    for pattern, what in ((_UNKNOWN, "unknown field"), (_MISSING, "missing required field")):
        if f := pattern.match(msg):
            path, msg = (f"{path}.{f['field']}" if path else f["field"]), what
    msg = msg.replace("`", "")
    return f"{path}: {msg}" if path else msg


def _parse_header(obj: dict[str, Any], where: str) -> ManifestHeader:
    try:
        header = msgspec.convert(obj, ManifestHeader)
    except msgspec.ValidationError as e:
        raise ManifestError(f"{where}: {_describe(e)}") from None
    if header.manifest != MANIFEST_MAGIC:
        raise ManifestError(f"{where}: manifest: expected {MANIFEST_MAGIC!r}, got {header.manifest!r}")
    if header.version not in READABLE_VERSIONS:
        raise ManifestError(f"{where}: version: unsupported manifest version {header.version} "
                            f"(this reader knows versions {', '.join(map(str, READABLE_VERSIONS))})")
    if header.version == 1 and header.protocol is not None:
        raise ManifestError(f"{where}: protocol: not in manifest version 1 (write version 2)")
    return header


def parse_manifest(lines: Iterable[str | bytes], source: str = "<manifest>") -> Manifest:
    """A manifest from its JSONL lines; ``source`` names it in errors. Blank lines are skipped
    (and counted); the first non-blank line is a header if it has a "manifest" key."""
    header: ManifestHeader | None = None
    conversations: list[ManifestConversation] = []
    seen_on: dict[str, int] = {}
    decoder = msgspec.json.Decoder(ManifestConversation)
    first = True
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            if first:
                first = False
                obj = msgspec.json.decode(line)
                if isinstance(obj, dict) and "manifest" in obj:
                    header = _parse_header(obj, where)
                    continue
            conv = decoder.decode(line)
        except msgspec.DecodeError as e:
            if isinstance(e, msgspec.ValidationError):
                detail = _describe(e)
                if detail == "manifest: unknown field":
                    detail = "a header is only allowed on the first line"
                raise ManifestError(f"{where}: {detail}") from None
            reason = str(e).removeprefix("JSON is malformed: ")
            raise ManifestError(f"{where}: invalid JSON: {reason}") from None
        if conv.conversation_id in seen_on:
            raise ManifestError(f"{where}: conversation_id: duplicate id {conv.conversation_id!r} "
                                f"(first on line {seen_on[conv.conversation_id]})")
        seen_on[conv.conversation_id] = number
        conversations.append(conv)
    return Manifest(header, conversations)


def load_manifest(path: str | Path) -> Manifest:
    """Reads and validates a manifest file; raises `ManifestError` naming the line and field."""
    with open(path, "rb") as f:
        return parse_manifest(f, source=str(path))


def dump_manifest(manifest: Manifest) -> bytes:
    """The manifest's JSONL text: the header line (if any), then one conversation per line."""
    encoder = msgspec.json.Encoder()
    lines = [encoder.encode(manifest.header)] if manifest.header is not None else []
    lines.extend(encoder.encode(c) for c in manifest.conversations)
    return b"".join(line + b"\n" for line in lines)


def save_manifest(manifest: Manifest, path: str | Path) -> None:
    """Writes the manifest as JSONL (`dump_manifest`); `load_manifest` reads back an equal one."""
    Path(path).write_bytes(dump_manifest(manifest))


def to_sim(manifest: Manifest, count_tokens: TokenCounter | None = None,
           template: sim.ChatTemplate | None = None) -> list[sim.Conversation]:
    """The simulator's conversations for this manifest, turn for turn. Text turns become token
    counts with ``count_tokens`` (default: words, `approx_tokens`); the header's seed seeds the
    simulated user tokens; ``template``: the chat template's token counts (None: the
    simulator's own)."""
    seed = manifest.header.seed if manifest.header else 0
    shared = manifest.header.shared_prefix_tokens if manifest.header else 0
    return [sim.Conversation(c.conversation_id, c.arrival_s,
                             [sim.Turn(turn_user_tokens(t, count_tokens), t.max_tokens, t.think_time_s)
                              for t in c.turns], seed=seed, template=template, shared_prefix_tokens=shared)
            for c in manifest.conversations]


def from_sim(conversations: Iterable[sim.Conversation], header: ManifestHeader | None = None) -> Manifest:
    """A manifest of the simulator's conversations (token-count turns), e.g. from
    `sim.conversation.synthetic_workload`."""
    return Manifest(header, [
        ManifestConversation(c.conversation_id, c.arrival_s,
                             [ManifestTurn(t.max_tokens, user_tokens=t.user_tokens,
                                           think_time_s=t.think_time_s) for t in c.turns])
        for c in conversations])


def scale_arrivals(manifest: Manifest, rate_conv_per_s: float) -> Manifest:
    """The same conversations with arrival times multiplied by one factor, so that N
    conversations arrive at ``rate_conv_per_s`` over the span from the run's start (t=0) to the
    last arrival: N / last arrival = rate. Order and relative gaps are kept, so a Poisson
    manifest stays Poisson; this is how one manifest is run at several QPS."""
    if not rate_conv_per_s > 0:
        raise ValueError(f"rate must be positive, got {rate_conv_per_s}")
    convs = manifest.conversations
    header = manifest.header
    if not convs:
        return Manifest(header, [])
    last = convs[-1].arrival_s
    if last <= 0:
        raise ManifestError("cannot rescale arrivals: every conversation arrives at t=0")
    k = len(convs) / (rate_conv_per_s * last)
    if header is not None:
        duration = header.duration_s * k if header.duration_s else len(convs) / rate_conv_per_s
        protocol = header.protocol
        if protocol is not None and protocol.arrival_window_s is not None:  # the window stretches too
            protocol = msgspec.structs.replace(protocol, arrival_window_s=protocol.arrival_window_s * k)
        header = msgspec.structs.replace(header, rate_conv_per_s=rate_conv_per_s, duration_s=duration,
                                         protocol=protocol)
    return Manifest(header, [msgspec.structs.replace(c, arrival_s=c.arrival_s * k) for c in convs])
