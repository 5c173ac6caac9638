"""The relay benchmark's paired ratio: each system against the bare relay of the same round."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo_ppd.bench.cpu import process_cpu_s, thread_cpu_s
from dynamo_ppd.bench.relay import LEAN_ROUTER_ARGS, Run, paired_ratios, thread_breakdown

pytestmark = pytest.mark.unit


def _run(system: str, cpu_s: float, round_: int, tokens: int = 1000) -> Run:
    return Run(system, 1, 2.0, {"router": cpu_s}, tokens, 10, 0, 30.0, round=round_)


def test_each_round_is_compared_with_its_own_relay_run():
    # Round 0 ran on a busier machine (everything cheaper per token): its ppd/relay is 1.2, round
    # 1's is 1.1; an unpaired mean of means would say (0.12 + 0.22) / (0.10 + 0.20) = 1.13.
    runs = [_run("ppd", 0.12, 0), _run("relay", 0.10, 0), _run("ppd", 0.22, 1), _run("relay", 0.20, 1)]
    lines = paired_ratios(runs)
    row = next(line for line in lines if line.startswith("| ppd |"))
    assert row == "| ppd | 1 | 2 | 1 | 2 | 1.15 [1.10-1.20] |"


def test_no_relay_run_no_ratio():
    assert paired_ratios([_run("ppd", 0.12, 0), _run("pd", 0.10, 0)]) == []


def test_thread_breakdown_splits_the_relay_cpu_by_thread_per_token():
    threads = {"router": {"python": 0.10, "tokio-rt-worker": 0.25, "grpc_global_tim": 0.01,
                          "event_engine": 0.02}}
    runs = [Run("ppd", 1, 2.0, {"router": 0.38}, 1000, 10, 0, 30.0, threads_cpu_s=threads),
            Run("pd", 1, 2.0, {"frontend": 0.1}, 1000, 10, 0, 30.0)]  # no relay process: no row
    lines = thread_breakdown(runs)
    assert [line for line in lines if line.startswith("| ppd")] == ["| ppd | 1 | 2 | 1 | 100 | 250 | 30 |"]
    assert not any(line.startswith("| pd ") for line in lines)
    assert thread_breakdown([Run("pd", 1, 2.0, {}, 1000, 10, 0, 30.0)]) == []


def test_this_process_threads_are_read_by_name():
    import threading

    done = threading.Event()
    worker = threading.Thread(target=done.wait, name="x")
    worker.start()
    try:
        by_name = thread_cpu_s(os.getpid())
    finally:
        done.set()
        worker.join()
    main_name = Path("/proc/self/comm").read_text().strip()  # the main thread's name
    assert main_name in by_name
    assert sum(by_name.values()) <= process_cpu_s(os.getpid()) + 0.05
    assert all(cpu >= 0 for cpu in by_name.values())


def test_the_lean_router_runs_without_both_subscriptions():
    from dynamo_ppd.routing.args import parse_args

    lean = parse_args(LEAN_ROUTER_ARGS)
    assert (lean.load_reports, lean.residency_recovery) == (False, False)
    default = parse_args([])
    assert (default.load_reports, default.residency_recovery) == (True, True)


def test_with_relay_pd_runs_the_router_is_also_compared_with_its_own_routes_through_a_bare_relay():
    from dynamo_ppd.bench.relay import render

    runs = [_run("ppd", 0.15, 0), _run("relay", 0.10, 0), _run("relay-pd", 0.12, 0)]
    text = render(runs, {})
    assert "(relay = 1)" in text and "(relay-pd = 1)" in text
    after = text.split("(relay-pd = 1)")[1]
    assert "| ppd | 1 | 2 | 1 | 1 | 1.25 |" in after
    assert "(relay-pd = 1)" not in render([_run("ppd", 0.15, 0), _run("relay", 0.10, 0)], {})


@pytest.mark.parametrize("argv, complaint", [
    (["--systems", "relay-pd", "--router-replicas", "1,2"], "relay-pd runs one replica only"),
    (["--systems", "ppd,relay-pd", "--workers", "mocker", "--ttft-conversations", "0"], "--workers mocker"),
    (["--systems", "ppd", "--workers", "mocker"], "--ttft-conversations 0"),
])
def test_relay_benchmark_refuses_what_it_cannot_measure_with_one_line(argv, complaint, capsys):
    from dynamo_ppd.bench.relay import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert complaint in capsys.readouterr().err


def test_what_the_callout_adds_is_paired_by_conversation():
    from dynamo_ppd.bench.relay import TtftSetup, callout_added, render

    # The gateway's conversations vary a lot (10-40 ms); the picker adds 2 ms to each.
    gateway = [10.0 + 3 * i for i in range(11)]
    ttft = {"gateway": (gateway, [g / 2 for g in gateway]),
            "picker": ([g + 2 for g in gateway], [g / 2 + 1 for g in gateway])}
    rows = callout_added(ttft)
    assert rows[-2].startswith("| turn 1 | 2.00 [2.00, 2.00] ms | 11 |")
    assert rows[-1].startswith("| turn 2 | 1.00 [1.00, 1.00] ms | 11 |")
    assert callout_added({"gateway": ttft["gateway"]}) == []
    text = render([], ttft, TtftSetup(11, 100_000, 20, 50.0))
    assert "20 2-turn conversations in flight, turn 1 100,000 fresh words" in text
    assert "workers at 50x" in text
