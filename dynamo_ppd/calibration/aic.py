"""`dynamo-ppd engine aic`: the engine cost model against NVIDIA AIConfigurator, and a refit.

AIConfigurator (`aiconfigurator-core`, the `aic` extra: `uv sync --extra aic`) predicts step
times of TensorRT-LLM from kernel tables measured on each GPU. This command asks it for three
families of iterations on a grid of shapes a worker can really run (KV within the profile's
capacity, tokens within max_num_tokens, requests within max_batch_size) and compares them with
`CostModel.iteration` for the same shapes:

- prefill: m new tokens on n cached ones, alone in the iteration:
  AIC `predict_prefill_latency(1, isl=n+m, prefix=n)` vs `iteration(0, 0, [PrefillChunk(m, n, True)])`;
- decode: B sequences at prompt length L: AIC `decode_step_latency(B, L, osl=2)` (its step after
  the context phase's token: each sequence holds L+1 tokens' KV, as in TensorRT-LLM, whose
  generation step attends to the prompt and the token sampled before it) vs `iteration(B, B*(L+1))`;
- mixed: a chunk of m tokens of an L-token prompt beside B decodes at L: AIC
  `mixed_step_latency(m, B, isl=L, osl=2)`, which charges the context attention of an L-long prompt
  divided by ceil(L/m) (the chunk as an equal share of its prompt), vs `iteration(B, B*(L+1),
  [PrefillChunk(m, (L-m)//2, m == L)])` (the chunk at the average position of its prompt). L is a
  multiple of m, so the two shares agree on the attention pairs (m*L/2 on both sides).

It reports the median and p90 |model - AIC| / AIC per profile and family, before and after a
refit of the profile's four efficiency constants to AIC's points (`fit.calibrate`, all families
together, relative errors), and after the refit on a held-out set: AIC's answers for shapes off
the grid (`heldout_grid`: other sizes, contexts, batches and prompt multiples), kept out of the
fit. A profile is asked at its own tensor-parallel degree and precision (TP GPUs per worker, bf16
or FP8 weights and KV: `aic_target`), so a profile `dynamo-ppd engine profile` built for any
shipped model is checked and refit the same way. AIC's answers can be written (--write-points)
and read back (--points), so the comparison runs without AIC; docs/engine-aic/ ships them for
every bundled TensorRT-LLM profile.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from ..argtypes import cli_error
from ..engine.profile import EngineProfile, ProfileError, dump_profile, load_profile
from ..experiment import plots
from .fit import (
    CONSTANTS,
    MeasuredChunk,
    MeasuredPoint,
    Measurements,
    calibrate,
    model_times,
    relative_errors,
)

Family = Literal["prefill", "decode", "mixed"]
FAMILIES: tuple[Family, ...] = ("prefill", "decode", "mixed")
AIC_PACKAGE, AIC_BACKEND = "aiconfigurator-core", "trtllm"  # the version: pyproject.toml, extra `aic`
# Issue 28's "Done when", per profile and family, after the refit.
TARGET_MEDIAN, TARGET_P90 = 0.10, 0.25
MIN_POINTS_PER_FAMILY = 200

# AIC's names for our hardware and model. AIC ships the base model's config; the Instruct model
# the profiles name has the same architecture (config.json: same shapes, same vocabulary).
AIC_SYSTEMS = {"NVIDIA H100 SXM5 80GB": "h100_sxm", "NVIDIA H200 SXM 141GB": "h200_sxm",
               "NVIDIA B200 SXM 180GB": "b200_sxm"}
AIC_MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3.1-8B",
              "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B",
              "Qwen/Qwen3-8B": "Qwen/Qwen3-8B", "Qwen/Qwen3-32B": "Qwen/Qwen3-32B"}

# The grid, before the physical filter (`fits`). Sizes step by ~sqrt(2) so every regime (weight-
# bound, compute-bound, attention-bound) gets points; contexts go to 32K, Llama-3.1's usual limit.
PREFILL_NEW = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
               6144, 8192)
PREFILL_CACHED = (0, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
DECODE_BATCH = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DECODE_CONTEXT = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288,
                  16384, 24576, 32768)
# No 8192-token chunk beside a decode: TensorRT-LLM's max_num_tokens (8192) counts decode tokens
# too. 255 decodes, not 256: the prefilling request takes a slot of max_batch_size (256).
MIXED_CHUNK = (256, 512, 1024, 2048, 3072, 4096, 6144, 7680)
MIXED_BATCH = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 255)
MIXED_PROMPT_MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 128)  # L = k*m (see the module docstring)
MAX_CONTEXT = 32768
# The held-out grid: no value of it is on the grid above (sizes between its steps, prompt
# multiples that are not powers of two), so its points test the refit away from what it saw.
HELDOUT_PREFILL_NEW = (20, 40, 80, 160, 320, 640, 1280, 2560, 5120)
HELDOUT_PREFILL_CACHED = (64, 700, 1800, 5000, 10000, 20000, 28000)
HELDOUT_DECODE_BATCH = (5, 10, 20, 40, 80, 112, 144, 208, 240)
HELDOUT_DECODE_CONTEXT = (160, 320, 640, 1280, 2560, 5000, 10000, 20000, 28000)
HELDOUT_MIXED_CHUNK = (384, 768, 1536, 5120)
HELDOUT_MIXED_BATCH = (3, 12, 24, 48, 80, 160, 224)
HELDOUT_MIXED_PROMPT_MULTIPLES = (1, 3, 6, 12, 24)


# The refit keeps the hardware terms physical: HBM is never streamed at its peak. 0.90 of peak is
# what streaming kernels reach on H100/H200 (NVIDIA cites ~3 TB/s of 3.35; AIC's own decode
# attention reads KV at ~89%), so a fit that wants more (the H100's wants 1.004: one rate must
# cover AIC's weight streaming at ~76% and its KV reads at ~89%) is held there and the other
# three constants are refit around it.
PHYSICAL_BANDWIDTH_EFFICIENCY = 0.90


class Shape(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One grid point in AIC's terms; which fields matter depends on the family."""

    family: Family
    new_tokens: int = 0  # m: prefill and mixed
    cached_tokens: int = 0  # n: prefill
    batch: int = 0  # B: decode and mixed
    prompt_tokens: int = 0  # L: decode (each sequence's prompt) and mixed (the chunk's prompt)


class AicPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    shape: Shape
    aic_ms: float  # AIC's predicted step time

    @property
    def family(self) -> Family:
        return self.shape.family

    def measured(self) -> MeasuredPoint:
        """This point as calibrate's measured point: our shape for it (module docstring) and
        AIC's time as the measurement."""
        s, seconds = self.shape, self.aic_ms / 1e3
        if s.family == "prefill":
            return MeasuredPoint(0, 0, [MeasuredChunk(s.new_tokens, s.cached_tokens, True)], seconds)
        decode_kv = s.batch * (s.prompt_tokens + 1)
        if s.family == "decode":
            return MeasuredPoint(s.batch, decode_kv, [], seconds)
        chunk = MeasuredChunk(s.new_tokens, (s.prompt_tokens - s.new_tokens) // 2,
                              s.new_tokens == s.prompt_tokens)
        return MeasuredPoint(s.batch, decode_kv, [chunk], seconds)


class AicPoints(msgspec.Struct, forbid_unknown_fields=True):
    """AIC's answers for one profile's grid (the file --write-points writes, --points reads), and
    for the held-out grid (none in files written before it existed)."""

    profile: str
    aic_version: str
    backend: str
    backend_version: str  # the TensorRT-LLM version of AIC's kernel tables
    system: str
    model: str
    points: list[AicPoint]
    tensor_parallel: int = 1
    quantization: str = "bfloat16"  # AIC's gemm quant mode ("fp8": FP8 weights and KV)
    heldout: list[AicPoint] = msgspec.field(default_factory=list)

    def measurements(self) -> Measurements:
        return Measurements(f"AIConfigurator {self.aic_version} {self.system} {self.backend} "
                            f"{self.backend_version} ({self.model})", [p.measured() for p in self.points])


class AicError(Exception):
    """AIC is missing or cannot answer, or a points file does not fit; the message says which."""


def _blocks(profile: EngineProfile, tokens: int) -> int:
    return math.ceil(tokens / profile.engine.block_size)


