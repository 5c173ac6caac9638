"""The simulator's built-in routers: the fixed rules (pd, local, fraction, agg), the paper
authors' proxy, and `make_router`, every router by its CLI name (the peers' from `peers`).

A router is any callable ``(features, view) -> assignment`` (`cluster.Router`). It sees
`SimRequestFeatures` (what the live router learns from the request and the conversation's earlier
turns) and a `ClusterView` (the load metrics, KV-event state and transfer backlog the live router
gets from the workers), never the simulator's internals, so a policy tuned here can run unchanged
in front of real workers. What it answers, an `Assignment`, is in `assignment`.
"""

from __future__ import annotations

import random
import re

import msgspec

from .assignment import Assignment, DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill
from .cluster import ClusterView, Router
from .peers import PEER_ROUTERS, make_peer_router

# -- load signals of the plain built-in routers (pd, local, fraction, agg) -----------------------
# These are the fixed rules' own placement, which table cells are measured with. The PPD router
# (live and simulated) places by `dynamo_ppd.policy.placement`, which also weighs the prompt
# tokens a prefill worker already holds.

def least_loaded_prefill(view: ClusterView) -> str:
    """The prefill worker with the fewest prompt tokens still to compute (queued or running),
    then the fewest requests in flight, then the lowest id."""
    def key(worker: str) -> tuple[int, int, str]:
        load = view.load(worker)
        return load.waiting_prompt_tokens + load.prefill_tokens_remaining, view.inflight(worker), worker

    workers = view.prefill_workers
    if not workers:
        raise RoutingError("this router needs prefill workers; the cluster has none")
    return min(workers, key=key)


def least_loaded_decode(view: ClusterView) -> str:
    """The decode worker with the fewest active KV blocks plus requests in flight to it, then
    the fewest cached blocks (idle workers: spread the sessions' KV), then the lowest id.

    Requests in flight count from the moment they are routed (the router's own bookkeeping, as
    Dynamo's KV router predicts load): a burst of new conversations otherwise all lands on the
    same worker before the first of them has reached it."""
    def key(worker: str) -> tuple[int, int, str]:
        load = view.load(worker)
        return load.kv_active_blocks + view.inflight(worker), load.kv_used_blocks, worker

    workers = view.decode_workers
    if not workers:
        raise RoutingError("this router needs decode workers; the cluster has none")
    return min(workers, key=key)


def session_decode(features: SimRequestFeatures, view: ClusterView) -> str:
    """The conversation's decode worker if it has one (sticky sessions keep its KV useful),
    else the least loaded decode worker."""
    if features.decode_worker is not None and features.decode_worker in view.decode_workers:
        return features.decode_worker
    return least_loaded_decode(view)


# -- built-in routers ---------------------------------------------------------------------------

def pd_router(features: SimRequestFeatures, view: ClusterView) -> Assignment:
    """Classic PD (x=0): every turn through the least loaded prefill worker."""
    return ViaPrefill(least_loaded_prefill(view), session_decode(features, view))


def local_router(features: SimRequestFeatures, view: ClusterView) -> Assignment:
    """x=1: turn 1 as PD (nothing is cached anywhere), later turns append-prefill on the
    conversation's decode worker."""
    if features.turn > 1 and features.decode_worker in view.decode_workers:
        return DecodeLocal(features.decode_worker)
    return pd_router(features, view)


def fraction_router(x: float, seed: int = 0) -> Router:
    """0 <= x <= 1: each later turn goes local with probability ``x``, drawn from (seed,
    conversation, turn) so a rerun makes the same choices whatever else changed."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"local fraction must be in [0, 1], got {x}")

    def route(features: SimRequestFeatures, view: ClusterView) -> Assignment:
        if features.turn > 1:
            draw = random.Random(f"{seed}:{features.conversation_id}:{features.turn}").random()
            if draw < x:
                return local_router(features, view)
        return pd_router(features, view)

    route.__name__ = f"fraction_router({x})"
    return route


def replica_router(features: SimRequestFeatures, view: ClusterView) -> Assignment:
    """Replicas: the aggregated worker holding the longest prefix of the prompt; ties (a new
    conversation) to the least loaded, as `least_loaded_decode` ranks them."""
    workers = view.replica_workers
    if not workers:
        raise RoutingError("replica_router needs aggregated workers (config like 4R); the cluster has none")

    def key(worker: str) -> tuple[int, int, int, str]:
        load = view.load(worker)
        return (-view.cached_prefix_tokens(worker, features.token_ids),
                load.kv_active_blocks + view.inflight(worker), load.kv_used_blocks, worker)

    return Replica(min(workers, key=key))


class PaperConfig(msgspec.Struct, frozen=True):
    """One of the paper's configurations, by the name its data uses (``1P_2D_1pD``, ``4R``,
    ``1R_1P_2D``): counts of prefill workers (P), decode workers that never prefill (D),
    prefill-capable decode workers whose conversations' later turns run decode-local (pD), and
    aggregated replicas (R)."""

    name: str
    prefill: int
    decode: int  # D
    prefill_capable_decode: int  # pD
    replicas: int  # R

    @property
    def cluster_config(self) -> str:
        """The simulator's worker counts (D and pD are both decode workers), e.g. ``1P3D1R``."""
        parts = [(self.prefill, "P"), (self.decode + self.prefill_capable_decode, "D"), (self.replicas, "R")]
        return "".join(f"{n}{role}" for n, role in parts if n)


