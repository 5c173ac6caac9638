"""The simulated TensorRT-LLM engine: a pure, clock-free model (profile, cost, block hashing, KV
cache, scheduler, the P->D handoff). `dynamo_ppd.worker` serves it as a Dynamo component on a wall
clock; `dynamo_ppd.sim` runs it on a virtual clock."""

from .cost import CostModel, PrefillChunk, TransferLink
from .kv_cache import KvCache, KvEvent, KvRemoved, KvStored
from .profile import DEFAULT_PROFILE, EngineProfile, ProfileError, load_profile
from .scheduler import (
    Engine,
    EngineConfig,
    EngineRequest,
    Iteration,
    LoadSnapshot,
    RequestKind,
    RequestRejected,
    TokenOutput,
)

__all__ = ["DEFAULT_PROFILE", "CostModel", "Engine", "EngineConfig", "EngineProfile", "EngineRequest",
           "Iteration", "KvCache", "KvEvent", "KvRemoved", "KvStored", "LoadSnapshot", "PrefillChunk",
           "ProfileError", "RequestKind", "RequestRejected", "TokenOutput", "TransferLink", "load_profile"]
