"""vLLM V1's cascade attention in the engine model (the profile's ``engine.cascade_attention``):
its heuristic as vLLM's ``use_cascade_attention``, the common prefix as vLLM's scheduler finds it
(blocks held by every request with KV), and its price: the prefix's KV read once per step."""

from __future__ import annotations

import random

import msgspec
import pytest

from dynamo_ppd.engine import CostModel, Engine, EngineRequest, PrefillChunk, load_profile
from dynamo_ppd.engine.cost import vllm_uses_cascade
from dynamo_ppd.engine.profile import EngineProfile
from dynamo_ppd.engine.scheduler import Iteration

pytestmark = pytest.mark.unit

PAPER = load_profile("h100-llama3.1-8b-vllm-paper")
CONTEXT = 2048


def with_cascade(profile: EngineProfile, on: bool) -> EngineProfile:
    return msgspec.structs.replace(profile, engine=msgspec.structs.replace(profile.engine,
                                                                           cascade_attention=on))


def test_only_vllm_profiles_turn_it_on():
    assert PAPER.engine.cascade_attention and PAPER.engine.gpu_sm_count == 132
    for name in ("h100-llama3.1-8b", "h200-llama3.1-8b"):  # TensorRT-LLM: no such path
        assert not load_profile(name).engine.cascade_attention


def test_heuristic_is_vllms():
    # Llama-3.1-8B (32 query heads, 8 KV heads) on 132 SMs.
    llama = {"num_query_heads": 32, "num_kv_heads": 8, "num_sms": 132}
    assert not vllm_uses_cascade(255, 200, False, **llama)  # prefix under 256 tokens
    assert vllm_uses_cascade(256, 200, False, **llama)
    assert not vllm_uses_cascade(2048, 7, False, **llama)  # under 8 requests
    assert vllm_uses_cascade(2048, 8, False, **llama)  # a prefill in the batch: no FlashDecoding
    # Pure decode: FlashDecoding unless the prefix kernel needs fewer waves. Over 2048 tokens
    # (16 KV tiles) the prefix kernel is 1 wave x 16 tiles; FlashDecoding ceil(B*8*16/132) waves.
    assert not vllm_uses_cascade(2048, 16, True, **llama)  # 16 vs 16
    assert vllm_uses_cascade(2048, 17, True, **llama)  # 16 vs 17
    # Without grouped-query attention FlashDecoding is not the alternative: always cascade.
    assert vllm_uses_cascade(2048, 8, True, num_query_heads=32, num_kv_heads=32, num_sms=132)


def test_a_shared_prefix_read_once_costs_less():
    model = CostModel(PAPER)
    batch, own = 200, 32
    plain = model.iteration(batch, batch * (CONTEXT + own))
    shared = model.iteration(batch, batch * (CONTEXT + own), shared_prefix_tokens=CONTEXT)
    assert shared.total_s < plain.total_s - 0.01  # ~200 x 2048 tokens of KV not re-read: ~18 ms
    assert shared.gemm_s == plain.gemm_s and shared.overhead_s == plain.overhead_s
    assert shared.decode_attention_s == pytest.approx(model.iteration(batch, batch * own).decode_attention_s)
    assert shared.shared_prefix_attention_s > 0
    assert shared.total_s == pytest.approx(shared.overhead_s + shared.gemm_s + shared.decode_attention_s
                                           + shared.prefill_attention_s + shared.shared_prefix_attention_s)
    # A prefill chunk over the shared context reads only its own part per sequence too.
    chunk = [PrefillChunk(128, CONTEXT, True)]
    with_chunk = model.iteration(batch, batch * (CONTEXT + own), chunk, shared_prefix_tokens=CONTEXT)
    alone = model.iteration(batch, batch * (CONTEXT + own), chunk)
    assert with_chunk.prefill_attention_s < alone.prefill_attention_s


def test_flag_off_is_the_cost_model_without_it():
    model = CostModel(PAPER)
    for batch, ctx, chunks in ((1, 1024, []), (200, 200 * 2080, []),
                               (50, 50 * 3000, [PrefillChunk(1024, 0, True)]),
                               (8, 8 * 500, [PrefillChunk(128, 2048, True), PrefillChunk(512, 0, False)])):
        assert model.iteration(batch, ctx, chunks) == model.iteration(batch, ctx, chunks, 0)
        assert model.iteration(batch, ctx, chunks).shared_prefix_attention_s == 0.0


# -- the engine ------------------------------------------------------------------------------------
class Batch:
    """An engine with a warmed shared context and a clock, as the paper's benchmark drives it."""

    def __init__(self, profile: EngineProfile, seed: int = 0):
        self.engine = Engine(profile)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.context = self.fresh(CONTEXT)
        self.engine.submit(EngineRequest("warm", self.context + self.fresh(8), 2), self.now)
        self.run()

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(2000, 60000) for _ in range(n)]

    def submit(self, request_id: str, prompt: list[int], max_tokens: int = 16) -> None:
        self.engine.submit(EngineRequest(request_id, prompt, max_tokens), self.now)

    def step(self) -> Iteration:
        _, iteration = self.engine.step(self.now)
        assert iteration is not None
        self.now += iteration.duration_s
        self.engine.finish(iteration, self.now)
        return iteration

    def run(self) -> list[Iteration]:
        iterations = []
        while self.engine.has_work():
            iterations.append(self.step())
        return iterations


