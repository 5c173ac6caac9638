"""Calibration: the fit recovers known cost constants from points the cost model generated, bad
points files fail with the field named, and the GPU script's --tiny CPU run feeds the fit."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from dynamo_ppd.calibration.fit import (
    CONSTANTS,
    CalibrationError,
    MeasuredChunk,
    MeasuredPoint,
    Measurements,
    add_arguments,
    calibrate,
    decode_measurements,
    main,
)
from dynamo_ppd.engine import CostModel, PrefillChunk, load_profile

ROOT = Path(__file__).resolve().parent.parent
BASE = load_profile("h100-llama3.1-8b")
TRUE = msgspec.structs.replace(BASE, cost=msgspec.structs.replace(
    BASE.cost, iteration_overhead_s=0.0017, memory_bandwidth_efficiency=0.80,
    gemm_flops_efficiency=0.70, attention_flops_efficiency=0.38))


def _shapes() -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
    """(num_decode, context per sequence, chunks): the regimes the GPU script measures."""
    shapes: list[tuple[int, int, list[tuple[int, int, bool]]]] = [
        (b, c, []) for b in (1, 8, 32, 64, 128, 256) for c in (1024, 2048, 4096, 8192) if b * c <= 524288]
    shapes += [(0, 0, [(n, 0, True)]) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
    shapes += [(0, 0, [(n, ctx, True)]) for n in (128, 512, 2048) for ctx in (4096, 16384, 32768)]
    shapes += [(b, 1024, [chunk]) for b in (32, 128) for chunk in ((128, 0, True), (1024, 0, True),
                                                                   (128, 8192, True))]
    shapes += [(64, 1024, [(1024, 0, True)] * 4)]
    return shapes


def synthetic(profile=TRUE, noise: float = 0.01, seed: int = 0) -> Measurements:
    rng, model = random.Random(seed), CostModel(profile)
    points = []
    for b, c, chunks in _shapes():
        t = model.iteration(b, b * c, [PrefillChunk(*ch) for ch in chunks]).total_s
        points.append(MeasuredPoint(b, b * c, [MeasuredChunk(*ch) for ch in chunks],
                                    t * (1 + rng.gauss(0, noise))))
    return Measurements("synthetic", points)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_perturbed_constants(seed):
    result = calibrate(BASE, synthetic(seed=seed), name="fitted")
    for field in CONSTANTS:
        fitted, true = getattr(result.profile.cost, field), getattr(TRUE.cost, field)
        assert fitted == pytest.approx(true, rel=0.05), field
    assert result.before.mean_rel_error > 0.05  # the base profile really was off
    assert result.after.mean_rel_error < 0.015 and result.after.max_rel_error < 0.05
    assert result.profile.name == "fitted" and not result.unidentified and not result.clamped
    assert result.profile.model == BASE.model and result.profile.engine == BASE.engine


@pytest.mark.unit
def test_noise_free_fit_is_exact():
    result = calibrate(BASE, synthetic(noise=0.0))
    assert result.after.max_rel_error < 1e-6
    assert result.profile.name == "h100-llama3.1-8b-calibrated"


@pytest.mark.unit
def test_decode_only_points_leave_compute_rates_unidentified():
    only_decode = Measurements("d", [p for p in synthetic().points if not p.prefill])
    result = calibrate(BASE, only_decode)
    assert set(result.unidentified) == {"gemm_flops_efficiency", "attention_flops_efficiency"}
    assert result.profile.cost.gemm_flops_efficiency == BASE.cost.gemm_flops_efficiency
    assert result.profile.cost.memory_bandwidth_efficiency == pytest.approx(0.80, rel=0.05)


@pytest.mark.unit
def test_impossible_speed_is_clamped_to_peak():
    fast = msgspec.structs.replace(TRUE, hardware=msgspec.structs.replace(
        TRUE.hardware, peak_memory_bandwidth_bytes_s=TRUE.hardware.peak_memory_bandwidth_bytes_s * 2))
    result = calibrate(BASE, synthetic(fast, noise=0.0))  # needs 160% of BASE's peak bandwidth
    assert "memory_bandwidth_efficiency" in result.clamped
    assert result.profile.cost.memory_bandwidth_efficiency == 1.0


def _point(**overrides) -> dict:
    point = {"num_decode": 4, "decode_context_tokens": 4096,
             "prefill": [{"new_tokens": 128, "context_tokens": 0, "samples": True}], "measured_s": 0.01}
    point.update(overrides)
    return point


@pytest.mark.parametrize(("points", "message"), [
    ([_point(num_decode="4")] * 4, r"Expected `int`, got `str` - at `\$.points\[0\].num_decode`"),
    ([_point()] * 3 + [_point(measured_s=0)], r"Expected `float` >= 0.0|Expected `float` > 0.0"),
    ([_point(prefill=[{"new_tokens": 128, "context_tokens": 0}])] * 4, r"missing required field `samples`"),
    ([_point(extra=1)] * 4, r"unknown field `extra`"),
    ([_point()] * 3 + [_point(num_decode=0, decode_context_tokens=0, prefill=[])],
     r"\$.points\[3\]` has no work"),
    ([_point()] * 3, r"3 points cannot determine 4 constants"),
])
@pytest.mark.unit
def test_bad_points_name_the_field(points, message):
    with pytest.raises(CalibrationError, match=message):
        decode_measurements(json.dumps({"hardware": "x", "points": points}).encode(), "p.json")


@pytest.mark.unit
def test_missing_hardware_and_bad_json():
    with pytest.raises(CalibrationError, match="missing required field `hardware`"):
        decode_measurements(b'{"points": []}')
    with pytest.raises(CalibrationError, match="p.json: invalid measured points: Input data was truncated"):
        decode_measurements(b"{", "p.json")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.unit
def test_cli_writes_a_loadable_profile(tmp_path, capsys):
    points = tmp_path / "points.json"
    points.write_bytes(msgspec.json.encode(synthetic()))
    out = tmp_path / "fitted.yaml"
    assert main(_parse("--profile", "h100-llama3.1-8b", "--points", str(points), "--out", str(out),
                       "--name", "h100-fitted")) == 0
    printed = capsys.readouterr().out
    assert "mean before" in printed and "memory_bandwidth_efficiency" in printed
    assert out.read_text().startswith("# Calibrated by `dynamo-ppd engine calibrate`")
    fitted = load_profile(out)
    assert fitted.name == "h100-fitted"
    assert fitted.cost.gemm_flops_efficiency == pytest.approx(0.70, rel=0.05)


@pytest.mark.unit
def test_cli_reports_bad_files(tmp_path, capsys):
    assert main(_parse("--profile", "h100-llama3.1-8b", "--points", str(tmp_path / "none.json"))) == 2
    assert "cannot read measured points" in capsys.readouterr().err


@pytest.mark.e2e
def test_gpu_script_tiny_cpu_run_feeds_the_fit(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "tiny.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_calibrate.py"), "--tiny", "--device", "cpu",
                    "--repeats", "3", "--out", str(out)], check=True, timeout=120)
    measurements = decode_measurements(out.read_bytes(), str(out))
    assert {p.category for p in measurements.points} == {"decode", "prefill", "mixed"}
    tiny = msgspec.structs.replace(BASE, name="tiny-cpu", model=msgspec.structs.replace(
        BASE.model, name="tiny", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=2,
        head_dim=32, intermediate_size=768, vocab_size=2048))
    result = calibrate(tiny, measurements)
    assert result.after.mean_rel_error <= result.before.mean_rel_error