def fits(profile: EngineProfile, shape: Shape) -> bool:
    """Whether a TensorRT-LLM worker with this profile can run the iteration: its KV in the
    cache's blocks, its tokens within max_num_tokens, its requests within max_batch_size. The
    mixed step's prompt counts whole (GUARANTEED_NO_EVICT reserves it before the first chunk)."""
    limits, capacity = profile.engine, profile.kv_capacity_blocks()
    if shape.family == "prefill":
        return (shape.new_tokens <= limits.max_num_tokens
                and _blocks(profile, shape.cached_tokens + shape.new_tokens) <= capacity)
    decode_blocks = shape.batch * _blocks(profile, shape.prompt_tokens + 1)
    if shape.family == "decode":
        return (shape.batch <= min(limits.max_batch_size, limits.max_num_tokens)
                and decode_blocks <= capacity)
    return (shape.new_tokens <= shape.prompt_tokens
            and shape.batch + 1 <= limits.max_batch_size
            and shape.batch + shape.new_tokens <= limits.max_num_tokens
            and decode_blocks + _blocks(profile, shape.prompt_tokens) <= capacity)


def _shapes(prefill_new: Sequence[int], prefill_cached: Sequence[int], decode_batch: Sequence[int],
            decode_context: Sequence[int], mixed_chunk: Sequence[int], mixed_batch: Sequence[int],
            mixed_multiples: Sequence[int]) -> list[Shape]:
    shapes = [Shape("prefill", new_tokens=m, cached_tokens=n)
              for n, m in itertools.product(prefill_cached, prefill_new)]
    shapes += [Shape("decode", batch=b, prompt_tokens=length)
               for length, b in itertools.product(decode_context, decode_batch)]
    shapes += [Shape("mixed", new_tokens=m, batch=b, prompt_tokens=k * m)
               for m, k, b in itertools.product(mixed_chunk, mixed_multiples, mixed_batch)
               if k * m <= MAX_CONTEXT]
    return shapes


def grid(profile: EngineProfile) -> list[Shape]:
    """Every family's grid points that `fits` the profile, in a fixed order."""
    shapes = _shapes(PREFILL_NEW, PREFILL_CACHED, DECODE_BATCH, DECODE_CONTEXT, MIXED_CHUNK, MIXED_BATCH,
                     MIXED_PROMPT_MULTIPLES)
    return [s for s in shapes if fits(profile, s)]


def heldout_grid(profile: EngineProfile) -> list[Shape]:
    """The held-out shapes (off the grid) that `fits` the profile."""
    shapes = _shapes(HELDOUT_PREFILL_NEW, HELDOUT_PREFILL_CACHED, HELDOUT_DECODE_BATCH,
                     HELDOUT_DECODE_CONTEXT, HELDOUT_MIXED_CHUNK, HELDOUT_MIXED_BATCH,
                     HELDOUT_MIXED_PROMPT_MULTIPLES)
    return [s for s in shapes if fits(profile, s)]


class AicTarget(msgspec.Struct, frozen=True):
    """What AIC is asked for: its system and model names, the TP degree and the quant modes."""

    system: str
    model: str
    tensor_parallel: int
    gemm: str  # "bfloat16" or "fp8"
    kv_cache: str
    fmha: str


def aic_target(profile: EngineProfile) -> AicTarget:
    """AIC's names and modes for a profile; AicError when AIC has no tables for it."""
    system = AIC_SYSTEMS.get(profile.hardware.name)
    model = AIC_MODELS.get(profile.model.name)
    if system is None or model is None:
        raise AicError(f"profile {profile.name!r}: AIC has no TensorRT-LLM tables mapped for "
                       f"{profile.hardware.name} / {profile.model.name}; mapped: "
                       f"{', '.join(AIC_SYSTEMS)} with {', '.join(AIC_MODELS)}")
    if profile.engine.cascade_attention:
        raise AicError(f"profile {profile.name!r} models vLLM's cascade attention; AIC's points "
                       "here are TensorRT-LLM's")
    precision = {1: "fp8", 2: "bfloat16"}
    gemm = precision.get(profile.model.bytes_per_param)
    kv = precision.get(profile.model.kv_bytes_per_element)
    if gemm is None or kv is None:
        raise AicError(f"profile {profile.name!r}: weights of {profile.model.bytes_per_param} and KV of "
                       f"{profile.model.kv_bytes_per_element} bytes; AIC is asked for bf16 (2) or FP8 (1)")
    return AicTarget(system, model, profile.tp, gemm, kv, kv)


