"""How often a coding agent's follow-up finds its history gone from its decode worker, and what
that turn costs (issue 41, item 5), on the simulator (`dynamo-ppd sim run --json`).

For each rate and router: the follow-ups whose decode worker still held all of the history the
session had sent and received (kept), part of it (part: >= half, PPD keeps it decode-local and
recomputes the rest there), or less than half (gone: PPD sends it through a prefill worker,
``history_evicted``), with their turn-2+ TTFT; and the sessions' live history (from a session's
first request to its last answer: its context) against the decode workers' KV capacity, which
is why histories go. Each run is ``--duration`` s of arrivals on ``--config``.

    uv run python scripts/agent_history.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path


def _by_conversation(records: list[dict]) -> list[list[dict]]:
    """Each conversation's records, in turn order."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r["conversation_id"]].append(r)
    return [sorted(turns, key=lambda r: r["turn"]) for turns in by.values()]


def _classes(records: list[dict]) -> tuple[Counter, dict[str, list[float]]]:
    counts: Counter = Counter()
    ttft: dict[str, list[float]] = defaultdict(list)
    for turns in _by_conversation(records):
        for before, r in zip(turns, turns[1:], strict=False):
            history = before["prompt_tokens"] + before["output_tokens"]
            share = r["cached_tokens"] / history if history else 1.0
            kind = "gone" if share < 0.5 else "part" if share < 0.99 else "kept"
            counts[kind] += 1
            counts[(kind, r["route"])] += 1
            if r["ttft_s"] is not None:
                ttft[kind].append(r["ttft_s"] * 1e3)
    return counts, ttft


def _live_history(records: list[dict], start_s: float, end_s: float) -> float:
    """The median over [start_s, end_s] of the sessions' contexts summed, in tokens."""
    events: list[tuple[float, int]] = []
    for turns in _by_conversation(records):
        size = 0
        for r in turns:
            grown = r["prompt_tokens"] + r["output_tokens"]
            events.append((r["arrival_s"], grown - size))
            size = grown
        events.append((max(r["finished_s"] or r["arrival_s"] for r in turns), -size))
    events.sort()
    live, samples = 0, []
    for t, change in events:
        live += change
        if start_s <= t <= end_s:
            samples.append(live)
    return statistics.median(samples) if samples else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="0.2,0.5,1", help="conversations/s")
    p.add_argument("--routers", default="ppd,local", help="sim run --router values")
    p.add_argument("--config", default="1P3D", help="workers")
    p.add_argument("--duration", type=float, default=300, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    args = p.parse_args()
    from dynamo_ppd.engine.profile import load_profile

    profile = load_profile("h100-llama3.1-8b")
    decode_workers = int(args.config.split("P")[1].rstrip("D"))
    capacity = profile.kv_capacity_blocks() * profile.engine.block_size * decode_workers
    print("$ uv run python " + " ".join([sys.argv[0], *sys.argv[1:]]))
    print(f"coding-agent on {args.config}, {args.duration:g} s of arrivals, seed {args.seed}; decode KV "
          f"capacity {capacity / 1e6:.2f}M tokens ({decode_workers} workers)\n")
    print("| conv/s | router | follow-ups | kept | part (local / via) | gone (local / via) | TTFT p50 ms: "
          "kept / part / gone | live history, median |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates.split(","):
            for router in args.routers.split(","):
                out = Path(tmp) / f"{router}-{rate}.json"
                command = ["sim", "run", "--workload", "coding-agent", "--config", args.config, "--router",
                           router, "--qps", rate, "--duration", str(args.duration), "--seed", str(args.seed),
                           "--json", str(out)]
                subprocess.run([sys.executable, "-m", "dynamo_ppd", *command], check=True,
                               stdout=subprocess.DEVNULL)
                records = json.loads(out.read_text())["records"]
                counts, ttft = _classes(records)
                n = counts["kept"] + counts["part"] + counts["gone"]

                def share(kind: str, n: int = n, counts: Counter = counts) -> str:
                    return (f"{100 * counts[kind] / n:.1f}% ({counts[(kind, 'decode_local')]} / "
                            f"{counts[(kind, 'via_prefill')]})")

                p50 = " / ".join(f"{statistics.median(ttft[k]):.0f}" if ttft[k] else "-"
                                 for k in ("kept", "part", "gone"))
                live = _live_history(records, args.duration, 5 * args.duration)
                print(f"| {rate} | {router} | {n} | {100 * counts['kept'] / n:.1f}% | {share('part')} | "
                      f"{share('gone')} | {p50} | {live / 1e6:.2f}M |", flush=True)


if __name__ == "__main__":
    main()
