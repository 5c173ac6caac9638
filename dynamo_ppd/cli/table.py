"""`dynamo-ppd table ...`: build, show, explain, reweight and evaluate PPD tables."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..argtypes import cli_error, positive_int
from ..engine.profile import DEFAULT_PROFILE
from ..policy.table import (
    CONFIGS,
    PpdTable,
    TableError,
    Weights,
    bundled_table,
    load_table,
    parse_weights,
    reweight,
    save_table,
)


def weights_arg(text: str) -> Weights:
    try:
        return parse_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _table_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("table", help=f"table JSON path, or a P:D configuration ({', '.join(CONFIGS)}) for "
                   "the default table shipped for the default profile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="table_command", required=True,
                                metavar="{build,show,explain,reweight,evaluate}")
    b = sub.add_parser("build", help="measure every grid cell at x=0 and x=1 and write a table",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--backend", choices=["sim", "live"], default="sim",
                   help="sim: the virtual-clock simulation; live: a running deployment's router")
    b.add_argument("--url", help="live backend: the deployment's OpenAI base URL (http://host:port)")
    b.add_argument("--profile", default=DEFAULT_PROFILE, help="engine profile (sim backend)")
    b.add_argument("--config", default="1P3D", help="P:D configuration (e.g. 1P3D, 2P2D, 3P1D)")
    b.add_argument("--weights", type=weights_arg, default=Weights(), help="W_TTFT,W_TPOT")
    b.add_argument("--seconds-per-cell", type=float, default=10.0,
                   help="measured seconds per cell and route (the paper: 10)")
    b.add_argument("--seed", type=int, default=0, help="workload seed")
    b.add_argument("--jobs", type=positive_int, help="parallel processes (sim backend; default: CPU count)")
    b.add_argument("--out", type=Path, required=True, help="where to write the table JSON")
    s = sub.add_parser("show", help="print a table's decision grid, one block per QPS level")
    _table_arg(s)
    s.add_argument("--scores", action="store_true", help="print each cell's score instead of L/P")
    e = sub.add_parser("explain", help="the cell, measurements, score and decision for a request",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _table_arg(e)
    e.add_argument("--prompt-tokens", type=int, required=True, help="the turn's whole prompt")
    e.add_argument("--new-tokens", type=int, required=True, help="tokens the decode worker lacks")
    e.add_argument("--output-tokens", type=int, default=256, help="expected output tokens")
    e.add_argument("--qps", type=float, required=True, help="request rate the router sees")
    e.add_argument("--weights", type=weights_arg, help="W_TTFT,W_TPOT (default: the table's)")
    e.add_argument("--decode-batch", type=int, help="live: sequences on the decode worker")
    e.add_argument("--decode-kv-tokens", type=int, help="live: their total context")
    e.add_argument("--prefill-queue", type=int, help="live: prompt tokens queued on the prefill worker")
    r = sub.add_parser("reweight", help="recompute decisions for other weights (no measuring)")
    _table_arg(r)
    r.add_argument("--weights", type=weights_arg, required=True, help="W_TTFT,W_TPOT")
    r.add_argument("--out", type=Path, required=True, help="where to write the reweighted table")
    v = sub.add_parser("evaluate", help="pure table vs online correction vs x=0/x=1 in the simulation",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _table_arg(v)
    v.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per run")
    v.add_argument("--seed", type=int, default=0, help="workload seed")


def resolve(text: str) -> Path:
    return bundled_table(text) if text.upper() in CONFIGS else Path(text)


def show(table: PpdTable, scores: bool = False) -> str:
    grid = table.grid
    workloads = grid.workload_classes
    wts = table.weights
    lines = [f"table {table.profile} {table.config}, weights {wts.w_ttft:g},{wts.w_tpot:g} "
             f"(L = decode-local, P = via prefill; built by {table.build.backend} in "
             f"{table.build.build_seconds:.0f} s)",
             "workload classes: " + ", ".join(f"{w.name} ({grid.ratio_class(w)})" for w in workloads)]
    index = table.index()
    width = 7 if scores else 3
    for qps in grid.qps_levels:
        reached = [index[(c.name, w.name, qps)].via_prefill.achieved_rps
                   for c in grid.context_classes for w in workloads]
        lines.append(f"\nQPS {qps:g} (reached {min(reached):.1f}-{max(reached):.1f} req/s)")
        header = "".join(f"{x.name:>{max(width, len(x.name) + 1)}}" for x in workloads)
        lines.append(f"{'context':<8}{header}")
        for ctx in grid.context_classes:
            row = f"{ctx.name:<8}"
            for w in workloads:
                cell = index[(ctx.name, w.name, qps)]
                text = f"{cell.score:+.2f}" if scores else ("L" if cell.decision == "decode_local" else "P")
                row += f"{text:>{max(width, len(w.name) + 1)}}"
            lines.append(row)
    local = sum(c.decision == "decode_local" for c in table.cells)
    lines.append(f"\n{local}/{len(table.cells)} cells decode-local")
    return "\n".join(lines)


def one_line_grid(table: PpdTable) -> str:
    """One line per QPS level: every cell's L/P, context classes separated by '|'."""
    index = table.index()
    rows = []
    for qps in table.grid.qps_levels:
        blocks = ["".join("L" if index[(c.name, w.name, qps)].decision == "decode_local" else "P"
                          for w in table.grid.workload_classes) for c in table.grid.context_classes]
        rows.append(f"QPS {qps:>4g}: {' | '.join(blocks)}")
    return "\n".join(rows)