def ask_aic(profile: EngineProfile, shapes: Sequence[Shape], heldout: Sequence[Shape] = ()) -> AicPoints:
    """AIC's step time for each shape, and for each held-out one (imports AIC here: the extra is
    optional)."""
    target = aic_target(profile)
    try:
        from importlib.metadata import version

        from aiconfigurator_core.sdk import perf_database
        from aiconfigurator_core.sdk.engine import EngineHandle
    except ImportError:
        raise AicError(f"{AIC_PACKAGE} is not installed: install it with `uv sync --extra aic`, or "
                       "pass --points FILE.json (docs/engine-aic/ ships AIC's points)") from None
    # The quant modes pinned (AIC would infer bf16 from these configs; FP8 must be asked for).
    handle = EngineHandle.compile(target.model, target.system, AIC_BACKEND, tp_size=target.tensor_parallel,
                                  gemm_quant_mode=target.gemm, kvcache_quant_mode=target.kv_cache,
                                  fmha_quant_mode=target.fmha)

    def answer(s: Shape) -> AicPoint:
        if s.family == "prefill":
            ms = handle.predict_prefill_latency(1, s.cached_tokens + s.new_tokens, s.cached_tokens)
        elif s.family == "decode":
            ms = handle.decode_step_latency(s.batch, s.prompt_tokens, 2)
        else:
            ms = handle.mixed_step_latency(s.new_tokens, s.batch, s.prompt_tokens, 2)
        if not ms > 0:
            raise AicError(f"AIC answered {ms} ms for {s}")
        return AicPoint(s, float(ms))

    return AicPoints(profile.name, version(AIC_PACKAGE), AIC_BACKEND,
                     perf_database.resolve_query_version(target.system, AIC_BACKEND, "current"),
                     target.system, target.model, [answer(s) for s in shapes], target.tensor_parallel,
                     target.gemm, [answer(s) for s in heldout])


def load_points(path: Path, profile: EngineProfile) -> AicPoints:
    try:
        points = msgspec.json.decode(path.read_bytes(), type=AicPoints)
    except OSError as exc:
        raise AicError(f"cannot read AIC points {path}: {exc.strerror}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise AicError(f"{path}: invalid AIC points: {exc}") from exc
    if points.profile != profile.name:
        raise AicError(f"{path} holds AIC points for profile {points.profile!r}, not {profile.name!r}; "
                       "pass the matching --profile")
    return points


def write_points(points: AicPoints, path: Path) -> None:
    """JSON with one point a line, so that a new AIC's answers diff point by point."""
    head = {f: getattr(points, f) for f in points.__struct_fields__ if f not in ("points", "heldout")}
    text = msgspec.json.format(msgspec.json.encode(head)).decode().removesuffix("\n}")

    def lines(name: str, values: list[AicPoint]) -> str:
        body = ",\n".join("    " + msgspec.json.encode(p).decode() for p in values)
        return f'  "{name}": [\n{body}\n  ]'

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{text},\n{lines("points", points.points)},\n{lines("heldout", points.heldout)}\n}}\n')


class FamilyStats(msgspec.Struct, frozen=True):
    family: str
    points: int
    median_before: float  # |model - AIC| / AIC with the profile as given
    p90_before: float
    median_after: float  # with the refitted constants
    p90_after: float
    residual_after: float  # median (model - AIC) / AIC after the refit: the family's bias
    meets_target: bool  # median and p90 after within TARGET_MEDIAN / TARGET_P90, held-out too
    heldout_points: int = 0  # the held-out shapes of the family (kept out of the fit)
    heldout_median_after: float | None = None
    heldout_p90_after: float | None = None


class ProfileComparison(msgspec.Struct, frozen=True):
    profile: str
    source: str  # AIC version, system, backend and its TensorRT-LLM version
    points: int
    before: dict[str, float]  # the four constants
    after: dict[str, float]
    # Efficiencies the fit put above their bound (1; the bandwidth's: PHYSICAL_BANDWIDTH_EFFICIENCY).
    clamped: list[str]
    families: list[FamilyStats]
    fit_mean_rel_error: float  # all families, after the refit
    meets_target: bool  # every family does


def _within(median: float, p90: float) -> bool:
    return median <= TARGET_MEDIAN and p90 <= TARGET_P90


