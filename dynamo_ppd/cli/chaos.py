"""`dynamo-ppd chaos`: the workload against a supervised graph, one fault per run, the report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import msgspec

from ..chaos.report import REPORT_VERSION, ChaosReport, Fault, TurnRecord, analyze, markdown, passed
from ..chaos.run import FAULT_REPLICAS, FAULTS, RunSettings, run_fault

NOTES_MARKER = "<!-- notes: kept when the report is rewritten -->"

DESCRIPTION = (
    "Bring up a supervised graph (default ppd, 1P3D; 2P2D for prefill-kill, two router replicas for "
    "router-restart), play a multi-turn workload against it (default WildChat-like at 2 conv/s) and "
    "inject one fault at --fault-at: SIGKILL the busiest decode or prefill worker, restart a router "
    "replica, restart etcd or restart NATS. Each fault gets a fresh graph. Per fault the report "
    "gives failed requests, truncated streams (no finish_reason, an error event, or fewer tokens "
    "than max_tokens with ignore_eos), added p99 TTFT (the --window after the fault minus the one "
    "before) and the recovery time (until the decode-local share of follow-ups, told by their "
    "cached_tokens, is back to its pre-fault level), as markdown and JSON. Progress on stderr; "
    "exit 1 when any fault failed or truncated a request.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..argtypes import comma_choices, replica_counts

    parser.add_argument("--faults", type=comma_choices("fault", FAULTS, separator=","),
                        default=list(FAULTS),
                        help=f"comma-separated, from {','.join(FAULTS)}; one fresh graph each")
    parser.add_argument("--graph", default="ppd", help="graph name or YAML path (as for serve)")
    parser.add_argument("--replicas", type=replica_counts, default={},
                        help="replica counts over each fault's layout (default layouts: "
                        + "; ".join(f"{k}: {v or 'graph'}" for k, v in FAULT_REPLICAS.items()) + ")")
    parser.add_argument("--qps", type=float, default=2.0, help="conversation arrival rate (conv/s)")
    parser.add_argument("--workload", default="wildchat", help="generated workload (docs/manifest.md)")
    parser.add_argument("--duration", type=float, default=90.0,
                        help="seconds of the run; no turn is sent after it")
    parser.add_argument("--fault-at", type=float, default=45.0, help="seconds from the start to the fault")
    parser.add_argument("--target", help="process label to hit (e.g. decode-1, router-1); default: "
                        "the busiest decode/prefill worker, the first router replica")
    parser.add_argument("--aim", type=float, default=10.0,
                        help="worker kills: wait up to this many seconds after --fault-at for a worker "
                        "with a request in flight, so the kill cuts an answer (or a prefill)")
    parser.add_argument("--window", type=float, default=25.0,
                        help="seconds before/after the fault compared for p99 TTFT and the pre-fault "
                        "decode-local share")
    parser.add_argument("--recovery-window", type=float, default=10.0,
                        help="window of follow-ups whose decode-local share must be back")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="how far under the pre-fault share still counts as recovered")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", type=Path, default=Path("docs/chaos"),
                        help="report path without extension: writes OUT.md and OUT.json")
    parser.add_argument("--records", action="store_true",
                        help="also write every turn record to OUT-records.json")
    parser.add_argument("--reanalyze", action="store_true",
                        help="start nothing: recompute OUT.md/OUT.json from OUT.json and "
                        "OUT-records.json (a run with --records) with this command's --window, "
                        "--recovery-window and --tolerance")
    parser.add_argument("--run-root", type=Path, default=Path("runs/chaos"),
                        help="where each fault's graph keeps its logs")


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _write(report: ChaosReport, out: Path, records: dict[str, list[TurnRecord]] | None) -> None:
    table = markdown(report.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    md = out.with_suffix(".md")
    # Hand-written notes under NOTES_MARKER survive a rerun.
    old = md.read_text() if md.is_file() else ""
    notes = old[old.index(NOTES_MARKER):] if NOTES_MARKER in old else f"{NOTES_MARKER}\n"
    md.write_text(
        f"# Chaos run\n\n`{report.command}` ({time.strftime('%Y-%m-%d')}, tree {report.commit or 'unknown'}):"
        f" {report.workload} at {report.rate_conv_per_s:g} conv/s, {report.duration_s:g} s per fault, a "
        f"fresh supervised graph per fault. p99 TTFT: turns sent in the {report.window_s:g} s before vs "
        f"after the fault. Recovery: from the fault to the first {report.recovery_window_s:g} s window "
        f"of follow-ups whose decode-local share is back within {100 * report.tolerance:g} points of "
        f"the share in the {report.recovery_window_s:g} s before the fault (the 'decode-local before' "
        f"column; 'after' is from the recovery on). dynamo_ppd/chaos/report.py defines each column."
        f"\n\n{table}\n\n{notes}")
    if records is not None:
        out.with_name(out.name + "-records.json").write_bytes(msgspec.json.encode(records))
    print(table)
    print(f"\nwrote {md} and {out.with_suffix('.json')}")


def reanalyze(args: argparse.Namespace) -> ChaosReport:
    """The report of OUT.json recomputed from OUT-records.json with this command's windows (the
    analysis is pure: no graph is started)."""
    report = msgspec.json.decode(args.out.with_suffix(".json").read_bytes(), type=ChaosReport)
    records = msgspec.json.decode(args.out.with_name(args.out.name + "-records.json").read_bytes(),
                                  type=dict[str, list[TurnRecord]])
    results = []
    for old in report.results:
        fault = Fault(old.kind, old.target, old.at_s, old.graph, old.back_after_s, old.target_inflight)
        new = analyze(records[old.kind], fault, window_s=args.window,
                      recovery_window_s=args.recovery_window, tolerance=args.tolerance)
        results.append(msgspec.structs.replace(new, other_restarts=old.other_restarts,
                                               router_counters=old.router_counters))
    return msgspec.structs.replace(report, window_s=args.window, recovery_window_s=args.recovery_window,
                                   tolerance=args.tolerance, results=results)


def main(args: argparse.Namespace) -> int:
    from ..workloads.generators import UnknownWorkload, make_workload

    if args.reanalyze:
        try:
            report = reanalyze(args)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            print(f"dynamo-ppd: error: cannot reanalyze {args.out}: {exc}", file=sys.stderr)
            return 2
        _write(report, args.out, None)
        return 0 if all(passed(r) for r in report.results) else 1

    if not 0 < args.fault_at < args.duration:
        print("dynamo-ppd: error: --fault-at must be inside the run (0 < --fault-at < --duration)",
              file=sys.stderr)
        return 2
    try:
        manifest = make_workload(args.workload, args.qps, args.duration, args.seed)
    except (UnknownWorkload, ValueError) as exc:
        print(f"dynamo-ppd: error: {exc}", file=sys.stderr)
        return 2
    settings = RunSettings(graph=args.graph, rate=args.qps, duration_s=args.duration,
                           fault_at_s=args.fault_at, workload=args.workload, seed=args.seed,
                           replicas=args.replicas, target=args.target, aim_s=args.aim,
                           window_s=args.window,
                           recovery_window_s=args.recovery_window, tolerance=args.tolerance,
                           run_root=args.run_root)
    commit = _commit()  # at the start: each fault's graph runs the tree as it is when it starts
    results, records = [], {}
    for kind in args.faults:
        result, turns = run_fault(kind, settings, manifest)
        results.append(result)
        records[kind] = turns
    command = " ".join(["dynamo-ppd", "chaos", *(sys.argv[2:] if sys.argv[1:2] == ["chaos"] else [])])
    report = ChaosReport(REPORT_VERSION, command, args.workload, args.qps, args.duration, args.window,
                         args.recovery_window, args.tolerance, results, commit)
    _write(report, args.out, records if args.records else None)
    return 0 if all(passed(r) for r in results) else 1
