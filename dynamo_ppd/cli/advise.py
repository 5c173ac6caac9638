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
from ..advisor.search import SEARCHES, Runner, planned, search, tp_degrees
from ..argtypes import cli_error, positive_floats, positive_int, positive_ints
from ..engine.presets import DTYPES, GPUS, MODELS, TP_CHOICES, describe, model_config, tp_profiles
from ..engine.profile import DEFAULT_PROFILE, LINK_PRESETS, EngineProfile, ProfileError, load_profile
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
    parser.add_argument("--gpus", type=positive_int, required=True,
                        help="GPUs to spend (a worker is the profile's TP GPUs)")
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
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--profile", default=None,
                       help=f"engine profile (name or YAML path), TP as it says (default: {DEFAULT_PROFILE})")
    model.add_argument("--model", metavar="NAME",
                       help=f"a shipped model ({', '.join(MODELS)}): profiles are built for it at each "
                       "TP degree of --tp-choices (`dynamo-ppd engine profile`; the bundled refit "
                       "profile where one ships)")
    model.add_argument("--config", type=Path, metavar="PATH", help="the same for a model's config.json")
    parser.add_argument("--gpu", choices=list(GPUS), help="GPU of --model/--config (default: h100)")
    parser.add_argument("--dtype", choices=DTYPES, help="precision of --model/--config (default: bf16)")
    parser.add_argument("--tp-choices", type=positive_ints("TP degrees"), metavar="N,N,...",
                        help="TP degrees to search with --model/--config (default: 1,2,4,8, those the "
                        "model fits and splits over)")
    parser.add_argument("--search", choices=SEARCHES, default="staged",
                        help="staged: scan the splits, refine around the best, every policy on the best "
                        "three (`dynamo_ppd.advisor.search`); exhaustive: every candidate")
    parser.add_argument("--link", default="cross-node", choices=sorted(LINK_PRESETS),
                        help="KV link between prefill and decode workers")
    parser.add_argument("--timeout", type=float, default=CHAT_TIMEOUT_S, metavar="SECONDS",
                        help="a turn not answered within this many seconds fails")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and routing")
    parser.add_argument("--processes", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="simulations run in parallel")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every candidate and the choice here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw TTFT against TPOT of the candidates")


def profiles_for(args: argparse.Namespace) -> dict[int, EngineProfile]:
    """The engine profile of each TP degree searched: --profile's alone, or --model/--config's at
    each of --tp-choices it fits (a bundled refit profile where one ships for it)."""
    if args.model is None and args.config is None:
        given = [f"--{flag.replace('_', '-')}" for flag in ("tp_choices", "gpu", "dtype")
                 if getattr(args, flag)]
        if given:
            raise ProfileError(f"{' and '.join(given)} need --model or --config (a --profile has its own "
                               "TP, GPU and precision)")
        profile = load_profile(args.profile or DEFAULT_PROFILE)
        return {profile.tp: profile}
    name, config = model_config(str(args.config) if args.config else args.model)
    return tp_profiles(config, name, gpu=args.gpu or "h100", dtype=args.dtype or "bf16",
                       choices=sorted(set(args.tp_choices)) if args.tp_choices else TP_CHOICES)


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


def _label(p: advise.Measured) -> str:
    """``1P3D``, or ``1P3D@TP4`` for workers of 4 GPUs."""
    return p.deployment if p.tp == 1 else f"{p.deployment}@TP{p.tp}"


