"""The router's pure parts: policy, session table, residency index."""

from __future__ import annotations

import random

import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.engine.blocks import prefix_chain
from dynamo_ppd.policy.decision import (
    Decision,
    Mode,
    Policy,
    PolicyConfig,
    Prediction,
    ProfilePredictor,
    RequestFeatures,
    Route,
    WorkerLoad,
)
from dynamo_ppd.policy.score import score
from dynamo_ppd.routing.residency import Residency
from dynamo_ppd.routing.sessions import SessionRecord, decode, encode

pytestmark = pytest.mark.unit

IDLE = WorkerLoad()


def features(turn=2, prompt=2000, cached_d=1900, key="s:2", decode=IDLE, prefill=IDLE,
             has_decode=True, out=128) -> RequestFeatures:
    return RequestFeatures(decision_key=key, turn=turn, prompt_tokens=prompt, cached_on_decode=cached_d,
                           cached_on_prefill=0, expected_output_tokens=out, has_session_decode=has_decode,
                           decode_load=decode, prefill_load=prefill)


def policy(mode: Mode, **kw) -> Policy:
    predictor = ProfilePredictor(load_profile()) if mode is Mode.PPD else None
    return Policy(PolicyConfig(mode=mode, **kw), predictor)


def test_score_signs():
    fast_local = (Prediction(0.01, 0.007), Prediction(0.05, 0.007))
    assert score(*fast_local, 1, 1) > 0
    slow_tpot_local = (Prediction(0.04, 0.014), Prediction(0.05, 0.007))
    assert score(*slow_tpot_local, 1, 1) < 0
    assert score(*slow_tpot_local, 10, 1) > 0  # TTFT weighs more


@pytest.mark.parametrize("mode", list(Mode))
def test_first_turn_always_via_prefill_except_replica(mode):
    decision = policy(mode).decide(features(turn=1, cached_d=0, has_decode=False), history_tokens=0)
    assert decision.route is (Route.REPLICA if mode is Mode.REPLICA else Route.VIA_PREFILL)


def test_modes_on_follow_ups():
    f = features()
    assert policy(Mode.PD).decide(f, 1950).route is Route.VIA_PREFILL
    assert policy(Mode.LOCAL).decide(f, 1950) == Decision(Route.DECODE_LOCAL, "local_mode")
    decision = policy(Mode.PPD).decide(f, 1950)
    assert decision.route is Route.DECODE_LOCAL and decision.score is not None and decision.score > 0


def test_evicted_history_goes_via_prefill_in_every_mode():
    f = features(cached_d=320)  # the decode worker holds 320 of the 1950 tokens it had
    for mode in (Mode.LOCAL, Mode.PPD, Mode.FRACTION):
        assert policy(mode).decide(f, 1950) == Decision(Route.VIA_PREFILL, "history_evicted")


def test_fraction_is_deterministic_per_key_and_close_to_x():
    p = policy(Mode.FRACTION, local_fraction=0.3)
    routes = [p.decide(features(key=f"s{i}:2"), 1950).route for i in range(2000)]
    again = [p.decide(features(key=f"s{i}:2"), 1950).route for i in range(2000)]
    assert routes == again
    share = routes.count(Route.DECODE_LOCAL) / len(routes)
    assert 0.26 < share < 0.34


def test_raising_w_tpot_never_raises_the_local_share():
    rng = random.Random(0)
    cases = []
    for _ in range(300):
        prompt, batch = rng.randint(200, 8000), rng.randint(0, 200)
        cases.append(features(prompt=prompt, cached_d=int(prompt * rng.uniform(0.5, 0.99)),
                              decode=WorkerLoad(decode_requests=batch, decode_kv_tokens=batch * 1500),
                              prefill=WorkerLoad(pending_prefill_tokens=rng.randint(0, 20000)),
                              out=rng.randint(8, 512)))
    shares = []
    for w_tpot in (0.5, 1, 3, 6, 20):
        p = policy(Mode.PPD, w_tpot=w_tpot)
        shares.append(sum(p.decide(f, f.cached_on_decode).route is Route.DECODE_LOCAL for f in cases))
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]


def test_profile_predictions_follow_the_cost_model():
    predictor = ProfilePredictor(load_profile())
    busy_prefill = features(prefill=WorkerLoad(pending_prefill_tokens=16000))
    local, via = predictor.predict(features())
    _, via_busy = predictor.predict(busy_prefill)
    assert via_busy.ttft_s > via.ttft_s  # a queue on the prefill worker delays via-prefill
    assert local.ttft_s < via.ttft_s  # appending 50 tokens beats re-prefilling 2000 and sending them


def test_session_record_round_trips_and_rejects_unknown_fields():
    record = SessionRecord("s1", decode_worker=7, prefill_worker=3, turn=2, context_tokens=900,
                           history_hash=12345, last_access=1.5)
    assert decode(encode(record)) == record
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode({"session_id": "x", "colour": "red"}))


def test_residency_follows_stored_and_removed_events():
    from dynamo._core import compute_block_hash_for_seq

    residency = Residency(block_size=32)
    tokens = list(range(1000, 1320))  # 10 blocks
    local = compute_block_hash_for_seq(tokens, 32)
    chain = prefix_chain(local)
    blocks = [{"block_hash": 100 + i, "tokens_hash": h} for i, h in enumerate(local)]
    # Stored in two events, the second continuing from the first's last block.
    residency.apply(7, {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": blocks[:4]}}})
    residency.apply(7, {"event_id": 2, "data": {"stored": {"parent_hash": 103, "blocks": blocks[4:]}}})
    assert residency.held_blocks(7, chain) == 10
    assert residency.held_by_worker(chain, [7, 8]) == {7: 10, 8: 0}
    # The same tokens after a different first block are a different prefix.
    other = prefix_chain(compute_block_hash_for_seq(list(range(5000, 5032)) + tokens[32:], 32))
    assert residency.held_blocks(7, other) == 0
    residency.apply(7, {"event_id": 3, "data": {"removed": {"block_hashes": [106, 107, 108, 109]}}})
    assert residency.held_blocks(7, chain) == 6
    residency.remove_worker(7)
    assert residency.held_blocks(7, chain) == 0
