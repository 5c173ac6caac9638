"""Imitates tensorrt_llm/scheduling_params.py: the attention-DP placement of one request."""

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class SchedulingParams:
    attention_dp_rank: int | None = None
    attention_dp_relax: bool | None = None
