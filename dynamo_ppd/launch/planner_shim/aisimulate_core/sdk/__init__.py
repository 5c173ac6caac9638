"""`aisimulate_core.sdk`: what Dynamo 1.6.1's planner imports at module level.

``ForwardPassPerfModelConfig`` only holds the request the planner builds before it asks for the
model (``ais_adapter.PlannerEnginePerfModel._build_ais_config`` runs outside the ``try`` that
catches a missing SDK), so it is a plain record with the fields the planner reads; the model
itself (``RustForwardPassPerfModel.best_available``) raises ImportError."""

from dataclasses import asdict, dataclass, field
from typing import Any

from .. import RustForwardPassPerfModel


@dataclass
class ForwardPassPerfModelConfig:
    model: str = ""
    system: str = "unprofiled"
    backend: str = "trtllm"
    worker_type: str = "decode"
    estimation_mode: str = "fpm_regression"
    tp: int = 1
    pp: int = 1
    attention_dp: int = 1
    nextn: int = 0
    kv_block_size: int | None = None
    speculation: dict[str, Any] | None = None
    estimator_config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_legacy_engine_config(cls, legacy: dict[str, Any], worker_type: str,
                                  options: dict[str, Any]) -> "ForwardPassPerfModelConfig":
        return cls(model=str(legacy.get("model_name", "")), worker_type=worker_type,
                   estimator_config=dict(options))


__all__ = ["ForwardPassPerfModelConfig", "RustForwardPassPerfModel"]
