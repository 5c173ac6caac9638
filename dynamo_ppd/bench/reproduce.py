"""`just reproduce`: the paper's main results on the simulated H100 cluster (virtual clock).

- Table 1: x=1 vs x=0 follow-up TTFT by P:D configuration and load (WildChat-like).
- Table 3: per-metric wins of PPD, x=0 and x=1 over 3 configurations x 9 loads (WildChat-like).
- Fig. 5: link bandwidth sweep, 1P3D, 1 conversation/s (WildChat-like): PD drifts, PPD stays.
- Fig. 6: the w_tpot frontier on a prefill-heavy workload, 1P3D: share decode-local, TTFT, TPOT.

Writes ``docs/results.md`` and PNGs beside it. Loads are conversation arrival rates; the
WildChat-like conversations have ~2.5 turns, so the request rate is about 2.5x.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine.profile import load_profile
from ..policy.decision import Mode, Policy, PolicyConfig, ProfilePredictor
from ..policy.simulate import PolicyRouter
from ..policy.table import Weights, bundled_table, load_table, reweight
from ..sim import Cluster, simulate
from ..sim.outcome import CHAT_TIMEOUT_S
from ..sim.routing import local_router, pd_router
from .manifest import to_sim
from .workloads import make_workload

CONFIGS = ("1P3D", "2P2D", "3P1D")


def run(config: str, router, workload: str, rate: float, seconds: float, seed: int,
        bandwidth: float | None = None, timeout_s: float = CHAT_TIMEOUT_S) -> dict[str, float]:
    """One point, figures from the one outcome summary (`dynamo_ppd.sim.outcome`): turn-2+ TTFT
    mean with each failed follow-up at ``timeout_s`` (0: no follow-ups), p50s over successful
    requests, success as the share of all requests sent."""
    profile = load_profile()
    cluster = Cluster.from_config(profile, config, seed=seed, link_bandwidth_bytes_s=bandwidth)
    conversations = to_sim(make_workload(workload, rate, seconds, seed))
    result = simulate(cluster, conversations, router, timeout_s=timeout_s,
                      on_finish=getattr(router, "on_finish", None))
    o = result.outcome()

    def ms(value: float | None) -> float:
        return value * 1e3 if value is not None else 0.0

    return {"ttft2_p50_ms": ms(o.turn2.p50_ttft_s), "ttft2_mean_ms": ms(o.turn2_ttft_mean_with_timeouts_s),
            "tpot_p50_ms": ms(o.all_turns.p50_tpot_s), "tpot_mean_ms": ms(o.tpot_mean_s),
            "success": o.success_share, "local_share": result.local_share()}


def ppd_router(config: str, weights: Weights | None = None) -> PolicyRouter:
    weights = weights or Weights()
    table = reweight(load_table(bundled_table(config)), weights)
    policy = Policy(PolicyConfig(Mode.PPD, w_ttft=weights.w_ttft, w_tpot=weights.w_tpot),
                    ProfilePredictor(load_profile()), table)
    return PolicyRouter(policy)


def _progress(label: str) -> None:
    sys.stderr.write(f"  {label}\n")
    sys.stderr.flush()


def table1(rates, seconds, seed) -> tuple[str, dict]:
    rows, data = [], {}
    for config in CONFIGS:
        _progress(f"table 1: {config}")
        cells = []
        for rate in rates:
            x0 = run(config, pd_router, "wildchat", rate, seconds, seed)
            x1 = run(config, local_router, "wildchat", rate, seconds, seed)
            data[(config, rate)] = (x0, x1)
            if not x0["ttft2_mean_ms"]:
                cells.append("no follow-ups")
                continue
            change = x1["ttft2_mean_ms"] / x0["ttft2_mean_ms"] - 1
            cells.append(f"{x0['ttft2_mean_ms']:.0f} -> {x1['ttft2_mean_ms']:.0f} ({change:+.0%})")
        rows.append(f"| {config} | " + " | ".join(cells) + " |")
    header = "| config | " + " | ".join(f"{r:g} conv/s" for r in rates) + " |"
    return "\n".join([header, "|---" * (len(rates) + 1) + "|", *rows]), data


def table3(rates, seconds, seed) -> tuple[str, dict]:
    wins = {name: {"TTFT": 0, "TPOT": 0, "success": 0} for name in ("x=0", "x=1", "PPD")}
    points = 0
    for config in CONFIGS:
        _progress(f"table 3: {config}")
        for rate in rates:
            outcomes = {"x=0": run(config, pd_router, "wildchat", rate, seconds, seed),
                        "x=1": run(config, local_router, "wildchat", rate, seconds, seed),
                        "PPD": run(config, ppd_router(config), "wildchat", rate, seconds, seed)}
            points += 1
            for metric, key, better in (("TTFT", "ttft2_mean_ms", min), ("TPOT", "tpot_mean_ms", min),
                                        ("success", "success", max)):
                best = better(o[key] for o in outcomes.values())
                for name, o in outcomes.items():  # ties count for every system at the best value
                    wins[name][metric] += abs(o[key] - best) <= 1e-9 + 0.005 * abs(best)
    lines = [f"| system | turn-2+ TTFT wins | TPOT wins | success wins (of {points}) |", "|---|---|---|---|"]
    lines += [f"| {n} | {w['TTFT']} | {w['TPOT']} | {w['success']} |" for n, w in wins.items()]
    return "\n".join(lines), wins


def fig5(seconds, seed, out: Path) -> str:
    base = load_profile().transfer.link_bandwidth_bytes_s
    factors = [1, 0.5, 0.2, 0.1, 0.05, 0.02]
    rows: list[str] = []
    series: dict[str, list[dict]] = {"PD": [], "PPD": []}
    _progress("fig 5: bandwidth sweep")
    for factor in factors:
        pd = run("1P3D", pd_router, "wildchat", 1.0, seconds, seed, bandwidth=base * factor)
        ppd = run("1P3D", ppd_router("1P3D"), "wildchat", 1.0, seconds, seed, bandwidth=base * factor)
        series["PD"].append(pd)
        series["PPD"].append(ppd)
        rows.append(f"| {base * factor / 1e9:.1f} | {pd['ttft2_mean_ms']:.1f} | {ppd['ttft2_mean_ms']:.1f} | "
                    f"{pd['tpot_mean_ms']:.2f} | {ppd['tpot_mean_ms']:.2f} |")
    _plot(out / "fig5-bandwidth.png", [base * f / 1e9 for f in factors], series,
          "link bandwidth (GB/s)", "Fig. 5: bandwidth sweep (1P3D, 1 conv/s, WildChat-like)", log_x=True)
    return "\n".join(["| link GB/s | PD TTFT 2+ ms | PPD TTFT 2+ ms | PD TPOT ms | PPD TPOT ms |",
                      "|---|---|---|---|---|", *rows])


def fig6(seconds, seed, out: Path) -> str:
    weights = [0.5, 1, 2, 3, 6, 12]
    rows: list[str] = []
    series: dict[str, list[dict]] = {"PPD": []}
    _progress("fig 6: w_tpot frontier")
    x0 = run("1P3D", pd_router, "large_huge_paste", 4.0, seconds, seed)
    for w in weights:
        o = run("1P3D", ppd_router("1P3D", Weights(1, w)), "large_huge_paste", 4.0, seconds, seed)
        series["PPD"].append(o)
        rows.append(f"| {w:g} | {o['local_share']:.0%} | {o['ttft2_mean_ms']:.1f} | "
                    f"{o['tpot_mean_ms']:.2f} |")
    rows.append(f"| x=0 (PD) | 0% | {x0['ttft2_mean_ms']:.1f} | {x0['tpot_mean_ms']:.2f} |")
    _plot(out / "fig6-frontier.png", weights, series, "w_tpot (w_ttft = 1)",
          "Fig. 6: w_tpot frontier (1P3D, prefill-heavy, 4 conv/s)")
    return "\n".join(["| w_tpot | decode-local share | TTFT 2+ ms | TPOT ms |", "|---|---|---|---|", *rows])


def _plot(path: Path, xs, series: dict[str, list[dict]], xlabel: str, title: str,
          log_x: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, outcomes in series.items():
        axes[0].plot(xs, [o["ttft2_mean_ms"] for o in outcomes], "o-", label=name)
        axes[1].plot(xs, [o["tpot_mean_ms"] for o in outcomes], "o-", label=name)
    for ax, ylabel in zip(axes, ("turn-2+ TTFT mean (ms)", "TPOT mean (ms)"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        if log_x:
            ax.set_xscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.reproduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where results.md and PNGs go")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    t1, _ = table1([0.5, 1, 2, 4, 6, 8], args.seconds, args.seed)
    t3, _ = table3([0.5, 1, 2, 3, 4, 5, 6, 7, 8], args.seconds, args.seed)
    f5 = fig5(args.seconds, args.seed, args.out)
    f6 = fig6(args.seconds, args.seed, args.out)
    minutes = (time.monotonic() - started) / 60
    text = RESULTS_TEMPLATE.format(seconds=args.seconds, t1=t1, t3=t3, f5=f5, f6=f6, minutes=minutes)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


RESULTS_TEMPLATE = """# The paper's results on the simulated H100 cluster

