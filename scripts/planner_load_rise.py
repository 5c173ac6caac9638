"""Dynamo's planner scaling the `ppd` graph under a rising load: does it add workers, does PPD route
to them, does anything fail?

`dynamo-ppd serve --planner` as a user runs it (Dynamo 1.6.1's planner in its virtual environment,
the launcher's VirtualConnector client, the `planner` extra installed), from ``--start`` (1P1D),
with the benchmark's time dilation: the simulated workers, router and picker run ``--dilation`` N
times slower and the benchmark client (bench/client.py) stretches its schedule by N, so figures are
in model seconds. The load is WildChat-like conversations arriving at each of ``--rates`` conv/s
for ``--step`` model seconds in turn. The planner ticks on the wall clock (every
``--interval`` s, N times more often in model time).

Every second the script reads the graph's processes and each decode worker's served requests by
route (``dynamo_ppd_worker_served_requests_total``); afterwards the planner's decisions (the
client's RUN_DIR/planner-decisions.jsonl and the planner's own summary lines). It writes OUT.json,
OUT.md (tables) and OUT.png (rate, workers and each decode worker's requests over time).

    uv sync --extra planner
    uv run python scripts/planner_load_rise.py --out docs/bench/issue42/planner-rise
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import msgspec

from dynamo_ppd.argtypes import positive_floats, replica_counts, up_down
from dynamo_ppd.bench.client import RequestResult, run_manifest
from dynamo_ppd.experiment.progress import Progress
from dynamo_ppd.experiment.stats import bootstrap
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.graph import replicas_of, speedup_args
from dynamo_ppd.launch.planner import DECISIONS_FILE, PlannerOptions
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.launch.scaler import read_decisions
from dynamo_ppd.workloads.generators import make_workload
from dynamo_ppd.workloads.manifest import Manifest

DEFAULTS = PlannerOptions()  # serve --planner's thresholds
_SERVED = re.compile(r'^dynamo_ppd_worker_served_requests_total\{route="([^"]+)"\}\s+(\S+)', re.MULTILINE)
_SUMMARY = re.compile(r"^(\S+)\s+INFO\s+base\._log_decision_summary: \[summary\] (\w+) \| current: "
                      r"prefill=(\d+) decode=(\d+) \| recommended: prefill=(\S+) decode=(\S+) .*?"
                      r"load_reason=(\S+)", re.MULTILINE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", type=positive_floats("rates"), default=[1.0, 2.0, 4.0, 8.0],
                   help="conv/s of each step, in order")
    p.add_argument("--step", type=float, default=20.0, help="model seconds of arrivals per rate")
    p.add_argument("--cut-after", type=float, default=10.0,
                   help="model seconds after the last arrival step at which the run is cut (turns then "
                   "in flight are left out, as `bench --cut-after` does)")
    p.add_argument("--workload", default="wildchat", help="named workload")
    p.add_argument("--dilation", type=float, default=10.0, help="time dilation N")
    p.add_argument("--graph", default="ppd", help="graph to serve")
    p.add_argument("--start", type=replica_counts, default={"prefill": 1, "decode": 1},
                   help="replicas at the start, e.g. prefill=1,decode=1")
    p.add_argument("--interval", type=int, default=DEFAULTS.interval_s,
                   help="the planner's tick, wall seconds")
    p.add_argument("--decode-kv", type=up_down(float), metavar="UP,DOWN",
                   default=(DEFAULTS.decode_kv_up, DEFAULTS.decode_kv_down),
                   help="the planner's decode KV thresholds, percent (serve --planner-decode-kv)")
    p.add_argument("--prefill-queue", type=up_down(int),
                   default=(DEFAULTS.prefill_queue_up, DEFAULTS.prefill_queue_down), metavar="UP,DOWN",
                   help="the planner's prefill queue thresholds, tokens (serve --planner-prefill-queue)")
    p.add_argument("--no-planner", action="store_true",
                   help="the baseline: the same load on the --start layout, nothing scaling it")
    p.add_argument("--replot", action="store_true",
                   help="start nothing: redraw OUT.png and rewrite OUT.md from OUT.json")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", type=Path, default=Path("docs/bench/issue42/planner-rise"),
                   help="writes OUT.json, OUT.md and OUT.png")
    return p.parse_args(argv)


def rising(workload: str, rates: list[float], step_s: float, seed: int) -> Manifest:
    """Conversations arriving at each rate for ``step_s`` in turn (arrival times shifted)."""
    conversations = []
    for index, rate in enumerate(rates):
        part = make_workload(workload, rate, step_s, seed + index)
        conversations += [msgspec.structs.replace(c, conversation_id=f"s{index}-{c.conversation_id}",
                                                  arrival_s=c.arrival_s + index * step_s)
                          for c in part.conversations if c.arrival_s < step_s]
    return Manifest(None, conversations)


def served(port: int | None) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:  # noqa: S310
            return {route: float(n) for route, n in _SERVED.findall(response.read().decode())}
    except OSError:
        return {}


class Sampler:
    """Every ``every_s``: the graph's prefill and decode replicas and each decode worker's served
    requests, with the model time since ``t0``."""

    def __init__(self, dep, t0: float, dilation: float, every_s: float = 1.0):
        self.dep, self.t0, self.n, self.every_s = dep, t0, dilation, every_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_exc):
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            procs = {p.label: p for p in list(self.dep.workers)}
            decode, prefill = replicas_of(list(procs), "decode"), replicas_of(list(procs), "prefill")
            self.samples.append({
                "t": round((time.monotonic() - self.t0) / self.n, 2), "prefill": sorted(prefill),
                "decode": {label: served(int(procs[label].env.get("DYN_SYSTEM_PORT") or 0))
                           for label in decode}})
            self._stop.wait(self.every_s)


def decisions(run_dir: Path, t0_unix: float, n: float) -> list[dict]:
    """The client's record of each decision, times in model seconds since the load began."""
    out = []
    for decision in read_decisions(run_dir / DECISIONS_FILE):
        d = msgspec.structs.asdict(decision)
        d["t"] = round((d["received_at"] - t0_unix) / n, 2)
        d["done_after_s"] = round(d["completed_at"] - d["received_at"], 2)  # wall
        out.append(d)
    return out


