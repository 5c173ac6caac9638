"""`dynamo-ppd chaos`: the workload against a supervised graph, one fault per run, the report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from ..argtypes import cli_error
from ..chaos import experiment
from ..chaos.report import reanalyze
from ..chaos.run import DEFAULT_FAULTS, FAULT_REPLICAS, FAULTS, RunSettings
from ..policy.decision import Mode

DESCRIPTION = (
    "Bring up a supervised graph (default ppd, 1P3D; 2P2D for prefill-kill, two router replicas for "
    "router-restart), play a multi-turn workload against it (default WildChat-like at 2 conv/s) and "
    "inject one fault at --fault-at: SIGKILL the busiest decode or prefill worker, restart a router "
    "replica, restart etcd or restart NATS; or make one planned change there: a rolling restart of "
    "every worker (SIGTERM, its grace period, a new process), a decode worker joining (scale-out) or "
    "drained and leaving (scale-in), 1P3D to 2P2D and back (ratio-change). Each gets a fresh graph. "
    "Per fault the report gives failed requests, truncated streams (no finish_reason, an error "
    "event, or fewer tokens than max_tokens with ignore_eos), added p99 TTFT (the --window after the "
    "fault minus the one before) and the recovery time (until the decode-local share of follow-ups "
    "is back to its pre-fault level); per planned change, that share before, during and after it, "
    "and how soon the routing decided in the new P:D configuration. Markdown and JSON; progress on "
    "stderr; exit 1 when any fault failed or truncated a request.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..argtypes import comma_choices, replica_counts

    parser.add_argument("--faults", type=comma_choices("fault", FAULTS, separator=","),
                        default=list(DEFAULT_FAULTS),
                        help=f"comma-separated, from {','.join(FAULTS)}; one fresh graph each")
    parser.add_argument("--mode", choices=[m.value for m in Mode],
                        help="the routing component's --mode (the picker's or the relay router's); "
                        "default: the graph's")
    parser.add_argument("--system-tokens", type=int, default=0,
                        help="every conversation opens with the same system prompt of about this many "
                        "tokens (0: none)")
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
                        "the busiest decode/prefill worker, the first router replica; scale-out and "
                        "scale-in also take a component: prefill (a prefill worker joins or leaves)")
    parser.add_argument("--hold", type=float, default=20.0,
                        help="ratio-change: seconds the new ratio (2P2D) holds before it goes back")
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


def main(args: argparse.Namespace) -> int:
    from ..workloads.generators import UnknownWorkload, make_workload

    if args.reanalyze:
        try:
            report, records = experiment.load(args.out)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return cli_error(f"cannot reanalyze {args.out}: {exc}")
        report = reanalyze(report, records, window_s=args.window, recovery_window_s=args.recovery_window,
                           tolerance=args.tolerance)
        experiment.write(report, args.out, None)
        return 0 if experiment.all_passed(report) else 1

    if not 0 < args.fault_at < args.duration:
        return cli_error("--fault-at must be inside the run (0 < --fault-at < --duration)")
    if args.system_tokens < 0:
        return cli_error("--system-tokens must be 0 (none) or a positive token count")
    try:
        manifest = make_workload(args.workload, args.qps, args.duration, args.seed)
    except (UnknownWorkload, ValueError) as exc:
        return cli_error(exc)
    settings = RunSettings(graph=args.graph, rate=args.qps, duration_s=args.duration,
                           fault_at_s=args.fault_at, workload=args.workload, seed=args.seed,
                           replicas=args.replicas, target=args.target, aim_s=args.aim,
                           window_s=args.window,
                           recovery_window_s=args.recovery_window, tolerance=args.tolerance,
                           run_root=args.run_root, mode=args.mode, system_tokens=args.system_tokens,
                           hold_s=args.hold)
    command = " ".join(["dynamo-ppd", "chaos", *(sys.argv[2:] if sys.argv[1:2] == ["chaos"] else [])])
    report, records = experiment.run_faults(args.faults, settings, manifest, command)
    experiment.write(report, args.out, records if args.records else None)
    return 0 if experiment.all_passed(report) else 1
