"""`dynamo-ppd sim run`: simulate a multi-turn workload (a named one, or a synthetic shape) on a
virtual-clock P/D cluster with one router (the built-in modes, PPD's policy, or a peer's of `sim
compare`), print the outcome (turn 1, turns 2+, all) and the routes taken, and optionally write
every request record as JSON. The simulation itself is `dynamo_ppd.sim.run.simulate`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from ..argtypes import cli_error, positive_float, positive_seconds
from ..engine import DEFAULT_PROFILE, EngineProfile, ProfileError, load_profile
from ..engine.profile import believed_link
from ..policy.simulate import ppd_router
from ..policy.table import TableError, Weights, load_table, parse_weights, shipped_table
from ..sim.assignment import RoutingError
from ..sim.cluster import Cluster, Router, parse_config
from ..sim.conversation import Conversation, synthetic_workload
from ..sim.outcome import CHAT_TIMEOUT_S, PAPER_TIMEOUT_S, Outcome
from ..sim.peers import PEER_ROUTERS
from ..sim.routing import ROUTER_NAMES, make_router
from ..sim.run import SimResult, simulate
from ..workloads.generators import PAPER_WORKLOADS, UnknownWorkload, make_workload
from ..workloads.manifest import to_sim

# The built-in modes, PPD's own policy (`sim.routing` is core and cannot build it: the policy
# package sits beside it), and every peer `sim compare` runs.
SIM_ROUTERS = (*ROUTER_NAMES, "ppd", *PEER_ROUTERS)
# The synthetic workload's shape: (flag, attribute, default); None on the command line means not
# given, so a named workload can refuse them instead of silently ignoring them.
SYNTHETIC_SHAPE = (("--turns", "turns", 2), ("--first-turn", "first_turn", (1024, 128)),
                   ("--follow-up", "follow_up", (128, 128)), ("--think-time", "think_time", 0.0))


def _token_pair(text: str) -> tuple[int, int]:
    try:
        n_in, n_out = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not INPUT,OUTPUT tokens like 1024,128") from None
    if n_in < 1 or n_out < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts must be at least 1")
    return n_in, n_out


def _weights(text: str) -> Weights:
    try:
        return parse_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd sim run`."""
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help="engine profile: a bundled name or a path to a profile YAML")
    parser.add_argument("--config", default="1P3D",
                        help="workers: counts of Prefill, Decode and Replica (aggregated) workers, "
                        "e.g. 1P3D, 2P2D, 3P1D, 4R")
    parser.add_argument("--router", choices=SIM_ROUTERS, default="pd", metavar="ROUTER",
                        help="pd: every turn via a prefill worker (x=0); local: turns 2+ on the "
                        "conversation's decode worker (x=1); fraction: turns 2+ local with probability "
                        "--local-fraction; agg: aggregated workers by longest cached prefix; ppd: the "
                        "PPD policy (--weights, --table) with online correction; or a peer of `sim "
                        f"compare`: {', '.join(PEER_ROUTERS)} (dynamo-kv-agg on replicas: --config 4R)")
    parser.add_argument("--local-fraction", type=float, default=0.5,
                        help="share of turns 2+ run on the decode worker, for --router fraction")
    parser.add_argument("--weights", type=_weights, default=Weights(1.0, 1.0), metavar="W_TTFT,W_TPOT",
                        help="--router ppd: the operator's weights on turn-2+ TTFT and TPOT (default 1,1)")
    parser.add_argument("--table", default="none", metavar="none|auto|PATH",
                        help="--router ppd, as the router's --table: none (default) = the profile's cost "
                        "model priced as the fleet pays it, corrected by outcomes; auto = the paper's table "
                        "shipped for --config and --profile (1P3D, 2P2D, 3P1D of the default profile), "
                        "else the cost model; or a table JSON")
    parser.add_argument("--workload", metavar="NAME",
                        help="a named workload (wildchat, sharegpt, long-context, many-turn, agent-32k, "
                        "coding-agent, turns-N, the paper's small_tiny ...; an unknown name lists them all) "
                        "instead of the synthetic --turns/--first-turn/--follow-up/--think-time shape")
    parser.add_argument("--qps", "--rate", dest="qps", type=positive_float, default=4.0,
                        help="new conversations per second (Poisson); --rate is the same")
    parser.add_argument("--duration", type=positive_float, default=10.0,
                        help="seconds during which conversations start; the run goes on until all finish")
    parser.add_argument("--turns", type=int, help="synthetic workload: turns per conversation (default 2)")
    parser.add_argument("--first-turn", type=_token_pair, metavar="IN,OUT",
                        help="synthetic workload: first turn's user tokens, max output tokens "
                        "(default 1024,128)")
    parser.add_argument("--follow-up", type=_token_pair, metavar="IN,OUT",
                        help="synthetic workload: each later turn's new user tokens, max output tokens "
                        "(default 128,128)")
    parser.add_argument("--think-time", type=float,
                        help="synthetic workload: seconds between a turn's last token and the user's "
                        "next message (default 0)")
    parser.add_argument("--link-bandwidth", type=float, metavar="GB/S",
                        help="KV transfer bandwidth of each prefill worker's link in GB/s (1e9 "
                        "bytes/s); default: the profile's")
    parser.add_argument("--router-profile", metavar="PROFILE",
                        help="--router ppd: the engine profile PPD decides with (its belief), a bundled "
                        "name or a YAML path; default: --profile, the workers' own (the truth)")
    parser.add_argument("--router-link-bandwidth", metavar="GB/S|Nx",
                        help="--router ppd: the KV link bandwidth PPD believes, in GB/s (e.g. 25) or as a "
                        "factor of the workers' link (e.g. 4x, 0.25x); default: the workers' link "
                        "(--link-bandwidth, else the profile's)")
    parser.add_argument("--timeout", type=positive_seconds, metavar="SECONDS",
                        help="a turn not answered within this many seconds of being sent fails and its "
                        "conversation sends no further turn (the paper's protocol: 120, the chat "
                        "workloads: 30); default: a named workload's own (120 for the paper's, 30 for "
                        "the others), never give up on the synthetic one")
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


