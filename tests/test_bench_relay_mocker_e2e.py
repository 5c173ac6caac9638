"""`bench relay --workers mocker` end to end: the relay benchmark on Dynamo's own mocker workers
(aggregated, cheaper per token than the simulated worker), with the PPD router in replica mode."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_relay_runs_on_dynamos_mocker_workers_with_the_router_in_replica_mode(model_dir, tmp_path):
    from dynamo_ppd.bench.relay import measure_load, syn_a_manifest

    run = measure_load("ppd", 1, 2.0, 2.0, tmp_path, "mocker", workers="mocker")
    expected = sum(t.max_tokens for c in syn_a_manifest(2.0, 2.0).conversations for t in c.turns)
    assert run.failed == 0 and run.tokens == expected > 0
    assert run.workers == "mocker" and run.relay_us_per_token() > 0
    # The router counted what it relayed: at most a chunk per token, and the end of each answer
    # (the mocker ends an answer with a chunk of no tokens).
    assert run.chunks and run.chunks <= run.tokens + run.requests
    assert sum(cpu for label, cpu in run.cpu_s.items() if label.startswith("decode")) > 0
