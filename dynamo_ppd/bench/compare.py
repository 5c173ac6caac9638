"""`dynamo-ppd bench compare` and `bench run`: the same manifest against several systems.

`compare` brings up each system in turn on the same simulated cluster (same workers, same
profile, same P:D split) with `dynamo-ppd serve`, plays the manifest at each rate, and tears the
system down before the next:

- ``agg``: Dynamo's KV router over aggregated workers (the paper's Replica), as many workers as
  the P:D split has in all;
- ``pd``: Dynamo's frontend-native disaggregation (x=0);
- ``cond-disagg``: Dynamo's conditional disaggregation (its default-style `isl_or_load` policy);
- ``local``: PPD with every follow-up decode-local (x=1), through the endpoint picker;
- ``ppd``: PPD with the table and online correction, through the endpoint picker (`graphs/ppd.yaml`);
- ``local-relay``, ``ppd-relay``: the same through the relay router (`graphs/ppd-relay.yaml`).

Every system runs behind the local gateway (in pass-through; ``--no-gateway``: none, the relay
and Dynamo's graphs as they are), so all pay the same extra hop.

`run` plays it against any running OpenAI endpoint (a GPU cluster).

Each point runs on a freshly started system (no cache or session left from the previous point).
``--dilation N`` (one N, or one per rate) runs the simulated workers and the router at
``--speedup 1/N`` and the client N times slower (`dynamo_ppd.bench.client`): the Python processes
around the workers then cost 1/N as much against model time, so a point measures the routing
decisions rather than this machine's CPUs (the run-health table shows each process's cores and
the client's lag). ``--cut-after S`` ends a point S model seconds after its last arrival.

Sizing (`dynamo_ppd.bench.sizing`): a point is a number of conversations, not seconds: a pilot
of ``--conversations`` is simulated on the virtual clock for every system and grown until the
turn-2+ TTFT median's 95% interval is within +-10% (up to ``--max-conversations`` and
``--point-budget`` wall seconds); the live point plays that many, and its note says when it
could not. The same manifest's simulation is kept with the point: live against virtual.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from ..argtypes import cli_error, comma_choices, positive_floats, positive_int, positive_seconds
from ..experiment.progress import Progress
from ..launch import ServeOptions, start
from ..launch.graph import Component, ReadyCheck, load_graph, speedup_args
from ..launch.process import free_port
from ..sim.cluster import parse_config
from ..workloads.manifest import Manifest, load_manifest, scale_arrivals
from . import results as res
from . import routes, sizing
from .client import APIS, run_manifest
from .cpu import CpuMeter

SYSTEMS = ("agg", "pd", "cond-disagg", "local", "ppd", "local-relay", "ppd-relay")
# ppd / local: the endpoint picker (`graphs/ppd.yaml`); *-relay: the relay router (`ppd-relay`).
PPD_GRAPH = {"ppd": "ppd", "local": "ppd", "ppd-relay": "ppd-relay", "local-relay": "ppd-relay"}
GATEWAY = "gateway"


def ppd_graph_with_mode(mode: str, workdir: Path, graph: str = "ppd-relay") -> str:
    """A bundled PPD graph (the relay router's, or the endpoint picker's ``ppd``) with its
    ``--mode`` set, written under ``workdir``."""
    _, path = load_graph(graph)
    text = path.read_text()
    default = '"--mode", "ppd"'
    if default not in text:
        raise ValueError(f"{path}: the {default} is not in the graph; cannot set the mode")
    out = workdir / f"{graph}-mode-{mode}.yaml"
    out.write_text(text.replace(default, f'"--mode", "{mode}"'))
    return str(out)


def behind_gateway(graph: str, workdir: Path) -> str:
    """``graph`` with the local gateway in pass-through in front of its frontend (which moves to
    ``{frontend_port}``), written under ``workdir``; a graph with a gateway already is returned
    as it is. Every system of a comparison then pays the same extra hop, and the endpoint
    picker's differs from the others only by its callout."""
    loaded, path = load_graph(graph)
    if any(c.name == GATEWAY for c in loaded.components):
        return graph
    components = []
    for c in loaded.components:
        if c.name == loaded.frontend:
            moved = (lambda text: text.replace("{http_port}", "{frontend_port}"))  # noqa: E731
            ready = msgspec.structs.replace(c.ready, http=moved(c.ready.http)) if c.ready.http else c.ready
            c = msgspec.structs.replace(c, command=[moved(a) for a in c.command], ready=ready)
        components.append(c)
    components.append(Component(
        name=GATEWAY, description="the local gateway in pass-through (no picker)",
        command=["{python}", "-m", "dynamo_ppd.gateway", "--port", "{http_port}",
                 "--upstream", "127.0.0.1:{frontend_port}", "--metrics-port", "{metrics_port}"],
        ready=ReadyCheck(http="http://127.0.0.1:{http_port}/health")))
    out = workdir / f"{loaded.name}-behind-gateway.yaml"
    out.write_bytes(msgspec.yaml.encode(msgspec.structs.replace(
        loaded, name=f"{loaded.name}-gw", components=components, frontend=GATEWAY,
        description=f"{loaded.description} (behind the local gateway in pass-through)")))
    return str(out)


