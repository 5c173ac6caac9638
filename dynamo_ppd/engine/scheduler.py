"""The engine model: TensorRT-LLM-style in-flight batching over a paged KV cache, with no clock.

A driver owns time. It calls `Engine.step(now)` to learn what happens at ``now`` (first tokens of
transferred requests) and which iteration to run next with its modeled duration, waits that long
(on a wall clock in a live worker, on a virtual one in the simulator) and calls
`Engine.finish(iteration, now)` to get the tokens it produced. Same model, two clocks.

Scheduling, as TensorRT-LLM's (GUARANTEED_NO_EVICT capacity scheduler, chunked context):
1. Admission, first come first served: a waiting request is admitted while the batch has room
   (``max_batch_size``) and the KV cache can reserve its prompt plus ``max_tokens``; the head of
   the queue blocks those behind it.
2. Each iteration, every decoding request generates one token; then prefill (context) requests,
   in admission order, take chunks of the remaining ``max_num_tokens`` budget, each chunk a
   multiple of the block size unless it finishes the prompt.
3. With the profile's ``cascade_attention`` (vLLM V1's), the iteration is priced with the prefix
   of cached blocks that every admitted request holds, when vLLM's heuristic would use it
   (`_cascade_prefix_tokens`).

Request kinds, as TensorRT-LLM's ``request_type``:
- ``context_only`` (a prefill worker): compute the prompt (reusing cached blocks), sample one
  token, finish; the KV stays cached here and is sent to the decode worker by the driver.
- ``generation_only`` (a decode worker with a prefill result): reserve blocks, wait until the
  transferred KV has arrived (``kv_ready_at``), insert it into the cache, emit the prefill's
  token, then decode.
- ``context_and_generation`` (aggregated, or decode with the bypass annotation): compute only
  the prompt tokens not already cached (the append-prefill), then decode.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from dataclasses import dataclass, field

from .blocks import BlockHasher
from .cost import (
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_REQUESTS,
    CostModel,
    IterationCost,
    PrefillChunk,
    vllm_uses_cascade,
)
from .kv_cache import CacheFull, KvCache, KvEvent, SequenceKv
from .profile import EngineProfile
from .token_ids import random_ids


class RequestKind(str, enum.Enum):
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"
    CONTEXT_AND_GENERATION = "context_and_generation"


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted yet
    AWAITING_KV = "awaiting_kv"  # generation_only: admitted, transfer in flight
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class RequestRejected(ValueError):
    """The request can never run on this engine (e.g. larger than the KV cache)."""


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    kind: RequestKind = RequestKind.CONTEXT_AND_GENERATION
    first_token: int | None = None  # generation_only: the token the prefill worker sampled
    kv_ready_at: float = 0.0  # generation_only: when the transferred KV is complete here
    # Filled in by the engine:
    phase: Phase = Phase.WAITING
    arrival: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (or received) instead of computed
    computed_tokens: int = 0  # prompt tokens with KV here
    output: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    kv: SequenceKv = field(default_factory=SequenceKv)
    rng: random.Random | None = None
    prompt_hashes: list[int] | None = None  # chained block ids of the prompt, computed once
    drawn: list[int] = field(default_factory=list, repr=False)  # sampled ids not emitted yet

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def prompt_remaining(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def tokens_from(self, start: int) -> list[int]:
        """``all_tokens()[start:]`` without copying the history before ``start``."""
        prompt = self.prompt
        if start >= len(prompt):
            return self.output[start - len(prompt):]
        return prompt[start:] + self.output


@dataclass(frozen=True, slots=True)
class TokenOutput:
    request_id: str
    token_ids: list[int]
    at: float
    finished: bool = False
    finish_reason: str | None = None  # "length" when max_tokens is reached
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Iteration:
    decode: list[EngineRequest]
    prefill: list[tuple[EngineRequest, int]]  # (request, tokens computed in this iteration)
    cost: IterationCost
    started_at: float
    shared_prefix_tokens: int = 0  # cascade attention's common prefix (0: not used)
    # A run of decode-only iterations planned at once (`Engine.step` with ``run=True``): each
    # one's duration, in order (the first is ``cost``'s); empty for a single iteration.
    repeated_s: tuple[float, ...] = ()

    @property
    def repeats(self) -> int:
        return len(self.repeated_s) or 1

    @property
    def durations_s(self) -> tuple[float, ...]:
        return self.repeated_s or (self.cost.total_s,)

    @property
    def ends_at(self) -> float:
        """When the (last) iteration ends: the start plus each duration in turn, the sums a
        driver stepping one iteration at a time makes, so both ways agree to the bit."""
        end = self.started_at
        for duration in self.durations_s:
            end += duration
        return end

    @property
    def duration_s(self) -> float:
        return self.cost.total_s if not self.repeated_s else self.ends_at - self.started_at


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What a router or a metrics publisher wants to know about this worker now."""

    waiting_requests: int
    waiting_prompt_tokens: int  # of waiting requests it will prefill (not generation_only ones)
    awaiting_kv_requests: int
    awaiting_kv_tokens: int  # prompt tokens whose KV is being transferred here
    prefill_requests: int
    prefill_tokens_remaining: int
    decode_requests: int
    decode_kv_tokens: int
    kv_used_blocks: int
    kv_active_blocks: int
    kv_reserved_blocks: int  # promised to admitted requests, not yet filled
    kv_capacity_blocks: int