def format_table(points: list[advise.Measured], front: list[advise.Measured], best: advise.Measured | None,
                 costs: dict[int, float], slo: bool) -> str:
    head = (f"{'':2}{'deployment':<18}{'policy':<26}{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}"
            f"{'tok/s/GPU':>10}{'ok %':>7}{'local':>7}{'cost':>7}" + (f"{'SLO met':>9}" if slo else ""))
    lines = [head]
    for p in sorted(points, key=lambda p: (costs.get(id(p), 99.0), p.deployment, p.tp)):
        mark = ">>" if p is best else " *" if p in front else "  "
        local = f"{p.local_share:.0%}" if advise.kind_of(p.deployment) == "pd" else "-"
        cost = f"{costs[id(p)]:.2f}" if id(p) in costs else "-"
        lines.append(f"{mark}{_label(p):<18}{p.policy:<26}{_fmt_ms(p.ttft_p50_s):>9}"
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
        profiles = profiles_for(args)
        manifest, rate, source = _workload(args)
    except (ProfileError, ManifestError, UnknownWorkload, OSError) as exc:
        return cli_error(exc)
    if not rate > 0:
        return cli_error(f"--rate {rate} must be > 0 conversations per second")
    degrees = tp_degrees(args.gpus, profiles)
    if not degrees:
        return cli_error(f"{args.gpus} GPUs make no 2 workers at TP {', '.join(map(str, sorted(profiles)))}: "
                         "advise needs at least 2 workers (a P:D split has a prefill and a decode worker)")
    factors = sorted({1.0, *args.rate_factors})
    slo = advise.Slo(args.slo_ttft, args.slo_tpot)
    others = [f for f in factors if f != 1.0]
    single_turn = all(len(c.turns) == 1 for c in manifest.conversations)
    expected = planned(args.gpus, degrees, factors, args.search)
    name = next(iter(profiles.values())).model.name
    print(f"advise: {source} at {rate:g} conv/s ({len(manifest.conversations)} conversations), {args.gpus} "
          f"GPUs, {name} at TP {', '.join(map(str, degrees))}, {args.link} link; {args.search} search, then "
          f"the best {advise.SHORTLIST} and the replicas at "
          f"x{', x'.join(f'{f:g}' for f in others) or ' none'} "
          f"of the rate; ~{expected} simulations on {args.processes} processes", file=sys.stderr)
    for tp in degrees:
        print(f"  {describe(profiles[tp])}", file=sys.stderr)
    progress = Progress(expected, "advise", unit="simulations", every_s=15)
    started = time.monotonic()
    runner = Runner(manifest, {tp: profiles[tp] for tp in degrees}, args.processes, progress.step,
                    link=args.link, gpus=args.gpus, rate=rate, timeout_s=args.timeout, seed=args.seed,
                    slo=slo)
    points = search(runner, args.gpus, factors, args.weights, slo, args.search)
    nominal = [p for p in points if p.rate_factor == 1.0]
    front = advise.pareto_front(nominal)
    choice = advise.recommend(points, args.weights, slo, max(factors))
    costs = advise.weighted_costs(nominal, args.weights)
    over = "every turn (single-turn workload)" if single_turn else "follow-up turns (2+)"
    profile_names = ", ".join(profiles[tp].name for tp in degrees)
    print(f"{source}: {rate:g} conv/s, {args.gpus} GPUs ({profile_names}, {args.link} link); latencies over "
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
            row = "; ".join(f"{_label(p)} {p.policy} {c[id(p)]:.2f}"
                            + (f" ({p.slo_attainment or 0:.0%})" if slo.given else "") for p in ranked)
            print(f"  x{factor:<4g} {rate * factor:>7.2f} conv/s  best: {row or 'none met the success bar'}")
    if choice is None:
        print("\nno candidate met the 95% success bar at this rate: more GPUs, or a lower rate")
    else:
        b = choice.best
        weights = f" with PPD weights {b.policy[4:]}" if b.policy.startswith("ppd@") else f" ({b.policy})"
        workers = args.gpus // b.tp
        print(f"\nrecommended: {b.deployment} at TP{b.tp} ({workers} workers of {b.tp} GPU"
              f"{'s' if b.tp > 1 else ''}, {profiles[b.tp].name}){weights}; decided by {choice.key}: "
              f"{choice.margin}"
              + (f"; runner-up {_label(choice.runner_up)} {choice.runner_up.policy}"
                 if choice.runner_up else ""))
        if choice.better_reference is not None:
            r = choice.better_reference
            print(f"note: the reference policy {r.policy} on {_label(r)} did better on the same key "
                  f"(see the table); run the picker with --mode {_MODES.get(r.policy, r.policy)} for it")
    if args.plot:
        _plot(args.plot, nominal, front, choice.best if choice else None,
              f"{source}, {rate:g} conv/s, {args.gpus} GPUs ({profile_names})")
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode({
            "source": source, "rate": rate, "gpus": args.gpus,
            "profiles": {tp: profiles[tp].name for tp in degrees},
            "link": args.link, "search": args.search, "weights": args.weights, "slo": slo,
            "single_turn": single_turn, "points": points,
            "pareto_front": [[p.deployment, p.policy, p.tp] for p in front], "recommendation": choice})))
        print(f"json: {args.json}")
    return 0