Produced by `just reproduce` (`python -m dynamo_ppd.bench.reproduce`) in {minutes:.1f} minutes on 2
cores: the virtual-clock simulation of `dynamo_ppd.sim` with the default engine profile
(`h100-llama3.1-8b`), {seconds:g} s of conversation arrivals per run, WildChat-like conversations
unless stated, loads as conversation arrival rates (about 2.5 requests per conversation).
x=0 is classic PD (every follow-up through the prefill worker), x=1 sends every follow-up to its
decode worker, PPD is our router's policy (shipped table + online correction, weights 1,1).

## Table 1: follow-up TTFT, x=0 -> x=1 (mean ms, change)

{t1}

## Table 3: wins per metric over 3 configurations x 9 loads

{t3}

## Fig. 5: link bandwidth sweep (1P3D, 1 conv/s) — fig5-bandwidth.png

{f5}

## Fig. 6: the w_tpot frontier (1P3D, prefill-heavy follow-ups, 4 conv/s) — fig6-frontier.png

{f6}

## Where we differ from the paper, and why

- The paper measured real H100s through a Python proxy; our numbers come from the engine model's
  roofline costs (see README, "What the engine model says about interference"), without HTTP,
  tokenization or proxy overheads. Absolute TTFTs are therefore lower than the paper's 143.7 ms
  PD / ~51 ms PPD at WildChat 1P3D QPS 1; the ratios are what to compare.
- The simulated KV link is NVLink-class (225 GB/s effective): a 5K-token history moves in ~3 ms,
  so at the default bandwidth the transfer itself is a small part of PD's follow-up TTFT; the
  re-prefill on the prefill worker and its queue dominate. The paper's bandwidth sweep (Fig. 5)
  shows the same direction (PD degrades, PPD flat) but over a different range.
- Our WildChat-like and synthetic workloads are generated to the brief's published statistics, not
  sampled from the data sets; the paper's exact first-turn settings are not known to us.
"""


if __name__ == "__main__":
    raise SystemExit(main())