def parse_paper_config(name: str) -> PaperConfig:
    """``1P_2D_1pD`` -> PaperConfig(prefill=1, decode=2, prefill_capable_decode=1, replicas=0)."""
    counts = {"R": 0, "P": 0, "D": 0, "pD": 0}
    order = list(counts)
    last = -1
    for part in name.strip().split("_"):
        match = re.fullmatch(r"(\d+)(P|D|pD|R)", part)
        if match is None or int(match.group(1)) < 1 or order.index(match.group(2)) <= last:
            raise ValueError(f"config {name!r} is not like the paper's 1P_3D, 1P_2D_1pD, 1R_1P_2D or 4R "
                             f"(parts <n>R, <n>P, <n>D, <n>pD with n >= 1, in that order, joined by '_')")
        last = order.index(match.group(2))
        counts[match.group(2)] = int(match.group(1))
    decode = counts["D"] + counts["pD"]
    if (counts["P"] == 0) != (decode == 0) or counts["P"] + decode + counts["R"] == 0:
        raise ValueError(f"config {name!r}: prefill and decode workers come together, and a config "
                         f"needs at least one worker")
    return PaperConfig(name, counts["P"], counts["D"], counts["pD"], counts["R"])


def paper_proxy_router(config: PaperConfig, seed: int = 0) -> Router:
    """The paper authors' proxy (freelulul/vllm-ppd, ``ppd/comprehensive_proxy.py`` at commit
    3fa83415, ``select_servers``), as it places conversations with no load signal:

    - a new conversation draws a hash h (Python's per-process ``hash`` of the first user
      message there; a seeded 64-bit draw here);
    - pure P/D: prefill ``P[h % nP]``, decode ``(D + pD)[h % (nD + npD)]``; hybrids: slot
      ``h % (nR + nD + npD)`` over replicas first, then pD, then D, and prefill ``P[h % nP]``;
      4R: ``R[h % nR]``;
    - later turns stay on the conversation's workers; on a pD worker they run decode-local
      (``ppd_direct``), on a D worker through the same prefill worker again.

    The simulator's workers D0.. are the config's D workers first, then its pD workers."""
    prefill = [f"P{i}" for i in range(config.prefill)]
    plain = [f"D{i}" for i in range(config.decode)]
    capable = [f"D{config.decode + i}" for i in range(config.prefill_capable_decode)]
    replicas = [f"A{i}" for i in range(config.replicas)]
    placed: dict[str, Assignment] = {}

    def place(conversation_id: str) -> Assignment:
        h = random.Random(f"{seed}:{conversation_id}").getrandbits(64)
        if not prefill:
            return Replica(replicas[h % len(replicas)])
        if replicas:
            slot = h % (len(replicas) + len(capable) + len(plain))
            if slot < len(replicas):
                return Replica(replicas[slot])
            decode = (capable + plain)[slot - len(replicas)]
        else:
            decode = (plain + capable)[h % (len(plain) + len(capable))]
        return ViaPrefill(prefill[h % len(prefill)], decode)

    def route(features: SimRequestFeatures, view: ClusterView) -> Assignment:
        first = placed.get(features.conversation_id)
        if first is None or features.turn == 1:
            first = placed[features.conversation_id] = place(features.conversation_id)
        if features.turn > 1 and isinstance(first, ViaPrefill) and first.decode in capable:
            return DecodeLocal(first.decode)
        return first

    route.__name__ = f"paper_proxy_router({config.name})"
    return route


ROUTER_NAMES = ("pd", "local", "fraction", "agg")


def make_router(name: str, local_fraction: float = 0.5, seed: int = 0) -> Router:
    """A built-in router by its CLI name."""
    if name == "pd":
        return pd_router
    if name == "local":
        return local_router
    if name == "fraction":
        return fraction_router(local_fraction, seed)
    if name == "agg":
        return replica_router
    if name in PEER_ROUTERS:
        return make_peer_router(name, seed)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join((*ROUTER_NAMES, *PEER_ROUTERS))}")
