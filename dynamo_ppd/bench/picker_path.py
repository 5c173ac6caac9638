"""The endpoint picker's request path alone: `dynamo-ppd bench picker` (`just bench-picker`,
`python -m dynamo_ppd.bench.picker_path`).

What is measured: how long the PPD endpoint picker takes to route one request, from its first
ext_proc message in to the route out (``path``), split into the picker's stages (body, parse,
template, tokenize, hashes, plan, record, answer: `picker.stages.STAGES`); the round trip a gRPC
client sees for the same exchange (round trip - path = "grpc": both gRPC ends and the loopback
transport); and the picker process's CPU per pick. Per kind of request and per request rate.

How:

1. The real `ppd` graph (`graphs/ppd.yaml`: etcd, NATS, Dynamo's frontend, 1 prefill + 3 decode
   simulated TensorRT-LLM workers, the gateway, and the picker as ``python -m dynamo_ppd.picker``)
   starts with the picker's ``--timings``: each route's ext_proc answer then carries the
   picker's own times in the dynamic metadata namespace ``ppd.picker`` (`picker.extproc.
   timing_metadata`).
2. Warm-up through the gateway, served for real: ``--conversations`` two-turn conversations of
   ~2K tokens, so the picker holds their sessions (in etcd too) and the decode workers'
   residency comes from their own KV events. Each conversation's messages, the assistant's
   replies included, are kept for the follow-ups.
3. The driver (this process, grpc.aio on uvloop) then calls the picker's ext_proc port directly,
   as Envoy's ext_proc filter does (`gateway.extproc.process`: request headers, the body
   streamed full-duplex, the route and the body back; one stream per request). Nothing is
   forwarded: the routes go nowhere and no token is served. Kinds of request:
   - ``first-0.5k`` ... ``first-100k``: a first turn of that many user tokens (the chat template
     adds ~17), fresh random words and a fresh session id each, so nothing is cached;
   - ``follow-up``: a warm-up conversation's history and reply plus a new ~32-word user message;
     the conversation's next follow-up appends a short assistant message and another user
     message, so each continues the history the picker recorded. Conversations take turns, so a
     history grows by ~60 tokens each time its turn comes round: the report gives each point's
     mean prompt size;
   - ``agent-follow-up-100k`` and ``agent-first-20k`` (`picker_path_load.AgentTurns`): agent
     traffic over ``/v1/messages`` as Claude Code sends it, with its session header: a tool loop's
     next step on a ~100K-token context whose turn before the picker has seen, and a new
     session's first request sharing a 20K-token system prompt and tools the picker has seen.
   Open loop: requests leave at evenly spaced times at the target rate, whether earlier ones
   were answered or not; the first ``--warmup`` seconds of each point are left out of its
   figures. A kind climbs its rates until a point is not sustained (achieved < 95% of its rate,
   or a failure; follow-ups also when their p99 path passes ``--p99-limit-ms``). Closed loop:
   ``--closed-loop-concurrency`` requests of ``--closed-loop-kind`` in flight at all times.
4. Per point: path and round trip p50 (95% bootstrap interval over conversations) and p99, the
   mean per stage, the picker's CPU per pick (utime + stime of its process from /proc over the
   point, all threads, over its picks: what one pick costs a core), and the cores used by the
   picker, the driver and the whole machine; then the highest follow-up rate sustained with p99
   path within the limit (`picker_path_report`).

Caveats. The driver is Python too and shares the machine's cores with the picker and the
graph: a point that falls short while the picker uses less than a core was limited by the driver
or the machine, and the report says which. The picker charges each route to its workers' loads
until the turn is predicted to end, and here no turn runs, so at high rates its load view holds
many phantom requests; the policy reads them (decisions may differ from a served load's), their
cost hardly. Under concurrency a request's path includes its wait behind the picker's other
requests (one event loop).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..argtypes import cli_error, comma_choices, positive_int, positive_seconds
from ..picker.prompt import ENCODE_CACHE_PIECES
from .client import TokenText
from .picker_path_load import (
    AGENT_KINDS,
    FIRST_MESSAGE_TOKENS,
    FIRST_TURNS,
    MAX_TOKENS,
    AgentTurns,
    Conversation,
    Driver,
    FirstTurns,
    FollowUps,
    Meter,
    PickRequest,
    idle_cores,
    settle,
    warm_up,
)
from .picker_path_report import (
    FOLLOW_UP,
    Outcome,
    Point,
    Report,
    ReportError,
    encode_cache_note,
    markdown,
    plot,
    save,
    summarize,
    sustained,
    sustained_rate,
)
from .picker_path_report import load as load_report

LARGE_FIRST_TURNS = ("first-32k", "first-100k")  # too slow to pick for the ordinary rates: --large-rates
# In the order they run: follow-ups first, on the warm-up's state; the agent kinds last (/v1/messages).
KINDS = (FOLLOW_UP, *FIRST_TURNS, *AGENT_KINDS)
# The picker's refusal of a prompt too long: the context window, or the largest decode KV cache.
_LIMIT = re.compile(r"maximum context length is (\d+) tokens|KV cache holds \((\d+) tokens\)")


# --- the graph -----------------------------------------------------------------------------------

def _up(run_dir: Path):
    from ..launch import ServeOptions, start
    from ..launch.process import free_port

    options = ServeOptions(graph="ppd", http_port=free_port(), nats_port=free_port(), etcd_port=free_port(),
                           run_dir=run_dir, extra_args={"picker": ["--timings"]})
    return start(options, log=lambda _m: None)


def picker_address(dep) -> str:
    """The picker's ext_proc address (its ``--grpc-port``, filled in from ``{picker_port}``)."""
    argv = dep.process("picker").argv
    return f"127.0.0.1:{argv[argv.index('--grpc-port') + 1]}"


