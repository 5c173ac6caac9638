"""The paper's measured points (`data/paper_comprehensive.csv`) as validated structs, and what
the measurements imply for the PPD decision (the decode-local share at given weights).

One row per (config, workload, qps) with the columns of the authors' `comprehensive.csv`
(freelulul/vllm-ppd, ``ppd/results/comprehensive``; protocol in docs/manifest.md): the same
columns `dynamo-ppd sim paper --out` writes, so `load_points` reads either, and a simulated run
is compared with the measurements through the same code.

Pure apart from `load_points`/`bundled_points` (which read a file); no clock.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..engine.profile import NonNegative
from ..sim.routing import parse_paper_config
from ..workloads.generators import PAPER_WORKLOADS

BUNDLED_CSV = Path(__file__).parent / "data" / "paper_comprehensive.csv"

Count = Annotated[int, Meta(ge=0)]


class PaperDataError(ValueError):
    """A points file that does not validate; the message names the file, line and column."""


class TurnFigures(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One turn's figures over its successful requests, in ms (0 where none succeeded, as the
    authors write them)."""

    count: Count
    avg_ttft_ms: NonNegative
    p50_ttft_ms: NonNegative
    p99_ttft_ms: NonNegative
    avg_tpot_ms: NonNegative
    p50_tpot_ms: NonNegative
    p99_tpot_ms: NonNegative
    avg_e2e_ms: NonNegative


class PaperPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One measured (or simulated) point: a configuration, a workload, a rate."""

    config: str
    workload: str
    qps: Annotated[float, Meta(gt=0)]
    success_rate: Annotated[float, Meta(ge=0, le=100)]  # percent of all requests sent
    total_requests: Count
    failed: Count
    duration_s: NonNegative
    error: str  # the failures' cause ("" for none): timeout, connection_refused, ...
    turn1: TurnFigures
    turn2: TurnFigures
    tokens_per_sec: NonNegative

    @property
    def completed(self) -> bool:
        """Some turn-2 request succeeded, so turn-2 latencies exist."""
        return self.turn2.count > 0 and self.turn2.avg_ttft_ms > 0

    @property
    def crashed(self) -> bool:
        """Failures from a server of the stack going down, not from latency (the data's README:
        model timeouts, not crashes)."""
        return self.error in CRASH_ERRORS and self.failed > 0


CRASH_ERRORS = frozenset({"connection_refused", "connection_reset", "server_disconnected"})
_TURN_FIELDS = ("count", "avg_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "avg_tpot_ms", "p50_tpot_ms",
                "p99_tpot_ms", "avg_e2e_ms")
COLUMNS = ("config", "workload", "qps", "success_rate", "total_requests", "failed", "duration_s", "error",
           *(f"turn{n}_{f}" for n in (1, 2) for f in _TURN_FIELDS), "tokens_per_sec")
_INTS = {"total_requests", "failed", "turn1_count", "turn2_count"}


def _row_to_point(row: dict[str, str], where: str) -> PaperPoint:
    values: dict[str, object] = {}
    for column in COLUMNS:
        text = row[column]
        if column in ("config", "workload", "error"):
            values[column] = text
            continue
        try:
            number = float(text)
        except ValueError:
            raise PaperDataError(f"{where}: {column}: {text!r} is not a number") from None
        if column in _INTS:
            if not number.is_integer():
                raise PaperDataError(f"{where}: {column}: {text!r} is not a whole number")
            values[column] = int(number)
        else:
            values[column] = number
    nested = {k: v for k, v in values.items() if not k.startswith("turn")}
    for n in (1, 2):
        nested[f"turn{n}"] = {f: values[f"turn{n}_{f}"] for f in _TURN_FIELDS}
    try:
        point = msgspec.convert(nested, PaperPoint)
    except msgspec.ValidationError as e:  # 'Expected float >= 0.0 - at `$.turn1.avg_ttft_ms`'
        message, _, path = str(e).replace("`", "").partition(" - at $.")
        column = path.replace(".", "_")  # the CSV's column name
        raise PaperDataError(f"{where}: {column}: {message}" if column else f"{where}: {message}") from None
    try:
        parse_paper_config(point.config)
    except ValueError as e:
        raise PaperDataError(f"{where}: config: {e}") from None
    if point.workload not in PAPER_WORKLOADS:
        raise PaperDataError(f"{where}: workload: {point.workload!r} is not one of the paper's 18")
    if point.failed > point.total_requests:
        raise PaperDataError(f"{where}: failed: {point.failed} > total_requests {point.total_requests}")
    return point


def point_from_columns(config: str, workload: str, qps: float,
                       columns: Mapping[str, float | int | str]) -> PaperPoint:
    """A point from one outcome's columns (`dynamo_ppd.sim.outcome.paper_columns`), so that a
    simulated point and a measured one are the same struct. ``config`` is not checked against
    the paper's names (a simulated system may have none, e.g. our PPD policy)."""
    nested: dict[str, object] = {"config": config, "workload": workload, "qps": qps}
    nested.update({k: v for k, v in columns.items() if not k.startswith("turn")})
    for n in (1, 2):
        nested[f"turn{n}"] = {f: columns[f"turn{n}_{f}"] for f in _TURN_FIELDS}
    return msgspec.convert(nested, PaperPoint)


