"""The Helm chart's two routings (issue 27): `routing=picker` (the endpoint picker behind a Gateway
API gateway: DynamoGraphDeployment + picker Deployment/Service + InferencePool + HTTPRoute) and
`routing=relay` (the PPD router inside the graph). No cluster: every render of every preset in both
routings is checked against the custom resources' real schemas (tests/crds/, the CRDs of Dynamo's
operator, GAIE, Gateway API and the Prometheus Operator) with their own structural check, and the
commands the chart renders are parsed by the programs they start (Dynamo 1.6.1's frontend and
TensorRT-LLM worker parsers, the picker's parser)."""

from __future__ import annotations

import copy
import filecmp
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_deploy import (
    CHART,
    PRESETS,
    _components,
    _engine,
    _main,
    _parse_with_dynamo,
    _with_local_engine_file,
    render,
)

from dynamo_ppd.picker.args import parse_args as parse_picker_args
from dynamo_ppd.routing.args import build_parser as build_router_parser

CRDS = Path(__file__).resolve().parent / "crds"
SHARED_CRDS = Path(__file__).resolve().parents[2] / "shared" / "crds"
# Kind -> the schema of the custom resource (tests/crds/README.md says where each comes from).
SCHEMAS = {
    "DynamoGraphDeployment": "dgd-v1beta1-2a6da14c8.json",
    "InferencePool": "inferencepool-v1-gaie-v1.5.0.json",
    "HTTPRoute": "httproute-v1-gateway-api-v1.6.1.json",
    "PodMonitor": "podmonitor-v1-v0.93.0.json",
}
# Kinds of the API server itself (no CRD to check them against); anything else rendered is a bug.
CORE_KINDS = {"ConfigMap", "Deployment", "Service"}
RENDERS = [(routing, preset) for routing in ("picker", "relay") for preset in (None, *PRESETS)]


def _preset_args(preset: str | None) -> list[str]:
    return ["-f", str(CHART / "presets" / f"{preset}.yaml")] if preset else []