def explain(table: PpdTable, args) -> str:
    """The request's cell, what was measured there, the table's score and the online-corrected
    one (with live signals if given, else the cell's own conditions) and the decision."""
    import dataclasses

    from ..engine.profile import load_profile
    from ..policy.decision import Mode, Policy, PolicyConfig, ProfilePredictor, RequestFeatures, WorkerLoad

    weights = args.weights or table.weights
    policy = Policy(PolicyConfig(mode=Mode.PPD, w_ttft=weights.w_ttft, w_tpot=weights.w_tpot),
                    ProfilePredictor(load_profile(table.profile)), table)
    cached = max(0, args.prompt_tokens - args.new_tokens)
    features = RequestFeatures(
        decision_key="explain:2", turn=2, prompt_tokens=args.prompt_tokens, cached_on_decode=cached,
        cached_on_prefill=cached, expected_output_tokens=args.output_tokens, has_session_decode=True,
        decode_load=WorkerLoad(), prefill_load=WorkerLoad(), qps=args.qps)
    key, nominal = policy.cell_of(features)
    live = args.decode_batch is not None or args.prefill_queue is not None
    if live:
        features = dataclasses.replace(
            features, decode_load=WorkerLoad(decode_requests=args.decode_batch or 0,
                                             decode_kv_tokens=args.decode_kv_tokens or 0),
            prefill_load=WorkerLoad(pending_prefill_tokens=args.prefill_queue or 0))
    else:
        features = dataclasses.replace(features, decode_load=nominal.decode_load,
                                       prefill_load=nominal.prefill_load)
    decision = policy.decide(features, history_tokens=cached)
    cell = table.index()[key]
    workload = table.grid.workload_class(max(1, args.new_tokens), args.output_tokens)
    ratio = table.grid.ratio_class(workload)
    lines = [f"cell: context {key[0]}, workload {key[1]} ({ratio}), QPS {key[2]:g}"]
    for label, m in (("x=0 via prefill ", cell.via_prefill), ("x=1 decode-local", cell.decode_local)):
        lines.append(f"  measured {label}: follow-up TTFT {m.follow_up_ttft_s * 1e3:8.1f} ms, "
                     f"TPOT {m.tpot_s * 1e3:6.2f} ms, reached {m.achieved_rps:.1f} req/s, "
                     f"success {m.success_rate:.0%}")
    lines.append(f"  table score (weights {weights.w_ttft:g},{weights.w_tpot:g}): "
                 f"{decision.table_score:+.3f}")
    signals = "the live signals given" if live else "the cell's own conditions"
    lines.append(f"  corrected for this request's tokens and {signals}: {decision.score:+.3f}")
    lines.append(f"  decision: {decision.route.value} ({decision.reason})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        if args.table_command == "build":
            return _build(args)
        if args.table_command == "evaluate":
            from ..tables.evaluate import main as evaluate_main

            return evaluate_main(load_table(resolve(args.table)), args.seconds, args.seed)
        table = load_table(resolve(args.table))
        if args.table_command == "show":
            print(show(table, args.scores))
        elif args.table_command == "explain":
            print(explain(table, args))
        elif args.table_command == "reweight":
            out = reweight(table, args.weights)
            save_table(out, args.out)
            changed = sum(a.decision != b.decision for a, b in zip(table.cells, out.cells, strict=True))
            print(f"wrote {args.out}: {changed} of {len(out.cells)} decisions changed")
        return 0
    except TableError as exc:
        return cli_error(exc)


def _build(args) -> int:
    if args.backend == "live":
        if not args.url:
            return cli_error("--backend live needs --url of a running deployment "
                             "(dynamo-ppd serve ppd prints it)")
        from ..tables.live import build_live_table

        table = build_live_table(args.url, args.config, args.weights,
                                 seconds_per_cell=args.seconds_per_cell, seed=args.seed, profile=args.profile)
    else:
        from ..tables.build import build_sim_table

        table = build_sim_table(args.profile, args.config, args.weights,
                                seconds_per_cell=args.seconds_per_cell, seed=args.seed, jobs=args.jobs)
    save_table(table, args.out)
    local = sum(c.decision == "decode_local" for c in table.cells)
    print(f"wrote {args.out}: {len(table.cells)} cells ({local} decode-local) "
          f"in {table.build.build_seconds:.0f} s")
    print(one_line_grid(table))
    return 0
