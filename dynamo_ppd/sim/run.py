"""Run conversations through a simulated cluster and summarize them; the `dynamo-ppd sim run` CLI.

The driver plays the users and the router: each conversation's first turn arrives at its
arrival time, every later turn ``think_time_s`` after the previous one finished (a closed loop
per conversation). When a turn arrives, its prompt is built from the history the engine really
generated, the router picks a route from `RequestFeatures` and the `ClusterView`, and the cluster
runs it. One `RequestRecord` per finished turn.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from ..engine import DEFAULT_PROFILE, ProfileError, load_profile
from .cluster import Cluster, ClusterRequest
from .routing import ROUTER_NAMES, RequestFeatures, Router, RoutingError, ViaPrefill, make_router, route_name
from .workload import Conversation, ConversationPrompts, synthetic_workload


class RequestRecord(msgspec.Struct, frozen=True):
    """One finished turn. ``cached_tokens`` is what the worker that ran the prompt's prefill
    reported reusing (P for via_prefill, as Dynamo forwards P's prompt_tokens_details; else the
    decode or aggregated worker); ``transfer_s`` is queueing on P's link plus sending."""

    conversation_id: str
    turn: int
    route: str  # via_prefill | decode_local | aggregated
    prefill_worker: str | None
    decode_worker: str
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    arrival_s: float
    first_token_s: float
    finished_s: float
    ttft_s: float
    tpot_s: float | None  # None for a single output token
    output_tokens: int
    transfer_bytes: int
    transfer_s: float


class Percentiles(msgspec.Struct, frozen=True):
    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0, None, None, None, None)
    p50, p90, p99 = (float(v) for v in np.percentile(values, [50, 90, 99]))
    return Percentiles(len(values), p50, p90, p99, float(np.mean(values)))


@dataclass
class SimResult:
    records: list[RequestRecord]
    simulated_s: float  # the virtual clock at the end
    wall_s: float  # real seconds the run took
    unfinished: int  # turns routed but not finished when the run stopped (until_s)

    def turn1_ttft(self) -> Percentiles:
        return percentiles([r.ttft_s for r in self.records if r.turn == 1])

    def later_ttft(self) -> Percentiles:
        """TTFT of turns 2 and later: where PD and decode-local differ."""
        return percentiles([r.ttft_s for r in self.records if r.turn > 1])

    def tpot(self) -> Percentiles:
        return percentiles([r.tpot_s for r in self.records if r.tpot_s is not None])

    def throughput_tok_s(self) -> float:
        """Output tokens per simulated second over the whole run."""
        return sum(r.output_tokens for r in self.records) / self.simulated_s if self.simulated_s else 0.0

    def speed(self) -> float:
        """Simulated seconds per wall second."""
        return self.simulated_s / self.wall_s if self.wall_s else float("inf")

    def route_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.route] = counts.get(r.route, 0) + 1
        return counts

    def summary(self) -> dict[str, object]:
        return {"requests": len(self.records), "unfinished": self.unfinished,
                "routes": self.route_counts(), "turn1_ttft_s": self.turn1_ttft(),
                "later_ttft_s": self.later_ttft(), "tpot_s": self.tpot(),
                "throughput_tok_s": self.throughput_tok_s(), "simulated_s": self.simulated_s,
                "wall_s": self.wall_s, "simulated_s_per_wall_s": self.speed()}


