"""`bench router_state` end to end: the session work and the KV events it times go through real
etcd and NATS servers (started from the wheels), and every KV-event message is applied."""

from __future__ import annotations

import re

import pytest

from dynamo_ppd.bench import router_state

pytestmark = pytest.mark.e2e


def test_router_state_times_sessions_and_kv_events_against_real_servers(capsys):
    assert router_state.main(["--conversations", "5", "--messages", "60", "--interval-ms", "1",
                              "--burst", "6"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \|$", out, re.M))
    for name in ("all, watch events included", "read-through (header unknown)", "claim (lease + transaction)",
                 "turn 1 record", "turn 2 record"):
        assert float(rows[name]) > 0, name
    labels = "one at a time|bursts of 6|`Residency.apply_envelope` alone"
    applied = re.findall(rf"^\| ({labels}) \| (\d+) \| ([\d.]+) \|$", out, re.M)
    assert [(label, int(n)) for label, n, _ in applied] == [
        ("one at a time", 60), ("bursts of 6", 60), ("`Residency.apply_envelope` alone", 60)]
    assert all(float(us) > 0 for _, _, us in applied)


def test_router_state_rejects_a_non_positive_count(capsys):
    with pytest.raises(SystemExit) as exit_:
        router_state.main(["--messages", "0"])
    assert exit_.value.code == 2
    assert "--messages" in capsys.readouterr().err
