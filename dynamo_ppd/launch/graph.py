"""Graph files: which processes make up a local deployment, and how to tell each is ready.

A graph is YAML (schema `Graph`). Strings in ``command`` and ``env`` may use placeholders that the
launcher fills in per process (see `PLACEHOLDERS`). Example::

    name: pd
    components:
      - name: frontend
        command: ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}"]
      - name: decode
        replicas: 3
        command: ["{python}", "-m", "dynamo.mocker", "--model-path", "{model_dir}"]
        ready: {http: "http://127.0.0.1:{system_port}/health"}
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated

import msgspec

# Placeholders a graph may use, and what the launcher puts there.
PLACEHOLDERS: dict[str, str] = {
    "python": "the Python interpreter running dynamo-ppd",
    "model_dir": "the local model directory (dynamo-ppd model init)",
    "model_name": "the served model name",
    "namespace": "the graph's Dynamo namespace",
    "http_port": "the frontend's HTTP port (--http-port)",
    "nats_url": "the NATS server URL",
    "etcd_url": "the etcd client URL",
    "system_port": "a free port for this process's Dynamo system server (DYN_SYSTEM_PORT)",
    "metrics_port": "another free port for this process (e.g. a router's Prometheus server)",
    "replica": "this process's replica index, from 0",
    "frontend_port": "a free port for a Dynamo frontend behind a gateway (one per graph)",
    "picker_port": "this endpoint-picker replica's ext_proc gRPC port (component `picker`)",
    "picker_endpoints": "every endpoint-picker replica's ext_proc address, ip:port,ip:port",
    "run_dir": "the run directory (logs and run.json)",
    "graph_dir": "the directory holding the graph file",
}

_NAME = r"^[a-z][a-z0-9-]*$"


class ReadyCheck(msgspec.Struct, forbid_unknown_fields=True):
    """How the launcher tells a process is ready. With neither field set: as soon as it runs."""

    http: str | None = None  # a URL that must answer 2xx
    log: str | None = None  # a regular expression that must appear in the process's log
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


class Component(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=_NAME)]
    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    replicas: Annotated[int, msgspec.Meta(ge=0)] = 1
    env: dict[str, str] = {}
    ready: ReadyCheck = msgspec.field(default_factory=ReadyCheck)
    stop_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    description: str = ""
    metrics: str | None = None  # a URL `serve` prints as "<name> metrics: URL" once ready


class Graph(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=_NAME)]
    components: Annotated[list[Component], msgspec.Meta(min_length=1)]
    description: str = ""
    namespace: str = "dynamo"
    # The process (by component name) serving the OpenAI API; readiness ends with /v1/models.
    frontend: str = "frontend"


# Our own components that take an engine profile (--profile) and a model clock (--speedup): the
# simulated workers and the routing shells (the relay router also by its old module path).
PPD_MODULES = ("dynamo_ppd.worker", "dynamo_ppd.relay", "dynamo_ppd.router", "dynamo_ppd.picker")


ROUTING_MODULES = PPD_MODULES[1:]  # the shells around PPD's policy: their profile is its belief


def ppd_components(graph: Graph, modules: tuple[str, ...] = PPD_MODULES) -> list[str]:
    """The names of the graph's components that run one of ``modules``."""
    return [c.name for c in graph.components if any(a in modules for a in c.command)]


class GraphError(Exception):
    """A graph file is missing or invalid; the message names the file and the problem."""


def bundled_graph_dirs() -> list[Path]:
    """Where `serve NAME` looks for ``NAME.yaml``: ./graphs, then the graphs shipped with us."""
    package = Path(__file__).resolve().parent.parent
    return [Path.cwd() / "graphs", package.parent / "graphs", package / "_graphs"]


def resolve_graph_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        if not path.is_file():
            raise GraphError(f"graph file {path} does not exist")
        return path
    for directory in bundled_graph_dirs():
        candidate = directory / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for d in bundled_graph_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise GraphError(f"no graph named {name_or_path!r}; known graphs: {', '.join(known) or 'none'}"
                     " (or pass a path to a .yaml file)")


def load_graph(name_or_path: str) -> tuple[Graph, Path]:
    path = resolve_graph_path(name_or_path)
    try:
        graph = msgspec.yaml.decode(path.read_bytes(), type=Graph)
    except msgspec.ValidationError as exc:
        raise GraphError(f"{path}: invalid graph: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise GraphError(f"{path}: not valid YAML: {_one_line(str(exc))}") from exc
    _check(graph, path)
    return graph, path


def _check(graph: Graph, path: Path) -> None:
    names = [c.name for c in graph.components]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise GraphError(f"{path}: component name {duplicates[0]!r} is used twice")
    if graph.frontend not in names:
        raise GraphError(f"{path}: frontend {graph.frontend!r} is not one of the components {names}")
    for comp in graph.components:
        where = f"{path}: component {comp.name!r}"
        fields = [("command", s) for s in comp.command] + [(f"env.{k}", v) for k, v in comp.env.items()]
        if comp.ready.http:
            fields.append(("ready.http", comp.ready.http))
        if comp.metrics:
            fields.append(("metrics", comp.metrics))
        for field, text in fields:
            for placeholder in _placeholders(text, where, field):
                if placeholder not in PLACEHOLDERS:
                    raise GraphError(f"{where}: {field} uses unknown placeholder {{{placeholder}}}; "
                                     f"known: {', '.join(sorted(PLACEHOLDERS))}")
        if comp.ready.log:
            try:
                re.compile(comp.ready.log)
            except re.error as exc:
                raise GraphError(f"{where}: ready.log is not a valid regex: {exc}") from exc


def _placeholders(text: str, where: str, field: str) -> list[str]:
    try:
        return [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise GraphError(f"{where}: {field} {text!r}: {exc} (write literal braces as {{{{ }}}})") from exc


def expand(text: str, values: dict[str, object]) -> str:
    """Fill a graph string's placeholders (all known to exist after `load_graph`)."""
    return text.format_map(values)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def replicas_of(labels: list[str], component: str) -> list[str]:
    """The labels of ``component``'s replicas among ``labels``: ``decode`` alone, or ``decode-0``,
    ``decode-1`` ... (the launcher's naming), not ``decoder`` nor ``prefill-0``."""
    return [label for label in labels if label == component or label.rpartition("-")[0] == component]


def speedup_args(graph: str, dilation: float) -> dict[str, list[str]]:
    """``--speedup 1/N`` for every simulated worker, router and picker component of ``graph`` (a
    name or path): time dilation N, as `bench --dilation` and `serve --dilation` run it."""
    if dilation == 1.0:
        return {}
    loaded, _ = load_graph(graph)
    flag = ["--speedup", repr(1.0 / dilation)]
    return {name: list(flag) for name in ppd_components(loaded)}
