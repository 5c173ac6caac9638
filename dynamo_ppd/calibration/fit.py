"""Fit an engine profile's four cost constants to measured iteration times.

Measured points (JSON, written by ``scripts/gpu_calibrate.py`` or by hand) give the shape of one
iteration (decoding sequences, their cached tokens, the prefill chunks) and its measured time.
The cost model prices an iteration as

    t = overhead + max(W*a, G*b) + max(K*a, A*c) + sum over chunks max(Kc*a, Ac*c)

with a = 1/bandwidth, b = 1/GEMM throughput, c = 1/attention throughput, and W, G, K, A, Kc, Ac the
bytes and FLOPs that `CostModel` charges. For a fixed choice of the active side of every max this
is linear in (overhead, a, b, c), so the fit alternates: pick the active sides under the current
parameters, solve a non-negative least squares on relative errors, repeat until the active sides
stop changing. It restarts from a few scalings of the base profile and keeps the best, because an
alternating fit can settle in a local optimum.

The bytes and FLOPs are not re-derived here: `CostModel.iteration` is evaluated with probe rates
(1 byte/s with infinite FLOP/s, then the reverse), so the fit always prices exactly what the
simulator prices.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from ..argtypes import cli_error
from ..engine.cost import CostModel, PrefillChunk
from ..engine.profile import EngineProfile, ProfileError, dump_profile, load_profile

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
CONSTANTS = ("iteration_overhead_s", "memory_bandwidth_efficiency", "gemm_flops_efficiency",
             "attention_flops_efficiency")


class MeasuredChunk(msgspec.Struct, forbid_unknown_fields=True):
    new_tokens: Annotated[int, msgspec.Meta(gt=0)]
    context_tokens: NonNegativeInt
    samples: bool


class MeasuredPoint(msgspec.Struct, forbid_unknown_fields=True):
    num_decode: NonNegativeInt
    decode_context_tokens: NonNegativeInt  # summed over the decoding sequences
    prefill: list[MeasuredChunk]
    measured_s: Annotated[float, msgspec.Meta(gt=0)]

    def chunks(self) -> list[PrefillChunk]:
        return [PrefillChunk(c.new_tokens, c.context_tokens, c.samples) for c in self.prefill]

    @property
    def category(self) -> str:
        if not self.prefill:
            return "decode"
        return "mixed" if self.num_decode else "prefill"


class Measurements(msgspec.Struct, forbid_unknown_fields=True):
    hardware: str
    points: list[MeasuredPoint]


class CalibrationError(Exception):
    """Measured points are missing or invalid, or cannot determine a fit; the message says which."""


def decode_measurements(data: bytes, source: str = "points") -> Measurements:
    try:
        measurements = msgspec.json.decode(data, type=Measurements)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CalibrationError(f"{source}: invalid measured points: {exc}") from exc
    for i, point in enumerate(measurements.points):
        if point.num_decode == 0 and not point.prefill:
            raise CalibrationError(f"{source}: `$.points[{i}]` has no work (num_decode 0, no prefill)")
        if point.num_decode == 0 and point.decode_context_tokens:
            raise CalibrationError(f"{source}: `$.points[{i}].decode_context_tokens` is "
                                   f"{point.decode_context_tokens} with num_decode 0")
    if len(measurements.points) < len(CONSTANTS):
        raise CalibrationError(f"{source}: {len(measurements.points)} points cannot determine "
                               f"{len(CONSTANTS)} constants; measure at least {len(CONSTANTS)}")
    return measurements


def load_measurements(path: str | Path) -> Measurements:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CalibrationError(f"cannot read measured points {path}: {exc.strerror}") from exc
    return decode_measurements(data, str(path))


@dataclass(frozen=True)
class FitQuality:
    mean_rel_error: float
    max_rel_error: float


@dataclass(frozen=True)
class CalibrationResult:
    profile: EngineProfile
    before: FitQuality
    after: FitQuality
    unidentified: tuple[str, ...]  # constants no point constrains: kept from the base profile
    clamped: tuple[str, ...]  # efficiencies the fit put above 1, clamped to 1


def model_times(profile: EngineProfile, points: list[MeasuredPoint]) -> np.ndarray:
    model = CostModel(profile)
    return np.array([model.iteration(p.num_decode, p.decode_context_tokens, p.chunks()).total_s
                     for p in points])


def relative_errors(profile: EngineProfile, points: list[MeasuredPoint]) -> np.ndarray:
    measured = np.array([p.measured_s for p in points])
    return np.abs(model_times(profile, points) - measured) / measured


def fit_quality(profile: EngineProfile, points: list[MeasuredPoint]) -> FitQuality:
    errors = relative_errors(profile, points)
    return FitQuality(float(errors.mean()), float(errors.max()))


@dataclass
class _Features:
    """Per point: the bytes (priced at a) and FLOPs (priced at b or c) of every max term."""

    weights: np.ndarray  # W
    gemm: np.ndarray  # G
    decode_bytes: np.ndarray  # K
    decode_flops: np.ndarray  # A
    chunk_point: np.ndarray  # index of the point each chunk belongs to
    chunk_bytes: np.ndarray  # Kc
    chunk_flops: np.ndarray  # Ac
    fixed: np.ndarray  # seconds the four constants do not price (tensor parallelism's all-reduces)


def _probe(profile: EngineProfile, *, bytes_side: bool) -> CostModel:
    """A CostModel that prices only bytes (at 1 B/s) or only FLOPs (at 1 FLOP/s): its iteration
    terms are then the raw bytes or FLOPs."""
    model = CostModel(profile)
    model.overhead_s = 0.0
    model.allreduce = None  # priced apart (`_Features.fixed`)
    if bytes_side:
        model.bandwidth, model.gemm_flops, model.attention_flops = 1.0, math.inf, math.inf
        model.weight_stream_s = float(profile.gpu_streamed_weight_bytes)
        model.lm_head_stream_s = float(profile.gpu_lm_head_bytes)
    else:
        model.bandwidth, model.gemm_flops, model.attention_flops = math.inf, 1.0, 1.0
        model.weight_stream_s = 0.0
    return model


def _features(profile: EngineProfile, points: list[MeasuredPoint]) -> _Features:
    by_bytes, by_flops = _probe(profile, bytes_side=True), _probe(profile, bytes_side=False)
    cols: dict[str, list[float]] = {k: [] for k in ("w", "g", "k", "a", "cp", "kc", "ac", "x")}
    for i, p in enumerate(points):
        tokens = p.num_decode + sum(c.new_tokens for c in p.chunks())
        cols["x"].append(profile.allreduce_s(tokens))
        b = by_bytes.iteration(p.num_decode, p.decode_context_tokens, p.chunks())
        f = by_flops.iteration(p.num_decode, p.decode_context_tokens, p.chunks())
        cols["w"].append(b.gemm_s)
        cols["g"].append(f.gemm_s)
        cols["k"].append(b.decode_attention_s)
        cols["a"].append(f.decode_attention_s)
        for chunk in p.chunks():
            cols["cp"].append(i)
            cols["kc"].append(by_bytes.iteration(0, 0, [chunk]).prefill_attention_s)
            cols["ac"].append(by_flops.iteration(0, 0, [chunk]).prefill_attention_s)
    def array(key: str) -> np.ndarray:
        return np.array(cols[key], dtype=int if key == "cp" else float)

    return _Features(weights=array("w"), gemm=array("g"), decode_bytes=array("k"),
                     decode_flops=array("a"), chunk_point=array("cp"), chunk_bytes=array("kc"),
                     chunk_flops=array("ac"), fixed=array("x"))


def _design(f: _Features, theta: np.ndarray) -> tuple[np.ndarray, tuple[bool, ...]]:
    """The linear rows [1, a-coef, b-coef, c-coef] under the active sides that ``theta`` picks,
    and those sides (True = bytes side) as a hashable pattern."""
    _, a, b, c = theta
    n = len(f.weights)
    rows = np.zeros((n, 4))
    rows[:, 0] = 1.0
    gemm_bytes = f.weights * a >= f.gemm * b
    decode_bytes = f.decode_bytes * a >= f.decode_flops * c
    chunk_bytes = f.chunk_bytes * a >= f.chunk_flops * c
    rows[:, 1] = np.where(gemm_bytes, f.weights, 0) + np.where(decode_bytes, f.decode_bytes, 0)
    rows[:, 2] = np.where(gemm_bytes, 0, f.gemm)
    rows[:, 3] = np.where(decode_bytes, 0, f.decode_flops)
    np.add.at(rows[:, 1], f.chunk_point, np.where(chunk_bytes, f.chunk_bytes, 0))
    np.add.at(rows[:, 3], f.chunk_point, np.where(chunk_bytes, 0, f.chunk_flops))
    pattern = tuple(gemm_bytes) + tuple(decode_bytes) + tuple(chunk_bytes)
    return rows, pattern


def _nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained solution over
    every subset of columns whose solution is non-negative (exact, and 15 solves for 4 columns)."""
    norms = np.linalg.norm(matrix, axis=0)
    usable = [j for j in range(matrix.shape[1]) if norms[j] > 0]
    scaled = matrix[:, usable] / norms[usable]
    best, best_cost = np.zeros(matrix.shape[1]), float(np.sum(target ** 2))
    for size in range(1, len(usable) + 1):
        for subset in itertools.combinations(range(len(usable)), size):
            solution, *_ = np.linalg.lstsq(scaled[:, subset], target, rcond=None)
            if np.any(solution < 0):
                continue
            cost = float(np.sum((scaled[:, subset] @ solution - target) ** 2))
            if cost < best_cost:
                best_cost = cost
                best = np.zeros(matrix.shape[1])
                for j, value in zip(subset, solution, strict=True):
                    best[usable[j]] = value / norms[usable[j]]
    return best


