"""The interference micro-benchmark on the engine model: append-prefill must disturb decoding less
than full prefill, full prefill must hurt more with longer context, and the outputs keep their
schema."""

from __future__ import annotations

import argparse
import json

import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.sim import interference

BATCHES = (1, 100, 200)
CONTEXTS = (2048, 8192, 32768)


@pytest.fixture(scope="module")
def points() -> list[interference.InterferencePoint]:
    return interference.sweep(load_profile("h100-llama3.1-8b"), batches=BATCHES, contexts=CONTEXTS,
                              min_steps=16)


def _by(points, kind, k=None, context=None):
    return {(p.concurrent, p.decode_batch, p.context_tokens): p for p in points
            if p.kind == kind and (k is None or p.concurrent == k)
            and (context is None or p.context_tokens == context)}


def test_append_disturbs_less_than_full_at_every_point(points):
    full, append = _by(points, "full"), _by(points, "append")
    assert full.keys() == append.keys() and len(full) == 2 * len(BATCHES) + len(CONTEXTS)
    for key, f in full.items():
        assert append[key].slowdown < f.slowdown, key
        assert append[key].baseline_tpot_ms == f.baseline_tpot_ms  # same no-prefill baseline


def test_prefill_slows_decoding_and_more_clients_slow_it_more(points):
    for p in points:
        assert p.tpot_ms > p.baseline_tpot_ms > 0
    for kind in ("full", "append"):
        one, four = _by(points, kind, k=1, context=1024), _by(points, kind, k=4, context=1024)
        for batch in BATCHES:
            assert four[(4, batch, 1024)].slowdown > one[(1, batch, 1024)].slowdown


def test_baseline_grows_with_batch(points):
    base = sorted({(p.decode_batch, p.baseline_tpot_ms) for p in points if p.context_tokens == 1024})
    assert [b for _, b in base] == sorted(b for _, b in base)


def test_full_slowdown_grows_with_context(points):
    full = sorted((p.context_tokens, p.slowdown) for p in points
                  if p.kind == "full" and p.context_tokens in CONTEXTS)
    assert [c for c, _ in full] == list(CONTEXTS)
    slowdowns = [s for _, s in full]
    assert slowdowns == sorted(slowdowns) and slowdowns[-1] > 2 * slowdowns[0]


def test_append_actually_hits_the_cache():
    # measure_tpot raises if an append request recomputed its context; a full prefill of the
    # same total length must cost far more.
    profile = load_profile("h100-llama3.1-8b")
    append = interference.measure_tpot(profile, 8, kind="append", context_tokens=4096, min_steps=8)
    full = interference.measure_tpot(profile, 8, kind="full", context_tokens=4096 + 128, min_steps=8)
    assert full > 3 * append


def test_batch_zero_is_rejected():
    with pytest.raises(ValueError, match="no TPOT"):
        interference.measure_tpot(load_profile("h100-llama3.1-8b"), 0)


def test_paper_figures_sit_beside_matching_points():
    point = interference.InterferencePoint("full", 1, 200, 1024, 1.0, 2.0, 1.0)
    assert interference.paper_figure(point, 64) == "+48%"
    ctx = interference.InterferencePoint("append", 1, 64, 65536, 1.0, 1.1, 0.1)
    assert "25%" in interference.paper_figure(ctx, 64)
    assert interference.paper_figure(ctx, 32) == ""


def test_cli_writes_exact_json_and_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(interference, "QUICK_BATCHES", (50,))
    monkeypatch.setattr(interference, "QUICK_CONTEXTS", (2048, 4096))
    parser = argparse.ArgumentParser()
    interference.add_arguments(parser)
    out_json, out_png = tmp_path / "points.json", tmp_path / "fig.png"
    args = parser.parse_args(["--quick", "--json", str(out_json), "--png", str(out_png),
                              "--context-batch", "16"])
    assert interference.main(args) == 0
    printed = capsys.readouterr().out
    assert "slowdown" in printed and "+48%" not in printed  # batch 200 not in this sweep

    data = json.loads(out_json.read_text())
    assert set(data) == {"profile", "points"} and data["profile"] == "h100-llama3.1-8b"
    assert len(data["points"]) == 2 * 2 * 1 + 2 * 2
    types = {"kind": str, "concurrent": int, "decode_batch": int, "context_tokens": int,
             "baseline_tpot_ms": float, "tpot_ms": float, "slowdown": float}
    for point in data["points"]:
        assert set(point) == set(types)
        for key, typ in types.items():
            assert type(point[key]) is typ, (key, point[key])
        assert point["kind"] in ("full", "append")
        assert point["slowdown"] == pytest.approx(point["tpot_ms"] / point["baseline_tpot_ms"] - 1,
                                                  abs=1e-3)
    assert {p["decode_batch"] for p in data["points"] if p["context_tokens"] > 1024} == {16}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_unknown_profile_is_a_clear_error(capsys):
    parser = argparse.ArgumentParser()
    interference.add_arguments(parser)
    assert interference.main(parser.parse_args(["--profile", "nope"])) == 2
    assert "no engine profile named 'nope'" in capsys.readouterr().err
