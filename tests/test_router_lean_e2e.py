"""The lean router (`--no-load-reports --no-residency-recovery`, what `bench relay`'s ``ppd-lean``
runs) end to end: it makes neither Dynamo's forward-pass tracker nor its recovery indexers, and a
conversation still keeps its follow-ups decode-local on the decode worker holding the history,
from the live KV events alone."""

from __future__ import annotations

import pytest
from test_router import _log, conversation, decisions, deploy

from dynamo_ppd.bench.relay import LEAN_ROUTER_ARGS

pytestmark = pytest.mark.e2e


def test_the_lean_router_keeps_follow_ups_decode_local_from_live_events(model_dir, tmp_path):
    dep = deploy(tmp_path, model_dir, mode="local", decode=2, router_args=tuple(LEAN_ROUTER_ARGS))
    try:
        results = conversation(dep, turns=3, session="lean-1")
        assert all(r["text"] for r in results)
        assert decisions(dep, "decode_local", "follow_up") == 2
        assert decisions(dep, "via_prefill", "follow_up") == 0
        # Turn 3's prompt is cached on its decode worker: turn 2's answer came back as KV events.
        assert results[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        log = _log(next(p for p in dep.workers if p.label.startswith("router")))
        assert "--no-load-reports" in log and "--no-residency-recovery" in log
        assert "FPM tracker" not in log  # Dynamo's tracker was never started in this router
    finally:
        dep.stop()
