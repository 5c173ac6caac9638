"""`dynamo-ppd sim run`: simulate a multi-turn workload on a virtual-clock P/D cluster with a
routing mode, print the outcome (turn 1, turns 2+, all) and the routes taken, and optionally write
every request record as JSON. The simulation itself is `dynamo_ppd.sim.run.simulate`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from ..argtypes import cli_error, positive_seconds
from ..engine import DEFAULT_PROFILE, ProfileError, load_profile
from ..sim.cluster import Cluster
from ..sim.conversation import synthetic_workload
from ..sim.outcome import Outcome
from ..sim.routing import ROUTER_NAMES, RoutingError, make_router
from ..sim.run import SimResult, simulate


def _token_pair(text: str) -> tuple[int, int]:
    try:
        n_in, n_out = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not INPUT,OUTPUT tokens like 1024,128") from None
    if n_in < 1 or n_out < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be at least 1")
    return n_in, n_out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd sim run`."""
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="engine profile: a bundled name or a path to a profile YAML")
    parser.add_argument("--config", default="1P3D",
                        help="workers: counts of Prefill, Decode and Replica (aggregated) workers, "
                        "e.g. 1P3D, 2P2D, 3P1D, 4R")
    parser.add_argument("--router", choices=ROUTER_NAMES, default="pd",
                        help="pd: every turn via a prefill worker (x=0); local: turns 2+ on the "
                        "conversation's decode worker (x=1); fraction: turns 2+ local with probability "
                        "--local-fraction; agg: aggregated workers by longest cached prefix")
    parser.add_argument("--local-fraction", type=float, default=0.5,
                        help="share of turns 2+ run on the decode worker, for --router fraction")
    parser.add_argument("--rate", type=float, default=4.0, help="new conversations per second (Poisson)")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds during which conversations start; the run goes on until all finish")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation")
    parser.add_argument("--first-turn", type=_token_pair, default=(1024, 128), metavar="IN,OUT",
                        help="first turn: user tokens, max output tokens")
    parser.add_argument("--follow-up", type=_token_pair, default=(128, 128), metavar="IN,OUT",
                        help="each later turn: new user tokens, max output tokens")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="seconds between a turn's last token and the user's next message")
    parser.add_argument("--link-bandwidth", type=float, metavar="GB/S",
                        help="KV transfer bandwidth of each prefill worker's link in GB/s (1e9 "
                        "bytes/s); default: the profile's")
    parser.add_argument("--timeout", type=positive_seconds, metavar="SECONDS",
                        help="a turn not answered within this many seconds of being sent fails and its "
                        "conversation sends no further turn (the paper's protocol: 120, the chat "
                        "workloads: 30); default: never give up")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts, tokens and routing")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the settings, summary and every request record to PATH")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_outcome(outcome: Outcome) -> str:
    """The outcome as a small table in milliseconds (latencies over successful requests)."""
    lines = [f"{'turns':<10}{'ok/sent':>10}{'TTFT avg':>10}{'p50':>9}{'p99':>9}{'TPOT avg':>10}"
             f"{'p50':>8}{'p99':>8}{'e2e avg':>10}"]
    for name, g in (("turn 1", outcome.turn1), ("turns 2+", outcome.turn2), ("all", outcome.all_turns)):
        lines.append(f"{name:<10}{f'{g.count}/{g.sent}':>10}{_ms(g.avg_ttft_s):>10}{_ms(g.p50_ttft_s):>9}"
                     f"{_ms(g.p99_ttft_s):>9}{_ms(g.avg_tpot_s):>10}{_ms(g.p50_tpot_s):>8}"
                     f"{_ms(g.p99_tpot_s):>8}{_ms(g.avg_e2e_s):>10}")
    deadline = f"{outcome.timeout_s:g} s timeout" if outcome.timeout_s is not None else "no timeout"
    errors = ", ".join(f"{label} {n}" for label, n in outcome.errors.items())
    lines.append(f"success {outcome.success_rate:.1f}% of {outcome.total_requests} requests ({deadline}); "
                 f"{outcome.failed} failed{f' ({errors})' if errors else ''}")
    lines.append(f"turn-2+ TTFT mean with timeouts {_ms(outcome.turn2_ttft_mean_with_timeouts_s)} ms; "
                 f"{outcome.tokens_per_sec:.0f} output tok/s over {outcome.duration_s:.2f} s")
    return "\n".join(lines)


def format_summary(result: SimResult) -> str:
    """The run's outcome, its routes and how fast it ran."""
    routes = ", ".join(f"{name} {count}" for name, count in sorted(result.route_counts().items()))
    in_flight = f"; {result.unfinished} in flight at the end" if result.unfinished else ""
    return "\n".join([format_outcome(result.outcome()), f"routes: {routes or 'none'}{in_flight}",
                      f"simulated {result.simulated_s:.2f} s in {result.wall_s:.2f} s wall "
                      f"({result.speed():.1f} simulated s per wall s)"])


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd sim run`: 0 on success, 2 with a one-line error for bad settings."""
    try:
        profile = load_profile(args.profile)
        bandwidth = args.link_bandwidth * 1e9 if args.link_bandwidth is not None else None
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError("--link-bandwidth must be positive")
        cluster = Cluster.from_config(profile, args.config, link_bandwidth_bytes_s=bandwidth, seed=args.seed)
        router = make_router(args.router, args.local_fraction, args.seed)
        conversations = synthetic_workload(args.rate, args.duration, args.first_turn, args.follow_up,
                                           args.turns, args.think_time, args.seed)
        result = simulate(cluster, conversations, router, timeout_s=args.timeout)
    except (ProfileError, RoutingError, ValueError) as exc:
        return cli_error(exc)
    print(f"{args.config} router {args.router}, profile {profile.name}: {len(conversations)} conversations "
          f"of {args.turns} turns at {args.rate:g}/s for {args.duration:g} s")
    print(format_summary(result))
    if args.json is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if not callable(v)}
        document = {"settings": settings, "summary": result.summary(), "records": result.records,
                    "in_flight": result.in_flight}
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(document)))
        print(f"wrote {args.json}")
    return 0