def _graph(system: str, workdir: Path, gateway: bool = True) -> str:
    """The graph a system runs: a bundled one, or a PPD graph with its mode set; behind the local
    gateway unless ``gateway`` is False (the endpoint picker's graph always has it)."""
    if system in ("agg", "pd", "cond-disagg"):
        graph = system
    else:
        graph = ppd_graph_with_mode("local" if system.startswith("local") else "ppd", workdir,
                                    PPD_GRAPH[system])
    return behind_gateway(graph, workdir) if gateway else graph


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
    from ..workloads.generators import make_workload

    name = workload or "wildchat"
    return name, [(rate, make_workload(name, rate, duration_s, seed)) for rate in rates]


def per_rate(values: list[float] | None, rates: list[float], what: str = "--dilation") -> list[float]:
    """One value per rate: a single value for all, or exactly one per rate."""
    if not values:
        return [1.0] * len(rates)
    if len(values) == 1:
        return values * len(rates)
    if len(values) != len(rates):
        raise ValueError(f"{what} has {len(values)} values for {len(rates)} rates: give one, or one per rate")
    return values


def play(url: str, system: str, workload: str, rate: float, manifest: Manifest, seed: int,
         dilation: float = 1.0, horizon_s: float | None = None, meter: CpuMeter | None = None,
         api: str = "chat", **extra) -> res.Point:
    label = f"{system} {workload} @ {rate:g} conv/s" + (f" (dilation {dilation:g})" if dilation != 1 else "")
    progress = Progress(sum(len(c.turns) for c in manifest.conversations), f"  {label}", "requests",
                        every_s=30.0)
    started = time.monotonic()
    if meter is not None:
        meter.start()
    results = asyncio.run(run_manifest(url, manifest, seed=seed, dilation=dilation, horizon_s=horizon_s,
                                       on_result=lambda r: progress.step(failed=not r.ok and not r.cut),
                                       api=api))
    cores = meter.stop() if meter is not None else {}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    progress.close()
    wall = time.monotonic() - started
    span = max((c.arrival_s for c in manifest.conversations), default=0.0)
    return res.summarize(system, workload, rate, results, max(span, wall / dilation), dilation=dilation,
                         conversations=len(manifest.conversations), horizon_s=horizon_s, wall_s=wall,
                         cpu_cores=cores, load_avg=load, **extra)


def _base_manifests(workload: str | None, manifest_path: Path | None, rates: list[float],
                    conversations: int, seed: int) -> tuple[str, list[Manifest]]:
    """Per rate, a manifest of at least ``conversations`` conversations (all of a file's)."""
    if manifest_path is not None:
        base = load_manifest(manifest_path)
        return manifest_path.stem, [scale_arrivals(base, rate) for rate in rates]
    from ..workloads.generators import make_workload

    name = workload or "wildchat"
    out = []
    for rate in rates:
        duration = conversations / rate
        manifest = make_workload(name, rate, duration, seed)
        while len(manifest.conversations) < conversations:  # Poisson: a few short; draw longer
            duration *= 1.1
            manifest = make_workload(name, rate, duration, seed)
        out.append(sizing.first(manifest, conversations))
    return name, out


