"""`just reproduce` on the paper's workloads: a simulated point comes out in the measured data's
columns, wins are counted with ties shared, and bad options are one-line errors."""

from __future__ import annotations

import pytest

from dynamo_ppd.paper import measured as pdata
from dynamo_ppd.paper import reproduce as rep

pytestmark = pytest.mark.unit


def test_a_point_is_the_papers_protocol_in_the_datas_columns():
    x0 = rep.run(rep.Spec("h100-llama3.1-8b", "1P3D", "x0", "small_mid_bal", 2.0))
    x1 = rep.run(rep.Spec("h100-llama3.1-8b", "1P3D", "x1", "small_mid_bal", 2.0))
    for result, share in ((x0, 0.0), (x1, 1.0)):
        p = result.point
        assert isinstance(p, pdata.PaperPoint) and p.workload == "small_mid_bal" and p.qps == 2.0
        # 2 turns per conversation, the authors' arrivals: at most 2 conv/s x 10 s conversations.
        assert p.total_requests % 2 == 0 and 0 < p.total_requests <= 2 * 20 and p.success_rate == 100
        assert p.turn1.count == p.turn2.count == p.total_requests // 2 and p.completed
        assert result.local_share == share
    assert x1.point.turn2.avg_ttft_ms < x0.point.turn2.avg_ttft_ms  # no re-prefill, no KV transfer
    assert pdata.paper_score(x0.point, x1.point, 1, 1) > 0


def _point(ttft: float, tpot: float, success: float = 100.0) -> pdata.PaperPoint:
    turn = pdata.TurnFigures(1 if ttft else 0, ttft, ttft, ttft, tpot, tpot, tpot, 1.0)
    return pdata.PaperPoint("c", "small_tiny", 1.0, success, 2, 0, 1.0, "", turn, turn, 1.0)


def test_wins_share_ties_and_a_side_without_turn2_loses():
    wins, n = rep.count_wins([
        {"a": _point(100, 8.0), "b": _point(100.2, 9.0)},  # TTFT tie within 0.5%; a's TPOT
        {"a": _point(0, 0, success=0), "b": _point(50, 8.0)},  # a completed nothing: b wins all
    ])
    assert n == 2
    assert wins["a"] == {"turn-2 TTFT": 1, "turn-2 TPOT": 1, "success": 1}
    assert wins["b"] == {"turn-2 TTFT": 2, "turn-2 TPOT": 1, "success": 2}


@pytest.mark.parametrize("argv, message", [
    (["--rates", "3"], "no rate [3.0]"),
    (["--profile", "no-such-profile"], "reproduce: error"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys, tmp_path):
    assert rep.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unknown_workload_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        rep.main(["--workloads", "small_tiny,nope"])
    assert "unknown workloads ['nope']" in capsys.readouterr().err