def parse_points(text: str, source: str = "<points>") -> list[PaperPoint]:
    """Points from CSV text with (at least) the paper's columns; every row validated, the first
    bad one named by line and column; a (config, workload, qps) seen twice is an error."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise PaperDataError(f"{source}: missing columns: {', '.join(missing)}")
    points: list[PaperPoint] = []
    seen: dict[tuple[str, str, float], int] = {}
    for row in reader:
        where = f"{source} line {reader.line_num}"
        point = _row_to_point(row, where)
        key = (point.config, point.workload, point.qps)
        if key in seen:
            raise PaperDataError(f"{where}: duplicate point {key} (first on line {seen[key]})")
        seen[key] = reader.line_num
        points.append(point)
    return points


def load_points(path: str | Path) -> list[PaperPoint]:
    """A points CSV (the measurements, or a `sim paper --out` file), validated."""
    return parse_points(Path(path).read_text(), source=str(path))


def bundled_points() -> list[PaperPoint]:
    """The paper's measured points shipped with the package (`data/paper_comprehensive.csv`)."""
    return load_points(BUNDLED_CSV)


def by_key(points: Iterable[PaperPoint]) -> dict[tuple[str, str, float], PaperPoint]:
    return {(p.config, p.workload, p.qps): p for p in points}


# x=0 (`..D`) and x=1 (`..pD`) twins in the measured data: the same GPUs, turn 2 through a
# prefill GPU or decode-local. (2P_2D and its twins are among the configurations kept back.)
MEASURED_FAMILIES: dict[str, tuple[str, str]] = {
    "1P_3D": ("1P_3D", "1P_3pD"), "3P_1D": ("3P_1D", "3P_1pD"),
    "1R_1P_2D": ("1R_1P_2D", "1R_1P_2pD"), "2R_1P_1D": ("2R_1P_1D", "2R_1P_1pD")}

OneSideFailed = Literal["completed-side-wins", "exclude"]


def paper_score(x0: PaperPoint, x1: PaperPoint, w_ttft: float, w_tpot: float) -> float:
    """The paper's score of x=1 against x=0 on turn-2 mean TTFT and TPOT:
    ``w_ttft (TTFT_0 - TTFT_1) / TTFT_0 - w_tpot (TPOT_1 - TPOT_0) / TPOT_0`` (> 0: x=1 wins).
    Both points must have completed turn-2 requests with a TPOT."""
    t0, t1 = x0.turn2, x1.turn2
    if min(t0.avg_ttft_ms, t1.avg_ttft_ms, t0.avg_tpot_ms, t1.avg_tpot_ms) <= 0:
        raise ValueError(f"{x0.workload} at {x0.qps:g}: a side has no turn-2 TTFT/TPOT to score")
    return (w_ttft * (t0.avg_ttft_ms - t1.avg_ttft_ms) / t0.avg_ttft_ms
            - w_tpot * (t1.avg_tpot_ms - t0.avg_tpot_ms) / t0.avg_tpot_ms)