# --- a run ---------------------------------------------------------------------------------------

def ladder(kind: str, args: argparse.Namespace) -> list[float]:
    """The rates a kind climbs (open loop)."""
    if kind == FOLLOW_UP:
        return sorted({*args.rates, *args.follow_up_rates})
    return list(args.large_rates if kind in (*LARGE_FIRST_TURNS, *AGENT_KINDS) else args.rates)


def point_size(rate: float, args: argparse.Namespace) -> tuple[int, int]:
    """(requests left out at the start, requests measured) of an open-loop point."""
    measured = min(args.max_requests, max(args.min_requests, round(args.duration * rate)))
    return math.ceil(args.warmup * rate), measured


async def fitting_first_turn(driver: Driver, source: FirstTurns, notes: list[str],
                             say: Callable[[str], None]) -> bool:
    """Send one request of the kind; if the picker refuses it as too long, shrink the kind to the
    limit its refusal names, and note it. False when it can not be made to fit."""
    error: str | None = None
    for _ in range(2):
        _, _, error = await driver.send(source.next())
        if error is None:
            return True
        match = _LIMIT.search(error)
        if not error.startswith("HTTP 400") or match is None:
            break
        fitted = int(match.group(1) or match.group(2)) - MAX_TOKENS - FIRST_MESSAGE_TOKENS - 32
        notes.append(f"{source.kind}: the picker refused {source.tokens:,} user tokens ({error[:160]}); "
                     f"measured with {fitted:,} instead, the largest that fits")
        say(notes[-1])
        source.tokens = fitted
    notes.append(f"{source.kind}: not measured, the picker refused it: {(error or '')[:200]}")
    say(notes[-1])
    return False


async def primed(driver: Driver, source: AgentTurns, notes: list[str], say: Callable[[str], None]) -> bool:
    """Send what the picker would have seen before an agent kind's requests (`AgentTurns.prime`);
    False, noted, when it refuses one."""
    for request in source.prime():
        _, _, error = await driver.send(request)
        if error is not None:
            notes.append(f"{source.kind}: not measured, the picker refused its priming request: "
                         f"{error[:200]}")
            say(notes[-1])
            return False
    return True


