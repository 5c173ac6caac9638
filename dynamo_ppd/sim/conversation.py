"""The request generator, kept apart from the cluster (as in Vidur): conversations with Poisson
arrivals, and the token ids of each turn's prompt.

A conversation's turns are only sizes here. The prompt of turn k depends on what the engine
actually generated for turn k-1, so the simulator builds it when the turn starts, with
`ConversationPrompts`, the way a chat template renders a history:

    turn 1: BOS + user header + user tokens
    turn k: prompt(k-1) + generated(k-1) + end-of-turn + user header + user tokens

so every turn's prompt starts with the previous prompt and output, token for token, and the
previous turn's KV blocks are an exact prefix match (as with a real template). User tokens are
drawn from [2000, 8000), apart from the ids the engine generates (1000-2000) and from the
template ids (< 1000).
"""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Annotated

import msgspec
import numpy as np

BOS_TOKEN = 1
END_OF_TURN_TOKEN = 2
USER_HEADER = (3, 4, 5, 6)  # start header, role, end header, newline
TEMPLATE_TOKENS = 1 + len(USER_HEADER)  # added between a turn's output and the next user message
USER_TOKEN_RANGE = (2000, 8000)


class ChatTemplate(msgspec.Struct, frozen=True):
    """How many template tokens a chat template puts around each user message, for prompts built
    the way a live stack renders them (`model.chat_template_tokens` counts them for the local
    model). ``first_prefix``: before the first message (BOS and the user header);
    ``next_prefix``: between an answer and the next message (end of turn and the user header);
    ``suffix``: after each message (end of turn and the assistant header, the generation
    prompt)."""

    first_prefix: Annotated[int, msgspec.Meta(ge=0)]
    next_prefix: Annotated[int, msgspec.Meta(ge=0)]
    suffix: Annotated[int, msgspec.Meta(ge=0)] = 0


# The simulator's own template (the layout above): BOS + user header, then end-of-turn + user header.
SIM_TEMPLATE = ChatTemplate(first_prefix=TEMPLATE_TOKENS, next_prefix=TEMPLATE_TOKENS, suffix=0)


def _template_ids(count: int, first: int) -> list[int]:
    """``count`` template ids: ``first``, then the user header, then further ids below 1000."""
    return [first, *[USER_HEADER[i] if i < len(USER_HEADER) else 10 + i for i in range(count - 1)]][:count]


class Turn(msgspec.Struct, frozen=True):
    """One user message: its size, the output cap, and how long the user thinks before sending
    it (counted from the end of the previous turn; ignored for the first turn)."""

    user_tokens: int
    max_tokens: int
    think_time_s: float = 0.0


class Conversation(msgspec.Struct, frozen=True):
    conversation_id: str
    arrival_s: float  # when the first turn arrives
    turns: list[Turn]
    seed: int = 0  # with the id, seeds the user tokens: same workload, same prompts
    # False (a chat template over token ids, as Dynamo's frontend renders messages): the next
    # prompt repeats the previous output token for token, so its KV blocks match. True (the
    # paper authors' client: `/v1/completions` with the history concatenated as text): the
    # output comes back as text and is tokenized again, which does not reproduce the sampled
    # ids, so no cache can match past the previous prompt; the output is prefilled again.
    history_as_text: bool = False
    # The template's token counts; None: the simulator's own (`SIM_TEMPLATE`). `bench compare`'s
    # twin sets the live model's, so its prompts are as long as the ones the live stack prefills.
    template: ChatTemplate | None = None
    # Ids every conversation of the workload (the same ``seed``) starts its first message with: an
    # agent's system prompt and tool schemas, which every session shares and a cache can reuse.
    shared_prefix_tokens: int = 0


@functools.lru_cache(maxsize=8)
def shared_prefix(seed: int, count: int) -> tuple[int, ...]:
    """The ``count`` ids a workload's conversations share at the start (seeded by the workload's
    seed alone, so every conversation and every process draws the same)."""
    if count <= 0:
        return ()
    key = hashlib.blake2b(f"{seed}:shared-prefix".encode(), digest_size=16)
    rng = np.random.default_rng(int.from_bytes(key.digest(), "little"))
    return tuple(rng.integers(*USER_TOKEN_RANGE, size=count).tolist())


