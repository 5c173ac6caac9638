"""`dynamo-ppd sim paper` and `sim fidelity`: the authors' protocol on the simulated cluster, in
their CSV's columns, compared with their measurements."""

from __future__ import annotations

import json

import msgspec
import pytest

from dynamo_ppd.cli import main as cli_main
from dynamo_ppd.engine import load_profile
from dynamo_ppd.paper import fidelity
from dynamo_ppd.paper import protocol as paper
from dynamo_ppd.paper.measured import COLUMNS, bundled_points, by_key, parse_points

pytestmark = pytest.mark.unit

PROFILE = load_profile(paper.PAPER_PROFILE)


def test_sim_paper_writes_the_measured_csv_columns_and_follows_the_protocol(tmp_path):
    out = tmp_path / "points.csv"
    assert cli_main(["sim", "paper", "--config", "1P_2D_1pD", "--workloads", "small_tiny,large_mid_bal",
                     "--qps", "0.5,4", "--jobs", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.splitlines()[0].split(",") == list(COLUMNS)
    points = parse_points(text)
    assert [(p.workload, p.qps) for p in points] == [
        ("small_tiny", 0.5), ("small_tiny", 4.0), ("large_mid_bal", 0.5), ("large_mid_bal", 4.0)]
    measured = by_key(bundled_points())
    for point in points:
        twin = measured[("1P_2D_1pD", point.workload, point.qps)]
        # Same arrival process as the authors': int(qps*10) draws inside 10 s, two turns each.
        assert point.total_requests <= 2 * int(point.qps * 10)
        assert point.success_rate == 100.0 and point.turn2.count == point.total_requests // 2
        # The paper stack's fixed costs put a low-load PD turn 1 near the measured ~100-150 ms.
        assert 0.5 * twin.turn1.avg_ttft_ms < point.turn1.avg_ttft_ms < 2 * twin.turn1.avg_ttft_ms


def test_bad_paper_settings_exit_2_with_one_line(capsys, tmp_path):
    assert cli_main(["sim", "paper", "--config", "1P3D", "--out", str(tmp_path / "x.csv")]) == 2
    assert "1P_3D" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["sim", "paper", "--config", "1P_3D", "--workloads", "small_nope", "--out", "x.csv"])
    assert "unknown workload 'small_nope'" in capsys.readouterr().err


def test_fidelity_of_the_measurements_against_themselves_is_perfect():
    measured = bundled_points()
    same = [p for p in measured if p.config in ("1P_3D", "1P_3pD")]
    index = by_key(measured)
    for config in ("1P_3D", "1P_3pD"):
        report = fidelity.compare_config(config, [p for p in same if p.config == config], index)
        assert report.ttft.median_rel_error == 0.0 and report.tpot.p90_rel_error == 0.0
        assert report.success_agreement == 1.0 and report.ttft.spearman == pytest.approx(1.0)
        assert report.points == 180 and report.success_points == 180 - report.crashed
    shares = fidelity.local_shares(same, measured)
    assert [s.w_tpot for s in shares] == [1, 3, 6, 12]
    assert all(s.simulated == s.measured for s in shares)
    assert [round(100 * s.measured) for s in shares] == [99, 99, 97, 92]  # the data's own figures


def test_fidelity_counts_errors_and_disagreements(tmp_path):
    measured = bundled_points()
    index = by_key(measured)
    pick = [p for p in measured if p.config == "4R" and p.workload == "small_mid_bal"]
    doubled = [msgspec.structs.replace(p, turn2=msgspec.structs.replace(
        p.turn2, avg_ttft_ms=2 * p.turn2.avg_ttft_ms)) for p in pick]
    doubled[0] = msgspec.structs.replace(doubled[0], success_rate=50.0)  # one disagreement of ten
    report = fidelity.compare_config("4R", doubled, index)
    assert report.ttft.median_rel_error == pytest.approx(1.0) and report.tpot.median_rel_error == 0.0
    assert report.success_agreement == pytest.approx(0.9)
    # The CLI compares a points file without simulating, and writes the report.
    points = tmp_path / "sim.csv"
    points.write_text(paper.points_csv(doubled))
    prefix = tmp_path / "fid"
    assert cli_main(["sim", "fidelity", "--points", str(points), "--out", str(prefix)]) == 0
    saved = json.loads((tmp_path / "fid.json").read_text())
    first = saved["configs"][0]
    assert first["config"] == "4R" and first["success_agreement"] == pytest.approx(0.9)
    assert (tmp_path / "fid.png").stat().st_size > 10_000 and "| 4R |" in (tmp_path / "fid.md").read_text()


def test_each_fitted_constant_reports_its_residual_on_its_own_points():
    measured = bundled_points()
    index = by_key(measured)
    five = [p for p in measured if p.config in fidelity.DONE_CONFIGS]
    rows = fidelity._residual_rows(five, index, PROFILE)
    assert {r.constant for r in rows} >= {"stack.request_overhead_s", "stack.handoff_overhead_s",
                                          "cost.gemm_flops_efficiency", "cost.per_sequence_overhead_s"}
    assert all(r.points > 0 and r.median_residual == 0.0 for r in rows)  # the data against itself
    shifted = [msgspec.structs.replace(p, turn1=msgspec.structs.replace(
        p.turn1, avg_ttft_ms=p.turn1.avg_ttft_ms - 5)) for p in five]
    request = next(r for r in fidelity._residual_rows(shifted, index, PROFILE)
                   if r.constant == "stack.request_overhead_s")
    assert request.median_residual == pytest.approx(5.0) and request.value == PROFILE.stack.request_overhead_s
