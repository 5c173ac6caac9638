"""`dynamo-ppd bench compare` and `bench run`: the same manifest against several systems.

`compare` brings up each system in turn on the same simulated cluster (same workers, same
profile, same P:D split) with `dynamo-ppd serve`, plays the manifest at each rate, and tears the
system down before the next:

- ``agg``: Dynamo's KV router over aggregated workers (the paper's Replica), as many workers as
  the P:D split has in all;
- ``pd``: Dynamo's frontend-native disaggregation (x=0);
- ``cond-disagg``: Dynamo's conditional disaggregation (its default-style `isl_or_load` policy);
- ``local``: our router with every follow-up decode-local (x=1);
- ``ppd``: our router with the table and online correction.

`run` plays it against any running OpenAI endpoint (a GPU cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from ..cli import comma_choices
from ..launch import ServeOptions, start
from ..launch.graph import load_graph
from ..launch.process import free_port
from ..sim.cluster import parse_config
from . import results as res
from .client import RequestResult, run_manifest
from .manifest import Manifest, load_manifest, scale_arrivals

SYSTEMS = ("agg", "pd", "cond-disagg", "local", "ppd")


def ppd_graph_with_mode(mode: str, workdir: Path) -> str:
    """The bundled ppd graph with the router's ``--mode`` set, written under ``workdir``."""
    _, path = load_graph("ppd")
    text = path.read_text()
    default = '"--mode", "ppd"'
    if default not in text:
        raise ValueError(f"{path}: the router's {default} is not in the graph; cannot set the mode")
    out = workdir / f"ppd-mode-{mode}.yaml"
    out.write_text(text.replace(default, f'"--mode", "{mode}"'))
    return str(out)


def _graph(system: str, workdir: Path) -> str:
    """The graph a system runs: a bundled one, or ppd with the router's mode set."""
    if system in ("agg", "pd", "cond-disagg"):
        return system
    return ppd_graph_with_mode("local" if system == "local" else "ppd", workdir)


def replicas(system: str, config: str) -> dict[str, int]:
    prefill, decode, _ = parse_config(config)
    if system == "agg":
        return {"worker": prefill + decode}
    return {"prefill": prefill, "decode": decode}


def manifests(workload: str | None, manifest_path: Path | None, rates: list[float], duration_s: float,
              seed: int) -> tuple[str, list[tuple[float, Manifest]]]:
    if manifest_path is not None:
        base = load_manifest(manifest_path)
        return manifest_path.stem, [(rate, scale_arrivals(base, rate)) for rate in rates]
    from .workloads import make_workload

    name = workload or "wildchat"
    return name, [(rate, make_workload(name, rate, duration_s, seed)) for rate in rates]


class _Progress:
    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.tty = sys.stderr.isatty()

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        if self.tty:
            sys.stderr.write(f"\r  {self.label}: {self.done}/~{self.total} requests, {self.failed} failed")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.write(f"  {self.label}: {self.done} requests, {self.failed} failed\n")
        sys.stderr.flush()


def play(url: str, system: str, workload: str, rate: float, manifest: Manifest, seed: int) -> res.Point:
    progress = _Progress(f"{system} {workload} @ {rate:g} conv/s",
                         sum(len(c.turns) for c in manifest.conversations))
    started = time.monotonic()
    results = asyncio.run(run_manifest(url, manifest, seed=seed, on_result=progress))
    progress.close()
    span = max((c.arrival_s for c in manifest.conversations), default=0.0)
    return res.summarize(system, workload, rate, results, max(span, time.monotonic() - started))


def compare(systems: list[str], workload: str | None, manifest_path: Path | None, rates: list[float],
            duration_s: float, config: str, out_dir: Path, seed: int = 0) -> res.BenchResults:
    name, runs = manifests(workload, manifest_path, rates, duration_s, seed)
    points: list[res.Point] = []
    with tempfile.TemporaryDirectory(prefix="ppd-bench-") as tmp:
        for system in systems:
            graph = _graph(system, Path(tmp))
            sys.stderr.write(f"bringing up {system} ({config}) ...\n")
            dep = start(ServeOptions(graph=graph, http_port=free_port(), nats_port=free_port(),
                                     etcd_port=free_port(), run_dir=Path(tmp) / f"run-{system}",
                                     replicas=replicas(system, config)), log=lambda _m: None)
            try:
                for rate, manifest in runs:
                    points.append(play(dep.base_url, system, name, rate, manifest, seed))
            finally:
                dep.stop()
    results = res.BenchResults(version=res.RESULTS_VERSION, config=config.upper(), points=points)
    write(results, out_dir)
    return results


def write(results: res.BenchResults, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    res.save(results, out_dir / "results.json")
    table = res.markdown(results)
    (out_dir / "results.md").write_text(f"# Benchmark ({results.config})\n\n{table}\n")
    res.plot(results, out_dir)
    print(table)
    print(f"\nwrote {out_dir / 'results.json'}, results.md and plots")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of rates like 1,4,8") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{compare,run}")
    for name, helptext in (("compare", "bring up each system on the simulated cluster and run the "
                            "same workload against it, side by side"),
                           ("run", "run a workload against a running OpenAI endpoint (--url)")):
        p = sub.add_parser(name, help=helptext, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        source = p.add_mutually_exclusive_group()
        source.add_argument("--workload", help="generated workload name (see docs/manifest.md); "
                            "default wildchat")
        source.add_argument("--manifest", type=Path, help="a manifest JSONL file; its arrivals are "
                            "scaled to each --qps")
        p.add_argument("--qps", type=_rates, default=[1.0], help="conversation arrival rates, e.g. 1,4,8")
        p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
        p.add_argument("--seed", type=int, default=0, help="workload seed")
        p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
        if name == "compare":
            p.add_argument("--systems", type=comma_choices("system", SYSTEMS),
                           default=["pd", "cond-disagg", "ppd"],
                           help=f"comma-separated, from {','.join(SYSTEMS)}")
            p.add_argument("--config", default="1P3D", help="P:D split of the simulated cluster")
        else:
            p.add_argument("--url", required=True, help="OpenAI base URL, e.g. http://host:8000")
            p.add_argument("--system", default="target", help="name of the system in the results")


def main(args: argparse.Namespace) -> int:
    from .manifest import ManifestError
    from .workloads import UnknownWorkload

    try:
        if args.bench_command == "compare":
            parse_config(args.config)
            compare(args.systems, args.workload, args.manifest, args.qps, args.duration, args.config,
                    args.out, args.seed)
            return 0
        name, runs = manifests(args.workload, args.manifest, args.qps, args.duration, args.seed)
        points = [play(args.url, args.system, name, rate, manifest, args.seed) for rate, manifest in runs]
        write(res.BenchResults(version=res.RESULTS_VERSION, config="external", points=points), args.out)
        return 0
    except (ManifestError, UnknownWorkload, ValueError) as exc:
        print(f"dynamo-ppd: error: {exc}", file=sys.stderr)
        return 2
