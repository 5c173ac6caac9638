"""`dynamo-ppd serve`: bring a graph up on loopback, report when it answers, tear it all down.

Order: port checks -> model directory -> nats-server and etcd (unless external URLs are given) ->
the graph's components in file order, each waited for -> the frontend lists the model on
/v1/models. On Ctrl-C or SIGTERM (or, unless supervised, if any process dies) every Dynamo process
gets SIGTERM (they deregister from etcd at once), stragglers get SIGKILL, leases left by killed
processes are revoked, then etcd and NATS stop and their data directories are deleted.

With ``supervise`` a process that exits is started again (supervise.py). Either way one component
can be killed or restarted: `Deployment.kill` / `Deployment.restart`, or from another process
through the control channel whose URL run.json holds (control.py, `dynamo-ppd ctl`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import model as model_dir_mod
from .control import ControlServer
from .graph import Component, Graph, expand, load_graph, replicas_of
from .planner import (
    DECISIONS_FILE,
    ROLES,
    PlannerOptions,
    PlannerUnavailable,
    check_available,
    planner_config,
    planner_process,
    scaler_process,
)
from .process import ManagedProcess, ReadySpec, free_port, group_alive, port_in_use, stop_all
from .servers import (
    Endpoints,
    dynamo_env,
    etcd_process,
    live_dynamo_keys,
    nats_process,
    revoke_leases,
)
from .supervise import RestartEvent, Supervisor

PICKER_COMPONENT = "picker"  # a graph's endpoint pickers: {picker_port}, {picker_endpoints}


class LaunchError(Exception):
    """Startup failed; the message is one line saying what and where to look."""


class BadInput(Exception):
    """The user asked for something impossible (taken port, bad graph): exit 2, one line."""


@dataclass
class ServeOptions:
    graph: str = "pd"
    http_port: int = 8000
    nats_port: int = 4222
    etcd_port: int = 2379
    nats_url: str | None = None  # use this NATS instead of starting one
    etcd_url: str | None = None  # use this etcd instead of starting one
    model_dir: Path | None = None
    run_dir: Path | None = None
    ready_timeout_s: float = 120.0
    dry_run: bool = False
    exit_when_ready: bool = False  # bring up, report, tear down (for scripts and smoke checks)
    replicas: dict[str, int] = field(default_factory=dict)  # component name -> replica count
    supervise: bool = False  # restart a process that exits instead of stopping the graph
    # component name -> arguments appended to its command (`bench --dilation` passes --speedup)
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    # Dynamo's planner scales the prefill and decode replicas (planner.py); None: nothing does.
    planner: PlannerOptions | None = None


@dataclass
class Deployment:
    """A running graph; `stop()` tears it down. Used by `serve` and by tests/benchmarks."""

    graph: Graph
    run_dir: Path
    endpoints: Endpoints
    http_port: int
    model_name: str
    servers: list[ManagedProcess] = field(default_factory=list)
    workers: list[ManagedProcess] = field(default_factory=list)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # process label -> URL
    temp_dirs: list[tempfile.TemporaryDirectory] = field(default_factory=list)
    log: Callable[[str], None] = print
    supervise: bool = False
    supervisor: Supervisor | None = None  # set once the graph is ready (also for restarts on request)
    control: ControlServer | None = None
    run_state: str = "starting"  # as in run.json
    factory: _Processes | None = None  # makes a component's processes (start-up, scale-out)
    next_replica: dict[str, int] = field(default_factory=dict)  # a scale-out's replica index

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def processes(self) -> list[ManagedProcess]:
        return self.servers + self.workers

    def write_run_file(self, state: str) -> None:
        self.run_state = state
        sup = self.supervisor
        record = {
            "graph": self.graph.name, "state": state, "base_url": self.base_url,
            "model": self.model_name, "nats_url": self.endpoints.nats_url,
            "etcd_url": self.endpoints.etcd_url, "namespace": self.graph.namespace,
            "supervise": self.supervise,
            "control_url": self.control.url if self.control and state != "stopped" else None,
            "processes": [{"label": p.label, "pid": p.popen.pid if p.popen else None,
                           "argv": p.argv, "log": str(p.log_path),
                           "system_port": int(p.env.get("DYN_SYSTEM_PORT") or 0) or None,
                           "restarts": sup.restarts(p.label) if sup else 0}
                          for p in self.processes()],
        }
        # Written from the supervisor thread too: replace atomically so a reader never sees half.
        tmp = self.run_dir / f".run.json.{threading.get_ident()}"
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "run.json")

    def first_dead(self) -> ManagedProcess | None:
        """A process that exited and is not being restarted on request."""
        sup = self.supervisor
        return next((p for p in self.processes() if p.exit_code() is not None
                     and not (sup and sup.restarting(p.label))), None)

    def process(self, label: str) -> ManagedProcess:
        """The process called ``label`` (``nats`` is accepted for ``nats-server``); KeyError naming
        the known labels otherwise."""
        wanted = "nats-server" if label == "nats" else label
        for proc in self.processes():
            if proc.label == wanted:
                return proc
        raise KeyError(f"no process {label!r}; the graph has: {', '.join(p.label for p in self.processes())}")

    def labels(self, component: str) -> list[str]:
        """The process labels of a component (``decode`` -> decode-0, decode-1, ...)."""
        return replicas_of([p.label for p in self.processes()], component)

    def kill(self, label: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one process's group; returns the pid signalled. Supervised, the process
        is started again once it exits; otherwise `serve` then stops the graph."""
        proc = self.process(label)
        if proc.popen is None or proc.exit_code() is not None:
            raise RuntimeError(f"{proc.label} is not running")
        pid = proc.pid
        proc.signal_group(sig)
        return pid

    def restart(self, label: str, wait: bool = True, timeout_s: float = 60.0) -> RestartEvent:
        """Stop one process (SIGTERM, SIGKILL after its stop timeout) and start it again with the
        same argv, environment and ports; with ``wait``, return once it is ready again."""
        proc = self.process(label)
        if self.supervisor is None:
            raise RuntimeError("the graph is not running (restart needs a started graph)")
        event = self.supervisor.request_restart(proc)
        if wait and not event.done.wait(timeout_s):
            raise TimeoutError(f"{proc.label} not ready {timeout_s:.0f} s after its restart; "
                               f"see {proc.log_path}")
        return event

    def add_replica(self, component: str, wait: bool = True, timeout_s: float = 90.0
                    ) -> tuple[str, RestartEvent]:
        """Start one more replica of ``component`` (a scale-out: a new pod of the Deployment) with
        its own ports and a new label (``decode-3``); with ``wait``, return once it is ready. Its
        label and the event (``ready_at``: when it was ready)."""
        comp = next((c for c in self.graph.components if c.name == component), None)
        if comp is None:
            raise KeyError(f"no component {component!r}; the graph has: "
                           f"{', '.join(c.name for c in self.graph.components)}")
        if comp.name == PICKER_COMPONENT:
            raise ValueError("the gateway's pickers are fixed at start-up (--replicas picker=N)")
        if self.supervisor is None or self.factory is None:
            raise RuntimeError("the graph is not running (a scale-out needs a started graph)")
        replica = self.next_replica.get(component, comp.replicas)
        self.next_replica[component] = replica + 1
        proc = self.factory.replica(comp, replica, f"{component}-{replica}", self)
        event = self.supervisor.request_start(proc, lambda: self.workers.append(proc))
        if wait and not event.done.wait(timeout_s):
            raise TimeoutError(f"{proc.label} not ready {timeout_s:.0f} s after its start; "
                               f"see {proc.log_path}")
        return proc.label, event

    def retire(self, label: str, wait: bool = True, timeout_s: float = 90.0) -> RestartEvent:
        """Stop one process for good (a scale-in: SIGTERM, its grace period, SIGKILL after it) and
        drop it from the graph; with ``wait``, return once it has exited."""
        proc = self.process(label)
        if self.supervisor is None:
            raise RuntimeError("the graph is not running (a scale-in needs a started graph)")
        if proc in self.servers:
            raise ValueError(f"{proc.label} is a server of the graph, not a component replica")

        def dropped() -> None:
            self.workers.remove(proc)
            self.metrics_urls.pop(proc.label, None)

        event = self.supervisor.request_retire(proc, dropped)
        if wait and not event.done.wait(timeout_s):
            raise TimeoutError(f"{proc.label} still running {timeout_s:.0f} s after its SIGTERM")
        return event

    def status(self) -> list[dict]:
        sup = self.supervisor
        return [{"label": p.label, "pid": p.popen.pid if p.popen else None,
                 "alive": p.popen is not None and p.exit_code() is None,
                 "exit_code": p.exit_code(), "restarts": sup.restarts(p.label) if sup else 0,
                 "log": str(p.log_path)} for p in self.processes()]

    def stop(self) -> list[str]:
        """Stop everything; return the labels of processes still alive afterwards (normally none)."""
        if self.supervisor:
            self.supervisor.halt()  # nothing is restarted while we stop
        if self.control:
            self.control.close()
        killed = stop_all(list(reversed(self.workers)))
        if killed:
            self.log(f"  killed after stop timeout: {', '.join(killed)}")
        self._clean_etcd()
        stop_all(list(reversed(self.servers)))
        if self.supervisor:
            self.supervisor.join()  # only now: its thread's exit SIGTERMs what it started
        for tmp in self.temp_dirs:
            tmp.cleanup()
        self.write_run_file("stopped")
        return [p.label for p in self.processes() if p.popen and group_alive(p.popen.pid)]

    def _clean_etcd(self) -> None:
        """Revoke leases of keys our processes left (only a SIGKILLed worker leaves any)."""
        etcd_alive = all(p.exit_code() is None for p in self.servers if p.label == "etcd")
        if not etcd_alive:
            return
        try:
            leftover = live_dynamo_keys(self.endpoints.etcd_url, self.graph.namespace)
            if leftover:
                revoke_leases(self.endpoints.etcd_url, leftover)
                self.log(f"  revoked the leases of {len(leftover)} etcd keys left by stopped workers")
        except Exception as exc:  # noqa: BLE001 (clean-up is best effort; say so, never hang)
            self.log(f"  warning: could not check etcd for stale keys: {exc}")


