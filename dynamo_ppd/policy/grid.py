"""The decision grid: cumulative context class x follow-up workload class x QPS level (README,
"PPD tables and the decision").

- Context classes by the prompt's total tokens (the conversation so far plus the new input):
  small <= 512 < large <= 4096 < huge. Each is measured on two-turn conversations whose first
  turn is the class's ``first_turn``: the paper's T1 for small (128 -> 128) and large (1024 ->
  1024), so a cell is the paper's workload ``<T1>_<T2>``. The paper has no T1 for huge (> 4096);
  it keeps our own representative (an 8,192-token turn-2 prompt). ``representative_tokens`` is a
  typical turn-2 prompt of the class (T1 plus the median T2 input, 64), what the online
  correction predicts a cell's nominal request at. Note that the paper's small T1 with the large
  T2 inputs (mid_paste, big_paste, huge_paste: 256-1024 new tokens) gives turn-2 prompts of
  ~520-1300 tokens, over the small cut point: those cells describe conversations with a small
  history, while a live request of that size is looked up in "large" by its whole prompt.
- Nine follow-up workload classes: the paper's nine T2 settings, named as in its data (new
  input -> output): tiny 16 -> 32, short_gen 32 -> 256, long_gen 32 -> 512, very_long_gen
  64 -> 1024, small_bal 64 -> 64, mid_bal 128 -> 128, mid_paste 256 -> 64, big_paste 512 -> 64,
  huge_paste 1024 -> 32. Each is labelled by its input/output ratio class (cut points 0.25 and
  2.0: decode-heavy, balanced, prefill-heavy). A request maps to the nearest point in log space.
- QPS levels {1, 2, 4, 8, 12, 16, 20, 24, 32, 40}: the request rates the router measures (both
  turns of a conversation count) at the paper's conversation rates {0.5, ..., 20}, so each cell
  is measured at one of the paper's points; a measured rate snaps to the nearest. (The levels
  were once the paper's numbers read as request rates, which capped the table at 10 conv/s: at
  16 conv/s PPD read a 10 conv/s cell, and the online correction, measuring against that
  cell's lighter decode batch, sent huge appends decode-local on a saturated decode worker.)

All of it is configurable and stored in each table, so a table says what it was built on.
"""

from __future__ import annotations

import math
import statistics
from typing import Annotated

import msgspec

from ..engine.profile import Positive
from ..workloads.generators import PAPER_QPS, PAPER_T1, PAPER_T2, PAPER_TURNS

DERIVED_FIRST_OUTPUT = 128  # turn-1 output of a class without a paper T1 (huge)


class ContextClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    max_tokens: int | None  # upper bound (inclusive); None for the last class
    representative_tokens: Annotated[int, msgspec.Meta(gt=0)]
    # The cells' first turn (prompt tokens, output tokens): the paper's T1. None: derived per
    # cell so that the turn-2 prompt is ``representative_tokens`` (128 output tokens).
    first_turn: tuple[Annotated[int, msgspec.Meta(gt=0)], Annotated[int, msgspec.Meta(gt=0)]] | None = None

    @property
    def first_output_tokens(self) -> int:
        """Turn 1's answer in this class's cells (the paper T1's, else `DERIVED_FIRST_OUTPUT`)."""
        return self.first_turn[1] if self.first_turn is not None else DERIVED_FIRST_OUTPUT


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


def paper_context_class(name: str, max_tokens: int | None, t1: str) -> ContextClass:
    """A context class measured with the paper's first turn ``t1`` (``small`` or ``large``)."""
    first_in, first_out = PAPER_T1[t1]
    typical_new = int(statistics.median(i for i, _ in PAPER_T2.values()))
    return ContextClass(name, max_tokens, first_in + first_out + typical_new, (first_in, first_out))


def default_grid() -> GridSpec:
    workloads = [WorkloadClass(name, i, o) for name, (i, o) in PAPER_T2.items()]
    return GridSpec(
        context_classes=[paper_context_class("small", 512, "small"),
                         paper_context_class("large", 4096, "large"),
                         ContextClass("huge", None, 8192)],  # no paper workload has > 4096 tokens
        workload_classes=workloads,
        qps_levels=[PAPER_TURNS * q for q in PAPER_QPS])


def cell_order(grid: GridSpec, key: tuple[str, str, float]) -> tuple[int, int, int]:
    """Sort key of a cell (context class, workload class, QPS level): the grid's own order, the
    order a table lists its cells in."""
    ctx, wl, qps = key
    return ([c.name for c in grid.context_classes].index(ctx),
            [w.name for w in grid.workload_classes].index(wl), grid.qps_levels.index(qps))