class ConversationPrompts:
    """Builds the prompts of one conversation turn by turn, from the outputs it is given.

    Also knows how many tokens each prompt adds to what a router has already seen (the
    previous prompt and its streamed output), which is what append-prefill has to compute."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        # A message's ids are drawn at once, up to thousands of them, each on its own (so two
        # conversations never start alike and share a cached prefix they should not): numpy's
        # generator does that in C, ~4x faster than 64-id chunks of `Random.randbytes`. Seeded
        # from the id, so a workload's prompts are the same in every process. (The engine's
        # answers are slices of a shared table, `engine.token_ids`: blocks chain their prompt.)
        key = hashlib.blake2b(f"{conversation.seed}:{conversation.conversation_id}".encode(), digest_size=16)
        self._rng = np.random.default_rng(int.from_bytes(key.digest(), "little"))
        self._history: list[int] = []  # previous prompt + previous output
        template = conversation.template or SIM_TEMPLATE
        self._first = _template_ids(template.first_prefix, BOS_TOKEN)
        self._next = _template_ids(template.next_prefix, END_OF_TURN_TOKEN)
        self._suffix = [7 + i % 3 for i in range(template.suffix)]  # end of turn + assistant header

    def _user_tokens(self, count: int) -> list[int]:
        ids: list[int] = self._rng.integers(*USER_TOKEN_RANGE, size=count).tolist()
        return ids

    def next_prompt(self, turn: Turn) -> tuple[list[int], int]:
        """The next turn's prompt and its number of new tokens (for turn 1, all of them)."""
        if not self._history:
            shared = shared_prefix(self.conversation.seed, self.conversation.shared_prefix_tokens)
            prompt = [*self._first, *shared, *self._user_tokens(turn.user_tokens), *self._suffix]
        else:
            prompt = [*self._history, *self._next, *self._user_tokens(turn.user_tokens), *self._suffix]
        new_tokens = len(prompt) - len(self._history)
        self._history = prompt
        return prompt, new_tokens

    def record_output(self, output_tokens: list[int]) -> None:
        """The tokens the engine generated for the turn just built; the next prompt repeats them
        (as other ids of the same count if the history travels as text)."""
        if self.conversation.history_as_text:
            self._history = self._history + self._user_tokens(len(output_tokens))
        else:
            self._history = self._history + list(output_tokens)


def synthetic_workload(rate_conv_per_s: float, duration_s: float,
                       first_turn: tuple[int, int] = (1024, 128),
                       follow_up: tuple[int, int] = (128, 128), turns: int = 2,
                       think_time_s: float = 0.0, seed: int = 0) -> list[Conversation]:
    """Conversations arriving as a Poisson process of ``rate_conv_per_s`` in [0, duration_s).

    ``first_turn`` and ``follow_up`` are (user tokens, max output tokens), as the paper's
    synthetic workloads (n_in, n_out); every follow-up waits ``think_time_s`` after the previous
    turn finished (a closed loop per conversation, so a slow cluster also slows the arrivals of
    later turns, as real users do)."""
    if rate_conv_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    if turns < 1:
        raise ValueError("a conversation has at least one turn")
    if min(*first_turn, *follow_up) < 1:
        raise ValueError("token counts must be at least 1")
    if think_time_s < 0:
        raise ValueError("think time cannot be negative")
    rng = random.Random(seed)
    conversations: list[Conversation] = []
    t = rng.expovariate(rate_conv_per_s)
    while t < duration_s:
        plan = [Turn(*first_turn)] + [Turn(*follow_up, think_time_s=think_time_s)] * (turns - 1)
        conversations.append(Conversation(f"c{len(conversations):05d}", t, plan, seed=seed))
        t += rng.expovariate(rate_conv_per_s)
    return conversations