def planner_ticks(run_dir: Path) -> dict[str, int]:
    """How many of the planner's ticks ended in each summary (HOLD, SCALE_UP, ...) and why."""
    text = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    counts: dict[str, int] = defaultdict(int)
    for match in _SUMMARY.finditer(text):
        counts[f"{match.group(2)} ({match.group(7)})"] += 1
    return dict(counts)


def figures(results: list[RequestResult], rates: list[float], step_s: float) -> list[dict]:
    rows = []
    for index, rate in enumerate(rates):
        mine = [r for r in results if r.conversation_id.startswith(f"s{index}-") and not r.cut]
        follow = {r.conversation_id: [r.ttft_s] for r in mine if r.turn > 1 and r.ttft_s is not None}
        tpot = {r.conversation_id: [r.tpot_s] for r in mine if r.tpot_s is not None}
        ttft_i, tpot_i = bootstrap(follow), bootstrap(tpot)
        rows.append({"rate": rate, "from_s": index * step_s,
                     "conversations": len({r.conversation_id for r in mine}),
                     "turns": len(mine), "failed": sum(not r.ok for r in mine),
                     "ttft2_ms": None if ttft_i is None else [round(v * 1e3, 1) for v in
                                                              (ttft_i.value, ttft_i.low, ttft_i.high)],
                     "tpot_ms": None if tpot_i is None else [round(v * 1e3, 2) for v in
                                                             (tpot_i.value, tpot_i.low, tpot_i.high)]})
    return rows


def worker_rows(samples: list[dict]) -> list[dict]:
    """Per decode worker: when it first answered the sampler, and what it served since."""
    first: dict[str, float] = {}
    last: dict[str, dict[str, float]] = {}
    for sample in samples:
        for label, routes in sample["decode"].items():
            if routes or label in first:
                first.setdefault(label, sample["t"])
                last[label] = routes
    total = sum(sum(r.values()) for r in last.values()) or 1
    # What each served once the newest worker was serving: the split a join leads to.
    newest = max(first.values(), default=0.0)
    at_join: dict[str, dict[str, float]] = next((s["decode"] for s in samples if s["t"] >= newest), {})
    since = {label: sum(last[label].values()) - sum(at_join.get(label, {}).values()) for label in first}
    since_total = sum(since.values()) or 1
    return [{"worker": label, "seen_from_s": first[label], "served": last[label],
             "share": round(sum(last[label].values()) / total, 3),
             "share_since_last_join": round(since[label] / since_total, 3)} for label in sorted(first)]