def format_prediction_errors(summary: dict[str, dict[str, float | int | None]]) -> str:
    """PPD's prediction errors (observed / predicted - 1) of the finished follow-ups, per route
    taken: what a wrong belief (``--router-profile``, ``--router-link-bandwidth``) costs it."""
    def pct(value: float | int | None) -> str:
        return "-" if value is None else f"{value * 100:+.0f}%"

    lines = [f"{'prediction':<14}{'follow-ups':>11}{'TTFT err p50':>14}{'[p10, p90]':>16}{'|err| mean':>11}"
             f"{'TPOT err p50':>14}{'[p10, p90]':>16}{'|err| mean':>11}"]
    for route, row in summary.items():
        lines.append(f"{route:<14}{row['follow_ups']:>11}{pct(row['ttft_error_p50']):>14}"
                     f"{'[' + pct(row['ttft_error_p10']) + ', ' + pct(row['ttft_error_p90']) + ']':>16}"
                     f"{pct(row['ttft_abs_error_mean']).lstrip('+'):>11}{pct(row['tpot_error_p50']):>14}"
                     f"{'[' + pct(row['tpot_error_p10']) + ', ' + pct(row['tpot_error_p90']) + ']':>16}"
                     f"{pct(row['tpot_abs_error_mean']).lstrip('+'):>11}")
    return "\n".join(lines)


def _workload(args: argparse.Namespace) -> tuple[list[Conversation], float | None, str]:
    """The run's conversations, the turns' timeout and how the header line names them."""
    if args.workload is not None:
        given = [flag for flag, attr, _ in SYNTHETIC_SHAPE if getattr(args, attr) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} shape the synthetic workload; drop "
                             f"{'it' if len(given) == 1 else 'them'} or drop --workload {args.workload}")
        conversations = to_sim(make_workload(args.workload, args.qps, args.duration, args.seed))
        timeout = PAPER_TIMEOUT_S if args.workload in PAPER_WORKLOADS else CHAT_TIMEOUT_S
        return (conversations, args.timeout if args.timeout is not None else timeout,
                f"of workload {args.workload}")
    shape: dict[str, Any] = {attr: default if getattr(args, attr) is None else getattr(args, attr)
                             for _, attr, default in SYNTHETIC_SHAPE}
    if shape["turns"] < 1:
        raise ValueError("--turns must be at least 1")
    conversations = synthetic_workload(args.qps, args.duration, shape["first_turn"], shape["follow_up"],
                                       shape["turns"], shape["think_time"], args.seed)
    return conversations, args.timeout, f"of {shape['turns']} turns"


