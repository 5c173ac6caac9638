"""The whole chaos experiment behind `dynamo-ppd chaos`: every fault in turn on its own graph
(`run.run_fault`), one report of them all (`report`), written as OUT.md and OUT.json (and the turn
records as OUT-records.json, from which `load` and `report.reanalyze` recompute it later)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import msgspec

from ..workloads.manifest import Manifest
from .report import REPORT_VERSION, ChaosReport, TurnRecord, markdown, passed
from .run import RunSettings, run_fault

NOTES_MARKER = "<!-- notes: kept when the report is rewritten -->"


def tree_commit() -> str:
    """The tree measured (git describe --always --dirty), or "" outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_faults(faults: list[str], settings: RunSettings, manifest: Manifest,
               command: str) -> tuple[ChaosReport, dict[str, list[TurnRecord]]]:
    """Each fault on a fresh graph, in order; the report and each fault's turn records."""
    commit = tree_commit()  # at the start: each fault's graph runs the tree as it is when it starts
    results, records = [], {}
    for kind in faults:
        result, turns = run_fault(kind, settings, manifest)
        results.append(result)
        records[kind] = turns
    report = ChaosReport(REPORT_VERSION, command, settings.workload, settings.rate, settings.duration_s,
                         settings.window_s, settings.recovery_window_s, settings.tolerance, results, commit)
    return report, records


def all_passed(report: ChaosReport) -> bool:
    return all(passed(r) for r in report.results)


def load(out: Path) -> tuple[ChaosReport, dict[str, list[TurnRecord]]]:
    """OUT.json and OUT-records.json (raises OSError or a msgspec error when unreadable)."""
    report = msgspec.json.decode(out.with_suffix(".json").read_bytes(), type=ChaosReport)
    records = msgspec.json.decode(out.with_name(out.name + "-records.json").read_bytes(),
                                  type=dict[str, list[TurnRecord]])
    return report, records


def write(report: ChaosReport, out: Path, records: dict[str, list[TurnRecord]] | None) -> None:
    """OUT.json, OUT.md (keeping the notes under NOTES_MARKER) and, given records, OUT-records.json;
    prints the table and what was written."""
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