def _objective(f: _Features, theta: np.ndarray, measured: np.ndarray) -> float:
    o, a, b, c = theta
    t = (f.fixed + o + np.maximum(f.weights * a, f.gemm * b)
         + np.maximum(f.decode_bytes * a, f.decode_flops * c))
    t = t + np.bincount(f.chunk_point, np.maximum(f.chunk_bytes * a, f.chunk_flops * c), len(measured))
    return float(np.sum((t / measured - 1) ** 2))


def _alternate(f: _Features, theta: np.ndarray, measured: np.ndarray, max_rounds: int = 100,
               fixed_a: float | None = None) -> np.ndarray:
    """``fixed_a``: seconds per byte held there (the bandwidth not fitted); the others fit around it."""
    seen: set[tuple[bool, ...]] = set()
    if fixed_a is not None:
        theta = np.array([theta[0], fixed_a, theta[2], theta[3]])
    best, best_cost = theta, _objective(f, theta, measured)
    for _ in range(max_rounds):
        rows, pattern = _design(f, theta)
        if pattern in seen:  # the active sides repeat: converged (or cycling)
            break
        seen.add(pattern)
        scaled = rows / measured[:, None]
        target = 1 - f.fixed / measured  # what the four constants must explain
        if fixed_a is None:
            theta = _nnls(scaled, target)
        else:
            rest = _nnls(scaled[:, [0, 2, 3]], target - scaled[:, 1] * fixed_a)
            theta = np.array([rest[0], fixed_a, rest[1], rest[2]])
        cost = _objective(f, theta, measured)
        if cost < best_cost:
            best, best_cost = theta, cost
    return best


