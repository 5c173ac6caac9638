"""Shared runs (`dynamo_ppd.sim.shared_run`) and the simulator's speed-ups must not move a result.

`tests/data/sim_compare_7548310.json` holds `sim compare`'s figures for every policy at four
points (grid and sweep workloads, all three configurations, both links), each policy simulated
alone, as the code stood before runs were shared and token ids were drawn in C (the ppd@ policies'
figures regenerated the same way, one policy alone, when the decision changed: issue 40). Token ids
and block ids are only identities, so the figures must come out exactly the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from dynamo_ppd.engine.profile import DEFAULT_PROFILE, load_profile
from dynamo_ppd.paper.protocol import simulate_point
from dynamo_ppd.sim.routing import local_router, pd_router
from dynamo_ppd.sim.shared_run import simulate_shared
from dynamo_ppd.studies.policies import CompareSpec, policy_names, run_specs
from dynamo_ppd.workloads.generators import paper_workload

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "data" / "sim_compare_7548310.json"


def _points() -> dict[tuple, list[dict]]:
    by_point: dict[tuple, list[dict]] = {}
    for p in json.loads(GOLDEN.read_text())["points"]:
        by_point.setdefault((p["config"], p["link"], p["workload"], p["rate"]), []).append(p)
    return by_point


@pytest.mark.parametrize("point", list(_points()), ids=lambda p: "-".join(map(str, p)))
def test_every_policy_gets_at_a_point_what_it_got_alone_before(point):
    config, link, workload, rate = point
    expected = _points()[point]
    assert [p["policy"] for p in expected] == policy_names()
    got = run_specs([CompareSpec(DEFAULT_PROFILE, config, link, workload, rate, p) for p in policy_names()])
    for before, now in zip(expected, got, strict=True):
        figures = msgspec.to_builtins(now)
        figures.pop("sim_cpu_s")
        assert figures == before, f"{now.policy} at {point} moved"


def test_policies_that_decide_alike_share_a_run_and_the_others_run_again():
    """At a light point several policies decide alike: fewer simulations than policies, each
    run's CPU time on its lead alone."""
    got = run_specs([CompareSpec(DEFAULT_PROFILE, "1P3D", "cross-node", "small_big_paste", 4.0, p)
                     for p in policy_names()])
    leads = [p.policy for p in got if p.sim_cpu_s > 0]
    assert "x0" in leads and "x1" in leads  # they differ on every follow-up
    assert len(leads) < len(got)


def test_a_follower_that_differs_drops_out_and_leads_its_own_run():
    profile = load_profile()
    conversations = paper_workload("small_tiny", 2.0, 0)

    def run(router):
        return simulate_point(profile, "1P3D", router, conversations, 120.0)

    runs = simulate_shared(run, [("pd", lambda: pd_router), ("local", lambda: local_router),
                                 ("pd-again", lambda: pd_router)])
    assert [r.routers for r in runs] == [["pd", "pd-again"], ["local"]]
    alone = run(local_router)
    assert [r.ttft_s for r in runs[1].result.records] == [r.ttft_s for r in alone.records]
    assert runs[0].result.local_share() == 0.0 and runs[1].result.local_share() == 1.0
    with pytest.raises(ValueError, match="unique"):
        simulate_shared(run, [("pd", lambda: pd_router), ("pd", lambda: pd_router)])
