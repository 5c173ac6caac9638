"""Does the online correction earn its keep? `dynamo-ppd table evaluate TABLE`.

Runs, on the table's P:D configuration in the simulation, scenarios the table was not built on,
each under x=0 (every follow-up via prefill), x=1 (every follow-up decode-local), the pure table
and the table with online correction, and reports each route's weighted score against x=0 (the
paper's S on the run's mean follow-up TTFT and mean TPOT; x=0 scores 0 by definition):

- ``drift``: conversations unlike the grid's representatives (contexts between classes, follow-ups
  of varied sizes, four turns).
- ``hot-decode``: the same, while one decode worker is loaded by long-running background decodes
  that start after conversations were placed on it (a hot node the table cannot know about).
- ``prefill-drift``: long first turns and prefill-heavy follow-ups at a higher rate: the prefill
  worker is far busier than in the table's calibration workload.
- ``slow-link``: the drift conversations over a 10x slower KV link than the table was built with.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.profile import load_profile
from ..engine.scheduler import EngineRequest
from ..policy.decision import Mode, Policy, PolicyConfig, ProfilePredictor
from ..policy.score import Prediction, score
from ..policy.simulate import policy_router
from ..policy.table import PpdTable
from ..sim import Cluster, Conversation, Turn, simulate
from ..sim.outcome import CHAT_TIMEOUT_S
from ..sim.routing import local_router, pd_router

MARGIN = 0.05  # the stated margin: online never worse than the better static route by more than this


@dataclass(frozen=True)
class RouteFigures:
    """One route's run, scored as the tables are: follow-up TTFT mean with each failed follow-up
    counted at the timeout, TPOT mean over successful requests (`dynamo_ppd.sim.outcome`)."""

    follow_up_ttft_s: float
    tpot_s: float
    local_share: float  # of finished follow-ups


def _poisson_conversations(rate: float, seconds: float, seed: int,
                           turns: Callable[[random.Random], list[Turn]]) -> list[Conversation]:
    """Conversations arriving as a Poisson process of ``rate`` for ``seconds``, each with the turns
    ``turns`` draws (from the same generator, between arrival gaps)."""
    rng = random.Random(seed)
    conversations: list[Conversation] = []
    t = rng.expovariate(rate)
    while t < seconds:
        conversations.append(Conversation(f"c{len(conversations):04d}", t, turns(rng), seed=seed))
        t += rng.expovariate(rate)
    return conversations


def drifted_workload(rate: float, seconds: float, seed: int) -> list[Conversation]:
    def turns(rng: random.Random) -> list[Turn]:
        first = Turn(rng.randint(900, 3500), rng.choice([64, 128, 300]))
        return [first, *(Turn(int(rng.lognormvariate(4.6, 0.9)) + 8, int(rng.lognormvariate(5.0, 0.6)) + 8,
                              think_time_s=rng.uniform(0.2, 1.0)) for _ in range(3))]

    return _poisson_conversations(rate, seconds, seed, turns)


def prefill_heavy_workload(rate: float, seconds: float, seed: int) -> list[Conversation]:
    """Long first turns and prefill-heavy follow-ups: the prefill worker is busier than in the
    table's two-turn calibration workload."""
    def turns(rng: random.Random) -> list[Turn]:
        first = Turn(rng.randint(3000, 7000), rng.choice([32, 64]))
        return [first, *(Turn(rng.randint(600, 1500), rng.choice([32, 64]),
                              think_time_s=rng.uniform(0.1, 0.5)) for _ in range(2))]

    return _poisson_conversations(rate, seconds, seed, turns)


def _hot_decode(cluster: Cluster, start_s: float, sequences: int = 64, context: int = 3000,
                output: int = 1500) -> None:
    """Long decodes land at ``start_s`` on the decode worker that holds the most conversations
    then (its TPOT goes from ~7 ms to ~15 ms; they fit its KV cache, so it stays up, just slow):
    the node whose heat a router must notice, wherever its placement put the sessions."""
    rng = random.Random(7)

    def load() -> None:
        homes = list(cluster.sessions.values())
        worker = max(cluster.view.decode_workers, key=lambda w: (homes.count(w), w))
        for i in range(sequences):
            prompt = [rng.randrange(2000, 8000) for _ in range(context)]
            cluster.submit_background(worker, EngineRequest(f"background-{i}", prompt, output))

    cluster.call_at(start_s, load)


