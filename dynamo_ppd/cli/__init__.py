"""`dynamo-ppd` command line. Each subcommand is a thin shell over a module; errors the user can
fix exit with code 2 and one line saying what is wrong and how to fix it.

The top layer of the package: the shells of `sim run` (`sim`), `table` (`table`), `chaos`
(`chaos`) and `advise` (`advise`) sit beside this module; the experiments (`dynamo_ppd.bench`,
`studies`, `paper`, `calibration`, `tables`) keep their own `add_arguments`/`main` pair, which
`sim`, `bench`, `table` and `engine` call."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import __version__
from ..argtypes import cli_error, positive_float, replica_counts, up_down


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="run a graph locally: NATS, etcd, Dynamo's frontend and the workers",
        description="Start nats-server (JetStream) and etcd on 127.0.0.1 with throw-away data "
        "directories, then each component of GRAPH in order; wait until the model is listed on "
        "/v1/models, print the endpoint and a curl line, and run until Ctrl-C or SIGTERM, which "
        "stop every process (workers deregister from etcd at once). Each process's log is kept in "
        "RUN_DIR/logs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("graph", nargs="?", default="ppd",
                   help="graph name (a file NAME.yaml in ./graphs or the bundled graphs) or a path "
                   "to a graph YAML file")
    p.add_argument("--http-port", type=_port, default=8000,
                   help="the graph's OpenAI HTTP port (its frontend's, or its gateway's)")
    p.add_argument("--nats-port", type=_port, default=4222, help="port for the NATS server we start")
    p.add_argument("--etcd-port", type=_port, default=2379, help="client port for the etcd we start")
    p.add_argument("--nats-url", help="use this running NATS server instead of starting one "
                   "(e.g. nats://127.0.0.1:4222)")
    p.add_argument("--etcd-url", help="use this running etcd instead of starting one "
                   "(e.g. http://127.0.0.1:2379)")
    p.add_argument("--model-dir", type=Path, help="local model directory; default: the cache "
                   "directory's model, created by `model init` when missing")
    p.add_argument("--run-dir", type=Path, help="where logs and run.json go; default "
                   "runs/GRAPH-TIMESTAMP")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for the model to be listed on /v1/models")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the graph, check its programs exist, print the commands; start nothing")
    p.add_argument("--replicas", type=replica_counts, default={},
                   help="override replica counts, e.g. prefill=2,decode=2 (the 2P2D layout of ppd)")
    p.add_argument("--exit-when-ready", action="store_true",
                   help="stop everything as soon as the graph is ready (a start-up check)")
    p.add_argument("--supervise", action="store_true",
                   help="restart a process that exits (same argv, env and ports; etcd and NATS keep "
                   "their data; backoff 0.5 s doubling to 8 s) instead of stopping the whole graph")
    p.add_argument("--profile", metavar="PROFILE",
                   help="engine profile (a bundled name or a YAML path, e.g. one `dynamo-ppd engine "
                   "profile` wrote) for every simulated worker and the PPD picker or router; default: "
                   "each component's own (h100-llama3.1-8b)")
    p.add_argument("--router-profile", metavar="PROFILE",
                   help="the engine profile the PPD picker or router decides with, where it differs "
                   "from the workers' (--profile): what PPD believes of a fleet it was not profiled on")
    p.add_argument("--router-link-bandwidth", type=positive_float, metavar="GB/S",
                   help="the KV link bandwidth the PPD picker or router believes, in GB/s, where it "
                   "differs from the workers' (their profile's link)")
    p.add_argument("--dilation", type=float, default=1.0, metavar="N",
                   help="run the simulated workers, the PPD router and picker N times slower (their "
                   "--speedup 1/N), as `bench --dilation N` does, so a 2-core machine keeps up with a "
                   "high rate; drive it with a client that stretches its schedule by N")
    planner = p.add_argument_group(
        "Dynamo's planner", "scale the prefill and decode replicas by load with Dynamo 1.6.1's planner "
        "(python -m dynamo.planner, its virtual environment): a client process of the graph acts on "
        "each decision (adds, then retires, replicas as `ctl add/retire` do) and reports it done")
    planner.add_argument("--planner", nargs="?", const="dynamo", choices=("dynamo", "external"),
                         help="dynamo: start Dynamo's planner with the settings below (needs the "
                         "`planner` extra); external: start only the client, for a planner you run "
                         "in the graph's namespace yourself")
    # PlannerOptions' defaults, written out: importing dynamo_ppd.launch here would cost every
    # command ~140 ms of start-up (test_planner checks the two agree).
    planner.add_argument("--planner-prefill-queue", type=up_down(int), default=(8192, 1024),
                         metavar="UP,DOWN",
                         help="add a prefill worker when one has UP prompt tokens queued; remove one "
                         "when all have at most DOWN")
    planner.add_argument("--planner-decode-kv", type=up_down(float), default=(50.0, 15.0),
                         metavar="UP,DOWN",
                         help="add a decode worker when one holds UP percent of its KV capacity in "
                         "running and queued decodes; remove one when all hold at most DOWN")
    planner.add_argument("--planner-interval", type=int, default=5,
                         help="seconds between the planner's load checks")
    planner.add_argument("--planner-max-workers", type=int, default=8,
                         help="the most prefill plus decode workers the planner may run")
    planner.add_argument("--planner-config", type=Path, metavar="FILE",
                         help="JSON or YAML of Dynamo PlannerConfig fields, merged over the above")


def _add_ctl(sub) -> None:
    p = sub.add_parser(
        "ctl", help="list, kill, restart, add or retire one process of a graph run by `serve` in another "
        "process",
        description="Talks to a running `dynamo-ppd serve` through the control channel named in "
        "RUN_DIR/run.json (a loopback HTTP port). `kill` sends a signal to one process (a supervised "
        "graph starts it again; an unsupervised one then stops); `restart` stops it (SIGTERM, "
        "SIGKILL after its stop timeout) and starts it again, and returns once it is ready; `add` "
        "starts one more replica of a component (a scale-out) and `retire` drains one process and "
        "drops it (a scale-in: SIGTERM, Dynamo's graceful shutdown, SIGKILL after the stop timeout).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="the serve run's directory (--run-dir "
                   "of serve; it holds run.json)")
    csub = p.add_subparsers(dest="ctl_command", required=True, metavar="{status,kill,restart,add,retire}")
    csub.add_parser("status", help="each process: pid, alive, restarts")
    kill = csub.add_parser("kill", help="send a signal to one process",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kill.add_argument("label", help="process label, e.g. decode-1, router, etcd, nats-server")
    kill.add_argument("--signal", default="KILL", help="signal name or number (KILL, TERM, INT, 9)")
    restart = csub.add_parser("restart", help="stop one process and start it again",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    restart.add_argument("label", help="process label, e.g. router-0, etcd, nats-server")
    restart.add_argument("--timeout", type=float, default=60.0,
                         help="seconds to wait for it to be ready again")
    add = csub.add_parser("add", help="start one more replica of a component (a scale-out)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add.add_argument("component", help="component name, e.g. decode, prefill")
    add.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for it to be ready")
    retire = csub.add_parser("retire", help="drain one process and drop it from the graph (a scale-in)",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    retire.add_argument("label", help="process label, e.g. decode-1")
    retire.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for it to exit")


def _add_model(sub) -> None:
    p = sub.add_parser("model", help="the local model directory (tokenizer, config.json)")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="{init,info}")
    init = msub.add_parser(
        "init", help="write the local model directory",
        description="Train a byte-level BPE tokenizer on a seeded synthetic corpus and write it "
        "with a Llama-3-style chat template and a config.json shaped like Llama-3.1-8B. Nothing is "
        "downloaded.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    init.add_argument("--dir", type=Path, help="target directory; default "
                      "$DYNAMO_PPD_CACHE/models/llama-3.1-8b-sim (~/.cache/dynamo-ppd/...)")
    init.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary (>= 4096)")
    init.add_argument("--seed", type=int, default=0, help="seed of the synthetic training corpus")
    init.add_argument("--force", action="store_true", help="rewrite an existing directory")
    info = msub.add_parser("info", help="print a model directory's metadata")
    info.add_argument("--dir", type=Path, help="model directory; default: the cache directory's")


def _add_engine(sub) -> None:
    p = sub.add_parser("engine", help="the simulated TensorRT-LLM engine: profiles, calibration")
    esub = p.add_subparsers(dest="engine_command", required=True,
                            metavar="{profiles,profile,calibrate,aic}")
    esub.add_parser("profiles", help="list the bundled engine profiles and what they derive",
                    description="List bundled engine profiles with derived KV capacity and timings.")
    from ..calibration import aic, fit
    from . import profile

    profile.add_arguments(esub.add_parser(
        "profile", help="write an engine profile for a model's config.json, a TP degree and a "
        "precision on a named GPU", description=profile.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))

    fit.add_arguments(esub.add_parser(
        "calibrate", help="fit a profile's cost constants to measured iteration timings",
        description=fit.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    aic.add_arguments(esub.add_parser(
        "aic", help="compare a profile's cost model with NVIDIA AIConfigurator's TensorRT-LLM "
        "predictions and refit its constants to them",
        description=aic.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def _add_sim(sub) -> None:
    p = sub.add_parser("sim", help="virtual-clock simulation of the engine model")
    ssub = p.add_subparsers(dest="sim_command", required=True,
                            metavar="{run,interference,paper,fidelity,compare}")
    from ..paper import fidelity, interference, protocol
    from ..studies import policies
    from . import sim as run

    commands = [
        ("run", run, "simulate a multi-turn workload on a P/D cluster with a routing mode"),
        ("interference", interference, "decode slowdown under full vs append prefills (paper Fig. 2/7/8)"),
        ("paper", protocol, "the paper authors' benchmark on a simulated configuration, as their "
         "CSV's columns"),
        ("fidelity", fidelity, "simulated vs the paper's measured H100 points: errors, success, "
         "decode-local share"),
        ("compare", policies, "every P/D policy (ours, the peers', fixed rules) on one simulated cluster: "
         "wins, ties, losses")]
    for name, module, help_text in commands:
        module.add_arguments(ssub.add_parser(name, help=help_text, description=module.__doc__,
                                             formatter_class=argparse.RawDescriptionHelpFormatter))


def _add_table(sub) -> None:
    from . import table as table_cli

    table_cli.add_arguments(sub.add_parser(
        "table", help="PPD decision tables: build, show, explain, reweight, evaluate",
        description="Build a table (every grid cell measured at x=0 and x=1), read it, recompute it "
        "for other weights, or compare it with and without online correction in the simulation."))


def _add_router(sub) -> None:
    sub.add_parser("router", help="run the PPD relay router component (same as python -m "
                   "dynamo_ppd.relay; `dynamo-ppd router --help` lists its flags)", add_help=False)
    sub.add_parser("picker", help="run the PPD endpoint picker, an Envoy ext_proc server (same as "
                   "python -m dynamo_ppd.picker; `dynamo-ppd picker --help` lists its flags)",
                   add_help=False)
    sub.add_parser("gateway", help="run the local gateway that stands in for an Envoy-based one "
                   "(same as python -m dynamo_ppd.gateway; `dynamo-ppd gateway --help`)", add_help=False)


def _add_bench(sub) -> None:
    from ..bench import compare, picker_path

    bench = sub.add_parser(
        "bench", help="multi-turn benchmark: compare systems side by side, or measure an endpoint; "
        "the endpoint picker's request path alone (bench picker)",
        description=compare.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_arguments(bench)
    # `bench picker` sits beside compare's own subcommands (compare, run, versus, resimulate):
    # one more choice on the subparsers that compare.add_arguments made.
    commands = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    commands.metavar = "{compare,run,versus,resimulate,picker}"
    picker_path.add_arguments(commands.add_parser(
        "picker", help="the endpoint picker's request path alone: ext_proc straight to the picker of a "
        "live ppd graph, per stage, at fixed rates", description=picker_path.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynamo-ppd",
        description="PPD router for NVIDIA Dynamo: multi-turn chat on prefill/decode "
        "disaggregated clusters, with simulated workers for machines without GPUs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_model(sub)
    _add_engine(sub)
    _add_sim(sub)
    _add_table(sub)
    _add_router(sub)
    _add_bench(sub)
    _add_ctl(sub)
    from . import advise as advise_cli

    advise_cli.add_arguments(sub.add_parser(
        "advise", help="which deployment (replicas, a P:D split, a hybrid) and PPD weights to run "
        "for a workload on N GPUs, from simulating them all", description=advise_cli.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    from . import chaos as chaos_cli

    chaos_cli.add_arguments(sub.add_parser(
        "chaos", help="play a workload against a supervised graph and inject one fault per run",
        description=chaos_cli.DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return parser


def _profile_arg(name: str) -> str:
    """A profile as a component's --profile: checked here (a bad profile is one line, not a
    component's crash), a file given by its absolute path."""
    from ..engine.profile import load_profile

    load_profile(name)
    path = Path(name)
    return str(path.resolve()) if path.is_file() else name