@dataclass
class Points:
    """Runs one point at a time: the picker settled first, its CPU metered over the point."""

    driver: Driver
    meter: Meter
    picker_idle_cores: float
    seed: int
    say: Callable[[str], None]
    done: list[Point] = field(default_factory=list)

    async def open_loop(self, kind: str, rate: float, requests: list[PickRequest], left_out: int,
                        conversation_messages: int = 0) -> Point:
        await settle(self.meter.picker_pid)
        self.meter.start()
        outcomes = await self.driver.open_loop(requests, rate)
        return self._add(kind, "open", rate, outcomes, left_out, conversation_messages=conversation_messages)

    async def closed_loop(self, kind: str, concurrency: int, requests: list[PickRequest]) -> Point:
        await settle(self.meter.picker_pid)
        self.meter.start()
        outcomes = await self.driver.closed_loop(requests, concurrency)
        # The first `concurrency` requests fill the pipeline (each waits behind fewer than the
        # rest): left out, as an open-loop point's start is.
        return self._add(kind, "closed", 0.0, outcomes, concurrency, concurrency)

    def _add(self, kind: str, loop: str, rate: float, outcomes: list[Outcome], left_out: int,
             concurrency: int = 0, conversation_messages: int = 0) -> Point:
        cpu = self.meter.stop(sum(o.routed for o in outcomes), self.picker_idle_cores)
        point = summarize(kind, loop, rate, outcomes[left_out:], cpu, concurrency, self.seed,
                          conversation_messages)
        self.done.append(point)
        self.say(_progress(point))
        return point


async def run_points(dep, args: argparse.Namespace, say: Callable[[str], None]
                     ) -> tuple[list[Point], float, list[str]]:
    """Warm up, then every kind's ladder and the closed loop: (points, the picker's idle cores,
    notes)."""
    text = TokenText(args.seed)
    notes: list[str] = []
    started = time.monotonic()
    conversations: list[Conversation] = []
    if FOLLOW_UP in args.kinds:
        conversations = await warm_up(dep, args.conversations, text, args.seed)
        say(f"warm-up: {len(conversations)} two-turn conversations through the gateway "
            f"({time.monotonic() - started:.1f} s)")
    meter = Meter({p.label: p.popen.pid for p in dep.processes() if p.popen is not None})
    await settle(meter.picker_pid)
    idle = await idle_cores(meter.picker_pid)
    run = Points(Driver(picker_address(dep)), meter, idle, args.seed, say)
    try:
        for kind in [k for k in KINDS if k in args.kinds]:
            if kind == FOLLOW_UP:
                source: FollowUps | FirstTurns | AgentTurns = FollowUps(conversations, dep.model_name, text)
            elif kind in AGENT_KINDS:
                source = AgentTurns(kind, dep.model_name, text)
                if not await primed(run.driver, source, notes, say):
                    continue
            else:
                source = FirstTurns(kind, FIRST_TURNS[kind], dep.model_name, text)
                if not await fitting_first_turn(run.driver, source, notes, say):
                    continue
                if kind in LARGE_FIRST_TURNS and source.tokens == FIRST_TURNS[kind]:
                    notes.append(f"{kind}: the picker routes {source.tokens:,} user tokens, not refused "
                                 "(within the model's context window and the decode workers' KV caches).")
            for rate in ladder(kind, args):
                left_out, measured = point_size(rate, args)
                # Built before the clock runs, so that the driver's time goes to sending only.
                requests = [source.next() for _ in range(left_out + measured)]
                held = sum(len(c.messages) for c in conversations) if kind == FOLLOW_UP else 0
                point = await run.open_loop(kind, rate, requests, left_out, held)
                if not sustained(point, args.p99_limit_ms * 1e3 if kind == FOLLOW_UP else None):
                    break  # a higher rate of this kind would only queue more
        if args.closed_loop_concurrency:
            kind, concurrency = args.closed_loop_kind, args.closed_loop_concurrency
            source = FirstTurns(kind, FIRST_TURNS[kind], dep.model_name, text)
            if await fitting_first_turn(run.driver, source, notes, say):
                requests = [source.next() for _ in range(concurrency + args.closed_loop_requests)]
                await run.closed_loop(kind, concurrency, requests)
    finally:
        await run.driver.close()
    return run.done, idle, notes