def compare(systems: list[str], workload: str | None, manifest_path: Path | None, rates: list[float],
            config: str, out_dir: Path, seed: int = 0, conversations: int = 200,
            max_conversations: int = 2000, size: bool = True, dilation: list[float] | None = None,
            cut_after_s: float | None = None, point_budget_s: float | None = None,
            simulate: bool = True, gateway: bool = True, api: str = "chat") -> res.BenchResults:
    dilations = per_rate(dilation, rates)
    if size and not simulate:
        raise ValueError("sizing points needs the simulation (drop --no-simulate or pass --no-size)")
    if point_budget_s is not None and cut_after_s is None:
        raise ValueError("--point-budget needs --cut-after (without a horizon a point's length is "
                         "not known before it runs)")
    name, bases = _base_manifests(workload, manifest_path, rates,
                                  max_conversations if size else conversations, seed)
    plans = []
    for rate, n_dil, base in zip(rates, dilations, bases, strict=True):
        sys.stderr.write(f"{name} @ {rate:g} conv/s (dilation {n_dil:g}):\n")
        if size:
            sized = sizing.size_point(systems, config, base, conversations, n_dil, cut_after_s,
                                      point_budget_s, seed, log=lambda m: sys.stderr.write(m + "\n"))
        else:
            manifest = sizing.first(base, conversations)
            h = sizing.horizon(manifest, cut_after_s)
            sims = ({s: sizing.simulate_manifest(s, config, manifest, h, seed) for s in systems}
                    if simulate else {})
            sized = sizing.Sized(manifest, h, sims, "")
        plans.append((rate, n_dil, sized))
    points: list[res.Point] = []
    results = res.BenchResults(version=res.RESULTS_VERSION, config=config.upper(), points=points)
    with tempfile.TemporaryDirectory(prefix="ppd-bench-") as tmp:
        for system in systems:
            graph = _graph(system, Path(tmp), gateway)
            for rate, n_dil, sized in plans:
                sys.stderr.write(f"bringing up {system} ({config}, dilation {n_dil:g}) ...\n")
                dep = start(ServeOptions(graph=graph, http_port=free_port(), nats_port=free_port(),
                                         etcd_port=free_port(), run_dir=Path(tmp) / f"run-{system}-{rate:g}",
                                         replicas=replicas(system, config),
                                         extra_args=speedup_args(graph, n_dil)), log=lambda _m: None)
                try:
                    meter = CpuMeter({p.label: p.pid for p in dep.processes()})
                    # Simulated again now: the twin reads the same table file the router just loaded.
                    sim = (sizing.simulate_manifest(system, config, sized.manifest, sized.horizon_s, seed)
                           if simulate else None)
                    point = play(dep.base_url, system, name, rate, sized.manifest, seed, n_dil,
                                 sized.horizon_s, meter, api=api, note=sized.note,
                                 sim_samples=sim.samples if sim else None,
                                 sim_outcome=sim.outcome if sim else None,
                                 sim_routes=sim.routes if sim else None)
                    # The decisions the live point made, read off its workers before they stop.
                    ports = [int(p.env["DYN_SYSTEM_PORT"]) for p in dep.processes()
                             if p.env.get("DYN_SYSTEM_PORT")]
                    points.append(msgspec.structs.replace(point, routes=routes.scrape(ports),
                                                          routing=routes.routing_counts(dep.metrics_urls)))
                finally:
                    dep.stop()
                write(results, out_dir, quiet=True)  # a partial report survives an interrupted run
    write(results, out_dir)
    return results


def resimulate(results: res.BenchResults, systems: list[str], workload: str, seed: int = 0,
               max_conversations: int = 2000) -> res.BenchResults:
    """The points of ``systems`` with their virtual-clock twin simulated again on the same
    manifest (a generated workload: its first ``conversations`` conversations, as sized), e.g.
    after the table the live router loaded has changed since the run's sizing."""
    points = []
    for p in results.points:
        if p.system in systems and p.workload == workload:
            _, (base,) = _base_manifests(workload, None, [p.qps], max_conversations, seed)
            manifest = sizing.first(base, p.conversations)
            played = {s.conversation_id for s in p.samples}
            if not played <= {c.conversation_id for c in manifest.conversations}:
                raise ValueError(f"{p.system} @ {p.qps:g}: the regenerated manifest is not the one played")
            sim = sizing.simulate_manifest(p.system, results.config, manifest, p.horizon_s, seed)
            p = msgspec.structs.replace(p, sim_samples=sim.samples, sim_outcome=sim.outcome,
                                        sim_routes=sim.routes)
        points.append(p)
    return res.BenchResults(results.version, results.config, points)