def family_stats(before: EngineProfile, after: EngineProfile, points: Sequence[AicPoint],
                 heldout: Sequence[AicPoint] = ()) -> list[FamilyStats]:
    """Median and p90 |relative error| per family, for both profiles, over the same points; and
    the refit's over the held-out points."""
    measured = [p.measured() for p in points]
    aic_s = np.array([m.measured_s for m in measured])
    err_before, err_after = relative_errors(before, measured), relative_errors(after, measured)
    signed_after = model_times(after, measured) / aic_s - 1
    err_held = relative_errors(after, [p.measured() for p in heldout]) if heldout else np.array([])
    stats = []
    for family in FAMILIES:
        sel = np.array([p.family == family for p in points])
        if not sel.any():
            continue
        b, a = err_before[sel], err_after[sel]
        median_after, p90_after = float(np.median(a)), float(np.quantile(a, 0.9))
        held = err_held[np.array([p.family == family for p in heldout], dtype=bool)] if heldout else err_held
        held_median = float(np.median(held)) if held.size else None
        held_p90 = float(np.quantile(held, 0.9)) if held.size else None
        meets = _within(median_after, p90_after) and (
            held_median is None or held_p90 is None or _within(held_median, held_p90))
        stats.append(FamilyStats(
            family, int(sel.sum()), float(np.median(b)), float(np.quantile(b, 0.9)), median_after,
            p90_after, float(np.median(signed_after[sel])), meets, int(held.size), held_median, held_p90))
    return stats


def compare(base: EngineProfile, aic: AicPoints) -> tuple[ProfileComparison, EngineProfile]:
    """Refit ``base``'s four constants to AIC's points; the comparison and the refitted profile."""
    measurements = aic.measurements()
    result = calibrate(base, measurements, name=base.name,
                       max_bandwidth_efficiency=PHYSICAL_BANDWIDTH_EFFICIENCY)
    refit = result.profile
    families = family_stats(base, refit, aic.points, aic.heldout)
    comparison = ProfileComparison(
        base.name, measurements.hardware, len(aic.points), constants(base), constants(refit),
        list(result.clamped), families, result.after.mean_rel_error, all(f.meets_target for f in families))
    return comparison, refit


