"""The interference micro-benchmark on the engine model. Closed loop: append-prefill must disturb
decoding less than full prefill, full prefill must hurt more with longer context. Paper protocol:
the authors' batch-sent-together benchmark, its measured data and the figure beside it. Both keep
the InterferencePoint schema."""

from __future__ import annotations

import argparse
import json

import msgspec
import pytest

from dynamo_ppd.engine import load_profile
from dynamo_ppd.paper import interference
from dynamo_ppd.paper import interference_paper as paper

pytestmark = pytest.mark.unit

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


POINT_TYPES = {"kind": str, "concurrent": int, "decode_batch": int, "context_tokens": int,
               "baseline_tpot_ms": float, "tpot_ms": float, "slowdown": float}


def _assert_point_schema(points):
    assert points
    for point in points:
        assert set(point) == set(POINT_TYPES)
        for key, typ in POINT_TYPES.items():
            assert type(point[key]) is typ, (key, point[key])
        assert point["kind"] in ("full", "append")
        assert point["slowdown"] == pytest.approx(point["tpot_ms"] / point["baseline_tpot_ms"] - 1,
                                                  abs=1e-3)


def test_cli_writes_exact_json_and_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(interference, "QUICK_BATCHES", (50,))
    monkeypatch.setattr(interference, "QUICK_CONTEXTS", (2048, 4096))
    parser = argparse.ArgumentParser()
    interference.add_arguments(parser)
    out_json, out_png = tmp_path / "points.json", tmp_path / "fig.png"
    args = parser.parse_args(["--protocol", "closed-loop", "--quick", "--json", str(out_json),
                              "--png", str(out_png), "--context-batch", "16"])
    assert interference.main(args) == 0
    printed = capsys.readouterr().out
    assert "slowdown" in printed and "+48%" not in printed  # batch 200 not in this sweep

    data = json.loads(out_json.read_text())
    assert set(data) == {"profile", "points", "protocol"} and data["profile"] == "h100-llama3.1-8b"
    assert data["protocol"] == "closed-loop"
    assert len(data["points"]) == 2 * 2 * 1 + 2 * 2
    _assert_point_schema(data["points"])
    assert {p["decode_batch"] for p in data["points"] if p["context_tokens"] > 1024} == {16}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_unknown_profile_is_a_clear_error(capsys):
    parser = argparse.ArgumentParser()
    interference.add_arguments(parser)
    assert interference.main(parser.parse_args(["--profile", "nope"])) == 2
    assert "no engine profile named 'nope'" in capsys.readouterr().err


# -- the paper's protocol ------------------------------------------------------------------------
PAPER_PROFILE = "h100-llama3.1-8b-vllm-paper"


def test_paper_protocol_points_have_the_closed_loop_schema():
    points = interference.sweep_paper(load_profile(PAPER_PROFILE), batches=(10, 30), prefill_counts=(1, 2))
    assert [(p.kind, p.concurrent, p.decode_batch) for p in points] == [
        (kind, k, batch) for batch in (10, 30) for k in (1, 2) for kind in ("full", "append")]
    _assert_point_schema([msgspec.to_builtins(p) for p in points])
    for p in points:
        assert p.context_tokens == (1024 if p.kind == "full" else 2048)
        assert p.tpot_ms > p.baseline_tpot_ms > 0  # a 64-token prefill request decodes beside the batch
    base = {p.decode_batch: p.baseline_tpot_ms for p in points}
    assert base[30] > base[10]  # one baseline per decode batch, growing with it


def test_full_prefill_slows_decode_more_than_append_at_batch_200_once_it_spills_into_decode_steps():
    profile = load_profile(PAPER_PROFILE)
    base = paper.run_batch(profile, 200)
    full = paper.run_batch(profile, 200, "full", 4)
    append = paper.run_batch(profile, 200, "append", 4)
    # 200 x 32 + 4 x 1024 tokens exceed the 8192-token budget: part of the full prefills runs in
    # iterations where the decodes already stream, and costs them more than 4 appends of 128.
    assert full.decode_avg_tpot_s > append.decode_avg_tpot_s > base.decode_avg_tpot_s