def write(results: res.BenchResults, out_dir: Path, quiet: bool = False) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    res.save(results, out_dir / "results.json")
    table = res.markdown(results)
    (out_dir / "results.md").write_text(f"# Benchmark ({results.config})\n\n{table}\n")
    res.plot(results, out_dir)
    if quiet:
        return
    print(table)
    print(f"\nwrote {out_dir / 'results.json'}, results.md and plots")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True,
                                metavar="{compare,run,versus,resimulate}")
    v = sub.add_parser("versus", help="two results files' shared points side by side (e.g. dilated "
                       "against undilated), ratios paired over the same conversations",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    v.add_argument("a", type=Path, help="results.json of the first run")
    v.add_argument("b", type=Path, help="results.json of the second run")
    v.add_argument("--labels", default="a,b", help="names of the two runs in the table, A,B")
    r = sub.add_parser("resimulate", help="a compare run's virtual-clock twins simulated again on the "
                       "same manifests (after the simulator changed); the live figures are kept",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("results", type=Path, help="results.json of a `bench compare` run on a generated workload")
    r.add_argument("--out", type=Path, required=True, help="directory for the new results.json, results.md "
                   "and plots")
    r.add_argument("--seed", type=int, default=0, help="the seed the run was made with")
    for name, helptext in (("compare", "bring up each system on the simulated cluster and run the "
                            "same workload against it, side by side"),
                           ("run", "run a workload against a running OpenAI endpoint (--url)")):
        p = sub.add_parser(name, help=helptext, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        source = p.add_mutually_exclusive_group()
        source.add_argument("--workload", help="generated workload name (see docs/manifest.md); "
                            "default wildchat")
        source.add_argument("--manifest", type=Path, help="a manifest JSONL file; its arrivals are "
                            "scaled to each --qps")
        p.add_argument("--qps", type=positive_floats("rates"), default=[1.0],
                       help="conversation arrival rates, e.g. 1,4,8")
        p.add_argument("--seed", type=int, default=0, help="workload seed")
        p.add_argument("--api", choices=APIS, default="chat",
                       help="what the client speaks: chat (/v1/chat/completions) or messages (the "
                       "Anthropic Messages API, /v1/messages, as Claude Code does; the graphs serve it)")
        p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
        workers = ("the simulated workers and router run at --speedup 1/N" if name == "compare"
                   else "start the endpoint's simulated workers with --speedup 1/N")
        p.add_argument("--dilation", type=positive_floats("dilations"),
                       help="time dilation N, one for every rate or one per rate (e.g. 4,8,16,32): "
                       f"the client runs the schedule N times slower and divides what it measures by N; "
                       f"{workers}; default 1 (none)")
        p.add_argument("--cut-after", type=positive_seconds, metavar="SECONDS",
                       help="end each point this many model seconds after its last arrival (requests "
                       "running then are left out and counted as cut); default: run every "
                       "conversation to its end")
        if name == "compare":
            p.add_argument("--systems", type=comma_choices("system", SYSTEMS),
                           default=["pd", "cond-disagg", "ppd"],
                           help=f"comma-separated, from {','.join(SYSTEMS)}")
            p.add_argument("--config", default="1P3D", help="P:D split of the simulated cluster")
            p.add_argument("--conversations", type=positive_int, default=200,
                           help="conversations per point: the sizing's pilot, or the size with --no-size")
            p.add_argument("--max-conversations", type=positive_int, default=2000,
                           help="the most conversations sizing may give a point")
            p.add_argument("--point-budget", type=positive_seconds, metavar="SECONDS",
                           help="the most wall seconds sizing may give a point (its model duration "
                           "x the dilation; needs --cut-after); default: no limit")
            p.add_argument("--size", action=argparse.BooleanOptionalAction, default=True,
                           help="size each point (on the virtual clock) so the turn-2+ TTFT median's "
                           "95%% interval is within +-10%%")
            p.add_argument("--simulate", action=argparse.BooleanOptionalAction, default=True,
                           help="simulate the same manifest on the virtual clock (live/sim columns)")
            p.add_argument("--gateway", action=argparse.BooleanOptionalAction, default=True,
                           help="every system behind the local gateway (in pass-through; the endpoint "
                           "picker's ppd/local call the picker from it), so all pay the same hop")
        else:
            p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
            p.add_argument("--url", required=True, help="OpenAI base URL, e.g. http://host:8000")
            p.add_argument("--system", default="target", help="name of the system in the results")


def main(args: argparse.Namespace) -> int:
    from ..workloads.generators import UnknownWorkload
    from ..workloads.manifest import ManifestError

    try:
        if args.bench_command == "versus":
            labels = args.labels.split(",")
            if len(labels) != 2:
                raise ValueError(f"--labels {args.labels!r}: give two names, A,B")
            print(res.versus(res.load(args.a), res.load(args.b), labels[0], labels[1]))
            return 0
        if args.bench_command == "resimulate":
            results = res.load(args.results)
            systems = sorted({p.system for p in results.points})
            for workload in sorted({p.workload for p in results.points}):
                results = resimulate(results, systems, workload, args.seed)
            write(results, args.out)
            return 0
        if args.bench_command == "compare":
            parse_config(args.config)
            compare(args.systems, args.workload, args.manifest, args.qps, args.config, args.out, args.seed,
                    conversations=args.conversations, max_conversations=args.max_conversations,
                    size=args.size, dilation=args.dilation, cut_after_s=args.cut_after,
                    point_budget_s=args.point_budget, simulate=args.simulate, gateway=args.gateway,
                    api=args.api)
            return 0
        name, runs = manifests(args.workload, args.manifest, args.qps, args.duration, args.seed)
        dilations = per_rate(args.dilation, args.qps)
        points = [play(args.url, args.system, name, rate, manifest, args.seed, n_dil,
                       sizing.horizon(manifest, args.cut_after), api=args.api)
                  for (rate, manifest), n_dil in zip(runs, dilations, strict=True)]
        write(res.BenchResults(version=res.RESULTS_VERSION, config="external", points=points), args.out)
        return 0
    except (ManifestError, UnknownWorkload, ValueError, OSError) as exc:
        return cli_error(exc)
