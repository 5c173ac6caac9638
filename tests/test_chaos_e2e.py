"""`dynamo-ppd chaos` end to end, short: a decode worker SIGKILLed under a WildChat-like load on a
supervised ppd graph (1P2D: the endpoint picker in front of Dynamo's frontend). Fails when any
request fails or any stream is cut (Dynamo's migration must carry the killed worker's answers
over), or when the kill hit no answer at all (vacuous run)."""

from __future__ import annotations

import json

import pytest

from dynamo_ppd.cli import main

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_chaos_decode_kill_smoke(model_dir, tmp_path):
    out = tmp_path / "chaos"
    code = main(["chaos", "--faults", "decode-kill", "--replicas", "decode=2", "--qps", "3",
                 "--duration", "24", "--fault-at", "12", "--window", "10", "--recovery-window", "5",
                 "--out", str(out), "--run-root", str(tmp_path / "runs"), "--records"])
    report = json.loads(out.with_suffix(".json").read_text())
    (result,) = report["results"]
    assert result["kind"] == "decode-kill" and result["graph"] == "1P2D"
    assert result["target"] in ("decode-0", "decode-1") and result["back_after_s"] is not None
    assert result["target_inflight"] >= 1, "the kill hit no answer in flight: nothing was tested"
    assert result["requests"] >= 30 and result["follow_ups_before"] > 0 and result["follow_ups_after"] > 0
    assert (result["failed"], result["truncated"]) == (0, 0), result["errors"]
    assert code == 0
    assert "| decode-kill | 1P2D |" in out.with_suffix(".md").read_text()
    records = json.loads((tmp_path / "chaos-records.json").read_text())["decode-kill"]
    assert len(records) == result["requests"]


@pytest.mark.slow
def test_chaos_ratio_change_smoke(model_dir, tmp_path):
    """1P3D to 2P2D and back under load: a decode worker drained, a prefill worker added, that one
    drained, a decode worker added. Nothing fails, every step is done, and the picker decides in
    each new configuration within seconds of it."""
    out = tmp_path / "chaos"
    code = main(["chaos", "--faults", "ratio-change", "--qps", "3", "--duration", "36", "--fault-at", "8",
                 "--hold", "6", "--window", "6", "--recovery-window", "4", "--out", str(out),
                 "--run-root", str(tmp_path / "runs")])
    report = json.loads(out.with_suffix(".json").read_text())
    (result,) = report["results"]
    assert result["graph"] == "1P3D" and (result["failed"], result["truncated"]) == (0, 0), result["errors"]
    steps = result["steps"]
    assert [(s["action"], s["configuration"]) for s in steps] == [
        ("retire", "1P2D"), ("add", "2P2D"), ("retire", "1P2D"), ("add", "1P3D")]
    assert all(s["done_s"] is not None for s in steps), steps
    # Each configuration the change leaves the graph in is decided in within seconds (the 1P2D
    # between a retirement and the next addition lasts about a second: it may see no turn).
    added = [s for s in steps if s["action"] == "add"]
    assert all(s["seen_s"] is not None and s["seen_s"] - s["done_s"] < 10 for s in added), steps
    assert [c for _, c, _ in result["configurations"]][-1] == "1P3D"
    assert result["follow_ups_during"] > 0 and result["follow_ups_since"] > 0
    assert code == 0