def believed_profile(args: argparse.Namespace, cluster: Cluster) -> EngineProfile:
    """The profile PPD decides with: ``--router-profile`` (default the cluster's) with the link
    ``--router-link-bandwidth`` says (default the cluster's own link)."""
    router_profile = load_profile(args.router_profile) if args.router_profile else cluster.profile
    link = believed_link(args.router_link_bandwidth, cluster.link)
    return msgspec.structs.replace(router_profile, transfer=link)


def _belief(args: argparse.Namespace, profile: EngineProfile, cluster: Cluster) -> str:
    """How the header line names a belief that is not the truth ("" where it is)."""
    if not (args.router_profile or args.router_link_bandwidth):
        return ""
    return (f" believing profile {profile.name} and a {profile.transfer.link_bandwidth_bytes_s / 1e9:g} "
            f"GB/s link (the workers': {cluster.link.link_bandwidth_bytes_s / 1e9:g} GB/s)")


def _router(args: argparse.Namespace, profile: EngineProfile) -> tuple[Router, str]:
    """The router and how the header line names it (PPD: its weights and table); ``profile``:
    the one PPD decides with (`believed_profile`)."""
    if args.router != "ppd":
        return make_router(args.router, args.local_fraction, args.seed), args.router
    p, d, r = parse_config(args.config)
    path = None
    if args.table == "auto":
        path = shipped_table(profile.name, f"{p}P{d}D") if not r else None
    elif args.table != "none":
        path = Path(args.table)
    table = load_table(path) if path is not None else None
    w = args.weights
    source = f"table {path.name}" if path is not None else "the profile's cost model"
    return ppd_router(profile, w, table), f"ppd (weights {w.w_ttft:g},{w.w_tpot:g}; {source})"


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd sim run`: 0 on success, 2 with a one-line error for bad settings."""
    try:
        profile = load_profile(args.profile)
        bandwidth = args.link_bandwidth * 1e9 if args.link_bandwidth is not None else None
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError("--link-bandwidth must be positive")
        cluster = Cluster.from_config(profile, args.config, link_bandwidth_bytes_s=bandwidth, seed=args.seed)
        if args.router != "ppd" and (args.router_profile or args.router_link_bandwidth):
            raise ValueError("--router-profile and --router-link-bandwidth are PPD's beliefs: add "
                             "--router ppd, or drop them")
        belief = believed_profile(args, cluster)
        router, router_name = _router(args, belief)
        if args.router == "ppd":
            router_name += _belief(args, belief, cluster)
        conversations, timeout_s, workload = _workload(args)
        result = simulate(cluster, conversations, router, timeout_s=timeout_s,
                          on_finish=getattr(router, "on_finish", None))
    except UnknownWorkload as exc:  # a KeyError, whose str() would be quoted
        return cli_error(str(exc))
    except (ProfileError, RoutingError, TableError, ValueError) as exc:
        return cli_error(exc)
    print(f"{args.config} router {router_name}, profile {profile.name}: {len(conversations)} conversations "
          f"{workload} at {args.qps:g}/s for {args.duration:g} s")
    print(format_summary(result))
    predictions = getattr(router, "predictions", None)
    errors = predictions.error_summary() if predictions is not None else {}
    if errors:
        print(format_prediction_errors(errors))
    if args.json is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if not callable(v)}
        settings["timeout"] = timeout_s
        document = {"settings": settings, "summary": result.summary(), "prediction_errors": errors,
                    "records": result.records, "in_flight": result.in_flight}
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(document)))
        print(f"wrote {args.json}")
    return 0
