"""What `dynamo-ppd serve` gives the processes it starts, and the defaults a user meets first:
plain-text logs, no ERROR line per readiness poll, the caller's DYN_LOG, and the same default
graph from `dynamo-ppd serve` and `uv run just serve`."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from dynamo_ppd.cli import build_parser
from dynamo_ppd.launch import launcher
from dynamo_ppd.launch.graph import load_graph
from dynamo_ppd.launch.servers import QUIET_HEALTH_POLLS, Endpoints, dynamo_env, dynamo_log_filter

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
ENDPOINTS = Endpoints("nats://127.0.0.1:4222", "http://127.0.0.1:2379")


def test_dynamo_processes_log_plain_text_without_the_readiness_polls_503s():
    env = dynamo_env(ENDPOINTS, 9000)
    assert env["DYN_SDK_DISABLE_ANSI_LOGGING"] == "1" and env["NO_COLOR"] == "1"
    assert env["DYN_LOG"] == f"info,{QUIET_HEALTH_POLLS}"


def test_the_callers_dyn_log_is_kept():
    assert dynamo_log_filter("debug") == f"debug,{QUIET_HEALTH_POLLS}"
    # A caller who filters tower_http himself gets exactly his filter.
    assert dynamo_log_filter("info,tower_http=debug") == "info,tower_http=debug"


def test_every_process_of_a_graph_gets_them(monkeypatch, tmp_path):
    ports = itertools.count(20000)
    monkeypatch.setattr(launcher, "free_port", lambda **_: next(ports))  # no socket in a unit test
    monkeypatch.setenv("DYN_LOG", "debug")
    monkeypatch.setenv("DYN_NAMESPACE", "theirs")  # other Dynamo settings of the shell stay out
    graph, path = load_graph("ppd")
    deployment = launcher.Deployment(graph, tmp_path, ENDPOINTS, 8000, "m")
    deployment.factory = launcher._Processes.for_graph(graph, path.parent, 8000, tmp_path)
    processes = [p for batch in launcher._component_processes(graph, deployment) for p in batch]
    assert {p.label for p in processes} >= {"frontend", "prefill", "picker", "gateway"}
    for proc in processes:
        assert proc.env["DYN_LOG"] == f"debug,{QUIET_HEALTH_POLLS}", proc.label
        assert proc.env["DYN_SDK_DISABLE_ANSI_LOGGING"] == "1" and "DYN_NAMESPACE" not in proc.env


def test_serve_and_just_serve_start_the_same_default_graph():
    args = build_parser().parse_args(["serve"])
    recipe = re.search(r'^serve graph="([^"]+)"', (REPO / "justfile").read_text(), re.MULTILINE)
    assert recipe is not None
    assert args.graph == recipe.group(1) == "ppd"  # the endpoint picker graph
