"""The pure engine model: profile, cost model, KV cache and scheduler, without any clock or I/O."""

from __future__ import annotations

import random

import msgspec
import pytest

from dynamo_ppd.engine import (
    CostModel,
    Engine,
    EngineConfig,
    EngineRequest,
    KvCache,
    KvRemoved,
    KvStored,
    PrefillChunk,
    ProfileError,
    RequestKind,
    RequestRejected,
    TransferLink,
    load_profile,
)
from dynamo_ppd.engine.handoff import (
    HandoffError,
    TransferHandle,
    decode_leg,
    pack_params,
    prefill_leg,
    unpack_params,
)

pytestmark = pytest.mark.unit

PROFILE = load_profile()


def fresh(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2000, 8000) for _ in range(n)]


def run_until_idle(engine: Engine, now: float = 0.0, until: float = 1e9) -> tuple[float, list]:
    outputs = []
    while now < until:
        immediate, iteration = engine.step(now)
        outputs += immediate
        if iteration is None:
            wake = engine.next_wakeup()
            if wake is None:
                break
            now = wake
            continue
        now += iteration.duration_s
        outputs += engine.finish(iteration, now)
    return now, outputs


# -- profile and cost ------------------------------------------------------------------------------

def test_profiles_derive_llama_quantities():
    assert PROFILE.model.kv_bytes_per_token == 128 * 1024
    assert 8.0e9 < PROFILE.model.total_params < 8.1e9  # Llama-3.1-8B: 8.03 B
    h200 = load_profile("h200-llama3.1-8b")
    assert h200.kv_capacity_blocks() > 2 * PROFILE.kv_capacity_blocks()  # 141 GB vs 80 GB


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(ProfileError, match="bundled: .*h100-llama3.1-8b, .*h200-llama3.1-8b"):
        load_profile("a100")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(msgspec.yaml.encode(msgspec.structs.replace(
        PROFILE, cost=msgspec.structs.replace(PROFILE.cost, gemm_flops_efficiency=1.5))))
    with pytest.raises(ProfileError, match=r"gemm_flops_efficiency"):
        load_profile(bad)


def test_decode_at_batch_one_is_weight_streaming():
    cost = CostModel(PROFILE).iteration(1, 1024)
    weights_s = PROFILE.model.streamed_weight_bytes / (3.35e12 * PROFILE.cost.memory_bandwidth_efficiency)
    assert cost.gemm_s == pytest.approx(weights_s)
    assert 0.005 < cost.total_s < 0.008  # ~6-7 ms/token, TensorRT-LLM's published range


def test_append_prefill_disturbs_decode_far_less_than_full_prefill():
    model = CostModel(PROFILE)
    for batch in (1, 50, 200):
        base = model.iteration(batch, batch * 1024).total_s
        full = model.iteration(batch, batch * 1024, [PrefillChunk(1024, 0, True)]).total_s
        append = model.iteration(batch, batch * 1024, [PrefillChunk(128, 1024, True)]).total_s
        assert base < append < full
        assert (append - base) * 5 < full - base


def test_transfer_link_queues_transfers():
    link = TransferLink(1e9, setup_s=0.001)
    assert link.schedule(1_000_000_000, ready_at=0.0) == (0.0, pytest.approx(1.001))
    start, finish = link.schedule(500_000_000, ready_at=0.5)  # waits behind the first
    assert start == pytest.approx(1.001) and finish == pytest.approx(1.502)
    assert link.backlog_s(1.0) == pytest.approx(0.502)


# -- KV cache ----------------------------------------------------------------------------------------

def replay(events) -> set[int]:
    cached: set[int] = set()
    for event in events:
        if isinstance(event, KvStored):
            assert len(event.token_ids) == 32 * len(event.block_hashes)
            cached |= set(event.block_hashes)
        else:
            cached -= set(event.block_hashes)
    return cached


def test_cache_reuses_prefix_dedupes_and_evicts_leaf_first():
    from dynamo_ppd.engine.kv_cache import SequenceKv

    cache = KvCache(capacity_blocks=8, block_size=32)
    tokens = fresh(128, 1)  # 4 blocks
    a = SequenceKv()
    cache.admit(a, cache.prefix_hashes(tokens), 4)
    cache.commit(a, tokens, 128)
    b = SequenceKv()  # same prompt: all 4 blocks reused, nothing reserved
    assert cache.admit(b, cache.prefix_hashes(tokens), 4) == 4
    assert cache.used_blocks == 4
    cache.release(a)
    cache.release(b)
    assert cache.active_blocks == 0 and len(cache.cached_hashes()) == 4
    # A new 6-block prompt needs 2 evictions: the conversation's last blocks go first.
    c = SequenceKv()
    other = fresh(192, 2)
    cache.admit(c, cache.prefix_hashes(other), 6)
    cache.commit(c, other, 192)
    removed = [e for e in cache.events if isinstance(e, KvRemoved)]
    hashes = cache.prefix_hashes(tokens)
    assert [h for e in removed for h in e.block_hashes] == [hashes[3], hashes[2]]
    assert cache.match_blocks(hashes) == 2
    assert replay(cache.drain_events()) == cache.cached_hashes()
    assert cache.used_blocks <= cache.capacity


