"""The paper's measured points: the bundled CSV loads and validates, bad files are named by line
and column, and the decode-local share the data implies is the documented one."""

from __future__ import annotations

import pytest

from dynamo_ppd.paper import measured as pdata
from dynamo_ppd.workloads.generators import PAPER_QPS, PAPER_WORKLOADS

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def points() -> list[pdata.PaperPoint]:
    return pdata.bundled_points()


def test_bundled_data_is_the_papers_grid(points):
    assert len(points) == 12 * 18 * 10
    configs = {p.config for p in points}
    assert {"1P_3D", "1P_3pD", "3P_1D", "3P_1pD", "4R"} <= configs and "2P_2D" not in configs
    for config in configs:
        mine = [p for p in points if p.config == config]
        assert {p.workload for p in mine} == set(PAPER_WORKLOADS) and {p.qps for p in mine} == set(PAPER_QPS)
    p = pdata.by_key(points)[("1P_3D", "small_tiny", 0.5)]
    assert p.success_rate == 100 and 50 < p.turn2.avg_ttft_ms < 200 and 5 < p.turn2.avg_tpot_ms < 15
    crashed = [p for p in points if p.config == "1P_3D" and p.success_rate == 0]
    assert crashed and all(p.crashed and not p.completed for p in crashed)


def test_config_names_are_the_simulators_one_parser():
    from dynamo_ppd.sim.routing import PaperConfig, parse_paper_config

    assert pdata.parse_paper_config is parse_paper_config  # one parser for data and simulation
    assert parse_paper_config("4R") == PaperConfig("4R", 0, 0, 0, 4)
    assert parse_paper_config("1R_1P_1D_1pD") == PaperConfig("1R_1P_1D_1pD", 1, 1, 1, 1)
    for bad in ("3D_1P", "1P_1P", "0P_4D", "1X", "", "1P3D"):
        with pytest.raises(ValueError, match="config"):
            parse_paper_config(bad)


@pytest.mark.parametrize("column, value, expected", [
    ("qps", "fast", "qps: 'fast' is not a number"),
    ("qps", "0", "qps: Expected float > 0"),
    ("success_rate", "101", "success_rate: Expected float <= 100"),
    ("turn2_count", "2.5", "turn2_count: '2.5' is not a whole number"),
    ("turn1_avg_ttft_ms", "-1", "turn1_avg_ttft_ms: Expected float >= 0"),
    ("workload", "small_nothing", "workload: 'small_nothing' is not one of the paper's 18"),
    ("config", "3D_1P", "config: config '3D_1P' is not like the paper's 1P_3D"),
    ("failed", "99", "failed: 99 > total_requests"),
])
def test_bad_rows_are_named_by_line_and_column(column, value, expected):
    lines = pdata.BUNDLED_CSV.read_text().splitlines()[:3]
    header = lines[0].split(",")
    cells = lines[2].split(",")
    cells[header.index(column)] = value
    text = "\n".join([lines[0], lines[1], ",".join(cells)]) + "\n"
    with pytest.raises(pdata.PaperDataError) as err:
        pdata.parse_points(text, source="p.csv")
    assert str(err.value).startswith(f"p.csv line 3: {expected}"), str(err.value)


def test_missing_columns_and_duplicates():
    lines = pdata.BUNDLED_CSV.read_text().splitlines()
    with pytest.raises(pdata.PaperDataError, match="missing columns: tokens_per_sec"):
        pdata.parse_points(lines[0].rsplit(",", 1)[0] + "\n", source="p.csv")
    with pytest.raises(pdata.PaperDataError, match="line 3: duplicate point"):
        pdata.parse_points("\n".join([lines[0], lines[1], lines[1]]), source="p.csv")


def test_measured_local_share_of_1p3d(points):
    shares = [pdata.measured_local_share(points, "1P_3D", (1, w)) for w in (1, 3, 6, 12)]
    assert [round(100 * s.share, 1) for s in shares] == [98.9, 98.9, 96.7, 92.2]
    assert all(s.points == 180 and s.one_side_failed == 30 and s.excluded == 0 for s in shares)
    excluded = pdata.measured_local_share(points, ("1P_3D", "1P_3pD"), (1, 12), one_side_failed="exclude")
    assert excluded.points == 150 and excluded.excluded == 30 and round(100 * excluded.share, 1) == 90.7
    # Falls with w_tpot in every family the data has.
    for family in pdata.MEASURED_FAMILIES:
        values = [pdata.measured_local_share(points, family, (1, w)).share for w in (1, 3, 6, 12)]
        assert values == sorted(values, reverse=True), family
    with pytest.raises(ValueError, match="unknown family"):
        pdata.measured_local_share(points, "2P_2D", (1, 1))


def test_paper_score_sign(points):
    index = pdata.by_key(points)
    x0, x1 = index[("1P_3D", "small_tiny", 1.0)], index[("1P_3pD", "small_tiny", 1.0)]
    assert x1.turn2.avg_ttft_ms < x0.turn2.avg_ttft_ms and pdata.paper_score(x0, x1, 1, 0) > 0
    assert pdata.paper_score(x0, x1, 0, 1) == pytest.approx(
        -(x1.turn2.avg_tpot_ms - x0.turn2.avg_tpot_ms) / x0.turn2.avg_tpot_ms)
    crashed = index[("1P_3D", "large_huge_paste", 1.0)]
    with pytest.raises(ValueError, match="no turn-2"):
        pdata.paper_score(crashed, index[("1P_3pD", "large_huge_paste", 1.0)], 1, 1)
