"""Graph files and the CLI's answers to bad input: exit code 2 and one line saying what to fix."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_ppd.launch.graph import GraphError, load_graph
from dynamo_ppd.launch.process import free_port

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamo_ppd", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["pd", "agg", "cond-disagg", "pd-mocker", "agg-mocker"])
def test_bundled_graphs_load(name):
    graph, path = load_graph(name)
    assert path == REPO / "graphs" / f"{name}.yaml"
    assert graph.frontend in [c.name for c in graph.components]


@pytest.mark.unit
def test_pd_graph_is_one_prefill_three_decode():
    graph, _ = load_graph("pd")
    replicas = {c.name: c.replicas for c in graph.components}
    assert replicas == {"frontend": 1, "prefill": 1, "decode": 3}
    modes = {c.name: c.command[c.command.index("--disaggregation-mode") + 1]
             for c in graph.components if "--disaggregation-mode" in c.command}
    assert modes == {"prefill": "prefill", "decode": "decode"}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return path


GOOD = """
name: g
components:
  - name: frontend
    command: ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}"]
"""


@pytest.mark.parametrize(("text", "message"), [
    (GOOD.replace("{http_port}", "{http_prot}"), "unknown placeholder {http_prot}"),
    (GOOD + "    replicas: -1\n", "replicas"),
    (GOOD + "    colour: red\n", "colour"),
    (GOOD.replace("name: frontend", "name: Front End"), "name"),
    (GOOD + GOOD.split("components:\n")[1], "used twice"),
    ("name: g\ncomponents: [\n", "not valid YAML"),
    (GOOD.replace("components:", "frontend: web\ncomponents:"), "frontend 'web' is not one of"),
])
@pytest.mark.unit
def test_invalid_graphs_name_the_problem(tmp_path, text, message):
    with pytest.raises(GraphError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_graph(str(_write(tmp_path, text)))


@pytest.mark.e2e
def test_cli_missing_graph_file(tmp_path):
    result = cli("serve", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "nope.yaml does not exist" in result.stderr


@pytest.mark.e2e
def test_cli_unknown_graph_name_lists_known():
    result = cli("serve", "no-such-graph")
    assert result.returncode == 2
    known = ("agg, agg-mocker, cond-disagg, cond-disagg-trtllm, pd, pd-mocker, pd-trtllm, ppd, ppd-relay, "
             "ppd-relay-trtllm, ppd-trtllm, relay")
    assert f"known graphs: {known} (or pass" in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.e2e
def test_cli_bad_graph_file(tmp_path):
    result = cli("serve", str(_write(tmp_path, GOOD.replace("{http_port}", "{nope}"))))
    assert result.returncode == 2
    assert "unknown placeholder {nope}" in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.e2e
@pytest.mark.parametrize("flag", ["--http-port", "--nats-port", "--etcd-port"])
def test_cli_port_in_use_names_it(model_dir, flag):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        others = [a for f in ("--http-port", "--nats-port", "--etcd-port") if f != flag
                  for a in (f, str(free_port()))]
        result = cli("serve", "pd", *others, flag, str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and flag in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.e2e
def test_cli_bad_port_value():
    result = cli("serve", "--http-port", "99999")
    assert result.returncode == 2 and "99999 is not a port" in result.stderr


@pytest.mark.parametrize(("graph", "worker"), [("pd", "dynamo_ppd.worker"), ("agg", "dynamo_ppd.worker"),
                                             ("cond-disagg", "dynamo_ppd.worker"),
                                             ("pd-mocker", "dynamo.mocker"), ("agg-mocker", "dynamo.mocker")])
@pytest.mark.e2e
def test_dry_run_resolves_commands(graph, worker):
    result = cli("serve", graph, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "dynamo.frontend" in result.stdout and worker in result.stdout
    assert not re.search(r"\{[a-z_]+\}", result.stdout.split("\n", 1)[1])  # placeholders filled


@pytest.mark.e2e
def test_dry_run_reports_missing_module(tmp_path):
    result = cli("serve", str(_write(tmp_path, GOOD.replace("dynamo.frontend", "dynamo.nope"))),
                 "--dry-run")
    assert result.returncode == 2 and "dynamo.nope" in result.stderr


@pytest.mark.e2e
def test_help_documents_serve():
    result = cli("serve", "--help")
    assert result.returncode == 0
    for flag in ("--http-port", "--nats-port", "--etcd-port", "--run-dir", "--dry-run"):
        assert flag in result.stdout


@pytest.mark.e2e
def test_bench_rejects_bad_input_with_one_line():
    result = cli("bench", "compare", "--systems", "pd,nope")
    assert result.returncode == 2 and "unknown system 'nope'" in result.stderr
    result = cli("bench", "compare", "--workload", "no-such-workload", "--systems", "pd")
    assert result.returncode == 2 and "no-such-workload" in result.stderr


@pytest.mark.e2e
def test_engine_and_sim_commands_are_wired(tmp_path):
    profiles = cli("engine", "profiles")
    assert profiles.returncode == 0 and "h100-llama3.1-8b" in profiles.stdout
    out = tmp_path / "interference.json"
    result = cli("sim", "interference", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert {p["kind"] for p in json.loads(out.read_text())["points"]} == {"full", "append"}
    result = cli("sim", "run", "--config", "1P1D", "--rate", "2", "--duration", "2")
    assert result.returncode == 0 and "turn-2+ TTFT" in result.stdout
    result = cli("sim", "run", "--profile", "a100")
    assert result.returncode == 2 and "no engine profile named 'a100'" in result.stderr