def test_a_cache_without_events_keeps_the_same_blocks_and_counts_evictions():
    """A simulated worker's cache records no events (no indexer to publish to); what it caches
    and evicts must not change with that."""
    from dynamo_ppd.engine.kv_cache import SequenceKv

    caches = [KvCache(capacity_blocks=8, block_size=32),
              KvCache(capacity_blocks=8, block_size=32, events=False)]
    for cache in caches:
        for seed, size in ((1, 128), (2, 192), (3, 160)):
            seq, tokens = SequenceKv(), fresh(size, seed)
            cache.admit(seq, cache.prefix_hashes(tokens), size // 32)
            cache.commit(seq, tokens, size)
            cache.release(seq)
    with_events, without = caches
    assert without.cached_hashes() == with_events.cached_hashes() and without.events == []
    removed = sum(len(e.block_hashes) for e in with_events.events if isinstance(e, KvRemoved))
    assert removed > 0 and without.evicted_blocks == with_events.evicted_blocks == removed


def test_random_ids_stay_in_range_repeat_per_seed_and_differ_between_seeds():
    from dynamo_ppd.engine.token_ids import random_ids

    ids = random_ids(random.Random("0:a"), 1000, 2000, 10_000)  # more than one slice
    assert len(ids) == 10_000 and min(ids) >= 1000 and max(ids) < 2000
    assert len(set(ids)) > 900  # the range is covered, not a few values
    assert random_ids(random.Random("0:a"), 1000, 2000, 10_000) == ids
    assert random_ids(random.Random("0:a"), 1000, 2000, 5000) == ids[:5000]  # prefix-consistent
    assert random_ids(random.Random("0:b"), 1000, 2000, 64) != ids[:64]
    assert random_ids(random.Random("0:a"), 5, 6, 1) == [5] and random_ids(random.Random(), 0, 9, 0) == []
    with pytest.raises(ValueError, match="empty token id range"):
        random_ids(random.Random(), 7, 7, 3)


def test_cache_refuses_reservations_it_cannot_keep():
    from dynamo_ppd.engine.kv_cache import CacheFull, SequenceKv

    cache = KvCache(capacity_blocks=4, block_size=32)
    a = SequenceKv()
    cache.admit(a, [], 3)
    with pytest.raises(CacheFull):
        cache.admit(SequenceKv(), [], 2)
    cache.release(a)
    cache.admit(SequenceKv(), [], 2)


# -- scheduler ---------------------------------------------------------------------------------------

def test_chunked_prefill_respects_token_budget_and_blocks():
    engine = Engine(PROFILE)
    engine.submit(EngineRequest("long", fresh(20000, 1), 4), 0.0)
    engine.submit(EngineRequest("short", fresh(100, 2), 4), 0.0)
    _, iteration = engine.step(0.0)
    assert [(r.request_id, n) for r, n in iteration.prefill] == [("long", 8192)]
    engine.finish(iteration, iteration.duration_s)
    _, iteration = engine.step(iteration.duration_s)
    assert iteration.prefill[0][1] == 8192
    engine.finish(iteration, 1.0)
    _, iteration = engine.step(1.0)
    # The long prompt's last 3616 tokens and all of the short one fit in one iteration.
    assert [(r.request_id, n) for r, n in iteration.prefill] == [("long", 3616), ("short", 100)]


def test_decode_runs_beside_prefill_and_outputs_are_deterministic():
    def tokens(seed: int) -> list[int]:
        engine = Engine(PROFILE, EngineConfig(seed=seed))
        engine.submit(EngineRequest("a", fresh(300, 1), 20), 0.0)
        engine.submit(EngineRequest("b", fresh(5000, 2), 5), 0.05)
        _, outputs = run_until_idle(engine)
        return [t for o in outputs if o.request_id == "a" for t in o.token_ids]

    assert tokens(1) == tokens(1) != tokens(2)
    assert len(tokens(1)) == 20 and all(1000 <= t < 2000 for t in tokens(1))


def test_append_prefill_charges_only_uncached_tokens():
    engine = Engine(PROFILE)
    history = fresh(1000, 1)
    engine.submit(EngineRequest("t1", history, 40), 0.0)
    now, outputs = run_until_idle(engine)
    reply = [t for o in outputs for t in o.token_ids]
    charged = engine.prefill_tokens_computed
    turn2 = history + reply + fresh(60, 2)
    engine.submit(EngineRequest("t2", turn2, 8), now)
    _, outputs = run_until_idle(engine, now)
    cached = outputs[-1].cached_tokens
    assert cached == (1000 + 40 - 1) // 32 * 32  # history and the blocks the reply filled
    assert engine.prefill_tokens_computed - charged == len(turn2) - cached


def test_generation_only_waits_for_transfer_and_starts_with_prefill_token():
    engine = Engine(PROFILE)
    engine.submit(EngineRequest("g", fresh(500, 1), 5, RequestKind.GENERATION_ONLY,
                                first_token=1234, kv_ready_at=0.2), 0.0)
    immediate, iteration = engine.step(0.0)
    assert immediate == [] and iteration is None and engine.next_wakeup() == 0.2
    _, outputs = run_until_idle(engine, 0.0)
    assert outputs[0].token_ids == [1234] and outputs[0].at == pytest.approx(0.2)
    assert len(outputs) == 5 and engine.prefill_tokens_computed == 0
    assert len(engine.cache.cached_hashes()) == 500 // 32  # received blocks are reusable


def test_an_answer_through_a_prefill_worker_continues_the_prefill_token_stream():
    # Both legs of a P->D request carry the same request id and, on live workers, the same seed:
    # a decode leg that restarted the sampler repeated the prefill's token as its second one
    # ("blietfamviem blietfamviem ..."). The answer must be the one stream an aggregated worker
    # samples for that request, whatever the route.
    prompt = fresh(300, 1)
    prefill = Engine(PROFILE)
    prefill.submit(prefill_leg("r", prompt), 0.0)
    _, outputs = run_until_idle(prefill)
    first = outputs[-1].token_ids[0]
    decode = Engine(PROFILE)
    decode.submit(decode_leg("r", prompt, 40, first, kv_ready_at=0.0), 0.0)
    _, outputs = run_until_idle(decode)
    via_prefill = [t for o in outputs for t in o.token_ids]
    local = Engine(PROFILE)
    local.submit(EngineRequest("r", prompt, 40), 0.0)
    _, outputs = run_until_idle(local)
    assert via_prefill == [t for o in outputs for t in o.token_ids]
    assert via_prefill[1] != via_prefill[0]


def test_no_answer_through_a_prefill_worker_repeats_its_first_token():
    for n in range(50):
        prompt = fresh(64, n)
        prefill, decode = Engine(PROFILE), Engine(PROFILE)
        prefill.submit(prefill_leg(f"req-{n}", prompt), 0.0)
        first = run_until_idle(prefill)[1][-1].token_ids[0]
        decode.submit(decode_leg(f"req-{n}", prompt, 4, first, kv_ready_at=0.0), 0.0)
        tokens = [t for o in run_until_idle(decode)[1] for t in o.token_ids]
        assert tokens[0] == first and tokens[1] != first, n


def test_context_only_returns_one_token():
    engine = Engine(PROFILE)
    engine.submit(EngineRequest("p", fresh(64, 1), 1, RequestKind.CONTEXT_ONLY), 0.0)
    _, outputs = run_until_idle(engine)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].prompt_tokens == 64


