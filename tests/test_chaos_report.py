"""The chaos report's arithmetic (pure) and the client's verdict on one answer."""

from __future__ import annotations

import msgspec
import pytest

from dynamo_ppd.chaos.client import _Answer, turn_status
from dynamo_ppd.chaos.report import Fault, TurnRecord, analyze, markdown, p99, passed, served_decode_local

pytestmark = pytest.mark.unit


def turn(sent: float, *, local: bool | None = True, ttft: float = 0.1, status: str = "ok",
         turn_no: int = 2, conv: str = "c") -> TurnRecord:
    prev = 1000
    cached = None if local is None else (1200 if local else 960)
    return TurnRecord(conv, turn_no, sent, status, 100, 100 if status == "ok" else 10, ttft, 1.0,
                      "length", 1400, cached, prev if turn_no > 1 else None)


def test_decode_local_is_told_by_cached_tokens_beyond_the_previous_prompt():
    assert served_decode_local(turn(1, local=True)) is True
    assert served_decode_local(turn(1, local=False)) is False  # prefill's cache: at most the previous prompt
    assert served_decode_local(turn(1, local=None)) is None
    assert served_decode_local(turn(1, turn_no=1)) is None  # a first turn is no follow-up
    assert served_decode_local(turn(1, status="truncated")) is None


def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([1.0] * 50 + [9.0]) == 9.0  # with 51 samples the worst one is the p99


def test_failures_truncations_added_ttft_and_recovery():
    # Before: a warm-up of via-prefill follow-ups, then 10 s all decode-local; p99 TTFT 0.1 s.
    records = [turn(t, ttft=0.1, local=t >= 10) for t in range(0, 20)]
    records.append(turn(20.2, status="failed", ttft=0.0, local=None))
    records.append(turn(20.4, status="truncated"))
    # After the fault at 20 s: 6 s of via-prefill follow-ups with slow first tokens, then back.
    records += [turn(20 + 0.5 * k, local=False, ttft=0.9) for k in range(1, 12)]
    records += [turn(26 + 0.5 * k, local=True, ttft=0.1) for k in range(0, 40)]
    fault = Fault("decode-kill", "decode-1", 20.0, "1P3D", 2.5, target_inflight=3)
    result = analyze(records, fault, window_s=20, recovery_window_s=5, tolerance=0.05, step_s=0.5)
    assert (result.failed, result.truncated, result.requests) == (1, 1, len(records))
    # The baseline is the recovery window just before the fault: the warm-up does not lower it.
    assert result.decode_local_before == 1.0 and result.follow_ups_before == 5
    assert result.ttft_p99_before_s == pytest.approx(0.1)
    assert result.ttft_p99_after_s == pytest.approx(0.9)
    assert result.added_ttft_p99_s == pytest.approx(0.8)
    # The first 5-s window at >= 95% decode-local starts when the via-prefill turns are over.
    assert result.recovery_s == pytest.approx(6.0)
    assert result.decode_local_after == 1.0
    assert not passed(result)
    table = markdown([result])
    assert "| decode-kill | 1P3D | decode-1 (3) | 2.50 s |" in table and "| 6.00 s |" in table


def test_a_share_that_never_comes_back_is_not_recovered():
    records = [turn(t) for t in range(0, 20)] + [turn(20 + k, local=k % 2 == 0) for k in range(30)]
    result = analyze(records, Fault("etcd-restart", "etcd", 20.0), recovery_window_s=10)
    assert result.recovery_s is None
    assert result.decode_local_after == pytest.approx(0.5)
    assert "not recovered" in markdown([result])
    assert passed(result)  # nothing failed: the target is about requests, recovery is reported


def test_an_unaffected_run_recovers_at_once():
    records = [turn(0.5 * k, local=k % 10 != 0) for k in range(120)]  # 90% decode-local throughout
    result = analyze(records, Fault("nats-restart", "nats-server", 30.0), recovery_window_s=10)
    assert result.recovery_s == 0.0
    assert result.decode_local_before == pytest.approx(0.9)


def answer(tokens: int, *, ttft: float | None = 0.1, finish: str | None = "length",
           error: str | None = None, usage: bool = True) -> _Answer:
    a = _Answer()
    a.ttft, a.finish_reason, a.error, a.chunks = ttft, finish, error, tokens
    a.usage = {"completion_tokens": tokens} if usage else None
    return a