def calibrate(base: EngineProfile, measurements: Measurements, name: str | None = None,
              max_bandwidth_efficiency: float = 1.0) -> CalibrationResult:
    """Refit ``base``'s cost constants to ``measurements``; everything else is kept. A bandwidth
    efficiency the fit puts above ``max_bandwidth_efficiency`` (a physical bound: no kernel
    streams HBM at its peak) is held at that bound and the other three constants refit around it
    (it is then listed as clamped)."""
    points = measurements.points
    hw, cost = base.hardware, base.cost
    measured = np.array([p.measured_s for p in points])
    features = _features(base, points)
    start = np.array([cost.iteration_overhead_s,
                      1 / (hw.peak_memory_bandwidth_bytes_s * cost.memory_bandwidth_efficiency),
                      1 / (base.gemm_peak_flops * cost.gemm_flops_efficiency),
                      1 / (base.attention_peak_flops * cost.attention_flops_efficiency)])
    scales = [(1.0, 1.0, 1.0), *itertools.product((0.5, 2.0), repeat=3)]
    candidates = [_alternate(features, start * np.array([1.0, *scale]), measured) for scale in scales]
    theta = min(candidates, key=lambda t: _objective(features, t, measured))
    bandwidth_bound = False
    if theta[1] > 0 and 1.0 / (theta[1] * hw.peak_memory_bandwidth_bytes_s) > max_bandwidth_efficiency:
        fixed_a = 1.0 / (hw.peak_memory_bandwidth_bytes_s * max_bandwidth_efficiency)
        candidates = [_alternate(features, start * np.array([1.0, *scale]), measured, fixed_a=fixed_a)
                      for scale in scales]
        theta = min(candidates, key=lambda t: _objective(features, t, measured))
        bandwidth_bound = True

    rows, _ = _design(features, theta)
    peaks = {"memory_bandwidth_efficiency": (hw.peak_memory_bandwidth_bytes_s, 1),
             "gemm_flops_efficiency": (base.gemm_peak_flops, 2),
             "attention_flops_efficiency": (base.attention_peak_flops, 3)}
    values: dict[str, float] = {"iteration_overhead_s": float(theta[0])}
    unidentified, clamped = [], []
    for field, (peak, j) in peaks.items():
        if not np.any(rows[:, j]):  # no point is bound by this rate: the data cannot tell it
            unidentified.append(field)
            values[field] = getattr(cost, field)
            continue
        efficiency = 1.0 / (theta[j] * peak) if theta[j] > 0 else math.inf
        bound = max_bandwidth_efficiency if field == "memory_bandwidth_efficiency" else 1.0
        if efficiency > bound * (1 + 1e-9) or (field == "memory_bandwidth_efficiency" and bandwidth_bound):
            clamped.append(field)
        values[field] = float(min(bound, efficiency))
    new_cost = msgspec.structs.replace(cost, **values)
    profile = msgspec.structs.replace(base, name=name or f"{base.name}-calibrated", cost=new_cost)
    return CalibrationResult(profile, fit_quality(base, points), fit_quality(profile, points),
                             tuple(unidentified), tuple(clamped))


