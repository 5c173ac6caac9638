"""The router follows the live P:D configuration (`Routing._select_table`): workers that come and
go switch the table (or the profile's predictions) that decides turns, and say so in a metric."""

from __future__ import annotations

import pytest

from dynamo_ppd.policy.table import bundled_table
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.metrics import RoutingMetrics
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.routing.state import Routing


def _routing(*flags: str) -> Routing:
    config = parse_args(["--etcd-url", "http://127.0.0.1:9", *flags])
    return Routing(None, config, build_policy(config), RoutingMetrics())


def _current(routing: Routing) -> list[tuple[str, str]]:
    return [(s.labels["configuration"], s.labels["basis"])
            for s in routing.metrics.configuration.collect()[0].samples if s.value == 1]


@pytest.mark.unit
def test_with_shipped_tables_a_ratio_change_switches_to_the_new_ratios_table():
    routing = _routing("--table", "auto")
    routing._select_table(1, 3)
    assert routing.decision_basis == bundled_table("1P3D").name and routing.policy.table is not None
    assert _current(routing) == [("1P3D", bundled_table("1P3D").name)]
    routing._select_table(2, 2)  # a decode worker left, a prefill worker joined
    assert routing.decision_basis == bundled_table("2P2D").name
    assert routing.policy.table is not None and routing.policy.table.config == "2P2D"
    assert _current(routing) == [("2P2D", bundled_table("2P2D").name)]  # the old one reads 0
    routing._select_table(1, 2)  # no table ships for 1P2D: the profile's predictions
    assert routing.decision_basis == "profile" and routing.policy.table is None
    assert _current(routing) == [("1P2D", "profile")]


@pytest.mark.unit
def test_the_default_decision_reports_each_configuration_it_decides_in():
    routing = _routing()  # --table none: the cost model, fed the live workers
    routing._select_table(1, 3)
    routing._select_table(1, 4)
    assert routing.decision_basis == "profile" and routing.policy.table is None
    assert _current(routing) == [("1P4D", "profile")]
