"""Several routers on the same cluster and conversations: one simulation while they choose alike.

`sim compare` runs a dozen policies on every point, and at many points several of them make
exactly the same decisions (PPD at w_tpot 1, 3 and 6; Dynamo's two disaggregation rules below
their thresholds; every follow-up decode-local and a rule that finds no reason to send one to a
prefill worker). A simulation is deterministic given its decisions, so routers that decide alike
get the same result, and one run can stand for all of them.

`simulate_shared` runs the first router (the lead) and, at each of its decisions, asks every
other one (the followers) the same question on the same view. A follower that chooses otherwise
drops out; those that dropped out run again from the start, the first of them leading. A
follower that never differed gets the lead's result: the one it would have got alone, since it
was asked the same questions at the same moments of the same simulation and told of the same
finished turns (`on_finish`). A router's reads of the view cut decode runs short
(`Cluster.touch`), which by design changes no event's time, so the questions the others ask
change nothing either; `tests/test_shared_run.py` checks the results against runs alone.

What it costs: each follower is asked at every decision until it differs, and one that differs
late has been asked for most of a run before its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .assignment import Assignment, SimRequestFeatures
from .cluster import ClusterView, Router
from .run import RequestRecord, SimResult


@dataclass
class SharedRun:
    """One simulation and the routers it stands for (the lead first)."""

    routers: list[str]
    result: SimResult


class _Lockstep:
    """A router that runs ``lead``'s decisions and checks each follower's against them."""

    def __init__(self, lead: Router, followers: dict[str, Router]):
        self.lead = lead
        self.followers = followers  # name -> router, those that have chosen alike so far
        self.dropped: list[str] = []

    def __call__(self, features: SimRequestFeatures, view: ClusterView) -> Assignment:
        chosen = self.lead(features, view)
        for name, router in list(self.followers.items()):
            if router(features, view) != chosen:
                del self.followers[name]
                self.dropped.append(name)
        return chosen

    def on_finish(self, record: RequestRecord) -> None:
        for router in (self.lead, *self.followers.values()):
            hook = getattr(router, "on_finish", None)
            if hook is not None:
                hook(record)


def simulate_shared(run: Callable[[Router], SimResult],
                    routers: Sequence[tuple[str, Callable[[], Router]]]) -> list[SharedRun]:
    """Every named router's result, from as few runs as their decisions allow.

    ``run(router)`` simulates the point once on a fresh cluster (the same conversations, seed and
    cluster each time) and passes ``router.on_finish`` to `simulate`; ``routers`` are (name, a
    factory of a fresh router), the lead of each run taken in this order. Returns the runs in
    the order they ran; together they name every router once."""
    names = [name for name, _ in routers]
    if len(set(names)) != len(names):
        raise ValueError(f"router names must be unique, not {names}")
    factories = dict(routers)
    pending = names
    runs: list[SharedRun] = []
    while pending:
        lead, *rest = pending
        lockstep = _Lockstep(factories[lead](), {name: factories[name]() for name in rest})
        result = run(lockstep)
        runs.append(SharedRun([lead, *lockstep.followers], result))
        pending = [name for name in rest if name in lockstep.dropped]  # in the order asked
    return runs