def _progress(p: Point) -> str:
    where = f"@ {p.target_rate:g}/s" if p.loop == "open" else f"x{p.concurrency} in flight"
    if not p.samples:
        return f"  {p.kind} {where}: nothing routed ({p.first_error[:120]})"
    assert p.path_p50_us is not None and p.round_trip_p50_us is not None
    rest = sorted(((c, label) for label, c in p.graph_cores.items() if label != "picker"), reverse=True)
    busiest = ", ".join(f"{label} {c:.2f}" for c, label in rest[:3])
    threads = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(p.picker_threads_us_per_pick.items()))
    return (f"  {p.kind} {where}: {p.samples} routed{f', {p.refused} refused' if p.refused else ''}"
            f"{f', {p.failed} failed' if p.failed else ''}; path p50 {p.path_p50_us.value / 1e3:.2f} ms, "
            f"p99 {p.path_p99_us / 1e3:.2f} ms; round trip p50 {p.round_trip_p50_us.value / 1e3:.2f} ms; "
            f"achieved {p.achieved_rate:,.1f}/s; picker {p.picker_cores:.2f} cores, "
            f"{p.picker_cpu_us_per_pick:,.0f} us CPU/pick ({p.picker_busy_us_per_pick:,.0f} less idle); "
            f"driver {p.driver_cores:.2f}, machine {p.machine_cores:.2f} cores "
            f"(busiest of the rest: {busiest}); {p.wall_s:.1f} s\n"
            f"    picker CPU/pick by thread: {threads} us")


def measure(args: argparse.Namespace, command: str, say: Callable[[str], None] = print) -> Report:
    """Bring the graph up, warm it up, run every point, tear it down: the report."""
    import uvloop

    load_before = list(os.getloadavg())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ppd-picker-path-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        say(f"starting the ppd graph (picker --timings); logs in {run_dir}/logs")
        dep = _up(run_dir)
        try:
            say(f"graph ready in {time.monotonic() - started:.1f} s; picker at {picker_address(dep)}")
            points, idle, notes = uvloop.run(run_points(dep, args, say))
        finally:
            dep.stop()
    notes += _drift_note(points) + encode_cache_note(points, ENCODE_CACHE_PIECES)
    return Report(
        command=command, graph="ppd: 1 prefill + 3 decode simulated TensorRT-LLM workers, Dynamo's frontend, "
        "the picker (python -m dynamo_ppd.picker --timings)", arrivals="open loop, evenly spaced",
        conversations=args.conversations, duration_s=args.duration, warmup_s=args.warmup,
        min_requests=args.min_requests, max_requests=args.max_requests, p99_limit_ms=args.p99_limit_ms,
        cpus=os.cpu_count() or 1, load_before=load_before, picker_idle_cores=idle,
        wall_s=time.monotonic() - started, points=points,
        sustained_follow_up_rate=sustained_rate(points, args.p99_limit_ms * 1e3), notes=notes)


def _drift_note(points: list[Point]) -> list[str]:
    follow = [p for p in points if p.kind == FOLLOW_UP]
    if len(follow) < 2:
        return []
    return [f"Follow-up prompts grew as their conversations went on (each follow-up continues the last): "
            f"~{follow[0].prompt_tokens:,.0f} tokens on average at {follow[0].target_rate:g}/s, "
            f"~{follow[-1].prompt_tokens:,.0f} at {follow[-1].target_rate:g}/s."]


# --- command line --------------------------------------------------------------------------------