def test_fcfs_admission_blocks_behind_a_request_that_does_not_fit():
    engine = Engine(PROFILE, EngineConfig(capacity_blocks=10))
    engine.submit(EngineRequest("a", fresh(200, 1), 100), 0.0)  # 10 blocks: the whole cache
    engine.submit(EngineRequest("b", fresh(10, 2), 2), 0.0)
    engine.step(0.0)
    assert engine.load().waiting_requests == 1
    with pytest.raises(RequestRejected, match="need 11 KV blocks; this worker holds 10"):
        engine.submit(EngineRequest("c", fresh(300, 3), 40), 0.0)
    engine.cancel("a")
    engine.step(0.0)
    assert engine.load().waiting_requests == 0


def test_handoff_params_round_trip_and_reject_garbage():
    handle = TransferHandle("r1", 7, 600, 600 * 131072, 12.5, 0.003)
    params = pack_params(handle, 1500)
    assert unpack_params(params) == (handle, 1500)
    with pytest.raises(HandoffError, match="malformed"):
        unpack_params({"opaque_state": "bm90IG1zZ3BhY2s=", "first_gen_tokens": [1]})


def test_per_sequence_overhead_grows_the_iteration_with_the_batch():
    profile = load_profile()
    cost = msgspec.structs.replace(profile.cost, per_sequence_overhead_s=1e-4)
    slow = msgspec.structs.replace(profile, cost=cost)
    base, costly = CostModel(profile), CostModel(slow)
    for batch in (1, 50):
        extra = costly.iteration(batch, batch * 500).total_s - base.iteration(batch, batch * 500).total_s
        assert extra == pytest.approx(batch * 1e-4)


def test_waiting_prompt_tokens_count_only_the_prefill_work_ahead():
    engine = Engine(PROFILE)
    history = fresh(1000, 1)
    engine.submit(EngineRequest("t1", history, 8), 0.0)
    now, outputs = run_until_idle(engine)
    reply = [t for o in outputs for t in o.token_ids]
    turn2 = history + reply + fresh(20, 2)
    engine.submit(EngineRequest("t2", turn2, 8, prompt_hashes=engine.cache.prefix_hashes(turn2)), now)
    engine.submit(EngineRequest("g", fresh(700, 3), 4, RequestKind.GENERATION_ONLY, first_token=7,
                                kv_ready_at=now + 1), now)
    load = engine.load()
    assert load.waiting_requests == 2
    cached = (1000 + 8 - 1) // 32 * 32
    # The append computes what its cached prefix lacks; the transferred request computes nothing.
    assert load.waiting_prompt_tokens == len(turn2) - cached
