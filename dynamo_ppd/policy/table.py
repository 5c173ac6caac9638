"""PPD tables: one JSON file per (engine profile, P:D configuration, weights), one schema.

Each cell of the grid holds what was measured at x=0 (every follow-up via a prefill worker) and
x=1 (every follow-up decode-local): mean follow-up TTFT, mean TPOT, the rate actually reached,
the success share, and the live conditions the router saw at decision time (which the online
correction compares the present against). The score and decision of each cell follow from the
measurements and the weights, so `reweight` recomputes them without measuring again.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from ..engine.profile import NonNegative
from .grid import GridSpec
from .score import Prediction, score

TABLE_FORMAT_VERSION = 1


class TableError(Exception):
    """A table file is missing or invalid; the message names the file and the field."""


# What a cell decides: a `decision.Route` value, as the JSON stores it (a `decision.Decision` is
# the policy's whole answer: route, reason, predictions).
RouteName = Literal["decode_local", "via_prefill"]


class Conditions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Mean live conditions at follow-up decisions during a measurement."""

    prefill_queue_tokens: NonNegative = 0.0  # prompt tokens waiting or prefilling on the chosen P
    decode_batch: NonNegative = 0.0  # sequences decoding on the session's D
    decode_kv_tokens: NonNegative = 0.0  # their total context


class Measurement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    follow_up_ttft_s: Annotated[float, msgspec.Meta(gt=0)]
    tpot_s: Annotated[float, msgspec.Meta(gt=0)]
    requests: Annotated[int, msgspec.Meta(ge=0)]
    achieved_rps: NonNegative
    success_rate: Annotated[float, msgspec.Meta(ge=0, le=1)]
    conditions: Conditions = Conditions()

    def prediction(self) -> Prediction:
        return Prediction(self.follow_up_ttft_s, self.tpot_s)


class Cell(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    context_class: str
    workload_class: str
    qps: float
    via_prefill: Measurement  # x = 0
    decode_local: Measurement  # x = 1
    score: float
    decision: RouteName


class Weights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    w_ttft: NonNegative = 1.0
    w_tpot: NonNegative = 1.0


class BuildInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: Literal["sim", "live"]
    seed: int
    seconds_per_cell: float
    build_seconds: float
    created_unix: float
    target: str = ""  # the live deployment's URL, or the sim's description


class PpdTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format_version: int
    profile: str
    config: str  # P:D configuration, e.g. "1P3D"
    weights: Weights
    grid: GridSpec
    build: BuildInfo
    cells: list[Cell]

    def index(self) -> dict[tuple[str, str, float], Cell]:
        return {(c.context_class, c.workload_class, c.qps): c for c in self.cells}


def parse_weights(text: str) -> Weights:
    """``W_TTFT,W_TPOT`` (e.g. ``1,1`` or ``2,1``) -> Weights; ValueError saying what is wrong."""
    try:
        w_ttft, w_tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r} is not W_TTFT,W_TPOT (e.g. 1,1 or 2,1)") from None
    if w_ttft < 0 or w_tpot < 0 or w_ttft + w_tpot == 0:
        raise ValueError("weights must be non-negative and not both zero")
    return Weights(w_ttft, w_tpot)


def decide(via_prefill: Measurement, decode_local: Measurement, weights: Weights) -> tuple[float, RouteName]:
    s = score(decode_local.prediction(), via_prefill.prediction(), weights.w_ttft, weights.w_tpot)
    return s, ("decode_local" if s > 0 else "via_prefill")


def reweight(table: PpdTable, weights: Weights) -> PpdTable:
    cells = []
    for cell in table.cells:
        s, decision = decide(cell.via_prefill, cell.decode_local, weights)
        cells.append(msgspec.structs.replace(cell, score=s, decision=decision))
    return msgspec.structs.replace(table, weights=weights, cells=cells)


def validate(table: PpdTable, where: str = "table") -> PpdTable:
    """Checks beyond the types: the grid is sound and every cell is there once and consistent."""
    if table.format_version != TABLE_FORMAT_VERSION:
        raise TableError(f"{where}: format_version {table.format_version} is not {TABLE_FORMAT_VERSION}")
    try:
        table.grid.validate()
    except ValueError as exc:
        raise TableError(f"{where}: {exc}") from exc
    contexts = {c.name for c in table.grid.context_classes}
    workloads = {w.name for w in table.grid.workload_classes}
    expected = {(c, w, q) for c in contexts for w in workloads for q in table.grid.qps_levels}
    seen: set[tuple[str, str, float]] = set()
    for i, cell in enumerate(table.cells):
        key = (cell.context_class, cell.workload_class, cell.qps)
        if key not in expected:
            raise TableError(f"{where}: cells[{i}] {key} is not a cell of the grid")
        if key in seen:
            raise TableError(f"{where}: cells[{i}] {key} appears twice")
        seen.add(key)
        s, decision = decide(cell.via_prefill, cell.decode_local, table.weights)
        if decision != cell.decision or not math.isclose(s, cell.score, rel_tol=1e-6, abs_tol=1e-9):
            raise TableError(f"{where}: cells[{i}] {key}: decision/score do not follow from the "
                             f"measurements and weights (run `dynamo-ppd table reweight`)")
    missing = expected - seen
    if missing:
        raise TableError(f"{where}: {len(missing)} grid cells missing, e.g. {sorted(missing)[0]}")
    return table


def load_table(path: str | Path) -> PpdTable:
    path = Path(path)
    if not path.is_file():
        raise TableError(f"table {path} does not exist")
    try:
        table = msgspec.json.decode(path.read_bytes(), type=PpdTable)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise TableError(f"{path}: invalid table: {exc}") from exc
    return validate(table, str(path))


def save_table(table: PpdTable, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(table)) + b"\n")


TABLE_DIR = Path(__file__).parent / "tables"
CONFIGS = ("1P3D", "2P2D", "3P1D")  # the paper's P:D splits of 4 GPUs: a table ships for each


def bundled_table(config: str) -> Path:
    """The default table shipped for the default profile and a P:D configuration."""
    return TABLE_DIR / f"h100-llama3.1-8b-{config.lower()}.json"


def shipped_table(profile_name: str, config: str) -> Path | None:
    """``--table auto`` for a fixed configuration: the table shipped for ``config`` (``1P3D``)
    if one ships and was measured on this profile, else None (decide from the profile's
    predictions). The live router picks the same one per live P:D configuration."""
    path = bundled_table(config)
    if not path.is_file() or load_table(path).profile != profile_name:
        return None
    return path