def _rates(text: str) -> list[float]:
    """An argparse type: comma-separated positive rates, or ``none`` for no rate."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not rates like 1,50,200, or none") from None
    if min(values, default=1) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: rates must be positive")
    return sorted(set(values))


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd bench picker`."""
    add = parser.add_argument
    add("--kinds", type=comma_choices("kind", KINDS), default=list(KINDS), metavar="KIND,KIND",
        help=f"request kinds to measure, from {', '.join(KINDS)} (default: all)")
    add("--rates", type=_rates, default=[1.0, 50.0, 200.0, 500.0], metavar="R,R",
        help="requests/s of the follow-ups and of the first turns up to 8K (default 1,50,200,500)")
    add("--follow-up-rates", type=_rates, default=[750.0, 1000.0, 1500.0, 2000.0], metavar="R,R",
        help="further follow-up rates, climbed while each is sustained with p99 path within "
        "--p99-limit-ms; none: no more (default 750,1000,1500,2000)")
    add("--large-rates", type=_rates, default=[1.0, 20.0], metavar="R,R",
        help=f"requests/s of the {' and '.join(LARGE_FIRST_TURNS)} first turns and of the agent kinds "
        f"({', '.join(AGENT_KINDS)}) (default 1,20)")
    add("--duration", type=positive_seconds, default=4.0, metavar="SECONDS",
        help="seconds of measured requests per point, within --min-requests and --max-requests (default 4)")
    add("--warmup", type=_non_negative_seconds, default=0.5, metavar="SECONDS",
        help="seconds of requests at the start of each point left out of its figures (default 0.5)")
    add("--min-requests", type=positive_int, default=10, metavar="N",
        help="measured requests per point at least: a low rate runs longer (default 10)")
    add("--max-requests", type=positive_int, default=2000, metavar="N",
        help="measured requests per point at most: a high rate runs shorter (default 2000)")
    add("--p99-limit-ms", type=positive_seconds, default=10.0, metavar="MS",
        help="the follow-ups climb their rates while their p99 path is within this (default 10)")
    add("--conversations", type=positive_int, default=256, metavar="N",
        help="warm-up conversations (two turns, ~2K tokens, served through the gateway) that the "
        "follow-ups continue (default 256)")
    add("--closed-loop-concurrency", type=int, default=20, metavar="N",
        help="then N requests of --closed-loop-kind in flight at all times; 0: skip (default 20)")
    add("--closed-loop-requests", type=positive_int, default=20, metavar="N",
        help="measured requests of the closed loop, after the first --closed-loop-concurrency (default 20)")
    add("--closed-loop-kind", choices=list(FIRST_TURNS), default="first-100k",
        help="the closed loop's kind of request (default first-100k)")
    add("--seed", type=int, default=0, help="seed of the random words (default 0)")
    add("--run-dir", type=Path, metavar="DIR",
        help="keep the graph's logs here (default: a temporary directory)")
    add("--out", type=Path, metavar="PREFIX",
        help="write PREFIX.json, PREFIX.md and PREFIX.png (e.g. docs/bench/picker-path)")
    add("--json", type=Path, metavar="PATH", help="write the report's figures here (over --out's)")
    add("--markdown", type=Path, metavar="PATH", help="write the tables here (over --out's)")
    add("--png", type=Path, metavar="PATH", help="write the plot here (over --out's)")
    add("--render", type=Path, metavar="JSON",
        help="run nothing: render a report that --json wrote again (to --out, --markdown, --png)")


def _outputs(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None]:
    def pick(explicit: Path | None, suffix: str) -> Path | None:
        return explicit or (args.out.with_suffix(suffix) if args.out is not None else None)

    return pick(args.json, ".json"), pick(args.markdown, ".md"), pick(args.png, ".png")


def _command(args: argparse.Namespace) -> str:
    """The command line that made the report, for its first lines."""
    if sys.argv[1:3] == ["bench", "picker"]:
        return "uv run dynamo-ppd " + shlex.join(sys.argv[1:])
    if getattr(args, "argv", None) is not None:  # python -m dynamo_ppd.bench.picker_path
        return "uv run python -m dynamo_ppd.bench.picker_path " + shlex.join(args.argv)
    return "dynamo-ppd bench picker (called in process, e.g. by a test)"


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd bench picker`: 0 when the run (or the rendering) was done, 2 with a one-line
    error for a setting to fix, 1 when the graph did not start."""
    from ..launch import BadInput, LaunchError

    if args.closed_loop_concurrency < 0:
        return cli_error("--closed-loop-concurrency must be 0 (skip) or more")
    if args.min_requests > args.max_requests:
        return cli_error(f"--min-requests {args.min_requests} is over --max-requests {args.max_requests}")
    measures = any(ladder(kind, args) for kind in args.kinds) or args.closed_loop_concurrency
    if args.render is None and not measures:
        return cli_error("nothing to measure: every rate list is empty for --kinds, and no closed loop")
    json_path, md_path, png_path = _outputs(args)
    if args.render is not None:
        try:
            report = load_report(args.render)
        except (OSError, ReportError) as exc:
            return cli_error(exc)
    else:
        try:
            report = measure(args, _command(args), say=lambda line: print(line, file=sys.stderr, flush=True))
        except BadInput as exc:
            return cli_error(exc)
        except (LaunchError, RuntimeError) as exc:
            return cli_error(exc, 1)
    text = markdown(report)
    print(text)
    for path, write in ((json_path, lambda p: save(report, p)), (md_path, lambda p: p.write_text(text)),
                        (png_path, lambda p: plot(report, p))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _standalone(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.picker_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return main(args)


if __name__ == "__main__":
    raise SystemExit(_standalone())