WINDOW_S = 5.0  # model seconds over which the plot averages each worker's request rate


def plot(samples: list[dict], rates: list[float], step_s: float, decided: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].step([i * step_s for i in range(len(rates))] + [len(rates) * step_s], [*rates, rates[-1]],
                 where="post")
    axes[0].set_ylabel("arrivals (conv/s)")
    axes[1].step(t, [len(s["prefill"]) for s in samples], where="post", label="prefill workers")
    axes[1].step(t, [len(s["decode"]) for s in samples], where="post", label="decode workers")
    axes[1].set_ylabel("workers")
    axes[1].yaxis.get_major_locator().set_params(integer=True)
    axes[1].legend(loc="upper left")
    labels = sorted({label for s in samples for label in s["decode"]})
    for label in labels:
        points = [(s["t"], sum(s["decode"][label].values())) for s in samples if label in s["decode"]]
        times, rate, start = [], [], 0
        for t, count in points:
            while points[start][0] < t - WINDOW_S:
                start += 1
            if t - points[start][0] > 0:
                times.append(t)
                rate.append((count - points[start][1]) / (t - points[start][0]))
        axes[2].plot(times, rate, label=label)
    for ax in axes:
        for d in decided:
            ax.axvline(d["t"], color="grey", linestyle=":", linewidth=1)
    axes[2].set_ylabel(f"requests served /s ({WINDOW_S:g} s window)")
    axes[2].set_xlabel("model seconds since the load began")
    axes[2].legend(loc="upper left")
    fig.suptitle("Dynamo's planner on the ppd graph under a rising load (dotted: its decisions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict) -> str:
    lines = ["# serve --planner under a rising load\n", f"`{report['command']}` "
             f"(commit {report['commit']}, {report['date']})\n",
             f"Graph `{report['graph']}` from {report['start']}, workload {report['workload']}, dilation "
             f"x{report['dilation']:g} (times in model seconds), planner tick {report['interval']} s wall; "
             f"thresholds: decode KV {report['decode_kv']} %, prefill queue {report['prefill_queue']} "
             "tokens.\n",
             "## The planner's decisions\n", "| at (model s) | decision | before | added | retired | done "
             "after (wall s) |", "|---|---|---|---|---|---|"]
    for d in report["decisions"]:
        want = ", ".join(f"{role} {d[role]}" for role in ("prefill", "decode") if d[role] >= 0)
        before = f"{d['before'].get('prefill', 0)}P{d['before'].get('decode', 0)}D"
        lines.append(f"| {d['t']} | {d['decision_id']}: {want} | {before} | {', '.join(d['added']) or '-'} | "
                     f"{', '.join(d['retired']) or '-'} | {d['done_after_s']} |")
    lines += ["", "Ticks of the planner by outcome: " + ", ".join(f"{k} {v}" for k, v in
                                                                 sorted(report["ticks"].items())), "",
              "## Each rate step\n", "| conv/s | from (model s) | conversations | turns | failed | "
              "turn-2+ TTFT p50 ms [95%] | TPOT p50 ms [95%] |", "|---|---|---|---|---|---|---|"]
    for r in report["steps"]:
        ttft, tpot = (("-" if v is None else f"{v[0]} [{v[1]}, {v[2]}]")
                      for v in (r["ttft2_ms"], r["tpot_ms"]))
        lines.append(f"| {r['rate']:g} | {r['from_s']:g} | {r['conversations']} | {r['turns']} | "
                     f"{r['failed']} | {ttft} | {tpot} |")
    lines += ["", "## Decode workers\n", "| worker | serving from (model s) | decode-local | via prefill | "
              "share of decode requests | share once the last one joined |", "|---|---|---|---|---|---|"]
    for w in report["workers"]:
        lines.append(f"| {w['worker']} | {w['seen_from_s']} | {w['served'].get('decode_local', 0):g} | "
                     f"{w['served'].get('via_prefill', 0):g} | {w['share']:.0%} | "
                     f"{w.get('share_since_last_join', w['share']):.0%} |")
    failures = "".join(f"\n- {f['conversation']} turn {f['turn']}, sent at {f['sent_s']} s: "
                       + (f"error {f['error']}" if f["error"] else
                          f"{f['output_tokens']} tokens in {f['e2e_s']:.1f} s, past the 30 s chat timeout")
                       for f in report.get("failures", []))
    lines += ["", f"Turns: {report['turns']}, failed {report['failed']}, cut at the end {report['cut']}."
              + failures,
              "", f"![workers and load over time]({Path(report['plot']).name})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.out.with_suffix(".json").read_text())
        report["workers"] = worker_rows(report["samples"])
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        plot(report["samples"], report["rates"], report["step_s"], report["decisions"],
             args.out.with_suffix(".png"))
        args.out.with_suffix(".md").write_text(markdown(report))
        return 0
    rates, n, replicas = args.rates, args.dilation, args.start
    (kv_up, kv_down), (q_up, q_down) = args.decode_kv, args.prefill_queue
    start_layout = ",".join(f"{name}={count}" for name, count in replicas.items())
    manifest = rising(args.workload, rates, args.step, args.seed)
    import subprocess

    # The tree the run uses, read before it starts (a commit made during a 25-minute run is not it).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    run_dir = Path("runs") / f"planner-rise-{time.strftime('%Y%m%d-%H%M%S')}"
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    planned = "" if args.no_planner else " with Dynamo's planner"
    say(f"bringing up {args.graph} ({start_layout}){planned}; logs in {run_dir}/logs")
    dep = start(ServeOptions(graph=args.graph, http_port=free_port(), nats_port=free_port(),
                             etcd_port=free_port(), run_dir=run_dir, replicas=replicas, supervise=True,
                             extra_args=speedup_args(args.graph, n),
                             planner=None if args.no_planner else PlannerOptions(
                                 prefill_queue_up=q_up, prefill_queue_down=q_down, decode_kv_up=kv_up,
                                 decode_kv_down=kv_down, interval_s=args.interval)), log=say)
    try:
        total = sum(len(c.turns) for c in manifest.conversations)
        progress = Progress(total, "planner-rise", "turns", every_s=30.0)
        shown = ",".join(f"{r:g}" for r in rates)
        say(f"playing {len(manifest.conversations)} conversations at {shown} conv/s, "
            f"{args.step:g} model s each (x{n:g}: ~{len(rates) * args.step * n / 60:.0f} min of arrivals)")
        t0, t0_unix = time.monotonic(), time.time()
        with Sampler(dep, t0, n) as sampler:
            horizon = len(rates) * args.step + args.cut_after
            results = asyncio.run(run_manifest(dep.base_url, manifest, dilation=n, horizon_s=horizon,
                                               on_result=lambda r: progress.step(not r.ok and not r.cut)))
        progress.close()
        found = decisions(run_dir, t0_unix, n)
        ticks = {} if args.no_planner else planner_ticks(run_dir)
    finally:
        dep.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "uv run python scripts/planner_load_rise.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit, "date": time.strftime("%Y-%m-%d"), "graph": args.graph, "start": start_layout,
        "workload": args.workload, "rates": rates, "step_s": args.step, "dilation": n,
        "interval": args.interval, "decode_kv": f"{kv_up:g},{kv_down:g}",
        "prefill_queue": f"{q_up},{q_down}",
        "decisions": found, "ticks": ticks,
        "steps": figures(results, rates, args.step), "workers": worker_rows(sampler.samples),
        "turns": sum(not r.cut for r in results), "failed": sum(not r.ok and not r.cut for r in results),
        "cut": sum(r.cut for r in results), "plot": str(args.out.with_suffix(".png")),
        # each failure: an error, or an answer past the chat timeout (the benchmark's definition)
        "failures": [{"conversation": r.conversation_id, "turn": r.turn, "sent_s": round(r.sent_s, 2),
                      "e2e_s": r.e2e_s, "output_tokens": r.output_tokens, "error": r.error}
                     for r in results if not r.ok and not r.cut],
        "samples": sampler.samples,
    }
    plot(sampler.samples, rates, args.step, found, args.out.with_suffix(".png"))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