def constants(profile: EngineProfile) -> dict[str, float]:
    return {c: float(getattr(profile.cost, c)) for c in CONSTANTS}


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def markdown(comparisons: Sequence[ProfileComparison], command: str) -> str:
    lines = ["# Engine cost model vs AIConfigurator (TensorRT-LLM)", "",
             f"Produced by `{command}`. |relative error| = |model - AIC| / AIC per grid point; "
             f"target after the refit: median <= {TARGET_MEDIAN:.0%} and p90 <= {TARGET_P90:.0%} "
             "per profile and family. Median residual: median (model - AIC) / AIC, the family's bias.", "",
             "Held out: the refit against AIC's points for shapes off the grid, kept out of the fit.", "",
             "| profile | family | points | median before | p90 before | median after | p90 after | "
             "median residual after | held out: points | median | p90 | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        for f in c.families:
            held = (f"{f.heldout_points} | {_pct(f.heldout_median_after)} | {_pct(f.heldout_p90_after)}"
                    if f.heldout_median_after is not None and f.heldout_p90_after is not None
                    else "0 | - | -")
            lines.append(f"| {c.profile} | {f.family} | {f.points} | {_pct(f.median_before)} | "
                         f"{_pct(f.p90_before)} | {_pct(f.median_after)} | {_pct(f.p90_after)} | "
                         f"{f.residual_after:+.1%} | {held} | {'met' if f.meets_target else 'missed'} |")
    lines += ["", "| profile | constant | before | after |", "|---|---|---|---|"]
    for c in comparisons:
        for name in CONSTANTS:
            note = (" (held at the physical bound: the fit wanted more)" if name in c.clamped else "")
            lines.append(f"| {c.profile} | `{name}` | {c.before[name]:.4g} | {c.after[name]:.4g}{note} |")
    lines += [""] + [f"- {c.profile}: {c.points} points from {c.source}; mean |error| after the "
                     f"refit {_pct(c.fit_mean_rel_error)}" for c in comparisons]
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[tuple[EngineProfile, EngineProfile, AicPoints]], path: Path) -> None:
    """Model vs AIC, log-log, one panel per family; every profile before (hollow) and after the
    refit (filled)."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(16, 5.5))
    for ax, family in zip(axes, FAMILIES, strict=True):
        for i, (before, after, aic) in enumerate(runs):
            points = [p for p in aic.points if p.family == family]
            measured = [p.measured() for p in points]
            x = np.array([p.aic_ms for p in points])
            color = f"C{i}"
            ax.scatter(x, model_times(before, measured) * 1e3, s=10, facecolors="none",
                       edgecolors=color, alpha=0.5, lw=0.6, label=f"{before.name} before")
            ax.scatter(x, model_times(after, measured) * 1e3, s=8, color=color, alpha=0.8,
                       label=f"{after.name} refitted")
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(family)
        ax.set_xlabel("AIConfigurator step time (ms)")
        ax.set_ylabel("cost model step time (ms)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle("Engine cost model vs AIConfigurator's TensorRT-LLM tables")
    plots.save(fig, path)


def refit_yaml(base: EngineProfile, refit: EngineProfile, comparison: ProfileComparison,
               points: str, base_source: str = "") -> bytes:
    """The refit profile's YAML: what refit it, then the comments that opened the base profile's
    file (``base_source``: its path; they say where the profile came from)."""
    header = (f"# Refitted by `dynamo-ppd engine aic` from {base.name} and {points}:\n"
              f"# {comparison.points} points of {comparison.source};\n"
              f"# mean |relative error| {comparison.fit_mean_rel_error:.1%} after the refit.\n")
    path = Path(base_source)
    if base_source.endswith((".yaml", ".yml")) and path.is_file():
        lines = path.read_text().splitlines()
        opening = [line for line in itertools.takewhile(lambda line: line.startswith("#"), lines)]
        header += "".join(f"{line}\n" for line in opening)
    return header.encode() + dump_profile(refit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="append", required=True, metavar="PROFILE",
                        help="engine profile (bundled name or YAML path) to compare; repeat it to "
                        "compare several in one report and plot (the options below then repeat "
                        "in the same order)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--points", action="append", type=Path, metavar="FILE.json",
                        help="AIC's points for the profile, written earlier by --write-points (e.g. "
                        "docs/engine-aic/h100-llama3.1-8b.json); without it AIC is asked, which "
                        "needs the aic extra (`uv sync --extra aic`)")
    source.add_argument("--write-points", action="append", type=Path, metavar="FILE.json",
                        help="write AIC's answers for the profile's grid here")
    parser.add_argument("--refit", action="append", type=Path, metavar="OUT.yaml",
                        help="write the profile with its four efficiency constants refitted to "
                        "AIC's points here")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write DIR/comparison.md, DIR/comparison.json and DIR/predicted-vs-aic.png")


def _per_profile(args: argparse.Namespace, option: str, count: int) -> list:
    values = getattr(args, option.replace("-", "_")) or []
    if values and len(values) != count:
        raise AicError(f"--{option} is given {len(values)} times for {count} --profile; give it once "
                       "per --profile, in the same order")
    return values


def main(args: argparse.Namespace) -> int:
    """`dynamo-ppd engine aic`: 0 when the comparison ran, 2 with a one-line error."""
    try:
        profiles = [load_profile(p) for p in args.profile]
        files = _per_profile(args, "points", len(profiles))
        writes = _per_profile(args, "write-points", len(profiles))
        refits = _per_profile(args, "refit", len(profiles))
        if files:
            answers = [load_points(f, p) for f, p in zip(files, profiles, strict=True)]
        else:
            answers = [ask_aic(p, grid(p), heldout_grid(p)) for p in profiles]
    except (ProfileError, AicError) as exc:
        return cli_error(exc)
    for aic, path in zip(answers, writes, strict=False):
        write_points(aic, path)
        print(f"wrote {len(aic.points)} AIC points and {len(aic.heldout)} held-out ones to {path}")
    runs, comparisons = [], []
    for profile, aic in zip(profiles, answers, strict=True):
        comparison, refit = compare(profile, aic)
        runs.append((profile, refit, aic))
        comparisons.append(comparison)
    text = markdown(comparisons, "dynamo-ppd " + " ".join(sys.argv[1:]))
    print(text)
    for (base, refit, _), comparison, path, source, given in zip(
            runs, comparisons, refits, files or writes or ["AIC"] * len(refits), args.profile, strict=False):
        path.write_bytes(refit_yaml(base, refit, comparison, str(source), given))
        print(f"wrote {path}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "comparison.md").write_text(text)
        report = msgspec.json.format(msgspec.json.encode(comparisons))
        (args.out / "comparison.json").write_bytes(report + b"\n")
        plot(runs, args.out / "predicted-vs-aic.png")
        print(f"wrote {args.out}/comparison.md, comparison.json, predicted-vs-aic.png")
    return 0
