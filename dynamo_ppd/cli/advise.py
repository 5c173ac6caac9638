"""`dynamo-ppd advise`: the deployment and PPD weights to run for a workload on N GPUs, from the
virtual-clock simulation of every candidate (`dynamo_ppd.advisor.advise` says which and how it
chooses). Progress on stderr; the table, the Pareto front and the recommendation on stdout;
``--json`` and ``--plot`` write them to files."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import msgspec

from ..advisor import advise
from ..argtypes import cli_error, positive_floats, positive_int
from ..engine.profile import DEFAULT_PROFILE, LINK_PRESETS, ProfileError, load_profile
from ..experiment.progress import Progress
from ..sim.outcome import CHAT_TIMEOUT_S
from ..workloads.generators import WORKLOADS, UnknownWorkload, make_workload
from ..workloads.manifest import Manifest, ManifestError, load_manifest

DEFAULT_WINDOW_S = 30.0  # seconds of arrivals of a named workload
# The picker's / router's --mode that runs a reference policy (Dynamo's conditional
# disaggregation is the cond-disagg graph, no PPD process).
_MODES = {"x0": "pd", "x1": "local", "dynamo-isl-or-load-ours": "(none: graphs/cond-disagg.yaml)"}


def _weights(text: str) -> tuple[float, float]:
    try:
        w_ttft, w_tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not W_TTFT,W_TPOT like 1,1 or 1,3") from None
    if w_ttft < 0 or w_tpot < 0 or w_ttft + w_tpot == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: weights are >= 0 and not both 0")
    return w_ttft, w_tpot


def _ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not milliseconds like 200") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an SLO is > 0 ms")
    return value / 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", metavar="NAME",
                        help=f"a named workload ({', '.join(sorted(WORKLOADS))})")
    source.add_argument("--manifest", type=Path, metavar="PATH",
                        help="a workload manifest (JSONL, docs/manifest.md): a trace, or one written "
                        "by `dynamo-ppd bench`")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs to spend (one per worker)")
    parser.add_argument("--rate", type=float, metavar="CONV/S",
                        help="conversations per second (default: the manifest's own; a named "
                        "workload: required)")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_S, metavar="SECONDS",
                        help="seconds of arrivals of a named workload")
    parser.add_argument("--slo-ttft", type=_ms, metavar="MS",
                        help="TTFT objective of each follow-up turn (each turn of a single-turn workload)")
    parser.add_argument("--slo-tpot", type=_ms, metavar="MS", help="TPOT objective of the same requests")
    parser.add_argument("--weights", type=_weights, default=(1.0, 1.0), metavar="W_TTFT,W_TPOT",
                        help="how to trade TTFT against TPOT when no SLO decides (and between "
                        "candidates that meet the SLOs alike)")
    parser.add_argument("--rate-factors", type=positive_floats("rate factors"),
                        default=list(advise.RATE_FACTORS), metavar="F,F,...",
                        help="rates to simulate, as multiples of the workload's (1 is always run)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="engine profile (name or YAML path)")
    parser.add_argument("--link", default="cross-node", choices=sorted(LINK_PRESETS),
                        help="KV link between prefill and decode workers")
    parser.add_argument("--timeout", type=float, default=CHAT_TIMEOUT_S, metavar="SECONDS",
                        help="a turn not answered within this many seconds fails")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and routing")
    parser.add_argument("--processes", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="simulations run in parallel")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every candidate and the choice here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw TTFT against TPOT of the candidates")


def _workload(args: argparse.Namespace) -> tuple[Manifest, float, str]:
    if args.manifest:
        manifest = load_manifest(args.manifest)
        rate = args.rate or (manifest.header.rate_conv_per_s if manifest.header else None)
        if not rate:
            conv = manifest.conversations
            rate = len(conv) / conv[-1].arrival_s if conv and conv[-1].arrival_s > 0 else None
        if not rate:
            raise ManifestError(f"{args.manifest}: no rate in its header; give --rate")
        return manifest, rate, str(args.manifest)
    if not args.rate:
        raise ManifestError(f"--workload {args.workload} needs --rate (conversations per second)")
    return make_workload(args.workload, args.rate, args.window, args.seed), args.rate, args.workload


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}" if v >= 0.1 else f"{v * 1e3:.1f}"


def format_table(points: list[advise.Measured], front: list[advise.Measured], best: advise.Measured | None,
                 costs: dict[int, float], slo: bool) -> str:
    head = (f"{'':2}{'deployment':<14}{'policy':<26}{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}"
            f"{'tok/s/GPU':>10}{'ok %':>7}{'local':>7}{'cost':>7}" + (f"{'SLO met':>9}" if slo else ""))
    lines = [head]
    for p in sorted(points, key=lambda p: (costs.get(id(p), 99.0), p.deployment)):
        mark = ">>" if p is best else " *" if p in front else "  "
        local = f"{p.local_share:.0%}" if advise.kind_of(p.deployment) == "pd" else "-"
        cost = f"{costs[id(p)]:.2f}" if id(p) in costs else "-"
        lines.append(f"{mark}{p.deployment:<14}{p.policy:<26}{_fmt_ms(p.ttft_p50_s):>9}"
                     f"{_fmt_ms(p.ttft_p99_s):>8}"
                     f"{_fmt_ms(p.tpot_p50_s):>9}{p.tokens_per_s_per_gpu:>10.0f}{p.success_rate:>7.1f}"
                     f"{local:>7}{cost:>7}" + (f"{p.slo_attainment or 0.0:>9.1%}" if slo else ""))
    return "\n".join(lines)


def _plot(path: Path, points: list[advise.Measured], front: list[advise.Measured],
          best: advise.Measured | None, title: str) -> None:
    from ..experiment import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))

    def xy(ps: list[advise.Measured]) -> tuple[list[float], list[float]]:
        # Every plotted candidate is eligible: both latencies are there.
        return [(p.ttft_p50_s or 0.0) * 1e3 for p in ps], [(p.tpot_p50_s or 0.0) * 1e3 for p in ps]

    labels = {"replicas": "replicas", "pd": "P/D (PPD and references)", "hybrid": "hybrids"}
    for kind, color in {"replicas": "tab:green", "pd": "tab:blue", "hybrid": "tab:orange"}.items():
        mine = [p for p in advise.eligible(points) if advise.kind_of(p.deployment) == kind]
        ax.scatter(*xy(mine), s=22, color=color, label=labels[kind], alpha=0.75)
    ax.scatter(*xy(front), s=90, facecolors="none", edgecolors="black", label="Pareto front")
    if best is not None:
        ax.scatter(*xy([best]), marker="*", s=260, color="red",
                   label=f"recommended: {best.deployment} {best.policy}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p50 (ms, log)")
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    try:
        load_profile(args.profile)
        manifest, rate, source = _workload(args)
    except (ProfileError, ManifestError, UnknownWorkload, OSError) as exc:
        return cli_error(exc)
    if not rate > 0:
        return cli_error(f"--rate {rate} must be > 0 conversations per second")
    try:
        advise.deployments(args.gpus)
    except ValueError as exc:
        return cli_error(exc)
    factors = sorted({1.0, *args.rate_factors})
    slo = advise.Slo(args.slo_ttft, args.slo_tpot)
    job_args = dict(profile=args.profile, link=args.link, gpus=args.gpus, rate=rate, timeout_s=args.timeout,
                    seed=args.seed, slo=slo)
    specs = advise.plan(args.gpus, [1.0])
    others = [f for f in factors if f != 1.0]
    single_turn = all(len(c.turns) == 1 for c in manifest.conversations)
    planned = len(specs) + len(others) * (advise.SHORTLIST + 1)
    print(f"advise: {source} at {rate:g} conv/s ({len(manifest.conversations)} conversations), {args.gpus} "
          f"GPUs, {args.profile}, {args.link} link: {len(specs)} candidates, then the best "
          f"{advise.SHORTLIST} and the replicas at x{', x'.join(f'{f:g}' for f in others) or ' none'} "
          f"of the rate; ~{planned} simulations on {args.processes} processes", file=sys.stderr)
    progress = Progress(planned, "advise", unit="simulations", every_s=15)
    started = time.monotonic()
    nominal = advise.simulate_all(advise.jobs_for(manifest, specs, **job_args), args.processes, progress.step)
    keep = advise.shortlist(nominal, args.weights, slo)
    around = [advise.CandidateSpec(d, p, f) for f in others for d, p in keep]
    points = nominal + advise.simulate_all(advise.jobs_for(manifest, around, **job_args), args.processes,
                                           progress.step)
    front = advise.pareto_front(nominal)
    choice = advise.recommend(points, args.weights, slo, max(factors))
    costs = advise.weighted_costs(nominal, args.weights)
    over = "every turn (single-turn workload)" if single_turn else "follow-up turns (2+)"
    print(f"{source}: {rate:g} conv/s, {args.gpus} GPUs ({args.profile}, {args.link} link); latencies over "
          f"{over}; cost = {args.weights[0]:g} x (TTFT p50/best + p99/best)/2 + {args.weights[1]:g} x "
          f"TPOT p50/best"
          + (f"; SLOs TTFT {_fmt_ms(slo.ttft_s)} ms, TPOT {_fmt_ms(slo.tpot_s)} ms" if slo.given else ""))
    print(format_table(nominal, front, choice.best if choice else None, costs, slo.given))
    print(f"(>> recommended, * on the Pareto front; {len(points)} simulations in "
          f"{time.monotonic() - started:.0f} s)")
    if len(factors) > 1:
        print("\nAround the rate (the shortlist; cost at each rate over that rate's candidates" +
              (", SLO attainment" if slo.given else "") + "):")
        for factor in factors:
            at = [p for p in points if p.rate_factor == factor]
            c = advise.weighted_costs(at, args.weights)
            ranked = sorted((p for p in at if id(p) in c), key=lambda p: c[id(p)])[:3]
            row = "; ".join(f"{p.deployment} {p.policy} {c[id(p)]:.2f}"
                            + (f" ({p.slo_attainment or 0:.0%})" if slo.given else "") for p in ranked)
            print(f"  x{factor:<4g} {rate * factor:>7.2f} conv/s  best: {row or 'none met the success bar'}")
    if choice is None:
        print("\nno candidate met the 95% success bar at this rate: more GPUs, or a lower rate")
    else:
        b = choice.best
        weights = f" with PPD weights {b.policy[4:]}" if b.policy.startswith("ppd@") else f" ({b.policy})"
        print(f"\nrecommended: {b.deployment}{weights}; decided by {choice.key}: {choice.margin}"
              + (f"; runner-up {choice.runner_up.deployment} {choice.runner_up.policy}"
                 if choice.runner_up else ""))
        if choice.better_reference is not None:
            r = choice.better_reference
            print(f"note: the reference policy {r.policy} on {r.deployment} did better on the same key "
                  f"(see the table); run the picker with --mode {_MODES.get(r.policy, r.policy)} for it")
    if args.plot:
        _plot(args.plot, nominal, front, choice.best if choice else None,
              f"{source}, {rate:g} conv/s, {args.gpus} GPUs ({args.profile})")
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode({
            "source": source, "rate": rate, "gpus": args.gpus, "profile": args.profile, "link": args.link,
            "weights": args.weights, "slo": slo, "single_turn": single_turn, "points": points,
            "pareto_front": [[p.deployment, p.policy] for p in front], "recommendation": choice})))
        print(f"json: {args.json}")
    return 0