def test_one_full_prefill_switches_cascade_attention_off_for_the_whole_batch():
    # The measured +117% at batch 200: the decodes share the cached context, so vLLM's cascade
    # attention reads it once per step; the full prefill (which then decodes its 64 tokens
    # beside them) shares nothing, so every step re-reads 200 x 2048 tokens of KV. An append
    # shares the context and leaves cascade on.
    profile = load_profile(PAPER_PROFILE)
    assert profile.engine.cascade_attention
    base, full = paper.run_batch(profile, 200), paper.run_batch(profile, 200, "full", 1)
    append = paper.run_batch(profile, 200, "append", 1)
    low, high = paper.DONE_WHEN["full"]
    assert low <= full.decode_avg_tpot_s / base.decode_avg_tpot_s - 1 <= high
    assert append.decode_avg_tpot_s / base.decode_avg_tpot_s - 1 <= paper.DONE_WHEN["append"][1]
    assert full.prefill_avg_ttft_s == pytest.approx(full.decode_avg_ttft_s)  # the same iteration
    # Without cascade the full prefill lands in TTFT only: it fits the first iteration with the
    # decodes' 32-token appends and is one short row of the decode steps after that.
    off = msgspec.structs.replace(profile, engine=msgspec.structs.replace(profile.engine,
                                                                          cascade_attention=False))
    base, full = paper.run_batch(off, 200), paper.run_batch(off, 200, "full", 1)
    assert full.decode_avg_ttft_s - base.decode_avg_ttft_s > 0.01
    assert full.decode_avg_tpot_s / base.decode_avg_tpot_s - 1 < 0.02
    # Below vLLM's kernel-count rule (pure decode steps of 10 requests over 2048 tokens:
    # FlashDecoding) there is no cascade to lose, as in the data (+2% at batch 10).
    small = paper.run_batch(profile, 10, "full", 1).decode_avg_tpot_s
    assert small / paper.run_batch(profile, 10).decode_avg_tpot_s - 1 < 0.05


def test_paper_batch_rejects_no_decodes_and_unknown_kinds():
    profile = load_profile(PAPER_PROFILE)
    with pytest.raises(ValueError, match="no TPOT"):
        paper.run_batch(profile, 0, "full", 1)
    with pytest.raises(ValueError, match="unknown prefill kind"):
        paper.run_batch(profile, 8, "partial", 1)
    with pytest.raises(ValueError, match="max_batch_size"):
        paper.run_batch(load_profile("h100-llama3.1-8b"), 255, "full", 4)  # TensorRT-LLM's 256


def test_measured_data_loads_with_its_protocol():
    measured = paper.load_measured()
    # 25 decode batches (10..250) x (decode only + full/append x 1, 2, 4 prefills), 5 repeats each
    assert len(measured) == 25 * 7 and {m.repeats for m in measured.values()} <= {4, 5}
    base, full, append = (measured[(None, 0, 200)], measured[("full", 1, 200)],
                          measured[("append", 1, 200)])
    assert base.repeats == 5 and base.min_tpot_ms <= base.mean_tpot_ms <= base.max_tpot_ms
    assert base.mean_tpot_ms == pytest.approx(38.36, abs=0.01)
    assert paper.measured_slowdown(measured, "full", 1, 200) == pytest.approx(1.17, abs=0.01)
    assert paper.measured_slowdown(measured, "append", 1, 200) == pytest.approx(0.09, abs=0.01)
    assert full.mean_tpot_ms > 1.5 * append.mean_tpot_ms
    assert paper.measured_slowdown(measured, "full", 1, 260) is None
    sens_base, by_length = paper.load_sensitivity()
    assert sens_base.decode_count == 64 and sorted(by_length) == list(paper.SENSITIVITY_APPEND_TOKENS)


def test_measured_data_of_another_protocol_is_refused(tmp_path):
    data = json.loads(paper.MEASURED_CORE.read_text())
    data["append_prefill_config"]["input"] = 1024  # the authors' later revision of the script
    other = tmp_path / "core.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="append_prefill_config"):
        paper.load_measured(other)


def test_paper_cli_writes_json_png_and_the_done_when_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(paper, "QUICK_BATCHES", (20, 200))
    monkeypatch.setattr(paper, "QUICK_PREFILL_COUNTS", (1,))
    parser = argparse.ArgumentParser()
    interference.add_arguments(parser)
    out_json, out_png = tmp_path / "paper.json", tmp_path / "paper.png"
    args = parser.parse_args(["--quick", "--profile", PAPER_PROFILE, "--json", str(out_json),
                              "--png", str(out_png)])
    assert args.protocol == "paper"  # the default
    assert interference.main(args) == 0
    printed = capsys.readouterr().out
    assert "meas_slow" in printed and "+116.8%" in printed  # the measured point beside the model's
    assert "batch 200, 1 full prefill: model" in printed and "+24%..+96%" in printed
    assert "batch 200, 1 append prefill: model" in printed
    data = json.loads(out_json.read_text())
    assert data["protocol"] == "paper" and data["profile"] == PAPER_PROFILE
    _assert_point_schema(data["points"])
    assert {(p["kind"], p["decode_batch"]) for p in data["points"]} == {
        (kind, batch) for kind in ("full", "append") for batch in (20, 200)}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000
