"""Peers' P/D routing policies as simulator routers, each implemented from its own source.

Every router here is a `Router` (``(features, view) -> route``) and sees only what that peer
really sees, through the `ClusterView`: KV overlap as ``view.cached_prefix_tokens`` (whole
blocks, what KV events tell an indexer), load through ``view.load()`` / ``view.inflight()``.
Each docstring says how the peer's real signal maps onto ours. Registered by name in
`PEER_ROUTERS` (`make_peer_router`), which `routing.make_router` also resolves.

Sources (read for this module, 2026-12-01):

- **Dynamo 1.6.1** (ai-dynamo/dynamo; the installed wheel ``ai-dynamo 1.6.1``):
  ``lib/kv-router/src/conditional_disagg.rs`` (the three policies; the stored version whose
  ``ConditionalDisaggDecisionInput`` is ``{prompt_tokens, decode_chosen_cached_tokens,
  prefill_chosen_worker_busy, decode_chosen_worker_busy}`` and whose policy kinds are exactly
  ``IslBounding | PrefillLoad | IslOrLoad``, as the 1.6.1 ``_core.abi3.so`` has them: its
  strings carry no ``decode_chosen_overlap_blocks`` (the older input) nor ``CacheOrLoad``
  (a later one)); ``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs`` at 07a6c9ce
  (peek the decode router, then the prefill router; the decode gate); the worker cost in
  ``lib/kv-router/src/scheduling/selector/mod.rs`` (``worker_logit``); ``AdvisoryWorkerLoad::
  prefill_load_exceeds``; the Python defaults in the wheel's
  ``dynamo/common/configuration/groups/kv_router_args.py``. The mirror of the whole
  repository is over the fetch limit, so the 1.6.1 tag's commit could not be read; the
  versions above were matched to the wheel by their strings.
- **llm-d** (llm-d/llm-d-inference-scheduler at 06c08c08): ``pkg/plugins/profile/
  prefix_based_pd_decider.go`` (``decide``), ``pkg/plugins/profile/pd_profile_handler.go``
  (``Pick``: the decode profile first, then the decider on its endpoint); the scorer weights of
  its shipped P/D config (``prefix-cache-scorer`` 2, ``queue-scorer`` 1, ``max-score-picker``,
  ``nonCachedTokens: 16``, as in its deploy/test configs).
- **vLLM router** (vllm-project/router): ``src/main.rs`` (``--vllm-pd-disaggregation``;
  ``--policy`` default ``cache_aware``, ``cache_threshold 0.3``, ``balance_abs_threshold 64``,
  ``balance_rel_threshold 1.5``), ``src/routers/http/vllm_pd_router.rs`` (``select_pd_pair``:
  a prefill and a decode worker for every request), ``src/policies/cache_aware.rs`` at
  16917f49. **No uncached-token rule exists there**: every request goes prefill -> decode; we
  found no rule in vLLM's router (nor in the production-stack router, whose disaggregated
  modes also always prefill remotely) that skips remote prefill. `vllm_router` is that.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .assignment import Assignment, DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill
from .cluster import ClusterView, Router

if TYPE_CHECKING:
    from ..engine import EngineProfile

# Dynamo 1.6.1 defaults (lib/kv-router/src/conditional_disagg.rs; kv_router_args.py).
DYNAMO_EFF_ISL_THRESHOLD = 2048
DYNAMO_EFF_ISL_RATIO_THRESHOLD = 0.7
DYNAMO_OVERLAP_SCORE_CREDIT = 1.0  # --router-kv-overlap-score-credit
DYNAMO_PREFILL_LOAD_SCALE = 1.0  # --router-prefill-load-scale (the old overlap_score_weight)
# Our graphs/cond-disagg.yaml: isl_or_load with these (Dynamo 1.6.1 has no default busy
# threshold: a load policy without one and without --router-queue-threshold fails at startup).
OUR_PREFILL_BUSY_THRESHOLD = 0.5
# EngineLimits.max_num_tokens's default: a prefill worker's max_num_batched_tokens when no profile
# is given (Dynamo reads it from the worker's runtime config).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

LLMD_NON_CACHED_TOKENS = 16  # llm-d's shipped P/D configs (the plugin's own default 0 = always P/D)
LLMD_PREFIX_WEIGHT = 2.0
LLMD_QUEUE_WEIGHT = 1.0

VLLM_CACHE_THRESHOLD = 0.3
VLLM_BALANCE_ABS_THRESHOLD = 64
VLLM_BALANCE_REL_THRESHOLD = 1.5


# -- Dynamo's KV router cost ----------------------------------------------------------------------

def active_prefill_tokens(view: ClusterView, worker: str) -> int:
    """Dynamo's ``active_prefill_tokens`` of a worker: prompt tokens of the requests routed to
    it whose prefill is not done (the router books them at routing, frees them at the first
    token; each request counts its prompt minus what that worker holds). Ours: the engine's
    queued prompt tokens (whole prompts: the engine matches the cache at admission) plus those
    still to compute in running prefills (a request still in the stack's hop is not counted)."""
    load = view.load(worker)
    return load.waiting_prompt_tokens + load.prefill_tokens_remaining


def dynamo_potential_decode_blocks(view: ClusterView, worker: str, request_blocks: int) -> int:
    """Dynamo's ``potential_decode_blocks``: the blocks of the sequences it has routed to the
    worker and not seen finish (prompt blocks; output blocks are not tracked by default), plus
    this request's. Ours: the engine's active blocks, the blocks of prompts queued or whose KV
    is landing there, and, for requests routed here but still on a prefill worker (the engine
    does not see them yet; Dynamo books them at routing), this request's size as an estimate."""
    load = view.load(worker)
    bs = view.block_size
    known = load.waiting_requests + load.awaiting_kv_requests + load.prefill_requests + load.decode_requests
    in_transit = max(0, view.inflight(worker) - known)
    queued_blocks = math.ceil((load.waiting_prompt_tokens + load.awaiting_kv_tokens) / bs)
    return load.kv_active_blocks + queued_blocks + (in_transit + 1) * request_blocks


def dynamo_worker_logit(view: ClusterView, worker: str, features: SimRequestFeatures, *,
                        track_active_blocks: bool, overlap_credit: float = DYNAMO_OVERLAP_SCORE_CREDIT,
                        prefill_load_scale: float = DYNAMO_PREFILL_LOAD_SCALE) -> float:
    """``worker_logit`` of Dynamo's default selector (lower is better):

        raw_prefill_blocks = (active_prefill_tokens + isl) / block_size
        logit = prefill_load_scale * (raw_prefill_blocks - overlap_credit * overlap_blocks)
                + potential_decode_blocks

    (``raw_prefill_tokens = active + uncached + cached = active + isl``; host/disk tiers and the
    shared cache are off here; ``overlap_score_credit_decay`` defaults to 0). The prefill
    router does not track active blocks (its decode term is 0)."""
    bs = view.block_size
    isl = features.prompt_tokens
    overlap_blocks = view.cached_prefix_tokens(worker, features.token_ids) // bs
    raw_prefill_blocks = (active_prefill_tokens(view, worker) + isl) / bs
    logit = prefill_load_scale * (raw_prefill_blocks - overlap_credit * overlap_blocks)
    if track_active_blocks:
        logit += dynamo_potential_decode_blocks(view, worker, math.ceil(isl / bs))
    return logit


def _argmin(workers: list[str], cost: Callable[[str], float], rng: random.Random) -> str:
    """Temperature 0: the lowest cost; ties drawn uniformly (Dynamo's reservoir sampling)."""
    costs = {w: cost(w) for w in workers}
    best = min(costs.values())
    tied = [w for w in workers if costs[w] == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class DynamoKvRouter:
    """Dynamo's frontend with ``--router-mode kv`` over aggregated workers (a config like 4R):
    each request to the worker of lowest `dynamo_worker_logit` (overlap credit 1.0, prefill load
    scale 1.0, active-block tracking on, temperature 0)."""

    def __init__(self, seed: int = 0):
        self._rng = random.Random(f"dynamo-kv:{seed}")
        self.__name__ = "dynamo-kv-agg"

    def __call__(self, features: SimRequestFeatures, view: ClusterView) -> Assignment:
        workers = view.replica_workers
        if not workers:
            raise RoutingError("dynamo-kv-agg needs aggregated workers (config like 4R); "
                               "the cluster has none")
        return Replica(_argmin(workers, lambda w: dynamo_worker_logit(
            view, w, features, track_active_blocks=True), self._rng))


class DynamoConditionalDisagg:
    """Dynamo 1.6.1's frontend KV router with ``--router-conditional-disagg``, per request
    (turn 1 included: the policy runs on every request):

    1. Peek the decode router: the decode worker of lowest `dynamo_worker_logit` (with
       conditional disaggregation the decode selector keeps its overlap credit and KV events;
       plain disaggregated decode is load-only). ``cached_tokens`` = its overlap blocks x block
       size x credit; ``eff_isl = prompt_tokens - cached_tokens`` (``net_new_tokens``).
    2. ``isl_bounding``: bypass iff ``eff_isl < eff_isl_threshold`` and
       ``eff_isl / max(prompt_tokens, 1) < eff_isl_ratio_threshold`` (defaults 2048, 0.7).
    3. ``prefill_load``: peek the prefill router (the prefill worker of lowest logit, no decode
       term); bypass iff it is busy: ``active_prefill_tokens > prefill_busy_threshold x
       max_num_batched_tokens`` (``AdvisoryWorkerLoad::prefill_load_exceeds``).
       ``isl_or_load``: either. The decode gate (``decode_busy_threshold``) is off by default.
    4. Bypass: `DecodeLocal` on the peeked decode worker (an append-prefill there; for a new
       conversation the whole prompt). Otherwise `ViaPrefill` on the peeked prefill worker and
       the decode worker the decode router picks (the same cost)."""

    POLICIES = ("isl_bounding", "prefill_load", "isl_or_load")

    def __init__(self, policy: str, eff_isl_threshold: int = DYNAMO_EFF_ISL_THRESHOLD,
                 eff_isl_ratio_threshold: float = DYNAMO_EFF_ISL_RATIO_THRESHOLD,
                 prefill_busy_threshold: float | None = None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, seed: int = 0):
        if policy not in self.POLICIES:
            raise ValueError(f"unknown conditional-disagg policy {policy!r}; "
                             f"choose one of {', '.join(self.POLICIES)}")
        if policy != "isl_bounding" and prefill_busy_threshold is None:
            raise ValueError(f"conditional_disagg policy={policy!r} needs prefill_busy_threshold "
                             f"(Dynamo 1.6.1 has no default for it)")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.policy = policy
        self.eff_isl_threshold = eff_isl_threshold
        self.eff_isl_ratio_threshold = eff_isl_ratio_threshold
        self.prefill_busy_threshold = prefill_busy_threshold
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rng = random.Random(f"dynamo-cd:{seed}")
        self.__name__ = f"dynamo-{policy.replace('_', '-')}"

    def isl_bounding_bypasses(self, prompt_tokens: int, cached_tokens: int) -> bool:
        eff_isl = prompt_tokens - min(cached_tokens, prompt_tokens)
        if eff_isl >= self.eff_isl_threshold:
            return False
        return eff_isl / max(prompt_tokens, 1) < self.eff_isl_ratio_threshold

    def prefill_busy(self, view: ClusterView, prefill: str) -> bool:
        assert self.prefill_busy_threshold is not None
        line = self.prefill_busy_threshold * self.max_num_batched_tokens
        return active_prefill_tokens(view, prefill) > line

    def __call__(self, features: SimRequestFeatures, view: ClusterView) -> Assignment:
        if not view.decode_workers or not view.prefill_workers:
            raise RoutingError(f"{self.__name__} needs prefill and decode workers (config like 1P3D)")
        decode = _argmin(view.decode_workers, lambda w: dynamo_worker_logit(
            view, w, features, track_active_blocks=True), self._rng)
        prefill = _argmin(view.prefill_workers, lambda w: dynamo_worker_logit(
            view, w, features, track_active_blocks=False), self._rng)
        cached = int(view.cached_prefix_tokens(decode, features.token_ids) * DYNAMO_OVERLAP_SCORE_CREDIT)
        bypass = False
        if self.policy in ("isl_bounding", "isl_or_load"):
            bypass = self.isl_bounding_bypasses(features.prompt_tokens, cached)
        if not bypass and self.policy in ("prefill_load", "isl_or_load"):
            bypass = self.prefill_busy(view, prefill)
        return DecodeLocal(decode) if bypass else ViaPrefill(prefill, decode)


# -- llm-d ---------------------------------------------------------------------------------------

def llmd_prefix_decides_pd(input_tokens: int, cached_tokens: int, non_cached_tokens: int) -> bool:
    """``PrefixBasedPDDecider.decide``: True (run the prefill profile) unless the input is
    shorter than ``nonCachedTokens`` or its uncached suffix on the chosen decode endpoint is;
    ``nonCachedTokens <= 0`` always disaggregates."""
    if non_cached_tokens <= 0:
        return True
    if input_tokens < non_cached_tokens:
        return False
    return input_tokens - cached_tokens >= non_cached_tokens


class LlmdPrefixPd:
    """llm-d's ``pd-profile-handler`` with the ``prefix-based-pd-decider``: run the decode
    profile first (``decode-filter``, ``prefix-cache-scorer`` x2 + ``queue-scorer`` x1,
    ``max-score-picker``), then ask the decider about that endpoint; if it says P/D, run the
    prefill profile (same scorers over prefill workers).

    Signals: prefix score = matched blocks / prompt blocks (llm-d's approximate prefix index
    from its own routing; ours is the workers' real cache, whole blocks); queue score =
    ``(max - q) / (max - min)`` over the candidates, 1 when all equal, on vLLM's waiting
    queue (our engine's ``waiting_requests``); input tokens: llm-d estimates them as the chat
    JSON's bytes / 4, we use the prompt's tokens. Ties: random, as its picker shuffles."""

    def __init__(self, non_cached_tokens: int = LLMD_NON_CACHED_TOKENS, seed: int = 0):
        if non_cached_tokens < 0:
            raise ValueError("nonCachedTokens parameter of prefix disaggregation decider cannot be negative")
        self.non_cached_tokens = non_cached_tokens
        self._rng = random.Random(f"llm-d:{seed}")
        self.__name__ = "llm-d-prefix"

    def _pick(self, workers: list[str], features: SimRequestFeatures, view: ClusterView) -> str:
        prompt_blocks = max(1, math.ceil(features.prompt_tokens / view.block_size))
        queues = {w: view.load(w).waiting_requests for w in workers}
        low, high = min(queues.values()), max(queues.values())

        def score(w: str) -> float:
            prefix = view.cached_prefix_tokens(w, features.token_ids) // view.block_size / prompt_blocks
            queue = 1.0 if high == low else (high - queues[w]) / (high - low)
            return LLMD_PREFIX_WEIGHT * prefix + LLMD_QUEUE_WEIGHT * queue

        return _argmin(workers, lambda w: -score(w), self._rng)

    def __call__(self, features: SimRequestFeatures, view: ClusterView) -> Assignment:
        if not view.decode_workers or not view.prefill_workers:
            raise RoutingError("llm-d-prefix needs prefill and decode workers (config like 1P3D)")
        decode = self._pick(view.decode_workers, features, view)
        cached = view.cached_prefix_tokens(decode, features.token_ids)
        if llmd_prefix_decides_pd(features.prompt_tokens, cached, self.non_cached_tokens):
            return ViaPrefill(self._pick(view.prefill_workers, features, view), decode)
        return DecodeLocal(decode)


# -- vLLM router -----------------------------------------------------------------------------------

class _ApproximateTrees:
    """cache_aware's approximate per-worker radix trees of the texts it routed (chars there;
    our prompts' chained block hashes here, so membership of a block's hash is a prefix match).
    Its LRU eviction (every 120 s down to 2^26 chars per tree) never binds at our sizes."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}

    def match_tokens(self, worker: str, hashes: list[int], block_size: int) -> int:
        held = self.blocks.get(worker, set())
        matched = 0
        for h in hashes:
            if h not in held:
                break
            matched += 1
        return matched * block_size

    def size(self, worker: str) -> int:
        return len(self.blocks.get(worker, ()))

    def insert(self, worker: str, hashes: list[int]) -> None:
        self.blocks.setdefault(worker, set()).update(hashes)


class VllmRouter:
    """vLLM's router in ``--vllm-pd-disaggregation`` mode with its default ``cache_aware``
    policy for both pools: every request prefill -> decode (no rule skips prefill), each
    worker chosen by ``cache_aware`` over its pool:

    - imbalanced (``max_load - min_load > 64`` and ``max_load > 1.5 * min_load``, load = the
      router's requests in flight to the worker, our ``view.inflight``): the least loaded;
    - else the worker whose tree matches the longest prefix if ``matched / prompt > 0.3``,
      otherwise the one with the smallest tree; the prompt then goes into the chosen tree."""

    def __init__(self, seed: int = 0):
        self._trees = {"prefill": _ApproximateTrees(), "decode": _ApproximateTrees()}
        self.__name__ = "vllm-router"

    def _cache_aware(self, pool: str, workers: list[str], features: SimRequestFeatures,
                     view: ClusterView) -> str:
        trees = self._trees[pool]
        hashes = view.prompt_hashes(features.token_ids)
        loads = {w: view.inflight(w) for w in workers}
        low, high = min(loads.values()), max(loads.values())
        if high - low > VLLM_BALANCE_ABS_THRESHOLD and high > low * VLLM_BALANCE_REL_THRESHOLD:
            chosen = min(workers, key=lambda w: loads[w])
        else:
            matched = {w: trees.match_tokens(w, hashes, view.block_size) for w in workers}
            best = max(workers, key=lambda w: matched[w])
            if matched[best] / max(features.prompt_tokens, 1) > VLLM_CACHE_THRESHOLD:
                chosen = best
            else:
                chosen = min(workers, key=trees.size)
        trees.insert(chosen, hashes)
        return chosen

    def __call__(self, features: SimRequestFeatures, view: ClusterView) -> Assignment:
        if not view.decode_workers or not view.prefill_workers:
            raise RoutingError("vllm-router needs prefill and decode workers (config like 1P3D)")
        return ViaPrefill(self._cache_aware("prefill", view.prefill_workers, features, view),
                          self._cache_aware("decode", view.decode_workers, features, view))


# -- registry ----------------------------------------------------------------------------------------

def _batched_tokens(profile: EngineProfile | None) -> int:
    return profile.engine.max_num_tokens if profile is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS


class PeerFactory(Protocol):
    """Makes a fresh router (some keep state); callable with no arguments too."""

    def __call__(self, seed: int = 0, profile: EngineProfile | None = None) -> Router: ...


def _conditional(policy: str, busy: float | None, isl: int = DYNAMO_EFF_ISL_THRESHOLD,
                 ratio: float = DYNAMO_EFF_ISL_RATIO_THRESHOLD) -> PeerFactory:
    def make(seed: int = 0, profile: EngineProfile | None = None) -> Router:
        return DynamoConditionalDisagg(policy, eff_isl_threshold=isl, eff_isl_ratio_threshold=ratio,
                                       prefill_busy_threshold=busy,
                                       max_num_batched_tokens=_batched_tokens(profile), seed=seed)
    return make


def _dynamo_kv_agg(seed: int = 0, profile: EngineProfile | None = None) -> Router:
    return DynamoKvRouter(seed)


def _llmd_prefix(seed: int = 0, profile: EngineProfile | None = None) -> Router:
    return LlmdPrefixPd(LLMD_NON_CACHED_TOKENS, seed)


def _vllm_router(seed: int = 0, profile: EngineProfile | None = None) -> Router:
    return VllmRouter(seed)


PEER_ROUTERS: dict[str, PeerFactory] = {
    # Dynamo's defaults (2048, 0.7) are also our graph's ISL thresholds.
    "dynamo-isl-bounding": _conditional("isl_bounding", None),
    # Dynamo 1.6.1 has no default busy threshold: these two use our graph's 0.5, so
    # dynamo-isl-or-load is the same rule as dynamo-isl-or-load-ours (kept for the name).
    "dynamo-prefill-load": _conditional("prefill_load", OUR_PREFILL_BUSY_THRESHOLD),
    "dynamo-isl-or-load": _conditional("isl_or_load", OUR_PREFILL_BUSY_THRESHOLD),
    # graphs/cond-disagg.yaml exactly (eff_isl_threshold 2048, ratio 0.7, prefill_busy 0.5).
    "dynamo-isl-or-load-ours": _conditional("isl_or_load", OUR_PREFILL_BUSY_THRESHOLD, 2048, 0.7),
    "dynamo-kv-agg": _dynamo_kv_agg,
    "llm-d-prefix": _llmd_prefix,
    "vllm-router": _vllm_router,
}


# Peers that route over replicas (aggregated workers): run them on a replica configuration
# (1P3D -> 4R); the others need prefill and decode workers.
REPLICA_PEERS: frozenset[str] = frozenset({"dynamo-kv-agg"})


def make_peer_router(name: str, seed: int = 0, profile: EngineProfile | None = None) -> Router:
    """A peer's router by its name in `PEER_ROUTERS` (a fresh one: some keep state)."""
    factory = PEER_ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown peer router {name!r}; choose one of {', '.join(PEER_ROUTERS)}")
    return factory(seed, profile)
