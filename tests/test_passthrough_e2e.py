"""The bare pass-through relay's ``--first-turn-via-prefill`` (what `bench relay`'s ``relay-pd``
runs) end to end: a conversation's first request goes through the prefill worker, its later
requests decode-local to the decode worker that answered the first, as the PPD router sends them
for the relay benchmark's load; without the flag the relay stays decode-local round robin."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_router import conversation

from dynamo_ppd.bench import routes
from dynamo_ppd.bench.relay import RELAY_PD_ARGS
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port

pytestmark = pytest.mark.e2e


def _served_by_worker(dep) -> dict[str, dict[str, int]]:
    """Each worker process's answered requests by route (its Prometheus page), prefill legs too."""
    out: dict[str, dict[str, int]] = {}
    for p in dep.processes():
        if p.label.startswith(("prefill", "decode")):
            text = httpx.get(f"http://127.0.0.1:{p.env['DYN_SYSTEM_PORT']}/metrics", timeout=10).text
            out[p.label] = {sample.labels["route"]: int(sample.value)
                            for family in text_string_to_metric_families(text)
                            for sample in family.samples if sample.name == routes.SERVED_METRIC}
    return out


def _relay(tmp_path, model_dir, router_args: list[str]):
    return start(ServeOptions(graph="relay", http_port=free_port(), nats_port=free_port(),
                              etcd_port=free_port(), model_dir=model_dir, run_dir=tmp_path / "run",
                              extra_args={"router": router_args} if router_args else {}),
                 log=lambda _m: None)


def test_relay_pd_sends_the_first_turn_through_prefill_and_keeps_follow_ups_on_its_decode_worker(
        model_dir, tmp_path):
    dep = _relay(tmp_path, model_dir, RELAY_PD_ARGS)
    try:
        for session in ("relay-pd-1", "relay-pd-2"):
            results = conversation(dep, turns=3, session=session)
            assert all(r["text"] for r in results)
        served = _served_by_worker(dep)
    finally:
        dep.stop()
    legs = sum(c.get("prefill_leg", 0) for label, c in served.items() if label.startswith("prefill"))
    assert legs == 2  # one per conversation: its first turn
    decode = {label: counts for label, counts in served.items() if label.startswith("decode")}
    assert sum(c.get("via_prefill", 0) for c in decode.values()) == 2
    assert sum(c.get("decode_local", 0) for c in decode.values()) == 4
    # Each conversation's follow-ups ran where its first turn did (round robin would move them).
    for counts in decode.values():
        assert counts.get("decode_local", 0) == 2 * counts.get("via_prefill", 0)


def test_the_bare_relay_without_the_flag_never_uses_the_prefill_worker(model_dir, tmp_path):
    dep = _relay(tmp_path, model_dir, [])
    try:
        results = conversation(dep, turns=2, session="relay-1")
        assert all(r["text"] for r in results)
        served = _served_by_worker(dep)
    finally:
        dep.stop()
    assert not any(c.get("prefill_leg") for label, c in served.items() if label.startswith("prefill"))
    assert sum(c.get("decode_local", 0) for label, c in served.items() if label.startswith("decode")) == 2