def format_report(base: EngineProfile, result: CalibrationResult, measurements: Measurements) -> str:
    lines = [f"{'constant':<30}{'before':>12}{'after':>12}"]
    for field in CONSTANTS:
        note = (" (unidentified: kept)" if field in result.unidentified
                else " (clamped to 1)" if field in result.clamped else "")
        lines.append(f"{field:<30}{getattr(base.cost, field):>12.4g}"
                     f"{getattr(result.profile.cost, field):>12.4g}{note}")
    lines += ["", f"{'relative error':<20}{'points':>7}{'mean before':>13}{'mean after':>12}"
              f"{'max before':>12}{'max after':>11}"]
    points = measurements.points
    before, after = relative_errors(base, points), relative_errors(result.profile, points)
    for category in ("decode", "prefill", "mixed", "all"):
        sel = np.array([category in ("all", p.category) for p in points])
        if sel.any():
            lines.append(f"{category:<20}{int(sel.sum()):>7}{before[sel].mean():>13.1%}"
                         f"{after[sel].mean():>12.1%}{before[sel].max():>12.1%}{after[sel].max():>11.1%}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True,
                        help="base engine profile (bundled name or YAML path): hardware, model and "
                        "limits are kept, only the four cost constants are refitted")
    parser.add_argument("--points", type=Path, required=True,
                        help="measured points JSON (scripts/gpu_calibrate.py writes one)")
    parser.add_argument("--out", type=Path, help="write the calibrated profile YAML here")
    parser.add_argument("--name", help="name of the calibrated profile (default: BASE-calibrated)")


def main(args: argparse.Namespace) -> int:
    try:
        base = load_profile(args.profile)
        measurements = load_measurements(args.points)
    except (ProfileError, CalibrationError) as exc:
        return cli_error(exc)
    result = calibrate(base, measurements, args.name)
    print(f"calibrated {base.name} on {len(measurements.points)} points measured on "
          f"{measurements.hardware!r}")
    print(format_report(base, result, measurements))
    if args.out:
        header = (f"# Calibrated by `dynamo-ppd engine calibrate` from {base.name} and {args.points}:\n"
                  f"# {len(measurements.points)} points measured on\n# {measurements.hardware}\n"
                  f"# relative error mean {result.after.mean_rel_error:.1%}, "
                  f"max {result.after.max_rel_error:.1%}.\n")
        args.out.write_bytes(header.encode() + dump_profile(result.profile))
        print(f"wrote {args.out}")
    return 0