def validate(docs: list[dict], tmp_path: Path) -> dict[tuple[str, str], list[str]]:
    """(kind, name) -> the schema errors of every custom resource in ``docs``, from the shared
    validator (tests/crds/validate.py, run as its README says)."""
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    out: dict[tuple[str, str], list[str]] = {}
    for kind in sorted({d["kind"] for d in docs} & SCHEMAS.keys()):
        result = subprocess.run([sys.executable, str(CRDS / "validate.py"), str(CRDS / SCHEMAS[kind]), kind,
                                 str(rendered)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        current = None
        for line in result.stdout.splitlines():
            header = re.match(rf"## .*: {kind} (\S+) \(.*\) -> (\d+) schema error", line)
            if header:
                current = (kind, header.group(1))
                out[current] = []
            elif line.strip().startswith("ERROR") and current:
                out[current].append(line.strip())
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("routing, preset", RENDERS)
def test_every_render_validates_against_the_crd_schemas(helm, tmp_path, routing, preset):
    docs = render(helm, "--set", f"routing={routing}", *_preset_args(preset),
                  "--set", "grafanaDashboard.enabled=true")
    kinds = {d["kind"] for d in docs}
    assert kinds - CORE_KINDS <= SCHEMAS.keys(), f"rendered kinds with no schema: {kinds - CORE_KINDS}"
    expected = {"DynamoGraphDeployment", "PodMonitor"} | (
        {"InferencePool", "HTTPRoute"} if routing == "picker" else set())
    assert kinds & SCHEMAS.keys() == expected
    errors = validate(docs, tmp_path)
    assert {kind for kind, _ in errors} == expected  # every custom resource was checked
    assert all(not e for e in errors.values()), json.dumps({f"{k}/{n}": e for (k, n), e in errors.items()},
                                                           indent=1)


@pytest.mark.e2e
def test_the_schema_check_catches_unknown_and_missing_fields(helm, tmp_path):
    docs = render(helm)
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    (route,) = [d for d in docs if d["kind"] == "HTTPRoute"]
    (dgd,) = [d for d in docs if d["kind"] == "DynamoGraphDeployment"]
    bad_pool = copy.deepcopy(pool)
    bad_pool["spec"]["endpointPickerRef"]["portNumber"] = 9002  # unknown (a typo of port.number)
    del bad_pool["spec"]["selector"]  # missing, required
    bad_route = copy.deepcopy(route)
    bad_route["spec"]["rules"][0]["backendRefs"][0]["weigth"] = 1
    bad_dgd = copy.deepcopy(dgd)
    bad_dgd["spec"]["components"][0]["replica"] = 2
    errors = validate([bad_pool, bad_route, bad_dgd], tmp_path)
    assert len(errors[("InferencePool", "ppd")]) == 2, errors
    assert "portNumber" in " ".join(errors[("InferencePool", "ppd")])
    assert "'selector' is a required property" in " ".join(errors[("InferencePool", "ppd")])
    assert "weigth" in " ".join(errors[("HTTPRoute", "ppd")])
    assert "replica" in " ".join(errors[("DynamoGraphDeployment", "ppd")])


@pytest.mark.unit
@pytest.mark.skipif(not SHARED_CRDS.is_dir(), reason="no ../shared/crds next to this checkout")
def test_the_vendored_schemas_are_the_shared_ones():
    for name in [*SCHEMAS.values(), "validate.py"]:
        assert filecmp.cmp(CRDS / name, SHARED_CRDS / name, shallow=False), \
            f"tests/crds/{name} differs from ../shared/crds/{name}; copy it over"


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _picker_args(docs: list[dict]):
    deployment = _by_kind(docs, "Deployment")["ppd-picker"]
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    assert main["command"] == ["python3", "-m", "dynamo_ppd.picker"]
    return parse_picker_args(main["args"])  # a flag the picker does not accept: SystemExit


@pytest.mark.e2e
@pytest.mark.parametrize("preset", [None, *PRESETS])
def test_picker_routing_wires_gateway_pool_picker_and_frontend(helm, preset):
    docs = render(helm, *_preset_args(preset))
    comps = _components(docs)
    assert list(comps) == ["Frontend", "prefill", "decode"]  # no relay router on the token path
    if preset:
        assert (comps["prefill"]["replicas"], comps["decode"]["replicas"]) == PRESETS[preset]
    (dgd,) = _by_kind(docs, "DynamoGraphDeployment").values()
    assert dgd["metadata"]["annotations"]["nvidia.com/dynamo-discovery-backend"] == "etcd"

    # The frontend: KV router, conditional disaggregation that always bypasses prefill when the
    # chosen decode worker holds any of the prompt, soft session affinity, migration.
    frontend = _main(comps["Frontend"])["args"]
    flag = {a: frontend[i + 1] for i, a in enumerate(frontend[:-1]) if a.startswith("--")}
    assert flag["--router-mode"] == "kv" and "--router-kv-events" in frontend
    assert "--router-conditional-disagg" in frontend
    assert json.loads(flag["--router-conditional-disagg-config"]) == \
        {"policy": "isl_bounding", "eff_isl_threshold": 2147483647, "eff_isl_ratio_threshold": 1.0}
    assert flag["--router-session-affinity-mode"] == "soft"
    assert int(flag["--migration-limit"]) > 0
    assert int(flag["--kv-cache-block-size"]) == _engine("decode.yaml")["kv_cache_config"]["tokens_per_block"]

    # The picker plans for the workers the frontend serves.
    config, picker = _picker_args(docs)
    assert config.mode.value == "ppd" and config.block_size == int(flag["--kv-cache-block-size"])
    for role, component in (("prefill", config.prefill_component), ("decode", config.decode_component)):
        args = _main(comps[role])["args"]
        assert args[args.index("--endpoint") + 1] == \
            f"dyn://{flag['--namespace']}.{component}.generate" == \
            f"dyn://{config.workers_namespace}.{component}.generate"
        assert "--publish-kv-events" in args and "--publish-metrics" in args
    assert config.etcd_url.startswith("http://") and config.nats_url.startswith("nats://")

    # Pool -> picker Service -> picker pods; pool and headless Service -> the frontend pods.
    (pool,) = _by_kind(docs, "InferencePool").values()
    services = _by_kind(docs, "Service")
    picker_service = services[pool["spec"]["endpointPickerRef"]["name"]]
    ports = {p["name"]: p for p in picker_service["spec"]["ports"]}
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == ports["grpc"]["port"] == picker.grpc_port
    assert ports["grpc"]["appProtocol"] == "http2"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    deployment = _by_kind(docs, "Deployment")["ppd-picker"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert picker_service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    frontend_labels = comps["Frontend"]["podTemplate"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= frontend_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": int(flag["--http-port"])}]
    pool_dns = services["ppd-frontend-pool"]
    assert pool_dns["spec"]["clusterIP"] == "None"  # headless: the name resolves to the pods
    assert pool_dns["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert picker.frontends == (f"ppd-frontend-pool.llm.svc.cluster.local:{flag['--http-port']}",)
    assert picker.secure_serving  # the gateways' stock settings speak TLS to an endpoint picker

    # Probes on gRPC health (plaintext, its own port), metrics scraped by the PodMonitor.
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert main[probe]["grpc"]["port"] == picker.health_port == container_ports["grpc-health"]
    assert container_ports["grpc"] == picker.grpc_port
    assert {"name": "DYN_DISCOVERY_BACKEND", "value": "etcd"} in main["env"]
    (monitor,) = _by_kind(docs, "PodMonitor").values()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    scraped = [container_ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert scraped == [config.metrics_port]
    assert config.metrics_host == "0.0.0.0"
    assert deployment["spec"]["replicas"] >= 2  # replicas share sessions through etcd

    # The Gateway's route to the pool.
    (route,) = _by_kind(docs, "HTTPRoute").values()
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", "inference-gateway")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]


@pytest.mark.e2e
def test_picker_values_reach_the_picker_pool_and_route(helm):
    docs = render(helm, "--set", "picker.replicas=3", "--set", "picker.grpcPort=9102",
                  "--set", "picker.secureServing=false", "--set", "inferencePool.failureMode=FailOpen",
                  "--set", "gateway.name=gw", "--set", "gateway.namespace=gateways",
                  "--set", "gateway.sectionName=http", "--set", "httpRoute.hostnames={chat.example.com}",
                  "--set", "router.weights=2\\,1",
                  "--set-json", 'picker.extraArgs=["--frontend-refresh", "2"]',
                  "--set", "podMonitor.enabled=false", "--set", "router.mode=local")
    config, picker = _picker_args(docs)
    assert (config.w_ttft, config.w_tpot, config.mode.value) == (2.0, 1.0, "local")
    assert picker.grpc_port == 9102 and not picker.secure_serving and picker.frontend_refresh_s == 2.0
    assert _by_kind(docs, "Deployment")["ppd-picker"]["spec"]["replicas"] == 3
    (pool,) = _by_kind(docs, "InferencePool").values()
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == 9102
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    (route,) = _by_kind(docs, "HTTPRoute").values()
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "gw", "namespace": "gateways", "sectionName": "http"}]
    assert route["spec"]["hostnames"] == ["chat.example.com"]
    assert not _by_kind(docs, "PodMonitor")
    docs = render(helm, "--set", "httpRoute.enabled=false")
    assert not _by_kind(docs, "HTTPRoute") and _by_kind(docs, "InferencePool")


@pytest.mark.e2e
def test_relay_routing_renders_no_gateway_objects(helm):
    docs = render(helm, "--set", "routing=relay")
    assert list(_components(docs)) == ["Frontend", "Router", "prefill", "decode"]
    assert not {d["kind"] for d in docs} & {"InferencePool", "HTTPRoute", "Deployment", "Service"}
    router = build_router_parser().parse_args(_main(_components(docs)["Router"])["args"])
    frontend = _main(_components(docs)["Frontend"])["args"]
    assert router.namespace == frontend[frontend.index("--namespace") + 1] != router.workers_namespace
    assert frontend[frontend.index("--router-mode") + 1] == "round-robin"


@pytest.mark.parametrize("values, message", [
    (["--set", "routing=sidecar"], "routing"),
    (["--set", "router.mode=replica"], "needs routing=relay"),
    (["--set", "dynamo.discoveryBackend=kubernetes"], "needs dynamo.discoveryBackend=etcd"),
    (["--set", "inferencePool.failureMode=Open"], "failureMode"),
    (["--set", "httpRoute.timeout=5 minutes"], "timeout"),
    (["--set", "picker.grpcPort=0"], "grpcPort"),
])
@pytest.mark.e2e
def test_picker_routing_rejects_bad_values(helm, values, message):
    from test_deploy import _helm

    result = _helm(helm, "template", "ppd", str(CHART), *values)
    assert result.returncode != 0 and message in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("routing", ["picker", "relay"])
def test_rendered_frontend_and_worker_commands_parse_with_dynamo(helm, tmp_path, routing):
    docs = render(helm, "--set", f"routing={routing}", "-f", str(CHART / "presets" / "2p2d.yaml"))
    comps = _components(docs)
    (engine_cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "ppd-engine"]
    commands = [("frontend", _main(comps["Frontend"])["args"]),
                ("trtllm", _with_local_engine_file(_main(comps["prefill"])["args"], engine_cm, tmp_path)),
                ("trtllm", _with_local_engine_file(_main(comps["decode"])["args"], engine_cm, tmp_path))]
    frontend, prefill, decode = _parse_with_dynamo(commands)
    assert (prefill["mode"], decode["mode"]) == ("prefill", "decode")
    assert prefill["kv_events"] and decode["kv_events"]
    if routing == "picker":  # the frontend's KV router serves the workers itself
        assert prefill["namespace"] == decode["namespace"] == frontend["namespace"]
    else:  # hidden from the frontend, behind the router
        assert prefill["namespace"] == decode["namespace"] != frontend["namespace"]


@pytest.mark.unit
def test_deploy_readme_names_only_values_and_objects_the_chart_has():
    """The commands in deploy/README.md: every `--set` key is a chart value, and the names it
    types (the picker Service in Istio's DestinationRule, the Gateway) are the chart's defaults."""
    readme = (CHART.parent.parent / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # The chart's own commands (helm install/template of deploy/helm/dynamo-ppd, continuation lines
    # joined) and the `--set ...` the prose suggests; other charts' flags (dynamo-platform, kgateway)
    # are theirs.
    joined = readme.replace("\\\n", " ")
    ours = [line for line in joined.splitlines() if "deploy/helm/dynamo-ppd " in line]
    ours += re.findall(r"`[^`\n]*--set [^`\n]*`", readme)
    setting = r"--set(?:-file|-json|-string)? ([A-Za-z][\w.]*?)(?:\.\"[^\"]*\")?="
    keys = [key for text in ours for key in re.findall(setting, text)]
    assert {"routing", "images.router", "gateway.name", "picker.secureServing"} <= set(keys)
    for key in keys:
        node = values
        for part in key.split("."):
            if node == {}:  # a free-form map (labels, node selector): any key
                break
            assert isinstance(node, dict) and part in node, f"deploy/README.md sets {key}, not a chart value"
            node = node[part]
    assert "host: ppd-picker.llm.svc.cluster.local" in readme  # release ppd, namespace llm
    assert f"metadata: {{name: {values['gateway']['name']}}}" in readme
    assert values["routing"] == "picker" and values["picker"]["secureServing"] is True