def _port_checks(opts: ServeOptions) -> None:
    wanted = [(opts.http_port, "frontend HTTP", "--http-port")]
    if not opts.nats_url:
        wanted.append((opts.nats_port, "NATS", "--nats-port"))
    if not opts.etcd_url:
        wanted.append((opts.etcd_port, "etcd", "--etcd-port"))
    for port, what, flag in wanted:
        if port_in_use(port):
            raise BadInput(f"port {port} ({what}) is already in use on 127.0.0.1; "
                           f"stop what holds it or choose another with {flag}")


def _default_run_dir(graph: Graph) -> Path:
    return Path("runs") / f"{graph.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def wait_ready(procs: list[ManagedProcess], log) -> None:
    """Until every process passes its ready check; LaunchError naming the one that exited or timed out."""
    start = time.monotonic()
    pending = list(procs)
    while pending:
        for proc in list(pending):
            code = proc.exit_code()
            if code is not None:
                raise LaunchError(f"{proc.label} exited with code {code} during startup; "
                                  f"see {proc.log_path}\n{proc.log_tail()}")
            if proc.is_ready():
                pending.remove(proc)
                log(f"  {proc.label} ready ({time.monotonic() - start:.1f} s)")
            elif time.monotonic() - start > proc.ready.timeout_s:
                raise LaunchError(f"{proc.label} not ready after {proc.ready.timeout_s:.0f} s; "
                                  f"see {proc.log_path}")
        if pending:
            time.sleep(0.1)