def test_classify_an_answer():
    assert turn_status(answer(64), 64, 1.0) == ("ok", 64)
    assert turn_status(answer(0, ttft=None, error="HTTP 503: no workers"), 64, 0.1) == ("failed", 0)
    assert turn_status(answer(20, finish=None, usage=False), 64, 1.0) == ("truncated", 20)  # stream cut
    assert turn_status(answer(64, error="error event: worker died"), 64, 1.0)[0] == "truncated"
    assert turn_status(answer(40), 64, 1.0) == ("truncated", 40)  # ignore_eos: short = cut
    assert turn_status(answer(64), 64, 61.0)[0] == "truncated"  # past the client's timeout


def test_router_counter_deltas_sum_replicas_and_survive_a_restart():
    from dynamo_ppd.chaos.report import counter_delta

    before = {"router-0@10": {"ppd_migrations_total": 2.0, "ppd_rehomes_total": 5.0},
              "router-1@11": {"ppd_migrations_total": 1.0}}
    after = {"router-0@10": {"ppd_migrations_total": 3.0, "ppd_rehomes_total": 5.0},
             "router-1@12": {"ppd_migrations_total": 4.0}}  # router-1 restarted (new pid): from 0
    assert counter_delta(before, after) == {"ppd_migrations_total": 5.0}


def test_reanalyze_recomputes_a_report_from_its_records(tmp_path):
    import msgspec

    from dynamo_ppd.chaos.report import REPORT_VERSION, ChaosReport
    from dynamo_ppd.cli import main

    records = [turn(t, local=t >= 10) for t in range(20)] + [turn(20 + k, local=True) for k in range(30)]
    fault = Fault("etcd-restart", "etcd", 20.0, "1P3D", 1.0)
    old = msgspec.structs.replace(analyze(records, fault, recovery_window_s=20),
                                  router_counters={"ppd_rehomes_total": 3.0})
    assert old.decode_local_before == 0.5  # a 20-s baseline reaches into the warm-up
    out = tmp_path / "chaos"
    report = ChaosReport(REPORT_VERSION, "dynamo-ppd chaos", "wildchat", 2.0, 90.0, 20.0, 20.0, 0.05, [old])
    out.with_suffix(".json").write_bytes(msgspec.json.encode(report))
    (tmp_path / "chaos-records.json").write_bytes(msgspec.json.encode({"etcd-restart": records}))
    out.with_suffix(".md").write_text("old\n<!-- notes: kept when the report is rewritten -->\nmy notes\n")
    assert main(["chaos", "--reanalyze", "--out", str(out), "--recovery-window", "10"]) == 0
    new = msgspec.json.decode(out.with_suffix(".json").read_bytes(), type=ChaosReport)
    (result,) = new.results
    assert result.decode_local_before == 1.0 and new.recovery_window_s == 10.0
    assert result.router_counters == {"ppd_rehomes_total": 3.0}  # measured, not recomputable: kept
    text = out.with_suffix(".md").read_text()
    assert "| etcd-restart | 1P3D | etcd |" in text and text.endswith("my notes\n")


def test_the_settled_share_counts_follow_ups_sent_ten_seconds_after_the_target_was_back():
    # Killed at 20 s, back 2 s later: follow-ups sent from 32 s on are the settled ones.
    records = [turn(t, local=t < 20 or t >= 31) for t in range(0, 40)]
    result = analyze(records, Fault("picker-kill", "picker", 20.0, back_after_s=2.0))
    assert (result.decode_local_settled, result.follow_ups_settled) == (1.0, 8)  # 32..39
    assert "10 s or more after picker was back: 100% decode-local (8)" in markdown([result])
    late = analyze(records, Fault("picker-kill", "picker", 20.0, back_after_s=11.5))
    assert late.follow_ups_settled == 0 and late.decode_local_settled is None


def served(conv: str, turn_no: int, sent: float, decode: int | None, prefill: int | None = None,
           status: str = "ok") -> TurnRecord:
    """A turn as the workers Dynamo named served it (``nvext.worker_id``)."""
    return TurnRecord(conv, turn_no, sent, status, 100, 100, 0.1, 1.0, "length", 1400, 0, 1000,
                      decode_worker=decode, prefill_worker=prefill)


