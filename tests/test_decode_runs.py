"""Runs of decode iterations (`Engine.step(run=True)`, `Cluster.touch`): the simulator plans a
decode-only batch's iterations as one event and a router's read or a new request interrupts it.
The outcome must be the one of stepping every iteration, record for record, bit for bit."""

from __future__ import annotations

import random

import pytest

from dynamo_ppd.engine import EngineRequest, load_profile
from dynamo_ppd.engine.cost import CostModel
from dynamo_ppd.sim import peers
from dynamo_ppd.sim.cluster import Cluster
from dynamo_ppd.sim.routing import local_router, pd_router
from dynamo_ppd.sim.run import simulate
from dynamo_ppd.workloads.generators import make_workload, paper_workload
from dynamo_ppd.workloads.manifest import to_sim

pytestmark = pytest.mark.unit

PROFILE = load_profile()


@pytest.mark.parametrize("profile", ["h100-llama3.1-8b", "h100-llama3.1-8b-vllm-paper"])
def test_decode_run_costs_are_the_iteration_costs(profile):
    model = CostModel(load_profile(profile))
    rng = random.Random(3)
    for _ in range(2000):
        batch, context = rng.randint(1, 256), rng.randint(0, 400_000)
        run = model.decode_run_s(batch, context, 5)
        assert run == [model.iteration(batch, context + i * batch).total_s for i in range(5)]
    with pytest.raises(ValueError, match="at least one"):
        model.decode_run_s(0, 10, 3)


def _both(config: str, conversations, make_router, background: bool = False):
    results = []
    for runs in (False, True):
        cluster = Cluster.from_config(PROFILE, config, seed=1, decode_runs=runs)
        if background:  # long decodes submitted straight to a decode worker mid-run
            def load(cluster=cluster) -> None:
                for i in range(8):
                    cluster.submit_background(cluster.view.decode_workers[0],
                                              EngineRequest(f"bg-{i}", list(range(3000 + i, 4000 + i)), 300))
            cluster.call_at(1.3, load)
        result = simulate(cluster, conversations, make_router(), timeout_s=30.0)
        results.append((result, cluster))
    return results


@pytest.mark.parametrize("config, router", [
    ("1P3D", lambda: pd_router),
    ("1P3D", lambda: local_router),
    ("2P2D", lambda: peers.make_peer_router("dynamo-isl-or-load-ours", 0, PROFILE)),  # reads loads
    ("4R", lambda: peers.make_peer_router("dynamo-kv-agg", 0, PROFILE)),  # reads KV overlap
])
def test_runs_of_iterations_change_no_record(config, router):
    conversations = to_sim(make_workload("wildchat", 6.0, 4.0, 0))
    (stepped, reference), (ran, cluster) = _both(config, conversations, router)
    assert ran.records == stepped.records
    assert ran.records, "the workload finished no turn"
    assert sum(w.engine.iterations for w in cluster.workers.values()) == \
        sum(w.engine.iterations for w in reference.workers.values())
    assert cluster.events_run < reference.events_run / 2  # what the runs are for


def test_a_request_submitted_mid_run_sees_the_same_engine():
    conversations = paper_workload("large_long_gen", 2.0, 0)
    (stepped, reference), (ran, cluster) = _both("1P3D", conversations, lambda: local_router, background=True)
    assert ran.records == stepped.records
    engine, reference_engine = (c.workers["D0"].engine for c in (cluster, reference))
    assert engine.busy_s == reference_engine.busy_s and engine.iterations == reference_engine.iterations


def test_a_growing_sequence_commits_its_tail_as_its_whole_history():
    from dynamo_ppd.engine.kv_cache import KvCache, SequenceKv

    tokens = list(range(100, 260))
    caches = [KvCache(capacity_blocks=16, block_size=32) for _ in range(2)]
    seqs = [SequenceKv(), SequenceKv()]
    for cache, seq in zip(caches, seqs, strict=True):
        cache.admit(seq, [], 6)
    for end in (40, 64, 100, 160):
        caches[0].commit(seqs[0], tokens, end)
        start = len(seqs[1].hashes) * 32
        caches[1].commit(seqs[1], tokens[start:], end, offset=start)
        assert seqs[1].hashes == seqs[0].hashes and seqs[1].kv_tokens == end
    assert caches[1].drain_events() == caches[0].drain_events()
    with pytest.raises(ValueError, match="miss block"):
        caches[1].commit(seqs[1], tokens[200:], 200, offset=200)