class _Conversation:
    """A conversation in progress: its prompts and the turn it is on."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        self.prompts = ConversationPrompts(conversation)
        self.next_turn = 0  # index into conversation.turns


class _Driver:
    def __init__(self, cluster: Cluster, router: Router,
                 on_finish: Callable[[RequestRecord], None] | None = None):
        self.cluster = cluster
        self.router = router
        self.on_finish = on_finish
        self.records: list[RequestRecord] = []

    def start_turn(self, conv: _Conversation) -> None:
        cluster, view = self.cluster, self.cluster.view
        conversation = conv.conversation
        turn = conversation.turns[conv.next_turn]
        conv.next_turn += 1
        prompt, new_tokens = conv.prompts.next_prompt(turn)
        session = view.session_decode(conversation.conversation_id)
        features = RequestFeatures(
            conversation_id=conversation.conversation_id, turn=conv.next_turn, prompt_tokens=len(prompt),
            new_tokens=new_tokens, max_tokens=turn.max_tokens, decode_worker=session,
            cached_on_decode=view.cached_prefix_tokens(session, prompt) if session else 0,
            now=cluster.now, token_ids=prompt)
        route = self.router(features, view)
        cluster.dispatch(ClusterRequest(
            f"{conversation.conversation_id}/{conv.next_turn}", conversation.conversation_id, prompt,
            cluster.prompt_hashes(prompt), turn.max_tokens, cluster.now, route,
            functools.partial(self.finish_turn, conv, features)))

    def finish_turn(self, conv: _Conversation, features: RequestFeatures, request: ClusterRequest) -> None:
        serving = request.serving
        assert serving is not None and serving.first_token_at is not None and serving.finished_at is not None
        outputs = len(serving.output)
        reporter = request.prefill if isinstance(request.route, ViaPrefill) else serving
        assert reporter is not None
        self.records.append(RequestRecord(
            conversation_id=features.conversation_id, turn=features.turn, route=route_name(request.route),
            prefill_worker=request.prefill_worker, decode_worker=request.serving_worker,
            prompt_tokens=features.prompt_tokens, cached_tokens=reporter.cached_tokens,
            new_tokens=features.new_tokens, arrival_s=request.arrival_s,
            first_token_s=serving.first_token_at, finished_s=serving.finished_at,
            ttft_s=serving.first_token_at - request.arrival_s,
            tpot_s=(serving.finished_at - serving.first_token_at) / (outputs - 1) if outputs > 1 else None,
            output_tokens=outputs, transfer_bytes=request.transfer_bytes, transfer_s=request.transfer_s))
        if self.on_finish:
            self.on_finish(self.records[-1])
        conv.prompts.record_output(serving.output)
        turns = conv.conversation.turns
        if conv.next_turn < len(turns):
            self.cluster.call_at(self.cluster.now + turns[conv.next_turn].think_time_s, self.start_turn, conv)


def simulate(cluster: Cluster, conversations: list[Conversation], router: Router,
             until_s: float | None = None,
             on_finish: Callable[[RequestRecord], None] | None = None) -> SimResult:
    """Run ``conversations`` on ``cluster`` (fresh: its clock at 0) with ``router`` until every
    turn is done, or until the virtual clock passes ``until_s``. Deterministic for a given
    cluster seed and workload; only ``wall_s`` depends on the machine. ``on_finish`` sees each
    finished turn's record (a router that learns from outcomes, as the live one does)."""
    driver = _Driver(cluster, router, on_finish)
    for conversation in sorted(conversations, key=lambda c: (c.arrival_s, c.conversation_id)):
        if conversation.turns:
            cluster.call_at(conversation.arrival_s, driver.start_turn, _Conversation(conversation))
    started = time.perf_counter()
    end = cluster.run(until_s)
    wall = time.perf_counter() - started
    records = sorted(driver.records, key=lambda r: (r.arrival_s, r.conversation_id, r.turn))
    return SimResult(records, end, wall, cluster.pending_requests())


# -- CLI: dynamo-ppd sim run ---------------------------------------------------------------------

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
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts, tokens and routing")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the settings, summary and every request record to PATH")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_summary(result: SimResult) -> str:
    """A small table of the summary, in milliseconds."""
    lines = [f"{'metric':<18}{'n':>6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}"]
    for name, stats in (("turn-1 TTFT ms", result.turn1_ttft()), ("turn-2+ TTFT ms", result.later_ttft()),
                        ("TPOT ms", result.tpot())):
        lines.append(f"{name:<18}{stats.count:>6}{_ms(stats.p50):>10}{_ms(stats.p90):>10}"
                     f"{_ms(stats.p99):>10}{_ms(stats.mean):>10}")
    routes = ", ".join(f"{name} {count}" for name, count in sorted(result.route_counts().items()))
    unfinished = f"; {result.unfinished} unfinished" if result.unfinished else ""
    lines.append(f"routes: {routes or 'none'}{unfinished}")
    lines.append(f"throughput {result.throughput_tok_s():.0f} output tok/s; simulated "
                 f"{result.simulated_s:.2f} s in {result.wall_s:.2f} s wall "
                 f"({result.speed():.1f} simulated s per wall s)")
    return "\n".join(lines)


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
        result = simulate(cluster, conversations, router)
    except (ProfileError, RoutingError, ValueError) as exc:
        print(f"dynamo-ppd: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config} router {args.router}, profile {profile.name}: {len(conversations)} conversations "
          f"of {args.turns} turns at {args.rate:g}/s for {args.duration:g} s")
    print(format_summary(result))
    if args.json is not None:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                    if not callable(v)}
        document = {"settings": settings, "summary": result.summary(), "records": result.records}
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(document)))
        print(f"wrote {args.json}")
    return 0