def _serve(args) -> int:
    from ..launch import ServeOptions, serve
    from ..launch.graph import ROUTING_MODULES, load_graph, ppd_components, speedup_args
    from ..launch.planner import PlannerOptions


    if not args.dilation > 0:
        return cli_error("--dilation must be a positive factor (1: real time)")
    if args.planner_max_workers < 2 or args.planner_interval < 1:
        return cli_error("--planner-max-workers must be at least 2 (a prefill and a decode worker) "
                         "and --planner-interval at least 1 s")
    planner = None
    if args.planner:
        (queue_up, queue_down), (kv_up, kv_down) = args.planner_prefill_queue, args.planner_decode_kv
        planner = PlannerOptions(external=args.planner == "external", prefill_queue_up=queue_up,
                                 prefill_queue_down=queue_down, decode_kv_up=kv_up,
                                 decode_kv_down=kv_down, interval_s=args.planner_interval,
                                 max_workers=args.planner_max_workers, config_file=args.planner_config)
    extra = speedup_args(args.graph, args.dilation)
    belief = ["--profile", _profile_arg(args.router_profile)] if args.router_profile else []
    if args.router_link_bandwidth:
        belief += ["--link-bandwidth-gbps", f"{args.router_link_bandwidth:g}"]
    if args.profile or belief:
        graph, _ = load_graph(args.graph)
        if args.profile:
            profile = _profile_arg(args.profile)
            for name in ppd_components(graph):
                extra[name] = [*extra.get(name, []), "--profile", profile]
        for name in ppd_components(graph, ROUTING_MODULES) if belief else []:
            extra[name] = [*extra.get(name, []), *belief]  # (after --profile: the last one counts)
    return serve(ServeOptions(
        graph=args.graph, http_port=args.http_port, nats_port=args.nats_port,
        etcd_port=args.etcd_port, nats_url=args.nats_url, etcd_url=args.etcd_url,
        model_dir=args.model_dir, run_dir=args.run_dir, ready_timeout_s=args.ready_timeout,
        dry_run=args.dry_run, exit_when_ready=args.exit_when_ready, replicas=args.replicas,
        supervise=args.supervise, extra_args=extra, planner=planner))


