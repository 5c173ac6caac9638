"""The virtual-clock side of `bench compare`: the same manifest through the simulator's version
of each live system, and how many conversations a point needs.

Each live system has its simulated twin (`SIM_POLICY`, the names of `dynamo-ppd sim compare`):
frontend-native PD is ``x0``, Dynamo's conditional disaggregation with our graph's thresholds is
``dynamo-isl-or-load-ours``, our router in ppd mode is ``ppd@1`` (the shipped table, weights 1,1,
online correction), ``local`` is ``x1``, ``agg`` Dynamo's KV router over replicas. A point is
simulated on a fresh cluster of the same profile and P:D split, with the live client's timeout,
cut at the same horizon (turns running then are left out on both sides).

Sizing: the live point should be big enough that its turn-2+ TTFT median's 95% interval is
within +-10%. The simulator is cheap and close to the live system (that is checked per point),
so a pilot of ``conversations`` is simulated for every system, the count scaled by
(half-width / 10%)^2 for the widest, and simulated again; the live run then plays that many.
Capped by ``max_conversations`` and by a wall-clock budget per point (a dilated point takes N
times its model duration); a point that could not be sized says so in its note.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import msgspec

from .. import model
from ..engine.profile import DEFAULT_PROFILE, load_profile
from ..experiment import stats as bs
from ..sim.cluster import Cluster
from ..sim.outcome import CHAT_TIMEOUT_S, Outcome, TurnResult, summarize
from ..sim.run import simulate
from ..workloads.manifest import Manifest, to_sim
from .results import Sample, by_conversation

SIM_POLICY = {"pd": "x0", "cond-disagg": "dynamo-isl-or-load-ours", "ppd": "ppd@1", "local": "x1",
              "agg": "replicas"}
# The relay router's systems decide as the endpoint picker's do: one twin each.
SAME_TWIN = {"ppd-relay": "ppd", "local-relay": "local"}
NO_HORIZON_S = 3600.0  # a run without a horizon still stops here (model seconds)
SIZING_ROUNDS = 3


class SimPoint(msgspec.Struct, frozen=True):
    samples: list[Sample]
    outcome: Outcome
    simulated_s: float  # the virtual clock when the run ended
    cut: int
    routes: dict[str, int] = {}  # finished requests by route (`bench.routes`)


def sim_router(profile, config: str, system: str, seed: int = 0):
    """(the simulator's worker counts, the router) of ``system``'s twin. ppd as the live router's
    default (``--table none``: the cost model, learning from outcomes)."""
    from ..policy.decision import Mode, Policy, PolicyConfig, ProfilePredictor
    from ..policy.simulate import PolicyRouter
    from ..studies.policies import router_for

    system = SAME_TWIN.get(system, system)
    if system == "ppd":
        return config, PolicyRouter(Policy(PolicyConfig(Mode.PPD, w_ttft=1.0, w_tpot=1.0),
                                           ProfilePredictor(profile)))
    return router_for(profile, config, SIM_POLICY[system], seed)


@functools.cache
def live_template():  # -> sim.conversation.ChatTemplate
    """The local model's chat template, as the live graphs' frontend renders it (the model
    directory is made if missing, as the graphs make it)."""
    return model.chat_template_tokens(model.ensure_model_dir())


def simulate_manifest(system: str, config: str, manifest: Manifest, horizon_s: float | None,
                      seed: int = 0, profile: str = DEFAULT_PROFILE) -> SimPoint:
    """The manifest through ``system``'s simulated twin on ``config``, cut at ``horizon_s``. Its
    prompts carry the live model's chat template tokens (`live_template`): ~17 a turn here,
    where the simulator's own template adds 5, and a longer context makes every decode iteration
    a little longer (docs/bench/dilation.md, "Why ppd runs slower than its twin")."""
    prof = load_profile(profile)
    cluster_config, router = sim_router(prof, config, system, seed)
    cluster = Cluster.from_config(prof, cluster_config, seed=seed)
    until = horizon_s if horizon_s is not None else NO_HORIZON_S
    conversations = to_sim(manifest, template=live_template())
    result = simulate(cluster, conversations, router, until_s=until, timeout_s=CHAT_TIMEOUT_S,
                      on_finish=getattr(router, "on_finish", None))
    turns: list[TurnResult] = [r.turn_result() for r in result.records]
    # In flight at the end: given up at its deadline before the cut (a failure), else cut.
    timed_out = [t for t in result.in_flight if t.arrival_s + CHAT_TIMEOUT_S <= result.simulated_s]
    turns += [t.turn_result() for t in timed_out]
    samples = [Sample(r.conversation_id, r.turn, r.ttft_s, r.tpot_s) for r in result.records
               if r.finished_s - r.arrival_s <= CHAT_TIMEOUT_S]
    return SimPoint(samples, summarize(turns, CHAT_TIMEOUT_S), result.simulated_s,
                    len(result.in_flight) - len(timed_out), result.route_counts())


def first(manifest: Manifest, conversations: int) -> Manifest:
    """The manifest's first ``conversations`` conversations (by arrival)."""
    return Manifest(manifest.header, manifest.conversations[:conversations])


def horizon(manifest: Manifest, cut_after_s: float | None) -> float | None:
    """``cut_after_s`` after the last arrival (None: no horizon)."""
    if cut_after_s is None or not manifest.conversations:
        return None
    return manifest.conversations[-1].arrival_s + cut_after_s


@dataclass
class Sized:
    manifest: Manifest
    horizon_s: float | None
    sims: dict[str, SimPoint]  # system -> its simulation at this size
    note: str


def budget_conversations(base: Manifest, dilation: float, cut_after_s: float | None,
                         budget_s: float | None) -> int:
    """The most conversations whose point fits ``budget_s`` wall seconds: their arrivals plus
    the cut, times the dilation (without a horizon the run's tail is unknown: no cap)."""
    convs = base.conversations
    if budget_s is None or cut_after_s is None:
        return len(convs)
    last_arrival = budget_s / dilation - cut_after_s
    return sum(c.arrival_s <= last_arrival for c in convs)


def size_point(systems: list[str], config: str, base: Manifest, conversations: int, dilation: float,
               cut_after_s: float | None, budget_s: float | None, seed: int = 0,
               target: float = bs.TARGET_HALF_WIDTH, log=lambda _m: None) -> Sized:
    """The first n conversations of ``base`` such that every system's simulated turn-2+ TTFT
    median is within +-``target`` (starting from ``conversations``), within the caps."""
    cap = min(len(base.conversations), budget_conversations(base, dilation, cut_after_s, budget_s))
    n = max(1, min(conversations, cap))
    note = ""
    for round_ in range(SIZING_ROUNDS):
        manifest = first(base, n)
        h = horizon(manifest, cut_after_s)
        sims = {s: simulate_manifest(s, config, manifest, h, seed) for s in systems}
        widths = {s: bs.bootstrap(by_conversation(p.samples, "turn2_ttft"), resamples=500)
                  for s, p in sims.items()}
        needed = max(bs.conversations_needed(n, iv, target) for iv in widths.values())
        shown = ", ".join(f"{s} {'-' if iv is None else f'{iv.half_width * 100:.1f}%'}"
                          for s, iv in widths.items())
        log(f"  sizing round {round_ + 1}: {n} conversations -> turn-2+ TTFT CI +- {shown} "
            f"(virtual clock); needs {needed}")
        if needed <= n:
            return Sized(manifest, h, sims, "")
        if n >= cap:
            why = ("the wall-clock budget per point" if cap < len(base.conversations)
                   and cap < min(len(base.conversations), needed) else "--max-conversations")
            note = (f"sized {n} conversations, the most {why} allows; the simulation says "
                    f"{needed} for +-{target * 100:.0f}%")
            return Sized(manifest, h, sims, note)
        n = min(cap, max(needed, math.ceil(n * 1.25)))
    manifest = first(base, n)
    h = horizon(manifest, cut_after_s)
    return Sized(manifest, h, {s: simulate_manifest(s, config, manifest, h, seed) for s in systems}, note)