def test_the_workers_dynamo_names_tell_decode_local_over_cached_tokens():
    assert served_decode_local(served("c", 2, 1.0, decode=7)) is True  # no prefill worker
    assert served_decode_local(served("c", 2, 1.0, decode=7, prefill=3)) is False
    assert served_decode_local(served("c", 1, 1.0, decode=7, prefill=3)) is None
    # Behind the relay router the frontend names the router as both: the cached tokens tell.
    relayed = msgspec.structs.replace(served("c", 2, 1.0, decode=4, prefill=4), cached_tokens=1200)
    assert served_decode_local(relayed) is True
    assert served_decode_local(msgspec.structs.replace(relayed, cached_tokens=900)) is False


def test_a_planned_change_gives_its_shares_the_joining_workers_and_the_moved_sessions():
    from dynamo_ppd.chaos.report import ChangeStep, change_figures, planned_markdown

    # Decode worker 1 leaves at 30 s (drained by 34 s), decode worker 9 joins ready at 36 s.
    steps = [ChangeStep("retire", "decode-1", 30.0, 34.0, instance=1, configuration="1P2D", seen_s=30.4),
             ChangeStep("add", "decode-3", 34.0, 36.0, instance=9, configuration="1P3D", seen_s=36.5)]
    records = [served("a", 1, 10.0, 1, 5), served("a", 2, 20.0, 1), served("a", 3, 32.0, 2, 5),  # moved: via
               served("b", 1, 11.0, 1, 5), served("b", 2, 40.0, 2),  # moved: decode-local elsewhere
               served("c", 1, 12.0, 2, 5), served("c", 2, 31.0, 2),  # on a worker that stayed
               served("d", 2, 25.0, 2), served("d", 3, 50.0, 2)]
    records += [served(f"n{k}", 1, 37.0 + k, 9 if k < 3 else 2, 5) for k in range(6)]  # 3 of 6 on the new one
    fault = Fault("ratio-change", "1P3D -> 2P2D -> back", 30.0, "1P3D", back_after_s=6.0)
    figures = change_figures(records, fault, steps)
    assert (figures["decode_local_during"], figures["follow_ups_during"]) == (0.5, 2)  # c's 31 s, a's 32 s
    assert (figures["decode_local_since"], figures["follow_ups_since"]) == (1.0, 2)  # b's 40 s, d's 50 s
    assert figures["joined_conversations"] == 6 and figures["joined_share"] == 0.5
    assert figures["joined_fair_share"] == pytest.approx(1 / 3)
    assert (figures["moved_sessions"], figures["moved_local"], figures["moved_via_prefill"],
            figures["moved_not_ok"]) == (2, 1, 1, 0)
    assert [s.switch_s for s in steps] == [0.4, 0.5]  # from the SIGTERM; from the new worker's readiness
    result = msgspec.structs.replace(analyze(records, fault), steps=steps, **figures)
    table = planned_markdown([result])
    assert "| ratio-change | 1P3D | 1P3D -> 2P2D -> back | 6.00 s |" in table and "| 0.50 s |" in table
    assert "took 50% of the 6 conversations" in table and "(fair share 33%)" in table
    assert "2 sessions last served by a decode worker that left went on: 1 decode-local, 1 through" in table
    assert "| ratio-change |" in markdown([result])


def test_a_steps_configuration_is_looked_for_until_the_next_step_begins():
    from dynamo_ppd.chaos.planned import Change
    from dynamo_ppd.chaos.report import ChangeStep, mark_seen

    # Surge first: 1P4D lasts a tenth of a second before the old worker's SIGTERM; the next
    # replacement brings 1P4D back later, which is not the first one's.
    change = Change("rolling-restart", "every worker", [
        ChangeStep("add", "decode-3", 43.3, 44.2, configuration="1P4D"),
        ChangeStep("retire", "decode-0", 44.3, 49.2, configuration="1P3D"),
        ChangeStep("add", "decode-4", 51.2, 52.8, configuration="1P4D")],
        configurations=[(1.3, "1P3D", "profile"), (53.0, "1P4D", "profile")])
    mark_seen(change.steps, change.configurations)
    # 1P4D passed unseen; 1P3D again is what the routing was deciding in all along: seen at once.
    assert [s.seen_s for s in change.steps] == [None, 44.3, 53.0]
    assert change.steps[1].switch_s == 0.0
    change.configurations.insert(1, (44.0, "1P4D", "profile"))  # had it seen the passing 1P4D
    change.configurations.insert(2, (44.5, "1P3D", "profile"))
    mark_seen(change.steps, change.configurations)
    assert [s.seen_s for s in change.steps] == [44.0, 44.5, 53.0]
    assert change.steps[1].switch_s == pytest.approx(0.2)
