"""`serve --planner`: Dynamo's own planner scales the local graph, as it scales a
DynamoGraphDeployment, through its ``VirtualConnector``.

Dynamo 1.6.1's planner (``python -m dynamo.planner``) with ``environment: virtual`` does not start
or stop anything itself (``dynamo/planner/connectors/virtual.py``): it publishes each decision (a
prefill and a decode replica count, with an id) through the runtime's
``VirtualConnectorCoordinator`` and waits until the deployment reports it done and the worker
counts it discovers match. The deployment's side is a ``VirtualConnectorClient``; here that is
`scaler.py`, a process of the graph that turns each decision into the launcher's own scale-out and
scale-in (`Deployment.add_replica` / `retire`, over the control channel), the same steps as
`dynamo-ppd ctl add|retire` and the chaos harness's planned changes.

What this module does: checks the planner can run, writes its configuration, and makes the two
processes. ``--planner external`` starts only the client, for a planner run elsewhere (your own
configuration, or a test that publishes decisions itself).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .process import ManagedProcess, ReadySpec

# The planner's imports that the ai-dynamo 1.6.1 wheel does not declare (the `planner` extra).
PLANNER_MODULES = ("sklearn", "pandas", "pmdarima", "filterpy", "prophet", "plotly", "prometheus_api_client")
SHIM_DIR = Path(__file__).with_name("planner_shim")  # aisimulate_core, absent (its README.md)
DECISIONS_FILE = "planner-decisions.jsonl"  # one line per decision the client acted on
# The graph components the planner's two roles scale: Dynamo's prefill and decode workers
# (our simulated workers serve dynamo.prefill.generate and dynamo.backend.generate, the
# component names the planner counts for the trtllm backend).
ROLES = {"prefill": "prefill", "decode": "decode"}


class PlannerUnavailable(Exception):
    """The planner cannot run on this install; the message says how to fix it."""


@dataclass
class PlannerOptions:
    """What `serve --planner` hands Dynamo's planner; ``config_file`` (JSON or YAML) is merged
    over the rest, so any field of Dynamo's PlannerConfig can be set."""

    external: bool = False  # start only the client: a planner runs elsewhere
    # Load scaling's thresholds (Dynamo sets no default). A prefill worker with a full iteration of
    # prompt tokens (the profile's max_num_tokens, 8192) waiting adds an iteration to every new
    # TTFT: scale out there, in once the queue is an eighth of that. Decode: the share of KV
    # capacity the running and queued decodes hold, in percent. Under PPD a decode worker's KV also
    # keeps the histories of paused conversations (what makes a follow-up decode-local), so half
    # of it in running decodes is already a squeeze: scale out at 50%, in at 15%.
    prefill_queue_up: int = 8192
    prefill_queue_down: int = 1024
    decode_kv_up: float = 50.0
    decode_kv_down: float = 15.0
    interval_s: int = 5  # load_adjustment_interval_seconds (the planner's tick)
    max_workers: int = 8  # max_gpu_budget, one GPU a worker
    config_file: Path | None = None


def check_available() -> None:
    """PlannerUnavailable unless ``python -m dynamo.planner`` can import what it needs."""
    missing = [m for m in PLANNER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise PlannerUnavailable(
            f"--planner runs Dynamo's planner, which needs {', '.join(missing)}: install the "
            "`planner` extra (uv sync --extra planner, or pip install 'dynamo-ppd[planner]'), "
            "or use --planner external with a planner you run yourself")


def planner_config(opts: PlannerOptions, namespace: str, model_name: str) -> dict:
    """Dynamo's PlannerConfig for the local graph: the virtual environment, disaggregated
    TensorRT-LLM workers, and load-based scaling (``optimization_target: load``,
    ``load_scaling.py``): each tick, from the workers' forward-pass metrics, a prefill worker is
    added when any prefill worker's queued prompt tokens reach ``prefill_queue_up`` (one removed
    when all are at most ``prefill_queue_down``), and a decode worker when any decode worker's
    scheduled and queued KV reach ``decode_kv_up`` percent of its capacity.

    Not the SLA target: in 1.6.1 its TTFT and ITL predictions come only from AISimulate's engine
    model (``PlannerEnginePerfModel.has_sufficient_data`` is False without it), which is not
    installable here (planner_shim/README.md). Nor throughput scaling: it forecasts the request
    rate from the frontend's Prometheus metrics, and no Prometheus server runs here."""
    config = {
        "environment": "virtual", "namespace": namespace, "backend": "trtllm", "mode": "disagg",
        "optimization_target": "load", "model_name": model_name,
        "prefill_scale_up_queue_tokens": opts.prefill_queue_up,
        "prefill_scale_down_queue_tokens": opts.prefill_queue_down,
        "decode_scale_up_kv_rate": opts.decode_kv_up, "decode_scale_down_kv_rate": opts.decode_kv_down,
        "load_adjustment_interval_seconds": opts.interval_s,
        "min_endpoint": 1, "max_gpu_budget": opts.max_workers,
        "prefill_engine_num_gpu": 1, "decode_engine_num_gpu": 1,
        "pre_deployment_sweeping_mode": "none",
        # Nothing listens beyond what the graph needs: no dashboard, no control API, no reports.
        "live_dashboard_port": 0, "control_api_port": 0, "report_interval_hours": None,
    }
    if opts.config_file is not None:
        config.update(_read_config(opts.config_file))
    return config


def _read_config(path: Path) -> dict:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--planner-config {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"--planner-config {path}: expected a mapping of PlannerConfig fields")
    return loaded


def planner_process(config: dict, run_dir: Path, env: dict[str, str]) -> ManagedProcess:
    """``python -m dynamo.planner`` with ``config`` (written to RUN_DIR/planner-config.json);
    ready once it serves its endpoint, which it does after its own start-up checks."""
    path = run_dir / "planner-config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    pythonpath = os.pathsep.join(p for p in (str(SHIM_DIR), env.get("PYTHONPATH", "")) if p)
    return ManagedProcess("planner", [sys.executable, "-m", "dynamo.planner", "--config", str(path)],
                          {**env, "PYTHONPATH": pythonpath}, run_dir / "logs" / "planner.log",
                          ReadySpec(log=r"Registered endpoint '[\w.-]*Planner\.generate'", timeout_s=180.0),
                          stop_timeout_s=10.0)


def scaler_process(run_dir: Path, namespace: str, env: dict[str, str]) -> ManagedProcess:
    """The deployment's VirtualConnectorClient (scaler.py)."""
    argv = [sys.executable, "-m", "dynamo_ppd.launch.scaler", "--run-dir", str(run_dir),
            "--namespace", namespace]
    return ManagedProcess("scaler", argv, env, run_dir / "logs" / "scaler.log",
                          ReadySpec(log="waiting for the planner's decisions", timeout_s=60.0),
                          stop_timeout_s=10.0)
