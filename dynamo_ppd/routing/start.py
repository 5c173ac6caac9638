"""Starting the routing state a shell wraps (the relay router's, the endpoint picker's): its policy
from the config, the model clock of a dilated benchmark, the subscriptions, the context window and
the decode workers' KV capacity from their model cards."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from .. import model as model_dir
from ..engine.profile import EngineProfile, load_profile
from ..policy.decision import Decision, Mode, Observed, Policy, PolicyConfig, ProfilePredictor
from ..policy.qps import SlidingWindowRate
from ..policy.table import load_table
from .args import RoutingConfig
from .limits import WorkerCards, read_context_window
from .state import Routing


class ModelClockPolicy(Policy):
    """A policy behind dilated workers (``--speedup`` < 1): the latencies the router measures on
    the wall clock are put on the model's clock before the policy learns from them."""

    speedup = 1.0

    def observe(self, decision: Decision, ttft_s: float, tpot_s: float | None) -> Observed | None:
        tpot = None if tpot_s is None else tpot_s * self.speedup
        return super().observe(decision, ttft_s * self.speedup, tpot)


class ModelClockRate(SlidingWindowRate):
    """The request rate on the model's clock (wall time x speedup): arrivals a dilated benchmark
    sends at rate/N on the wall clock are the workload's rate, the table's QPS axis."""

    def __init__(self, speedup: float, window_s: float = 10.0):
        super().__init__(window_s)
        self.speedup = speedup

    def record(self, now: float) -> None:
        super().record(now * self.speedup)

    def rate(self, now: float) -> float:
        return super().rate(now * self.speedup)


def believed_profile(config: RoutingConfig) -> EngineProfile:
    """The profile the policy predicts with: ``--profile``, its link's bandwidth replaced by
    ``--link-bandwidth-gbps`` where given (what the operator believes of the deployment)."""
    profile = load_profile(config.profile)
    if config.link_bandwidth_gbps is None:
        return profile
    transfer = msgspec.structs.replace(profile.transfer,
                                       link_bandwidth_bytes_s=config.link_bandwidth_gbps * 1e9)
    return msgspec.structs.replace(profile, transfer=transfer)


def build_policy(config: RoutingConfig) -> Policy:
    """The router's policy; with ``--table PATH`` its table (``auto`` picks one per decision)."""
    predictor = ProfilePredictor(believed_profile(config)) if config.mode is Mode.PPD else None
    table = load_table(config.table) if config.table not in ("auto", "none") else None
    policy = (Policy if config.speedup == 1.0 else ModelClockPolicy)(
        PolicyConfig(mode=config.mode, local_fraction=config.local_fraction, w_ttft=config.w_ttft,
                     w_tpot=config.w_tpot, min_resident_fraction=config.min_resident_fraction),
        predictor, table, online_correction=config.online_correction)
    if isinstance(policy, ModelClockPolicy):
        policy.speedup = config.speedup
    return policy


async def start_routing(routing: Routing) -> tuple[Path, WorkerCards | None]:
    """Start a routing shell's shared state (the relay router's, the endpoint picker's): the rate
    on the model's clock when dilated, the subscriptions, the context window of the model
    directory, and the decode workers' KV capacity from the model cards they register with
    Dynamo's discovery. Returns the model directory and the cards (stop them at the end)."""
    config = routing.config
    if config.speedup != 1.0:
        routing.rate.local = ModelClockRate(config.speedup, routing.rate.local.window_s)
    await routing.start()
    path = model_dir.ensure_model_dir(config.model_path)
    routing.limits.context_window = read_context_window(path)
    cards = None
    if os.environ.get("DYN_DISCOVERY_BACKEND", "etcd") == "etcd":
        discovery_etcd = os.environ.get("ETCD_ENDPOINTS", config.etcd_url).split(",")[0]
        cards = WorkerCards(routing.limits, discovery_etcd, config.workers_namespace, config.decode_component)
        await cards.start()
    return path, cards
