"""`serve --planner`'s pure parts: the scale plan a decision becomes, the planner's configuration,
and the checks that refuse a planner that cannot run (the processes: tests/test_planner_e2e.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import msgspec
import pytest

from dynamo_ppd.launch import BadInput
from dynamo_ppd.launch.graph import load_graph, replicas_of
from dynamo_ppd.launch.launcher import _check_planner
from dynamo_ppd.launch.planner import SHIM_DIR, PlannerOptions, planner_config
from dynamo_ppd.launch.scaler import Decision, plan, read_decisions, settled

pytestmark = pytest.mark.unit


def test_a_scale_out_adds_and_a_scale_in_retires_the_replica_holding_the_least_kv():
    running = {"prefill": ["prefill"], "decode": ["decode-0", "decode-1", "decode-2"]}
    out = plan(running, {"prefill": 2, "decode": 3}, {})
    assert out.add == ["prefill"] and out.retire == []
    out = plan(running, {"prefill": -1, "decode": 1}, {"decode-0": 50, "decode-1": 10, "decode-2": 30})
    assert out.add == [] and out.retire == ["decode-1", "decode-2"]
    # A tie (or no reading) retires the newest: it has had the least time to gather sessions.
    assert plan(running, {"decode": 2}, {}).retire == ["decode-2"]
    assert plan(running, {"decode": 2}, {"decode-0": 5, "decode-1": 5}).retire == ["decode-1"]
    assert plan(running, {"prefill": -1, "decode": -1}, {}).empty


def test_the_client_acts_while_the_graph_differs_from_the_decision():
    running = {"prefill": ["prefill"], "decode": ["decode", "decode-1"]}
    assert settled(running, {"prefill": 1, "decode": 2})
    assert settled(running, {"prefill": -1, "decode": 2})
    assert not settled(running, {"prefill": -1, "decode": 3})
    labels = ["decode", "decode-1", "decoder", "prefill-0", "scaler"]
    assert replicas_of(labels, "decode") == ["decode", "decode-1"]


def test_the_planner_runs_load_scaling_in_the_virtual_environment(tmp_path):
    opts = PlannerOptions(prefill_queue_up=4000, prefill_queue_down=500, decode_kv_up=70, decode_kv_down=10,
                          interval_s=3, max_workers=5)
    config = planner_config(opts, "ns", "model-a")
    assert config["environment"] == "virtual" and config["optimization_target"] == "load"
    assert (config["namespace"], config["model_name"], config["backend"], config["mode"]) == \
        ("ns", "model-a", "trtllm", "disagg")
    assert (config["prefill_scale_up_queue_tokens"], config["prefill_scale_down_queue_tokens"]) == (4000, 500)
    assert (config["decode_scale_up_kv_rate"], config["decode_scale_down_kv_rate"]) == (70, 10)
    assert (config["load_adjustment_interval_seconds"], config["max_gpu_budget"]) == (3, 5)
    override = tmp_path / "planner.yaml"
    override.write_text("decode_scale_up_kv_rate: 90\nmin_endpoint: 2\n")
    config = planner_config(PlannerOptions(config_file=override), "ns", "m")
    assert config["decode_scale_up_kv_rate"] == 90 and config["min_endpoint"] == 2
    override.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        planner_config(PlannerOptions(config_file=override), "ns", "m")


def test_the_aisimulate_stand_in_imports_and_refuses_to_build_a_model():
    sys.path.insert(0, str(SHIM_DIR))
    try:
        from aisimulate_core.sdk import ForwardPassPerfModelConfig, RustForwardPassPerfModel

        config = ForwardPassPerfModelConfig.from_legacy_engine_config({"model_name": "m"}, "decode", {"a": 1})
        assert config.to_dict()["estimator_config"] == {"a": 1} and config.worker_type == "decode"
        with pytest.raises(ImportError, match="not installed"):
            RustForwardPassPerfModel.best_available(json.dumps(config.to_dict()))
    finally:
        sys.path.remove(str(SHIM_DIR))
        for name in [m for m in sys.modules if m.startswith("aisimulate_core")]:
            del sys.modules[name]


def test_serve_refuses_a_planner_that_cannot_run(monkeypatch):
    # A graph without prefill and decode workers has nothing for the planner to scale.
    with pytest.raises(BadInput, match="graph 'agg' lacks 'prefill' and 'decode'"):
        _check_planner(load_graph("agg")[0], PlannerOptions(external=True))
    # Without the `planner` extra: one line saying how to install it; external needs none of it.
    # (every other module of the extra found, installed or not: CI does not install it)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prophet" else object())
    ppd = load_graph("ppd")[0]
    with pytest.raises(BadInput, match=r"needs prophet: install the `planner` extra"):
        _check_planner(ppd, PlannerOptions())
    _check_planner(ppd, PlannerOptions(external=True))
    _check_planner(ppd, None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(BadInput, match="--planner-config /nonexistent.yaml"):
        _check_planner(ppd, PlannerOptions(config_file=Path("/nonexistent.yaml")))


def test_the_decisions_file_round_trips_and_refuses_a_bad_line(tmp_path):
    path = tmp_path / "planner-decisions.jsonl"
    assert read_decisions(path) == []
    decision = Decision(3, -1, 2, 1.5, {"prefill": 1, "decode": 1}, added=["decode-1"], completed_at=2.0)
    path.write_bytes(msgspec.json.encode(decision) + b"\n")
    assert read_decisions(path) == [decision]
    path.write_text('{"decision_id": "three"}\n')
    with pytest.raises(msgspec.ValidationError):
        read_decisions(path)


def test_serves_planner_flags_default_to_planner_options():
    from dynamo_ppd.cli import build_parser

    args = build_parser().parse_args(["serve", "--planner"])
    defaults = PlannerOptions()
    assert args.planner_prefill_queue == (defaults.prefill_queue_up, defaults.prefill_queue_down)
    assert args.planner_decode_kv == (defaults.decode_kv_up, defaults.decode_kv_down)
    assert (args.planner_interval, args.planner_max_workers) == (defaults.interval_s, defaults.max_workers)