@dataclass(frozen=True)
class EngineConfig:
    token_range: tuple[int, int] = (1000, 2000)  # ids generated: the model's round-trip range
    seed: int = 0
    capacity_blocks: int | None = None  # None: derived from the profile
    # False: a `TokenOutput` only for a request's first and last token. A virtual-clock driver
    # reads only those (the request keeps every token and its times); not building an object per
    # token is most of what a long simulation saves. A streaming worker needs every token.
    every_token: bool = True
    # False: the KV cache records no events (`KvCache` ``events``): a simulated worker has no
    # indexer to publish them to.
    kv_events: bool = True


# Iterations planned as one run at most: a run a router interrupts wastes the rest of its plan,
# a longer one saves little more (one event per 32 iterations).
_RUN_MAX = 32
_DRAW_BATCH = 64  # token ids sampled at once per request


class Engine:
    def __init__(self, profile: EngineProfile, config: EngineConfig | None = None,
                 hasher: BlockHasher | None = None):
        self.profile = profile
        self.config = config or EngineConfig()
        limits = profile.engine
        self.block_size = limits.block_size
        self.max_batch_size = limits.max_batch_size
        self.max_num_tokens = limits.max_num_tokens
        self.cost_model = CostModel(profile)
        self.cascade_attention = limits.cascade_attention
        self.cascade_iterations = 0  # iterations priced with cascade attention
        self.cache = KvCache(self.config.capacity_blocks or profile.kv_capacity_blocks(),
                             self.block_size, hasher, events=self.config.kv_events)
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []  # admitted, in admission order
        self._by_id: dict[str, EngineRequest] = {}
        self.iterations = 0
        self.busy_s = 0.0
        self.prefill_tokens_computed = 0  # prompt tokens charged (not reused, not received)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request: EngineRequest, now: float) -> None:
        if not request.prompt:
            raise RequestRejected("empty prompt")
        if request.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if request.request_id in self._by_id:
            raise RequestRejected(f"duplicate request id {request.request_id}")
        if request.kind is RequestKind.GENERATION_ONLY and request.first_token is None:
            raise RequestRejected("generation_only needs the prefill worker's first token")
        needed = self._blocks_needed(request)
        if needed > self.cache.capacity:
            raise RequestRejected(
                f"{request.prompt_tokens} prompt tokens + max_tokens {request.max_tokens} need "
                f"{needed} KV blocks; this worker holds {self.cache.capacity}")
        request.arrival = now
        request.rng = random.Random(f"{self.config.seed}:{request.request_id}")
        if request.kind is RequestKind.GENERATION_ONLY:
            # Both legs of a P->D request share its id (and, on live workers, the seed): the
            # prefill leg sampled this stream's first token, so the decode leg continues after
            # it. Restarted, it sampled that token again as the answer's second one.
            self._draw(request)
        self._waiting.append(request)
        self._by_id[request.request_id] = request

    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks stay cached. False if unknown or done."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return False
        if request.phase is Phase.WAITING:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self.cache.release(request.kv)
        request.phase = Phase.FINISHED
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def next_wakeup(self) -> float | None:
        """When an idle engine next has something to do (a transfer completing), if ever."""
        times = [r.kv_ready_at for r in self._running if r.phase is Phase.AWAITING_KV]
        return min(times) if times else None

    # -- the loop --------------------------------------------------------------------------------
    def step(self, now: float, run: bool = False) -> tuple[list[TokenOutput], Iteration | None]:
        """Admit what fits, land arrived transfers, and plan the next iteration (None: idle).

        ``run`` (a virtual-clock driver, with ``every_token`` off): a decode-only batch with
        nothing waiting is planned as a run of iterations, up to the first request's last token
        (or `_RUN_MAX`), one `Iteration`. Until then nothing changes the batch unless the driver acts on
        the engine, and a driver that acts on it or reads it first calls `interrupt`, which
        applies what has run by then and cuts the run at the iteration in flight: the same
        events as stepping one iteration at a time, for a fraction of the work."""
        self._admit(now)
        outputs = self._land_transfers(now)
        decode = [r for r in self._running if r.phase is Phase.DECODE]
        budget = self.max_num_tokens - len(decode)
        prefill: list[tuple[EngineRequest, int]] = []
        for request in self._running:
            if budget <= 0:
                break
            if request.phase is not Phase.PREFILL:
                continue
            chunk = min(request.prompt_remaining, budget)
            if chunk < request.prompt_remaining:
                chunk -= chunk % self.block_size
                if chunk == 0:
                    break
            prefill.append((request, chunk))
            budget -= chunk
        if not decode and not prefill:
            return outputs, None
        shared = self._cascade_prefix_tokens(decode, prefill) if self.cascade_attention else 0
        kv_tokens = sum(r.kv.kv_tokens for r in decode)
        cost = self.cost_model.iteration(
            len(decode), kv_tokens,
            [PrefillChunk(n, r.computed_tokens, n == r.prompt_remaining) for r, n in prefill], shared)
        iteration = Iteration(decode, prefill, cost, now, shared)
        if run and not prefill and not self._waiting and len(decode) == len(self._running):
            iteration.repeated_s = self._decode_run(decode, kv_tokens, shared, cost.total_s)
        return outputs, iteration

    def _decode_run(self, decode: list[EngineRequest], kv_tokens: int, shared: int,
                    first_s: float) -> tuple[float, ...]:
        """Durations of the decode-only iterations up to the one in which the first of
        ``decode`` emits its last token, at most `_RUN_MAX` (each iteration's batch is one token
        longer per request); () when that is the first one."""
        most = min(min(r.max_tokens - len(r.output) for r in decode), _RUN_MAX)
        if most <= 1:
            return ()
        batch = len(decode)
        if not shared:
            return (first_s, *self.cost_model.decode_run_s(batch, kv_tokens + batch, most - 1))
        durations = [first_s]
        for _ in range(most - 1):
            kv_tokens += batch
            durations.append(self.cost_model.iteration(batch, kv_tokens, (), shared).total_s)
        return tuple(durations)

    def interrupt(self, iteration: Iteration, now: float) -> Iteration:
        """A run of iterations (`step` with ``run``) as it stands at ``now``, when the driver is
        about to act on this engine or read it: the iterations that ended before ``now`` are
        applied, and the one in flight is returned, to end (`finish`) as planned. A single
        iteration is returned unchanged."""
        durations = iteration.repeated_s
        if not durations:
            return iteration
        end, done = iteration.started_at, 0
        while done < len(durations) - 1 and end + durations[done] < now:
            end += durations[done]
            done += 1
        if done:
            self._account(durations[:done], iteration.shared_prefix_tokens)
            self._decode_tokens(iteration.decode, done, now)  # nothing finishes before the last
        decode = [r for r in iteration.decode if r.phase is Phase.DECODE]
        cost = self.cost_model.iteration(len(decode), sum(r.kv.kv_tokens for r in decode), (),
                                         iteration.shared_prefix_tokens)
        assert cost.total_s == durations[done], "an interrupted run must keep its planned times"
        return Iteration(decode, [], cost, end, iteration.shared_prefix_tokens)

    def finish(self, iteration: Iteration, now: float) -> list[TokenOutput]:
        """Apply an iteration that ended at ``now``: tokens computed, sampled, requests done."""
        self._account(iteration.durations_s, iteration.shared_prefix_tokens)
        outputs = self._decode_tokens(iteration.decode, iteration.repeats, now)
        for request, chunk in iteration.prefill:
            if request.phase is not Phase.PREFILL:
                continue
            request.computed_tokens += chunk
            self.prefill_tokens_computed += chunk
            self.cache.commit(request.kv, request.prompt, request.computed_tokens)
            if request.prompt_remaining == 0:
                request.phase = Phase.DECODE
                outputs.append(self._emit(request, now))
        return outputs

    def _account(self, durations: tuple[float, ...], shared_prefix_tokens: int) -> None:
        for duration in durations:
            self.iterations += 1
            self.busy_s += duration
            self.cascade_iterations += shared_prefix_tokens > 0

    def _decode_tokens(self, decode: list[EngineRequest], iterations: int, now: float) -> list[TokenOutput]:
        """``iterations`` decode iterations of ``decode`` ended at ``now``: in each, the token
        sampled in the one before gets its KV, and a token is sampled. This loop runs once per
        generated token, so most of a simulation is spent here: kept flat."""
        outputs: list[TokenOutput] = []
        cache, block_size, every_token = self.cache, self.block_size, self.config.every_token
        for request in decode:
            if request.phase is not Phase.DECODE:  # cancelled meanwhile
                continue
            output = request.output
            if iterations > 1:  # a run: all but its last iteration's tokens
                output.extend(self._draw_many(request, iterations - 1))
            kv = request.kv
            kv_tokens = kv.kv_tokens + iterations
            if kv_tokens // block_size == len(kv.hashes) and (kv_tokens % block_size == 0 or kv.has_partial):
                kv.kv_tokens = kv_tokens  # inside a block that has its physical block already
            else:
                start = len(kv.hashes) * block_size  # the first block not cached yet
                cache.commit(kv, request.tokens_from(start), kv_tokens, offset=start)
            if every_token or len(output) + 1 >= request.max_tokens:
                outputs.append(self._emit(request, now))
            else:
                output.append(self._draw(request))
        return outputs

    def drain_kv_events(self) -> list[KvEvent]:
        return self.cache.drain_events()

    def load(self) -> LoadSnapshot:
        # Prompt tokens this engine will compute: a generation_only request waiting for a slot
        # gets its KV by transfer, and a waiting append-prefill computes only what its cached
        # prefix lacks. Counted whole, they made a busy decode worker look as if it had a long
        # prefill queue (a 2,000-token history for a 20-token append), and a router avoided it.
        waiting_tokens = sum(self._uncached_tokens(r) for r in self._waiting
                             if r.kind is not RequestKind.GENERATION_ONLY)
        prefill = [r for r in self._running if r.phase is Phase.PREFILL]
        decode = [r for r in self._running if r.phase is Phase.DECODE]
        awaiting = [r for r in self._running if r.phase is Phase.AWAITING_KV]
        return LoadSnapshot(
            waiting_requests=len(self._waiting), waiting_prompt_tokens=waiting_tokens,
            awaiting_kv_requests=len(awaiting), awaiting_kv_tokens=sum(r.prompt_tokens for r in awaiting),
            prefill_requests=len(prefill),
            prefill_tokens_remaining=sum(r.prompt_remaining for r in prefill),
            decode_requests=len(decode), decode_kv_tokens=sum(r.kv.kv_tokens for r in decode),
            kv_used_blocks=self.cache.used_blocks, kv_active_blocks=self.cache.active_blocks,
            kv_reserved_blocks=self.cache.reserved_blocks, kv_capacity_blocks=self.cache.capacity)

    def _uncached_tokens(self, request: EngineRequest) -> int:
        if request.prompt_hashes is None:
            return request.prompt_tokens
        cached = self.cache.match_blocks(request.prompt_hashes) * self.block_size
        return max(1, request.prompt_tokens - cached)  # a fully cached prompt still computes one

    def get(self, request_id: str) -> EngineRequest | None:
        return self._by_id.get(request_id)

    # -- internals -------------------------------------------------------------------------------
    def _blocks_needed(self, request: EngineRequest) -> int:
        return math.ceil((request.prompt_tokens + request.max_tokens) / self.block_size)

    def _cascade_prefix_tokens(self, decode: list[EngineRequest],
                               prefill: list[tuple[EngineRequest, int]]) -> int:
        """The common prefix vLLM's cascade attention would use this iteration, in tokens (0: off).

        As vLLM V1 (freelulul/vllm-ppd at d6d4efb3 = upstream main b95d054d): its scheduler counts
        the leading blocks of one running request whose ref_cnt equals the number of requests
        holding KV blocks (`get_num_common_prefix_blocks`, vllm/v1/core/single_type_kv_cache_
        manager.py), i.e. blocks held by ALL of them, scheduled this step or not: one request
        that does not share the prefix (a fresh prompt) makes it 0. The model runner caps it at
        the fewest tokens any scheduled request has computed, in whole blocks
        (`_compute_cascade_attn_prefix_len`, vllm/v1/worker/gpu_model_runner.py), and the
        attention backend's heuristic decides (`vllm_uses_cascade`).

        vLLM walks the blocks one by one; since a block's holders also hold every block before
        it, the count never grows along the chain, so a binary search finds the same prefix in
        O(log blocks) lookups, after an O(1) exit when even vLLM's 256 tokens are not shared."""
        num_requests = len(decode) + len(prefill)
        if num_requests < CASCADE_MIN_REQUESTS:
            return 0
        holders = len(self._running)  # admitted requests hold KV blocks (vLLM: req_to_blocks)
        blocks = self._running[0].kv.hashes
        shared = -(-CASCADE_MIN_PREFIX_TOKENS // self.block_size)  # blocks known to be common
        if len(blocks) < shared or self.cache.holders(blocks[shared - 1]) != holders:
            return 0
        not_shared = len(blocks) + 1  # the first block count known not to be common
        while not_shared - shared > 1:
            mid = (shared + not_shared) // 2
            if self.cache.holders(blocks[mid - 1]) == holders:
                shared = mid
            else:
                not_shared = mid
        tokens = shared * self.block_size
        # Decoding requests hold only blocks they have computed, so only a prefill can be behind
        # the common blocks: a prompt cached whole still computes its last token.
        for request, _ in prefill:
            tokens = min(tokens, request.computed_tokens // self.block_size * self.block_size)
        model = self.profile.model
        if not vllm_uses_cascade(tokens, num_requests, not prefill, model.num_attention_heads,
                                 model.num_kv_heads, self.profile.engine.gpu_sm_count):
            return 0
        return tokens

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting[0]
            if request.prompt_hashes is None:
                request.prompt_hashes = self.cache.prefix_hashes(request.prompt)
            try:
                matched = self.cache.admit(request.kv, request.prompt_hashes, self._blocks_needed(request))
            except CacheFull:
                return  # first come, first served: the head waits for space
            self._waiting.popleft()
            self._running.append(request)
            # The last prompt token is always computed (its logits give the first token), so at
            # most prompt-1 tokens count as reused. For generation_only the transfer brings the
            # rest; like TensorRT-LLM we report only the blocks this worker already had.
            request.cached_tokens = min(matched * self.block_size, request.prompt_tokens - 1)
            if request.kind is RequestKind.GENERATION_ONLY:
                request.phase = Phase.AWAITING_KV
            else:
                request.phase = Phase.PREFILL
                request.computed_tokens = request.cached_tokens

    def _land_transfers(self, now: float) -> list[TokenOutput]:
        outputs = []
        for request in self._running:
            if request.phase is Phase.AWAITING_KV and request.kv_ready_at <= now:
                request.computed_tokens = request.prompt_tokens
                self.cache.commit(request.kv, request.prompt, request.prompt_tokens)
                request.phase = Phase.DECODE
                assert request.first_token is not None
                outputs.append(self._emit(request, now, token=request.first_token))
        return outputs

    def _draw(self, request: EngineRequest) -> int:
        """The request's next sampled token id (drawn from its own generator, in batches)."""
        if not request.drawn:
            self._refill(request)
        return request.drawn.pop()

    def _draw_many(self, request: EngineRequest, count: int) -> list[int]:
        """The request's next ``count`` sampled token ids, the same as ``count`` `_draw` calls."""
        tokens: list[int] = []
        while count > 0:
            if not request.drawn:
                self._refill(request)
            drawn = request.drawn
            take = min(count, len(drawn))
            tokens.extend(reversed(drawn[-take:]))
            del drawn[-take:]
            count -= take
        return tokens

    def _refill(self, request: EngineRequest) -> None:
        """Sample the next ids in one call (`token_ids.random_ids`); kept reversed, so the next
        one is popped from the end."""
        assert request.rng is not None
        drawn = random_ids(request.rng, *self.config.token_range, min(_DRAW_BATCH, request.max_tokens))
        drawn.reverse()
        request.drawn = drawn

    def _emit(self, request: EngineRequest, now: float, token: int | None = None) -> TokenOutput:
        if token is None:
            token = self._draw(request)
        request.output.append(token)
        if request.first_token_at is None:
            request.first_token_at = now
        done = (len(request.output) >= request.max_tokens
                or request.kind is RequestKind.CONTEXT_ONLY)
        if done:
            request.phase = Phase.FINISHED
            request.finished_at = now
            self._running.remove(request)
            self._by_id.pop(request.request_id, None)
            self.cache.release(request.kv)
        return TokenOutput(
            request_id=request.request_id, token_ids=[token], at=now, finished=done,
            finish_reason="length" if done else None, prompt_tokens=request.prompt_tokens,
            cached_tokens=request.cached_tokens, completion_tokens=len(request.output))
