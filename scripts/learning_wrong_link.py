"""A profile wrong about the cluster: does PPD's learning correct it, and do its decisions follow?

The issue-40 learning check, on the virtual clock (the same `Policy.observe` the relay router and
the endpoint picker call, `Routing.observe_outcome`): the simulated cluster's prefill workers ship KV
over a link ``--factor`` (4) times slower than the profile says, and PPD decides with the profile.
Per window of ``--window`` follow-ups, pooled over ``--seeds``: the share PPD sent through a prefill
worker, and the error of its mean via-prefill TTFT prediction (sum observed / sum predicted - 1),
corrected (what the decision read) and raw (the profile's cost model alone). ``--factor 1`` is the
control: the same run with the profile right about the link.

    uv run python scripts/learning_wrong_link.py                      # agent-32k, 2P2D, 2 conv/s
    uv run python scripts/learning_wrong_link.py --factor 1           # the control
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynamo_ppd.engine import DEFAULT_PROFILE, load_profile
from dynamo_ppd.policy.decision import Decision, Route
from dynamo_ppd.policy.simulate import ppd_router
from dynamo_ppd.policy.table import Weights
from dynamo_ppd.sim.cluster import Cluster
from dynamo_ppd.sim.outcome import CHAT_TIMEOUT_S
from dynamo_ppd.sim.run import simulate
from dynamo_ppd.workloads.generators import make_workload
from dynamo_ppd.workloads.manifest import to_sim


@dataclass
class Outcome:
    index: int  # the follow-up's place among the outcomes PPD learned from, in finishing order
    decision: Decision
    ttft_s: float


def run(seed: int, args: argparse.Namespace) -> list[Outcome]:
    profile = load_profile(args.profile)
    link = profile.transfer.link_bandwidth_bytes_s / args.factor
    cluster = Cluster.from_config(profile, args.config, link_bandwidth_bytes_s=link, seed=seed)
    router = ppd_router(profile, Weights(*args.weights))
    outcomes: list[Outcome] = []
    observe = router.policy.observe

    def watched(decision: Decision, ttft_s: float, tpot_s: float | None):
        observed = observe(decision, ttft_s, tpot_s)
        if observed is not None:
            outcomes.append(Outcome(len(outcomes), decision, ttft_s))
        return observed

    router.policy.observe = watched  # type: ignore[method-assign]
    conversations = to_sim(make_workload(args.workload, args.qps, args.duration, seed))
    simulate(cluster, conversations, router, timeout_s=CHAT_TIMEOUT_S, on_finish=router.on_finish)
    return outcomes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--factor", type=float, default=4.0, help="the real link is this many times slower")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="engine profile PPD decides with")
    p.add_argument("--config", default="2P2D", help="P:D split")
    p.add_argument("--workload", default="agent-32k", help="named workload")
    p.add_argument("--qps", type=float, default=2.0, help="new conversations per second")
    p.add_argument("--duration", type=float, default=120.0, help="seconds during which conversations start")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, pooled per window")
    p.add_argument("--window", type=int, default=100, help="follow-ups per window")
    p.add_argument("--weights", type=lambda s: tuple(float(x) for x in s.split(",")), default=(1.0, 1.0),
                   help="w_ttft,w_tpot")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [run(seed, args) for seed in seeds]
    print(f"{args.workload} {args.config} {args.qps:g} conv/s, link {args.factor:g}x slower than "
          f"the profile's, seeds {args.seeds}, windows of {args.window} follow-ups per seed")
    print("| follow-ups | via prefill | via TTFT error, corrected | raw (profile) |")
    print("|---|---|---|---|")
    longest = max(len(r) for r in runs)
    for start in range(0, longest, args.window):
        window = [o for r in runs for o in r[start:start + args.window]]
        via = [o for o in window if o.decision.route is Route.VIA_PREFILL]
        if not via:
            print(f"| {start}-{start + args.window} | 0 of {len(window)} | - | - |")
            continue
        observed = sum(o.ttft_s for o in via)
        used = sum(o.decision.via_prefill.ttft_s for o in via if o.decision.via_prefill)
        raw = sum(o.decision.raw.ttft_s for o in via if o.decision.raw)
        print(f"| {start}-{start + args.window} | {len(via)} of {len(window)} ({len(via) / len(window):.0%}) "
              f"| {observed / used - 1:+.0%} | {observed / raw - 1:+.0%} |")


if __name__ == "__main__":
    main()