def _model_listed(base_url: str, model_name: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as response:
            data = json.loads(response.read())
    except (OSError, ValueError):
        return False
    return any(m.get("id") == model_name for m in data.get("data", []))


def _check_components(graph: Graph, named: Iterable[str], what: str) -> None:
    """BadInput unless every name in ``named`` is a component of ``graph``; ``what`` leads the
    message and is followed by the first unknown name."""
    names = {c.name for c in graph.components}
    unknown = sorted(set(named) - names)
    if unknown:
        raise BadInput(f"{what} {unknown[0]!r}, which is not a component of graph "
                       f"{graph.name!r} ({', '.join(sorted(names))})")


def _with_replicas(graph: Graph, replicas: dict[str, int]) -> Graph:
    import msgspec

    _check_components(graph, replicas, "--replicas names")
    return msgspec.structs.replace(graph, components=[
        msgspec.structs.replace(c, replicas=replicas.get(c.name, c.replicas)) for c in graph.components])


def _check_planner(graph: Graph, planner: PlannerOptions | None) -> None:
    """BadInput unless the planner can run on this install and ``graph`` has what it scales."""
    if planner is None:
        return
    names = {c.name for c in graph.components}
    missing = [c for c in ROLES.values() if c not in names]
    if missing:
        raise BadInput(f"--planner scales the prefill and decode components; graph {graph.name!r} "
                       f"lacks {' and '.join(repr(m) for m in missing)} (try graph ppd or ppd-relay)")
    if not planner.external:
        try:
            check_available()
            planner_config(planner, graph.namespace, "-")  # a bad --planner-config fails here, not late
        except (PlannerUnavailable, ValueError) as exc:
            raise BadInput(str(exc)) from None


def _start_planner(deployment: Deployment, planner: PlannerOptions, log) -> None:
    """The VirtualConnectorClient (scaler.py), then Dynamo's planner unless it runs elsewhere."""
    assert deployment.factory is not None
    ports = deployment.factory.taken

    def env() -> dict[str, str]:
        port = free_port(below=32768, avoid=ports)
        ports.add(port)
        return {**_inherited_env(), **dynamo_env(deployment.endpoints, port, os.environ.get("DYN_LOG"))}

    namespace = deployment.graph.namespace
    procs = [scaler_process(deployment.run_dir, namespace, env())]
    if not planner.external:
        config = planner_config(planner, namespace, deployment.model_name)
        procs.append(planner_process(config, deployment.run_dir, env()))
    for proc in procs:
        proc.start()
        deployment.workers.append(proc)
        deployment.write_run_file("starting")
        wait_ready([proc], log)


def _with_extra_args(graph: Graph, extra: dict[str, list[str]]) -> Graph:
    import msgspec

    _check_components(graph, extra, "extra arguments for")
    return msgspec.structs.replace(graph, components=[
        msgspec.structs.replace(c, command=[*c.command, *extra.get(c.name, [])]) for c in graph.components])


@dataclass
class _Processes:
    """Makes a component's replica processes, placeholders filled in: at start-up for every
    replica, later for one more (`Deployment.add_replica`), with ports no other process holds."""

    graph_dir: Path
    model_dir: Path
    frontend_port: int
    picker_ports: list[int]
    taken: set[int]

    @classmethod
    def for_graph(cls, graph: Graph, graph_dir: Path, http_port: int, model_dir: Path) -> _Processes:
        # Graph-wide ports: a frontend behind a gateway, and the endpoint pickers the gateway calls.
        taken: set[int] = {http_port}
        frontend_port = free_port(below=32768, avoid=taken)
        taken.add(frontend_port)
        pickers = next((c.replicas for c in graph.components if c.name == PICKER_COMPONENT), 0)
        picker_ports: list[int] = []
        for _ in range(pickers):
            picker_ports.append(free_port(below=32768, avoid=taken))
            taken.add(picker_ports[-1])
        return cls(graph_dir, model_dir, frontend_port, picker_ports, taken)

    def replica(self, comp: Component, replica: int, label: str, deployment: Deployment) -> ManagedProcess:
        system_port = free_port(below=32768, avoid=self.taken)
        metrics_port = free_port(below=32768, avoid=self.taken | {system_port})
        self.taken |= {system_port, metrics_port}
        graph = deployment.graph
        values = {
            "python": sys.executable, "model_dir": str(self.model_dir),
            "model_name": deployment.model_name, "namespace": graph.namespace,
            "http_port": deployment.http_port, "nats_url": deployment.endpoints.nats_url,
            "etcd_url": deployment.endpoints.etcd_url, "system_port": system_port,
            "metrics_port": metrics_port, "frontend_port": self.frontend_port,
            "picker_port": self.picker_ports[replica] if comp.name == PICKER_COMPONENT else "",
            "picker_endpoints": ",".join(f"127.0.0.1:{p}" for p in self.picker_ports),
            "replica": replica, "run_dir": str(deployment.run_dir), "graph_dir": str(self.graph_dir),
        }
        if comp.metrics:
            deployment.metrics_urls[label] = expand(comp.metrics, values)
        env = {**_inherited_env(),
               **dynamo_env(deployment.endpoints, system_port, os.environ.get("DYN_LOG")),
               **{k: expand(v, values) for k, v in comp.env.items()}}
        ready = ReadySpec(http=expand(comp.ready.http, values) if comp.ready.http else None,
                          log=comp.ready.log, timeout_s=comp.ready.timeout_s)
        return ManagedProcess(label, [expand(a, values) for a in comp.command], env,
                              deployment.run_dir / "logs" / f"{label}.log", ready, comp.stop_timeout_s)


def _component_processes(graph: Graph, deployment: Deployment) -> list[list[ManagedProcess]]:
    """One list of processes per component, placeholders filled in."""
    assert deployment.factory is not None
    batches = []
    for comp in graph.components:
        deployment.next_replica[comp.name] = comp.replicas
        batches.append([deployment.factory.replica(comp, replica, comp.name if comp.replicas == 1
                                                   else f"{comp.name}-{replica}", deployment)
                        for replica in range(comp.replicas)])
    return batches


def _inherited_env() -> dict[str, str]:
    # Dynamo settings from the caller's shell would fight ours; everything else passes through
    # (DYN_LOG too, through `dynamo_env`: `DYN_LOG=debug dynamo-ppd serve` is how to see more).
    return {k: v for k, v in os.environ.items() if not k.startswith(("DYN_", "ETCD_", "NATS_"))}


def start(opts: ServeOptions, log=print) -> Deployment:
    """Bring the graph up and return it ready; on any failure, tear down what started and raise."""
    graph, graph_path = load_graph(opts.graph)
    graph = _with_extra_args(_with_replicas(graph, opts.replicas), opts.extra_args)
    _check_planner(graph, opts.planner)
    _port_checks(opts)
    model_dir = Path(opts.model_dir or model_dir_mod.default_model_dir())
    if not model_dir_mod.is_complete(model_dir):
        log(f"model directory {model_dir} is missing: creating it (once, ~20 s)")
        model_dir_mod.init_model_dir(model_dir)
    info = model_dir_mod.load_model_info(model_dir)

    run_dir = Path(opts.run_dir or _default_run_dir(graph)).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    endpoints = Endpoints(nats_url=opts.nats_url or f"nats://127.0.0.1:{opts.nats_port}",
                          etcd_url=opts.etcd_url or f"http://127.0.0.1:{opts.etcd_port}")
    deployment = Deployment(graph, run_dir, endpoints, opts.http_port, info.served_model_name, log=log,
                            supervise=opts.supervise)
    t0 = time.monotonic()
    try:
        servers = [(opts.nats_url, nats_process, opts.nats_port, "nats-server"),
                   (opts.etcd_url, etcd_process, opts.etcd_port, "etcd")]
        for external_url, make, port, label in servers:
            if external_url:
                continue
            tmp = tempfile.TemporaryDirectory(prefix=f"dynamo-ppd-{label}-")  # throw-away data
            deployment.temp_dirs.append(tmp)
            deployment.servers.append(make(port, Path(tmp.name), run_dir / "logs" / f"{label}.log"))
        for proc in deployment.servers:
            proc.start()
        wait_ready(deployment.servers, log)
        deployment.factory = _Processes.for_graph(graph, graph_path.parent, opts.http_port, model_dir)
        for batch in _component_processes(graph, deployment):
            for proc in batch:
                proc.start()
                deployment.workers.append(proc)
            deployment.write_run_file("starting")
            wait_ready(batch, log)
        deadline = time.monotonic() + opts.ready_timeout_s
        while not _model_listed(deployment.base_url, deployment.model_name):
            dead = deployment.first_dead()
            if dead:
                raise LaunchError(f"{dead.label} exited with code {dead.exit_code()}; see {dead.log_path}")
            if time.monotonic() > deadline:
                raise LaunchError(f"model {deployment.model_name!r} not listed on "
                                  f"{deployment.base_url}/v1/models after {opts.ready_timeout_s:.0f} s; "
                                  f"see the logs in {run_dir / 'logs'}")
            time.sleep(0.2)
        deployment.supervisor = Supervisor(deployment.processes, opts.supervise, log=log,
                                           on_change=lambda: deployment.write_run_file(deployment.run_state))
        deployment.supervisor.start()
        deployment.control = ControlServer(deployment)
        deployment.control.start()
        if opts.planner is not None:
            deployment.write_run_file("starting")  # the client reads the control channel's URL
            _start_planner(deployment, opts.planner, log)
    except BaseException:
        deployment.stop()
        raise
    deployment.write_run_file("ready")
    log(f"graph {graph.name!r} ready in {time.monotonic() - t0:.1f} s")
    return deployment


def dry_run(opts: ServeOptions, log=print) -> None:
    """Validate the graph and print the commands it would run; checks each program exists."""
    import shutil

    graph, graph_path = load_graph(opts.graph)
    graph = _with_extra_args(_with_replicas(graph, opts.replicas), opts.extra_args)
    _check_planner(graph, opts.planner)
    model_dir = Path(opts.model_dir or model_dir_mod.default_model_dir())
    run_dir = Path(opts.run_dir or _default_run_dir(graph))
    endpoints = Endpoints(nats_url=opts.nats_url or f"nats://127.0.0.1:{opts.nats_port}",
                          etcd_url=opts.etcd_url or f"http://127.0.0.1:{opts.etcd_port}")
    deployment = Deployment(graph, run_dir, endpoints, opts.http_port, model_dir_mod.DEFAULT_MODEL_NAME)
    log(f"graph {graph.name!r} ({graph_path}): {graph.description.strip()}")
    deployment.factory = _Processes.for_graph(graph, graph_path.parent, opts.http_port, model_dir)
    for batch in _component_processes(graph, deployment):
        for proc in batch:
            program = proc.argv[0]
            if shutil.which(program) is None:
                raise BadInput(f"{proc.label}: program {program!r} not found")
            if program == sys.executable and proc.argv[1:2] == ["-m"]:
                import importlib.util

                if importlib.util.find_spec(proc.argv[2]) is None:
                    raise BadInput(f"{proc.label}: Python module {proc.argv[2]!r} not found")
            log(f"  {proc.label}: {' '.join(proc.argv)}")
    if opts.planner is not None:
        log(f"  scaler: {sys.executable} -m dynamo_ppd.launch.scaler --run-dir {run_dir} "
            f"--namespace {graph.namespace}")
        if not opts.planner.external:
            config = planner_config(opts.planner, graph.namespace, deployment.model_name)
            log(f"  planner: {sys.executable} -m dynamo.planner --config {run_dir}/planner-config.json "
                f"({json.dumps(config)})")


def serve(opts: ServeOptions) -> int:
    """The `serve` command: returns the process exit code."""
    if opts.dry_run:
        dry_run(opts)
        return 0
    stop_requested: list[int] = []
    running: list[Deployment] = []

    def on_signal(signum, _frame):
        if not running:  # still starting: unwind start(), which stops what it started
            raise KeyboardInterrupt
        stop_requested.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            deployment = start(opts, log=lambda m: print(m, flush=True))
        except KeyboardInterrupt:
            print("interrupted during startup; everything started was stopped", flush=True)
            return 130
        running.append(deployment)
        _print_ready(deployment)
        code = 0
        while not stop_requested and not opts.exit_when_ready:
            dead = None if opts.supervise else deployment.first_dead()
            if dead:
                print(f"error: {dead.label} exited with code {dead.exit_code()}; see {dead.log_path}",
                      file=sys.stderr, flush=True)
                code = 1
                break
            time.sleep(0.2)
        print("stopping ...", flush=True)
        alive = deployment.stop()
        if alive:
            print(f"error: still running after stop: {', '.join(alive)}", file=sys.stderr, flush=True)
            return 1
        print("stopped: no process of the run is left", flush=True)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_ready(dep: Deployment) -> None:
    metrics = "".join(f"\n{label} metrics: {url}" for label, url in dep.metrics_urls.items())
    mode = ("supervised: a process that exits is started again" if dep.supervise
            else "any process exiting stops the graph")
    if any(p.label == "scaler" for p in dep.workers):
        mode = (f"the planner's decisions: {dep.run_dir}/{DECISIONS_FILE} (and logs/scaler.log)\n  "
                + mode)
    body = json.dumps({"model": dep.model_name, "stream": True, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hello! Who are you?"}]})
    print(f"""
  OpenAI endpoint  {dep.base_url}/v1   (model {dep.model_name})
  logs             {dep.run_dir}/logs/{metrics}
  try:  curl -sN {dep.base_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'

  control          dynamo-ppd ctl --run-dir {dep.run_dir} status|kill LABEL|restart LABEL
  {mode}; Ctrl-C stops everything.
""", flush=True)
