"""docs/router.md lists every metric the picker, the relay router and the gateway export."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_ppd.gateway.metrics import GatewayMetrics
from dynamo_ppd.picker.metrics import PickerMetrics
from dynamo_ppd.routing.metrics import RoutingMetrics

pytestmark = pytest.mark.unit

DOC = Path(__file__).parent.parent / "docs" / "router.md"


def test_router_md_lists_every_metric():
    routing = RoutingMetrics()
    PickerMetrics(routing)
    names = set()
    for registry in (routing.registry, GatewayMetrics().registry):
        for family in registry.collect():
            if family.name.startswith(("process_", "python_")):
                continue
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    text = DOC.read_text()
    missing = sorted(name for name in names if f"`{name}`" not in text and f"`{name}{{" not in text)
    assert not missing, f"docs/router.md does not list {missing}"
    assert len(names) > 40
