"""The decision grid (brief §2): cumulative context class x follow-up workload class x QPS level.

- Context classes by the prompt's total tokens (the conversation so far plus the new input):
  small <= 512 < large <= 4096 < huge. Each has a representative context used to measure it.
- Nine follow-up workload classes: representative (new input, output) points, the paper's span
  from decode-heavy (32 in, 512 out) to prefill-heavy (1024 in, 32 out): input in {32, 256, 1024}
  crossed with output in {32, 256, 512}. Each is labelled by its input/output ratio class (cut
  points 0.25 and 2.0: decode-heavy, balanced, prefill-heavy) and its size. A request maps to the
  nearest point in log space.
- QPS levels {0.5, 1, 2, 4, 6, 8, 10, 12, 16, 20}; a measured rate snaps to the nearest level.

All of it is configurable and stored in each table, so a table says what it was built on.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

Positive = Annotated[float, msgspec.Meta(gt=0)]


class ContextClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    max_tokens: int | None  # upper bound (inclusive); None for the last class
    representative_tokens: Annotated[int, msgspec.Meta(gt=0)]


class WorkloadClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    input_tokens: Annotated[int, msgspec.Meta(gt=0)]  # new tokens of the follow-up turn
    output_tokens: Annotated[int, msgspec.Meta(gt=0)]


class GridSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    context_classes: list[ContextClass]
    workload_classes: list[WorkloadClass]
    qps_levels: list[Positive]
    ratio_cuts: tuple[float, float] = (0.25, 2.0)

    def context_class(self, prompt_tokens: int) -> ContextClass:
        for cls in self.context_classes:
            if cls.max_tokens is None or prompt_tokens <= cls.max_tokens:
                return cls
        return self.context_classes[-1]

    def workload_class(self, input_tokens: int, output_tokens: int) -> WorkloadClass:
        """The nearest representative point in (log input, log output)."""
        x, y = math.log(max(1, input_tokens)), math.log(max(1, output_tokens))
        return min(self.workload_classes,
                   key=lambda w: (math.log(w.input_tokens) - x) ** 2 + (math.log(w.output_tokens) - y) ** 2)

    def qps_level(self, qps: float) -> float:
        return min(self.qps_levels, key=lambda level: (abs(level - qps), level))

    def ratio_class(self, workload: WorkloadClass) -> str:
        ratio = workload.input_tokens / workload.output_tokens
        low, high = self.ratio_cuts
        return "decode-heavy" if ratio < low else "prefill-heavy" if ratio > high else "balanced"

    def validate(self) -> None:
        """Errors that name the bad part of a grid (msgspec checks the types)."""
        if not self.context_classes or not self.workload_classes or not self.qps_levels:
            raise ValueError("grid: context_classes, workload_classes and qps_levels must not be empty")
        bounds = [c.max_tokens for c in self.context_classes]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
            raise ValueError("grid.context_classes: only the last class may (and must) have max_tokens null")
        if bounds[:-1] != sorted(bounds[:-1]):  # type: ignore[type-var]
            raise ValueError("grid.context_classes: max_tokens must increase")
        for field, names in (("context_classes", [c.name for c in self.context_classes]),
                             ("workload_classes", [w.name for w in self.workload_classes])):
            if len(set(names)) != len(names):
                raise ValueError(f"grid.{field}: names must be unique")
        if len(set(self.qps_levels)) != len(self.qps_levels):
            raise ValueError("grid.qps_levels: levels must be unique")


def default_grid() -> GridSpec:
    workloads = [WorkloadClass(f"in{i}-out{o}", i, o) for i in (32, 256, 1024) for o in (32, 256, 512)]
    return GridSpec(
        context_classes=[ContextClass("small", 512, 384), ContextClass("large", 4096, 2048),
                         ContextClass("huge", None, 8192)],
        workload_classes=workloads,
        qps_levels=[0.5, 1, 2, 4, 6, 8, 10, 12, 16, 20])
