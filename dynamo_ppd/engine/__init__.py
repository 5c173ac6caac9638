"""The simulated TensorRT-LLM engine: a pure, clock-free model (profile, cost, KV cache, scheduler)
and, in `worker`, the Dynamo adapter that runs it on a wall clock."""

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