def decoders(profile: EngineProfile, batch: int, *, share: bool = True,
             outsiders: int = 0) -> list[Iteration]:
    b = Batch(profile)
    for i in range(batch):
        b.submit(f"d{i}", (b.context if share else b.fresh(CONTEXT)) + b.fresh(32))
    for i in range(outsiders):
        b.submit(f"full{i}", b.fresh(1024))
    return b.run()


def test_decoders_sharing_a_cached_prefix_step_faster_with_cascade():
    on, off = with_cascade(PAPER, True), with_cascade(PAPER, False)
    sharing = decoders(on, 100)
    assert [it.shared_prefix_tokens for it in sharing] == [CONTEXT] * len(sharing)  # prefill step too
    unshared = decoders(on, 100, share=False)
    assert all(it.shared_prefix_tokens == 0 for it in unshared)
    decode_step = sharing[5].duration_s
    assert decode_step < decoders(off, 100)[5].duration_s - 0.005  # 100 x 2048 tokens of KV
    assert decode_step < unshared[5].duration_s - 0.005
    assert len(sharing[5].decode) == 100


def test_one_running_request_without_the_prefix_switches_it_off():
    on = with_cascade(PAPER, True)
    mixed = decoders(on, 100, outsiders=1)
    assert all(it.shared_prefix_tokens == 0 for it in mixed)
    assert mixed[5].duration_s > decoders(on, 100)[5].duration_s + 0.005
    # ... until it finishes: a request done leaves the holders (decodes that run longer).
    b = Batch(on)
    for i in range(40):
        b.submit(f"d{i}", b.context + b.fresh(32), max_tokens=32)
    b.submit("full", b.fresh(1024), max_tokens=4)
    iterations = b.run()
    assert [it.shared_prefix_tokens > 0 for it in iterations[:4]] == [False] * 4
    assert all(it.shared_prefix_tokens == CONTEXT for it in iterations[4:])


def test_below_vllms_thresholds_it_is_off():
    on = with_cascade(PAPER, True)
    assert all(it.shared_prefix_tokens == 0 for it in decoders(on, 7))  # under 8 requests
    small = decoders(on, 12)  # the prefill step is mixed (cascade); decode steps: FlashDecoding wins
    assert small[0].shared_prefix_tokens == CONTEXT
    assert all(it.shared_prefix_tokens == 0 for it in small[1:])
    b = Batch(on)  # a common prefix under 256 tokens (a shared 240-token start)
    for i in range(50):
        b.submit(f"d{i}", b.context[:240] + b.fresh(400))
    assert all(it.shared_prefix_tokens == 0 for it in b.run())


def test_the_common_prefix_is_the_shortest_one_in_whole_blocks():
    b = Batch(with_cascade(PAPER, True))
    for i in range(30):
        b.submit(f"d{i}", b.context + b.fresh(32))
    b.submit("short", b.context[:1000] + b.fresh(200))  # shares 62 blocks of 16 (992 tokens)
    first = b.step()
    assert first.shared_prefix_tokens == 992
    # Holders share less than the reference (the first running request) in scattered ways:
    # the common prefix is the minimum over them, as vLLM's ref_cnt == holders rule gives.
    b = Batch(with_cascade(PAPER, True), seed=1)
    cuts = [b.rng.randrange(300, CONTEXT) for _ in range(20)]
    for i, cut in enumerate(cuts):
        b.submit(f"d{i}", b.context[:cut] + b.fresh(64))
    assert b.step().shared_prefix_tokens == min(cuts) // 16 * 16
    # A prompt cached whole still computes its last token: the prefix stops a block earlier.
    b = Batch(with_cascade(PAPER, True))
    for i in range(10):
        b.submit(f"d{i}", list(b.context))
    assert b.step().shared_prefix_tokens == CONTEXT - 16
    assert b.step().shared_prefix_tokens == 0  # 10 decoders: FlashDecoding wins


def test_flag_off_prices_iterations_as_before():
    # Every iteration of a sharing batch, flag off, costs what the cost model without a shared
    # prefix says (each sequence reads its whole context), and the same with the flag on when
    # nothing is shared.
    off = with_cascade(PAPER, False)
    model = CostModel(off)
    b = Batch(off)
    for i in range(100):
        b.submit(f"d{i}", b.context + b.fresh(32))
    b.submit("full", b.fresh(1024))
    steps = 0
    while b.engine.has_work():
        _, iteration = b.engine.step(b.now)
        assert iteration is not None and iteration.shared_prefix_tokens == 0
        chunks = [PrefillChunk(n, r.computed_tokens, n == r.prompt_remaining) for r, n in iteration.prefill]
        assert iteration.cost == model.iteration(len(iteration.decode),
                                                 sum(r.kv.kv_tokens for r in iteration.decode), chunks)
        b.now += iteration.duration_s
        b.engine.finish(iteration, b.now)
        steps += 1
    assert steps == 16 and b.engine.cascade_iterations == 0
    durations = [it.duration_s for it in decoders(off, 100, share=False)]
    assert durations == [it.duration_s for it in decoders(with_cascade(PAPER, True), 100, share=False)]