class LocalShare(msgspec.Struct, frozen=True):
    """How often x=1 beats x=0 over the (workload, qps) points both configurations have."""

    w_ttft: float
    w_tpot: float
    share: float | None  # x1_wins / points; None with no point
    points: int  # points that count
    x1_wins: int
    one_side_failed: int  # points where one side completed no turn-2 request (a crash, or all timed out)
    excluded: int  # points left out: both sides failed, or one side failed with policy "exclude"


def _has_latency(p: PaperPoint) -> bool:
    return p.completed and p.turn2.avg_tpot_ms > 0


def local_share(pairs: Iterable[tuple[PaperPoint, PaperPoint]], w_ttft: float, w_tpot: float,
                one_side_failed: OneSideFailed = "completed-side-wins") -> LocalShare:
    """The decode-local share over (x=0, x=1) pairs of one (workload, qps) each: the share of
    pairs where x=1 scores > 0 (`paper_score`). A pair where only one side completed turn-2
    requests (the other 0% success: a crash or all timed out) counts as a win for the side that
    completed by default (the router would have to pick it), or is left out with
    ``one_side_failed="exclude"``; a pair where neither completed is always left out."""
    points = wins = one_failed = excluded = 0
    for x0, x1 in pairs:
        ok0, ok1 = _has_latency(x0), _has_latency(x1)
        if ok0 and ok1:
            points += 1
            wins += paper_score(x0, x1, w_ttft, w_tpot) > 0
        elif ok0 or ok1:
            one_failed += 1
            if one_side_failed == "exclude":
                excluded += 1
            else:
                points += 1
                wins += ok1
        else:
            excluded += 1
    return LocalShare(w_ttft, w_tpot, wins / points if points else None, points, wins, one_failed, excluded)


def family_pairs(points: Sequence[PaperPoint], x0_config: str,
                 x1_config: str) -> list[tuple[PaperPoint, PaperPoint]]:
    """The (x=0, x=1) pairs of every (workload, qps) both configurations have, in file order."""
    index = by_key(points)
    return [(p, index[(x1_config, p.workload, p.qps)]) for p in points
            if p.config == x0_config and (x1_config, p.workload, p.qps) in index]


def measured_local_share(points: Sequence[PaperPoint], family: str | tuple[str, str],
                         weights: tuple[float, float],
                         one_side_failed: OneSideFailed = "completed-side-wins") -> LocalShare:
    """The decode-local share the data implies for a configuration family at ``weights``
    (w_ttft, w_tpot): ``family`` is a `MEASURED_FAMILIES` name (``"1P_3D"``) or an explicit
    (x=0 config, x=1 config) pair. For 1P_3D at w_tpot 1/3/6/12 (w_ttft 1) the bundled data
    gives 98.9 / 98.9 / 96.7 / 92.2% (180 points, 30 of them with 1P_3D crashed)."""
    if isinstance(family, str):
        try:
            x0_config, x1_config = MEASURED_FAMILIES[family]
        except KeyError:
            raise ValueError(f"unknown family {family!r}; known: {', '.join(MEASURED_FAMILIES)}") from None
    else:
        x0_config, x1_config = family
    pairs = family_pairs(points, x0_config, x1_config)
    if not pairs:
        raise ValueError(f"no (workload, qps) point has both {x0_config} and {x1_config}")
    return local_share(pairs, *weights, one_side_failed=one_side_failed)
