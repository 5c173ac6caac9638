"""The load sweeps' part of `docs/policies.md`, "Where disaggregation pays": P/D with PPD against
replicas (the same GPUs as aggregated workers) and against the other P/D policies, on the
workloads of `dynamo_ppd.studies.saturation`, at every rung of each lane's ladder up to its
saturation; a table per question and PNGs of P99 turn-2+ TTFT and P50 TPOT against output
throughput per GPU (the paper's Fig. 1 axes).

Figures are over successful requests, as everywhere (`dynamo_ppd.sim.outcome`); ratios carry
95% intervals from paired bootstrap resamples of the conversations (`policy_points`) and the
number of conversations behind them. The verdict at a rate is the page's score at w_tpot 1
(turn-2+ mean TTFT and TPOT, the 95% success bar), so it agrees with the rest of the page,
unless one side is at or past its saturation there and the other is not: then the side that
keeps up wins (a policy that saturated at a lower rung has no point at this one).

With several seeds (`sim compare --seeds`), the section and its PNGs read the first seed's
points (the intervals pair one seed's conversations); the page's "Done-when check" and family
table (`families`) pool every seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..experiment import plots
from .policy_points import PolicyPoint, outcome_of, paired_ratio, score, tokens_per_sec_per_gpu
from .saturation import (
    SATURATION_FACTOR,
    SATURATION_FLOOR_S,
    SWEEPS,
    Lane,
    Saturation,
    lane_of,
    saturation_rates,
)
from .standings import OTHER_DEPLOYMENTS

REPLICAS = "replicas"
W_TPOT = 1.0  # the weights of the verdict: the paper's default (1, 1)
# What each sweep is, for the page (the generators' docstrings say it at length).
DESCRIPTIONS = {
    "long-context": "the paper's Fig. 1 workload: turn 1 sends 10,000 tokens, 4 follow-ups append 100 "
                    "each, every turn answers 100 (5 turns, no think time)",
    "many-turn": "2-16 turns per conversation, the count drawn uniformly (mean 9; the paper's Fig. 10 "
                 "range), ShareGPT-sized user messages (the first median 24 tokens, later ones 16: small "
                 "appends), short replies (median 64, p90 192), each turn sent when the previous answer "
                 "ends (the paper's protocol)",
    "agent-32k": "an agent loop (sizes assumed, not fitted): turn 1 median 6,000 tokens (system prompt, "
                 "tool schemas, task), each follow-up a tool output of median 2,500 / p90 6,000 tokens, "
                 "replies median 80 (tool calls), turns until the context would pass 32,768 tokens "
                 "(~9 turns), tool time exponential with mean 1 s (an idle session's KV stays cached)",
    "coding-agent": "Claude Code / Codex-like sessions from TraceLab's published distributions: a shared "
                    "16K-token system prompt, ~9 user requests of ~9 LLM steps, tool outputs median ~860 "
                    "tokens (90% under 1K, a tail to 32K), replies median 214, sub-second tool gaps with a "
                    "tail of minutes, human pauses of minutes, contexts up to 131K tokens",
}


def ppd_policy(points: Sequence[PolicyPoint]) -> str | None:
    """The PPD the section reads: at w_tpot 1 if it ran, else the lowest weight that ran."""
    weights = sorted({float(p.policy[4:]) for p in points if p.policy.startswith("ppd@")})
    if not weights:
        return None
    return f"ppd@{W_TPOT:g}" if W_TPOT in weights else f"ppd@{weights[0]:g}"


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def _ratio(a: PolicyPoint | None, b: PolicyPoint | None, figure: str) -> str:
    interval = paired_ratio(a, b, figure) if a is not None and b is not None else None
    return "-" if interval is None else f"{interval.text(2)}"


def _versus(a: PolicyPoint | None, b: PolicyPoint | None, sat: dict[Lane, Saturation]) -> str:
    """PPD's (``a``) outcome against replicas (``b``) at one rate: the score, unless one of them
    is at or past its saturation there and the other is not (a queue growing for the whole
    window is a loss whatever the follow-ups' latencies: the score reads turns 2+ only, and a
    P/D configuration saturates on its turn-1 prefills first)."""
    def past(p: PolicyPoint | None) -> bool:
        s = None if p is None else sat.get(lane_of(p))
        return p is None or (s is not None and s.saturated_at is not None and p.rate >= s.saturated_at)

    if a is None and b is None:
        return "-"
    if past(a) != past(b):
        return "loss (PPD saturated)" if past(a) else "win (replicas saturated)"
    if a is None or b is None:
        return "both saturated"
    value = score(a, b, W_TPOT)
    return f"{outcome_of(value)} {value:+.2f}" if abs(value) != float("inf") else outcome_of(value)


def _ranges(rates: list[tuple[float, str]]) -> dict[str, list[str]]:
    """Consecutive rungs with one outcome as ranges: {"win": ["0.5-2", "8"], ...}."""
    out: dict[str, list[str]] = {}
    run: list[float] = []
    for i, (rate, what) in enumerate(rates):
        run.append(rate)
        if i + 1 == len(rates) or rates[i + 1][1] != what:
            out.setdefault(what, []).append(f"{run[0]:g}" if len(run) == 1 else f"{run[0]:g}-{run[-1]:g}")
            run = []
    return out


def first_seed(points: Sequence[PolicyPoint]) -> list[PolicyPoint]:
    """The sweep points of the lowest seed that ran."""
    swept = [p for p in points if p.workload in SWEEPS]
    seed = min((p.seed for p in swept), default=0)
    return [p for p in swept if p.seed == seed]


def section(points: Sequence[PolicyPoint], stem: str = "policies") -> list[str]:
    """The section's markdown lines (none without sweep points)."""
    swept = first_seed(points)
    ppd = ppd_policy(swept)
    if not swept or ppd is None:
        return []
    by_key = {(p.config, p.link, p.workload, p.rate, p.policy): p for p in swept}
    lanes = sorted({(p.workload, p.config, p.link) for p in swept},
                   key=lambda k: (list(SWEEPS).index(k[0]), k[1], k[2]))
    sat = saturation_rates(swept)
    links = sorted({p.link for p in swept})
    seeds = sorted({p.seed for p in points if p.workload in SWEEPS})
    lines = ["## Where disaggregation pays", "",
             "The grid above is the paper's small two-turn workloads, mostly at light load. The paper's case "
             "for P/D is long contexts and many turns near saturation, so `sim compare` also sweeps three "
             f"such workloads up to saturation, on the {', '.join(links)} link"
             + ("" if len(seeds) < 2 else f" (seed {swept[0].seed}'s runs of seeds {seeds}: the Done-when "
                "check above pools them)") + ":", ""]
    lines += [f"- `{name}`: {DESCRIPTIONS.get(name, name)}; rates {sweep.rates()[0]:g} conv/s x "
              f"{sweep.step:.3g}^k up to {sweep.rates()[-1]:g}, {sweep.window_s:g} s of Poisson arrivals "
              f"per point (longer at light rates: at least ~{sweep.min_conversations} conversations), "
              f"{sweep.timeout_s:g} s timeout." for name, sweep in SWEEPS.items()
              if any(p.workload == name for p in swept)]
    lines += ["", "**How saturation is found** (`dynamo_ppd/studies/saturation.py`): every (configuration, "
              "policy) climbs its workload's ladder and stops after its first saturated rung: under 95% "
              "success, or a median TTFT (turn 1, or turns 2+) over "
              f"{SATURATION_FACTOR:g}x its own at the lightest rung and over "
              f"{SATURATION_FLOOR_S * 1e3:.0f} ms. "
              "The sustained rate is the last rung before it (`>=`: never saturated up to the last rung; "
              "`<`: saturated at the lightest). A policy absent at a rate had saturated below it.", "",
              f"PPD is `{ppd}`; replicas are the configuration's GPUs as aggregated workers (Dynamo's KV "
              "router). Throughput is output tokens/s of successful requests over the point's duration, per "
              "GPU. Ratios are PPD over replicas with the 95% paired-bootstrap interval over the "
              "point's n conversations (the same conversations on both sides); the verdict is the page's "
              "score at w_tpot 1 (turn-2+ mean TTFT and TPOT, the success bar), unless one side is at or "
              "past its saturation and the other is not: then the side that keeps up wins.", ""]
    lines += _verdicts(lanes, by_key, ppd, sat)
    lines += _saturation_table(lanes, sat, by_key, ppd, swept[0].seed)
    lines += _detail_table(lanes, by_key, ppd, sat)
    lines += [f"![P99 turn-2+ TTFT against throughput per GPU]({stem}-sweep-{links[0]}-p99-ttft.png)", "",
              f"![P50 turn-2+ TPOT against throughput per GPU]({stem}-sweep-{links[0]}-tpot.png)", ""]
    return lines


