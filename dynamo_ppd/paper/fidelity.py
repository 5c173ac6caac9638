"""`dynamo-ppd sim fidelity`: the simulator against the paper authors' own H100 measurements.

For each configuration it simulates every point of the authors' protocol (`sim paper`) with a
profile and compares it with the measured point of the same (configuration, workload, QPS):

- turn-2 mean TTFT and mean TPOT: median and p90 relative error |sim - measured| / measured,
  over the points where both sides completed turn-2 requests and the measurement did not crash;
  Spearman rank correlation over the same points (does the model order the points as the
  hardware does?);
- success agreement: the share of points, crash points excluded, where both sides agree on
  whether the point met the paper's 95% success bar;
- the decode-local share at weights (1, 1), (1, 3), (1, 6), (1, 12) for each x=0/x=1 family
  (``1P_3D`` vs ``1P_3pD`` ...): how often x=1 scores > 0 against x=0, from the simulated points
  beside the same figure from the measured ones (`paper_data.measured_local_share`).

Writes a markdown report, the JSON behind it and a predicted-vs-measured plot.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from ..argtypes import cli_error
from ..engine.profile import EngineProfile, ProfileError, load_profile
from ..experiment import plots
from ..sim.outcome import SUCCESS_BAR
from .measured import (
    MEASURED_FAMILIES,
    PaperDataError,
    PaperPoint,
    bundled_points,
    by_key,
    load_points,
    measured_local_share,
)
from .protocol import add_common_arguments, paper_specs, points_csv, resolve_link, run_points

DONE_CONFIGS = ("1P_3D", "1P_3pD", "3P_1D", "3P_1pD", "4R")  # issue 11's "Done when"
SHARE_WEIGHTS = ((1.0, 1.0), (1.0, 3.0), (1.0, 6.0), (1.0, 12.0))


class ErrorStats(msgspec.Struct, frozen=True):
    points: int
    median_rel_error: float | None
    p90_rel_error: float | None
    spearman: float | None


class ConfigFidelity(msgspec.Struct, frozen=True):
    config: str
    points: int  # simulated points with a measured twin
    crashed: int  # measured points left out of every figure (a server of the stack went down)
    ttft: ErrorStats  # turn-2 mean TTFT
    tpot: ErrorStats  # turn-2 mean TPOT
    success_agreement: float | None
    success_points: int


class ShareRow(msgspec.Struct, frozen=True):
    family: str
    w_tpot: float
    simulated: float | None
    measured: float | None


class Residual(msgspec.Struct, frozen=True):
    """How well one fitted constant of the profile explains the points it was fitted on."""

    constant: str
    value: float
    fitted_on: str
    points: int
    median_residual: float | None  # measured - simulated, in ``unit``
    unit: str


class FidelityReport(msgspec.Struct, frozen=True):
    profile: str
    link: str
    configs: list[ConfigFidelity]
    shares: list[ShareRow]
    residuals: list[Residual] = []


# Each fitted constant of a stack profile, and the points whose residual it sets: low load
# (no queueing, <= 2 conv/s), on the pure configurations whose requests all take one route.
_LOW_LOAD_QPS = 2.0


def _residual_rows(simulated: Sequence[PaperPoint], measured: dict[tuple[str, str, float], PaperPoint],
                   profile: EngineProfile | None) -> list[Residual]:
    def pairs(config: str, t1: str, low: bool = True) -> list[tuple[PaperPoint, PaperPoint]]:
        out = []
        for sim in simulated:
            meas = measured.get((sim.config, sim.workload, sim.qps))
            if (sim.config == config and sim.workload.startswith(t1 + "_") and meas is not None
                    and (sim.qps <= _LOW_LOAD_QPS) == low and sim.completed and meas.completed
                    and not meas.crashed):
                out.append((sim, meas))
        return out

    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    if profile is None:
        return []
    cost, stack, link = profile.cost, profile.stack, profile.transfer
    rows = []

    def add(constant: str, value: float, fitted_on: str, values: list[float], unit: str = "ms") -> None:
        rows.append(Residual(constant, value, fitted_on, len(values), median(values), unit))

    add("stack.request_overhead_s", stack.request_overhead_s, "4R, small T1: turn-1 mean TTFT",
        [m.turn1.avg_ttft_ms - s.turn1.avg_ttft_ms for s, m in pairs("4R", "small")])
    add("cost.gemm_flops_efficiency", cost.gemm_flops_efficiency, "4R, large T1: turn-1 mean TTFT",
        [m.turn1.avg_ttft_ms - s.turn1.avg_ttft_ms for s, m in pairs("4R", "large")])
    add("stack.handoff_overhead_s", stack.handoff_overhead_s, "1P_3D, small T1: turn-1 mean TTFT",
        [m.turn1.avg_ttft_ms - s.turn1.avg_ttft_ms for s, m in pairs("1P_3D", "small")])
    add("transfer.link_bandwidth_bytes_s", link.link_bandwidth_bytes_s, "1P_3D, large T1: turn-2 mean TTFT",
        [m.turn2.avg_ttft_ms - s.turn2.avg_ttft_ms for s, m in pairs("1P_3D", "large")])
    add("transfer.transfer_setup_s", link.transfer_setup_s,
        f"1P_3D, small T1, above {_LOW_LOAD_QPS:g} conv/s: turn-2 mean TTFT (the link's queue)",
        [m.turn2.avg_ttft_ms - s.turn2.avg_ttft_ms for s, m in pairs("1P_3D", "small", low=False)])
    add("stack.decode_local_overhead_s", stack.decode_local_overhead_s, "1P_3pD: turn-2 mean TTFT",
        [m.turn2.avg_ttft_ms - s.turn2.avg_ttft_ms for t1 in ("small", "large")
         for s, m in pairs("1P_3pD", t1)])
    add("cost.iteration_overhead_s", cost.iteration_overhead_s, "all five configs: turn-2 mean TPOT",
        [m.turn2.avg_tpot_ms - s.turn2.avg_tpot_ms for c in DONE_CONFIGS for t1 in ("small", "large")
         for s, m in pairs(c, t1)])
    add("cost.per_sequence_overhead_s", cost.per_sequence_overhead_s,
        f"all five configs above {_LOW_LOAD_QPS:g} conv/s: turn-2 mean TPOT",
        [m.turn2.avg_tpot_ms - s.turn2.avg_tpot_ms for c in DONE_CONFIGS for t1 in ("small", "large")
         for s, m in pairs(c, t1, low=False)])
    return [r for r in rows if r.points]


def _spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) < 3:
        return None

    def ranks(values: Sequence[float]) -> np.ndarray:
        order = np.argsort(values, kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(len(values))
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _errors(pairs: list[tuple[float, float]]) -> ErrorStats:
    """Relative errors of (simulated, measured) pairs."""
    if not pairs:
        return ErrorStats(0, None, None, None)
    rel = [abs(s - m) / m for s, m in pairs]
    return ErrorStats(len(pairs), float(np.median(rel)), float(np.percentile(rel, 90)),
                      _spearman([s for s, _ in pairs], [m for _, m in pairs]))


def compare_config(config: str, simulated: Sequence[PaperPoint],
                   measured: dict[tuple[str, str, float], PaperPoint]) -> ConfigFidelity:
    ttft: list[tuple[float, float]] = []
    tpot: list[tuple[float, float]] = []
    agree = considered = crashed = points = 0
    for sim in simulated:
        meas = measured.get((config, sim.workload, sim.qps))
        if meas is None:
            continue
        points += 1
        if meas.crashed:
            crashed += 1
            continue
        considered += 1
        agree += (sim.success_rate >= SUCCESS_BAR) == (meas.success_rate >= SUCCESS_BAR)
        if sim.completed and meas.completed:
            ttft.append((sim.turn2.avg_ttft_ms, meas.turn2.avg_ttft_ms))
            if sim.turn2.avg_tpot_ms > 0 and meas.turn2.avg_tpot_ms > 0:
                tpot.append((sim.turn2.avg_tpot_ms, meas.turn2.avg_tpot_ms))
    return ConfigFidelity(config, points, crashed, _errors(ttft), _errors(tpot),
                          agree / considered if considered else None, considered)


def local_shares(simulated: Sequence[PaperPoint], measured: Sequence[PaperPoint]) -> list[ShareRow]:
    """The decode-local share at each weight for every family whose two configs were simulated."""
    configs = {p.config for p in simulated}
    rows = []
    for family, (x0, x1) in MEASURED_FAMILIES.items():
        if x0 not in configs or x1 not in configs:
            continue
        keys = {(p.workload, p.qps) for p in simulated}
        measured_here = [p for p in measured if (p.workload, p.qps) in keys]
        for weights in SHARE_WEIGHTS:
            sim_share = measured_local_share(list(simulated), (x0, x1), weights).share
            meas_share = measured_local_share(measured_here, (x0, x1), weights).share
            rows.append(ShareRow(family, weights[1], sim_share, meas_share))
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: FidelityReport, command: str) -> str:
    lines = [f"# Simulator fidelity: `{report.profile}` against the paper's H100 measurements", "",
             f"Produced by `{command}` (link: {report.link}). Measured points: the paper authors' "
             "`comprehensive.csv` (freelulul/vllm-ppd, bundled in `dynamo_ppd/paper/data/`). Relative "
             "errors over points where both sides completed turn-2 requests; measured points where a "
             "server of their stack crashed are left out of every figure; success agreement: both "
             f"sides on the same side of the {SUCCESS_BAR:.0f}% success bar.", "",
             "| config | points | crashed | turn-2 TTFT median / p90 rel. error | TTFT rank corr. | "
             "TPOT median / p90 rel. error | TPOT rank corr. | success agreement |",
             "|---|---|---|---|---|---|---|---|"]
    for c in report.configs:
        lines.append(f"| {c.config} | {c.points} | {c.crashed} | {_pct(c.ttft.median_rel_error)} / "
                     f"{_pct(c.ttft.p90_rel_error)} (n={c.ttft.points}) | {_num(c.ttft.spearman)} | "
                     f"{_pct(c.tpot.median_rel_error)} / {_pct(c.tpot.p90_rel_error)} (n={c.tpot.points}) | "
                     f"{_num(c.tpot.spearman)} | {_pct(c.success_agreement)} (n={c.success_points}) |")
    if report.residuals:
        lines += ["", "## Fitted constants of the stack and their residuals", "",
                  f"Residual = measured - simulated, median over the points each constant is fitted on "
                  f"(<= {_LOW_LOAD_QPS:g} conv/s unless stated, where nothing queues).", "",
                  "| constant | value | fitted on | points | median residual |", "|---|---|---|---|---|"]
        for r in report.residuals:
            lines.append(f"| `{r.constant}` | {r.value:g} | {r.fitted_on} | {r.points} | "
                         f"{_num(r.median_residual, 1)} {r.unit} |")
    if report.shares:
        lines += ["", "## Decode-local share at w_ttft 1 (x=1 scores > 0 against x=0)", "",
                  "| family | w_tpot | simulated | measured |", "|---|---|---|---|"]
        for s in report.shares:
            lines.append(f"| {s.family} | {s.w_tpot:g} | {_pct(s.simulated)} | {_pct(s.measured)} |")
    return "\n".join(lines) + "\n"


def plot(simulated: Sequence[PaperPoint], measured: dict[tuple[str, str, float], PaperPoint],
         path: Path, title: str) -> None:
    plt = plots.pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    configs = sorted({p.config for p in simulated})
    for config in configs:
        pairs = [(s, measured[(config, s.workload, s.qps)]) for s in simulated
                 if s.config == config and (config, s.workload, s.qps) in measured]
        pairs = [(s, m) for s, m in pairs if s.completed and m.completed and not m.crashed]
        axes[0].scatter([m.turn2.avg_ttft_ms for _, m in pairs], [s.turn2.avg_ttft_ms for s, _ in pairs],
                        s=12, alpha=0.7, label=config)
        axes[1].scatter([m.turn2.avg_tpot_ms for _, m in pairs], [s.turn2.avg_tpot_ms for s, _ in pairs],
                        s=12, alpha=0.7, label=config)
    for ax, name in ((axes[0], "turn-2 mean TTFT (ms)"), (axes[1], "turn-2 mean TPOT (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_xlim()
        lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
        ax.set_xlabel(f"measured {name}")
        ax.set_ylabel(f"simulated {name}")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    plots.save(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dynamo-ppd sim fidelity`."""
    parser.add_argument("--configs", default=",".join(DONE_CONFIGS), metavar="NAMES",
                        help="comma-separated paper configurations to simulate and compare (default: "
                        f"{','.join(DONE_CONFIGS)})")
    add_common_arguments(parser)
    parser.add_argument("--points", type=Path, metavar="CSV",
                        help="compare these simulated points (a `sim paper --out` file) instead of "
                        "simulating again (--profile: the profile they were simulated with)")
    parser.add_argument("--out", type=Path, metavar="PREFIX",
                        help="write PREFIX.md, PREFIX.json, PREFIX.png and PREFIX-points.csv "
                        "(e.g. docs/fidelity)")


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd sim fidelity`: 0 when the comparison ran, 2 with a one-line error."""
    try:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
        measured_points = bundled_points()
        profile = load_profile(args.profile)
        if args.points is not None:
            simulated = load_points(args.points)
            configs = list(dict.fromkeys(p.config for p in simulated))
        else:
            specs = [s for c in configs for s in paper_specs(c, args.workloads, args.qps, args.seed)]
            link = resolve_link(args.link)
    except (ProfileError, PaperDataError, ValueError) as exc:
        return cli_error(exc)
    if args.points is None:
        simulated = run_points(profile, specs, link, args.jobs, label="sim fidelity")
        profile_name = profile.name
    else:  # --profile names the profile the points were simulated with
        profile_name = f"{profile.name} (points from {args.points})"
    fitted = profile if profile.stack.request_overhead_s > 0 and args.link == "profile" else None
    measured = by_key(measured_points)
    per_config = [compare_config(c, [p for p in simulated if p.config == c], measured) for c in configs]
    report = FidelityReport(profile_name, args.link, per_config, local_shares(simulated, measured_points),
                            _residual_rows(simulated, measured, fitted))
    text = markdown(report, "dynamo-ppd " + " ".join(sys.argv[1:]))
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
        Path(f"{args.out}-points.csv").write_text(points_csv(simulated))
        plot(simulated, measured, args.out.with_suffix(".png"), f"{profile_name}: simulated vs measured")
        print(f"wrote {args.out}.md, .json, .png, -points.csv")
    return 0