def _ctl(args) -> int:
    from ..launch.control import ControlError, call, control_url, parse_signal

    try:
        url = control_url(args.run_dir)
        if args.ctl_command == "status":
            for proc in call(url, "/status")["processes"]:
                state = "alive" if proc["alive"] else f"exited ({proc['exit_code']})"
                print(f"{proc['label']:<16} pid {proc['pid']!s:<8} {state:<14} restarts {proc['restarts']}")
        elif args.ctl_command == "kill":
            answer = call(url, "/kill", {"label": args.label, "signal": parse_signal(args.signal).name})
            print(f"sent {answer['signal']} to {answer['label']} (pid {answer['pid']})")
        elif args.ctl_command == "add":
            answer = call(url, "/add", {"component": args.component, "timeout_s": args.timeout},
                          timeout_s=args.timeout + 30)
            print(f"added {answer['label']}: ready {answer['ready_after_s']} s after its start")
        elif args.ctl_command == "retire":
            answer = call(url, "/retire", {"label": args.label, "timeout_s": args.timeout},
                          timeout_s=args.timeout + 30)
            print(f"retired {answer['label']}: gone {answer['gone_after_s']} s after its SIGTERM "
                  f"(exit code {answer['exit_code']})")
        else:
            answer = call(url, "/restart", {"label": args.label, "timeout_s": args.timeout},
                          timeout_s=args.timeout + 30)
            print(f"restarted {answer['label']}: down {answer['down_s']} s, ready "
                  f"{answer['ready_after_s']} s after it was stopped")
    except (ControlError, ValueError) as exc:
        return cli_error(exc, 1)
    return 0