def _rates(by_key: dict, workload: str, config: str, link: str) -> list[float]:
    return sorted({k[3] for k in by_key if k[:3] == (config, link, workload)})


def _verdicts(lanes, by_key, ppd: str, sat: dict[Lane, Saturation]) -> list[str]:
    lines = ["**Where P/D with PPD beats replicas, and where replicas win** (per rate, conv/s: the score "
             "at w_tpot 1, or the side that keeps up where the other has saturated):", ""]
    one_link = len({lane[2] for lane in lanes}) == 1
    order = ("win", "tie", "loss")
    for workload, config, link in lanes:
        outcomes = []
        for rate in _rates(by_key, workload, config, link):
            verdict = _versus(by_key.get((config, link, workload, rate, ppd)),
                              by_key.get((config, link, workload, rate, REPLICAS)), sat)
            if verdict.split(" ")[0] in order:
                outcomes.append((rate, verdict.split(" ")[0]))
        ranges = sorted(_ranges(outcomes).items(), key=lambda kv: order.index(kv[0]))
        text = "; ".join((f"PPD {what}s" if what != "loss" else "replicas win") + f" at {', '.join(rs)}"
                         for what, rs in ranges)
        where = config if one_link else f"{config} ({link})"
        lines.append(f"- `{workload}`, {where}: {text or 'no common rate'}.")
    return [*lines, ""]