def run(table: PpdTable, scenario: str, router: Callable, seconds: float, seed: int,
        timeout_s: float = CHAT_TIMEOUT_S) -> RouteFigures:
    profile = load_profile(table.profile)
    bandwidth = profile.transfer.link_bandwidth_bytes_s / 10 if scenario == "slow-link" else None
    cluster = Cluster.from_config(profile, table.config, seed=seed, link_bandwidth_bytes_s=bandwidth)
    if scenario == "hot-decode":
        _hot_decode(cluster, start_s=seconds / 4)
    workload = (prefill_heavy_workload(rate=4.0, seconds=seconds, seed=seed) if scenario == "prefill-drift"
                else drifted_workload(rate=3.0, seconds=seconds, seed=seed))
    result = simulate(cluster, workload, router, timeout_s=timeout_s,
                      on_finish=getattr(router, "on_finish", None))
    outcome = result.outcome()
    ttft, tpot = outcome.turn2_ttft_mean_with_timeouts_s, outcome.tpot_mean_s
    return RouteFigures(ttft if ttft is not None else timeout_s, tpot if tpot is not None else timeout_s,
                        result.local_share())


Results = dict[str, dict[str, RouteFigures]]


def compare(table: PpdTable, seconds: float = 20.0, seed: int = 0,
            scenarios: tuple[str, ...] = ("drift", "prefill-drift", "hot-decode", "slow-link")) -> Results:
    predictor = ProfilePredictor(load_profile(table.profile))
    config = PolicyConfig(mode=Mode.PPD, w_ttft=table.weights.w_ttft, w_tpot=table.weights.w_tpot)
    routers: dict[str, Callable[[], Callable]] = {
        "x=0": lambda: pd_router,
        "x=1": lambda: local_router,
        "table": lambda: policy_router(Policy(config, predictor, table, online_correction=False)),
        "table+online": lambda: policy_router(Policy(config, predictor, table, online_correction=True)),
    }
    return {scenario: {name: run(table, scenario, make(), seconds, seed) for name, make in routers.items()}
            for scenario in scenarios}


def weighted(outcome: RouteFigures, base: RouteFigures, table: PpdTable) -> float:
    return score(Prediction(outcome.follow_up_ttft_s, outcome.tpot_s),
                 Prediction(base.follow_up_ttft_s, base.tpot_s), table.weights.w_ttft, table.weights.w_tpot)


def report(table: PpdTable, results: Results) -> str:
    lines = [f"{'scenario':<15}{'route':<14}{'TTFT ms':>9}{'TPOT ms':>9}{'local':>7}{'S vs x=0':>10}"]
    for scenario, outcomes in results.items():
        base = outcomes["x=0"]
        for name, o in outcomes.items():
            lines.append(f"{scenario:<15}{name:<14}{o.follow_up_ttft_s * 1e3:>9.1f}{o.tpot_s * 1e3:>9.2f}"
                         f"{o.local_share:>7.0%}{weighted(o, base, table):>+10.3f}")
        best_static = max(0.0, weighted(outcomes["x=1"], base, table))
        online = weighted(outcomes["table+online"], base, table)
        pure = weighted(outcomes["table"], base, table)
        lines.append(f"{'':<15}online - best static {online - best_static:+.3f} (margin -{MARGIN}), "
                     f"online - pure table {online - pure:+.3f}")
    return "\n".join(lines)


def main(table: PpdTable, seconds: float, seed: int) -> int:
    print(f"evaluating {table.profile} {table.config} (weights {table.weights.w_ttft:g},"
          f"{table.weights.w_tpot:g}), {seconds:g} simulated s per run", flush=True)
    print(report(table, compare(table, seconds, seed)))
    return 0
