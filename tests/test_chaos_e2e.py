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