def _sustained_cell(sat: dict[Lane, Saturation], by_key: dict, lane: Lane) -> str:
    """A lane's sustained rate and its throughput per GPU there."""
    s = sat.get(lane)
    if s is None:
        return "-"
    point = by_key.get((*lane[:3], s.sustained, lane.policy)) if s.sustained else None
    return s.text() + (f" ({tokens_per_sec_per_gpu(point):.0f})" if point is not None else "")


def _saturation_table(lanes, sat: dict[Lane, Saturation], by_key, ppd: str, seed: int) -> list[str]:
    """Every policy's sustained rate, a column each: PPD, replicas, the fixed rules, the peers."""
    first = [ppd, REPLICAS, "x0", "x1"]
    ran = {lane.policy for lane in sat}
    others = sorted(p for p in ran - set(first) if not p.startswith("ppd@"))
    policies = [p for p in first if p in ran] + others
    lines = ["Sustained rate (conv/s) of each policy, and its output throughput per GPU there (tok/s/GPU):",
             "",
             "| workload | config | " + " | ".join("PPD" if p == ppd else p for p in policies) + " |",
             "|---|---|" + "---|" * len(policies)]
    for workload, config, link in lanes:
        cells = [_sustained_cell(sat, by_key, Lane(config, link, workload, p, seed)) for p in policies]
        lines.append(f"| {workload} | {config} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _at_saturation(p: PolicyPoint | None, sat: dict[Lane, Saturation]) -> str:
    """``*`` on the rung where the point's lane saturated."""
    s = None if p is None else sat.get(lane_of(p))
    return "*" if p is not None and s is not None and s.saturated_at == p.rate else ""


def _pair(a: PolicyPoint | None, b: PolicyPoint | None, field: str, sat: dict[Lane, Saturation],
          digits: int = 0) -> str:
    return " / ".join(f"{_ms(getattr(p, field) if p else None, digits)}{_at_saturation(p, sat)}"
                      for p in (a, b))


def _detail_table(lanes, by_key, ppd: str, sat: dict[Lane, Saturation]) -> list[str]:
    lines = ["Every rate, PPD / replicas (ms; ratio PPD/replicas [95% CI]; a `*` marks a rung where that "
             "policy saturated):", "",
             "| workload | config | conv/s | n | TTFT P50 | ratio | TTFT P99 | ratio | TPOT P50 | ratio "
             "| tok/s/GPU | PPD vs replicas | PPD vs best other P/D |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload, config, link in lanes:
        for rate in _rates(by_key, workload, config, link):
            a = by_key.get((config, link, workload, rate, ppd))
            b = by_key.get((config, link, workload, rate, REPLICAS))
            if a is None and b is None:
                continue
            per_gpu = " / ".join("-" if p is None else f"{tokens_per_sec_per_gpu(p):.0f}" for p in (a, b))
            n = (a or b).conversations if (a or b) else 0
            rivals = [p for k, p in by_key.items() if k[:4] == (config, link, workload, rate)
                      and k[4] not in OTHER_DEPLOYMENTS and not k[4].startswith("ppd@")]
            lines.append(f"| {workload} | {config} | {rate:g} | {n} | "
                         f"{_pair(a, b, 'turn2_p50_ttft_s', sat)} | {_ratio(a, b, 'p50 ttft')} | "
                         f"{_pair(a, b, 'turn2_p99_ttft_s', sat)} | "
                         f"{_ratio(a, b, 'p99 ttft')} | {_pair(a, b, 'turn2_p50_tpot_s', sat, 1)} | "
                         f"{_ratio(a, b, 'p50 tpot')} | {per_gpu} | {_versus(a, b, sat)} | "
                         f"{_best_rival(a, rivals)} |")
    return [*lines, ""]


def _best_rival(ppd: PolicyPoint | None, others: list[PolicyPoint]) -> str:
    """PPD's score against the best other P/D policy at the point (the one it scores lowest
    against), and which one."""
    if ppd is None or not others:
        return "-"
    value, name = min((score(ppd, o, W_TPOT), o.policy) for o in others)
    shown = outcome_of(value) if abs(value) == float("inf") else f"{value:+.2f}"
    return f"{shown} ({name})"


# -- plots ---------------------------------------------------------------------------------------

def plot(points: Sequence[PolicyPoint], out_dir: Path, stem: str) -> list[Path]:
    """Per link, two PNGs (rows: workloads; columns: configurations): P99 turn-2+ TTFT and P50
    turn-2+ TPOT against output tokens/s per GPU, one line per policy up its ladder, a cross on
    the rung where it saturated."""
    swept = first_seed(points)
    ppd = ppd_policy(swept)
    if not swept or ppd is None:
        return []
    plt = plots.pyplot()
    sat = saturation_rates(swept)
    workloads = [w for w in SWEEPS if any(p.workload == w for p in swept)]
    configs = sorted({p.config for p in swept})
    policies = sorted({p.policy for p in swept if not p.policy.startswith("ppd@") or p.policy == ppd})
    # PPD and replicas (the question) bold, the fixed rules solid, the peers thin and dashed in
    # colours none of those use.
    styles = {ppd: ("tab:red", 2.5, "-"), REPLICAS: ("black", 2.5, "-"), "x0": ("tab:blue", 1.5, "-"),
              "x1": ("tab:green", 1.5, "-")}
    spare = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "tab:orange"])
    for policy in policies:
        styles.setdefault(policy, (next(spare, "tab:gray"), 1.0, "--"))
    paths = []
    for link in sorted({p.link for p in swept}):
        for field, label, name in (("turn2_p99_ttft_s", "turn-2+ P99 TTFT (ms, log)", "p99-ttft"),
                                   ("turn2_p50_tpot_s", "turn-2+ P50 TPOT (ms, log)", "tpot")):
            fig, axes = plt.subplots(len(workloads), len(configs), squeeze=False,
                                     figsize=(5 * len(configs), 4 * len(workloads)))
            for row, workload in enumerate(workloads):
                for col, config in enumerate(configs):
                    ax = axes[row][col]
                    for policy in policies:
                        mine = sorted((p for p in swept if (p.workload, p.config, p.link, p.policy)
                                       == (workload, config, link, policy) and getattr(p, field)),
                                      key=lambda p: p.rate)
                        if not mine:
                            continue
                        color, width, line = styles[policy]
                        xs = [tokens_per_sec_per_gpu(p) for p in mine]
                        ys = [1e3 * getattr(p, field) for p in mine]
                        ax.plot(xs, ys, line, marker="o", color=color, lw=width, ms=3, label=policy)
                        s = sat.get(Lane(config, link, workload, policy, mine[0].seed))
                        if s is not None and s.saturated_at is not None:
                            ax.plot(xs[-1], ys[-1], "x", color=color, ms=9, mew=2)
                    ax.set_yscale("log")
                    ax.grid(alpha=0.3)
                    ax.set_title(f"{workload}, {config} (replicas: the same GPUs aggregated)", fontsize=9)
                    ax.set_xlabel("output tok/s per GPU")
                    ax.set_ylabel(label)
            axes[0][0].legend(fontsize=6, ncol=2)
            fig.suptitle(f"Load sweeps to saturation, {link} link: {label} against throughput per GPU "
                         "(x: the rung where the policy saturated)")
            paths.append(plots.save(fig, out_dir / f"{stem}-sweep-{link}-{name}.png", dpi=90))
    return paths