def _model(args) -> int:
    from .. import model

    if args.model_command == "init":
        target = args.dir or model.default_model_dir()
        if model.is_complete(target) and not args.force:
            print(f"{target} already exists (use --force to rewrite it)")
            return 0
        print(f"training the tokenizer and writing {target} ...", flush=True)
        path = model.init_model_dir(target, vocab_size=args.vocab_size, seed=args.seed, force=True)
        info = model.load_model_info(path)
        print(f"wrote {path} (vocab {info.vocab_size}, served as {info.served_model_name!r})")
        return 0
    info = model.load_model_info(args.dir or model.default_model_dir())
    import msgspec

    print(msgspec.json.format(msgspec.json.encode(info)).decode())
    return 0


def _engine(args) -> int:
    from ..calibration import aic, fit
    from ..engine.cost import CostModel, PrefillChunk
    from ..engine.profile import bundled_profiles, load_profile

    if args.engine_command == "calibrate":
        return fit.main(args)
    if args.engine_command == "aic":
        return aic.main(args)
    if args.engine_command == "profile":
        from . import profile as profile_cli

        return profile_cli.main(args)
    print(f"{'profile':<28}{'hardware':<26}{'TP':>3}{'KV blocks':>10}{'KV tokens':>11}{'TPOT b=1':>10}"
          f"{'prefill 1K':>12}")
    for name in bundled_profiles():
        profile = load_profile(name)
        model = CostModel(profile)
        blocks = profile.kv_capacity_blocks()
        tpot = model.iteration(1, 1024).total_s * 1e3
        prefill = model.iteration(0, 0, [PrefillChunk(1024, 0, True)]).total_s * 1e3
        print(f"{name:<28}{profile.hardware.name:<26}{profile.tp:>3}{blocks:>10}"
              f"{blocks * profile.engine.block_size:>11}{tpot:>8.2f}ms{prefill:>10.1f}ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..engine.profile import ProfileError
    from ..launch import BadInput, GraphError, LaunchError
    from ..model import ModelDirError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:  # the router has its own command line (dynamo_ppd/routing/args.py)
        from ..relay.service import main as router_main

        router_main(argv[1:])
        return 0
    if argv[:1] == ["picker"]:  # so has the picker (dynamo_ppd/picker/args.py)
        from ..picker.service import main as picker_main

        picker_main(argv[1:])
        return 0
    if argv[:1] == ["gateway"]:
        from ..gateway.__main__ import main as gateway_main

        gateway_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "model":
            return _model(args)
        if args.command == "engine":
            return _engine(args)
        if args.command == "sim":
            from ..paper import fidelity, interference, protocol
            from ..studies import policies
            from . import sim as run

            mains = {"run": run.main, "interference": interference.main, "paper": protocol.main,
                     "fidelity": fidelity.main, "compare": policies.main}
            return mains[args.sim_command](args)
        if args.command == "table":
            from . import table as table_cli

            return table_cli.main(args)
        if args.command == "bench":
            from ..bench import compare, picker_path

            return picker_path.main(args) if args.bench_command == "picker" else compare.main(args)
        if args.command == "ctl":
            return _ctl(args)
        if args.command == "chaos":
            from . import chaos as chaos_cli

            return chaos_cli.main(args)
        if args.command == "advise":
            from . import advise as advise_cli

            return advise_cli.main(args)
    except (GraphError, BadInput, ModelDirError, ProfileError) as exc:
        return cli_error(exc)
    except LaunchError as exc:
        return cli_error(exc, 1)
    raise AssertionError(f"unhandled command {args.command}")
