"""`dynamo-ppd bench picker`: the requests it builds, the figures it draws from them, its report,
its command line; and one tiny run against the real graph."""

from __future__ import annotations

import argparse
import json

import pytest

from dynamo_ppd.bench import picker_path
from dynamo_ppd.bench.picker_path_load import (
    AGENT_FIRST_TURN,
    AGENT_FOLLOW_UP,
    AGENT_SESSION_HEADER,
    AGENT_SESSIONS,
    AGENT_STEPS_MAX,
    ASSISTANT_WORDS,
    FOLLOW_UP_WORDS,
    AgentTurns,
    Conversation,
    FirstTurns,
    FollowUps,
    PickRequest,
)
from dynamo_ppd.bench.picker_path_report import (
    COLUMNS,
    GRPC,
    CpuUse,
    Outcome,
    Point,
    Report,
    ReportError,
    encode_cache_note,
    limited_by,
    load,
    markdown,
    save,
    summarize,
    sustained_rate,
)
from dynamo_ppd.cli import build_parser
from dynamo_ppd.picker.stages import STAGES

CHAT = "/v1/chat/completions"


class _Words:
    """A stand-in for `client.TokenText`: n numbered words (no model directory needed)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, tokens: int) -> str:
        self.n += 1
        return " ".join(f"w{self.n}x{i}" for i in range(tokens))


def _header(request: PickRequest, name: str) -> str:
    return next(v for k, v in request.headers if k == name)


def _conversations(count: int) -> list[Conversation]:
    return [Conversation(f"s{i}", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                         [1000, 32]) for i in range(count)]


# --- what is sent -------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_first_turn_is_envoys_header_map_and_a_fresh_chat():
    source = FirstTurns("first-0.5k", 500, "m", _Words())  # type: ignore[arg-type]
    a, b = source.next(), source.next()
    body = json.loads(a.body)
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert len(body["messages"][0]["content"].split()) == 500
    assert _header(a, ":path") == CHAT and _header(a, ":method") == "POST"
    assert _header(a, "content-length") == str(len(a.body))
    assert _header(a, "x-dynamo-session-id") == a.group != b.group  # a fresh session each
    assert a.body != b.body


@pytest.mark.unit
def test_each_follow_up_continues_its_conversations_last_request():
    follow = FollowUps(_conversations(2), "m", _Words())  # type: ignore[arg-type]
    sent = [follow.next() for _ in range(6)]  # s0, s1, s0, s1, s0, s1
    assert [r.group for r in sent] == ["s0", "s1"] * 3
    for earlier, later in zip(sent, sent[2:], strict=False):
        before, after = json.loads(earlier.body)["messages"], json.loads(later.body)["messages"]
        assert after[:len(before)] == before  # the same session, its history extended
        assert [m["role"] for m in after[len(before):]] == ["assistant", "user"]
        assert len(after[-2]["content"].split()) == ASSISTANT_WORDS
        assert len(after[-1]["content"].split()) == FOLLOW_UP_WORDS
        assert _header(later, "x-dynamo-session-id") == later.group
        assert later.prompt_tokens > earlier.prompt_tokens
    assert [m["role"] for m in json.loads(sent[0].body)["messages"]] == ["user", "assistant", "user"]


@pytest.mark.unit
def test_agent_follow_ups_extend_loops_the_picker_saw_a_step_before():
    source = AgentTurns(AGENT_FOLLOW_UP, "m", _Words())  # type: ignore[arg-type]
    primed = {r.group: json.loads(r.body) for r in source.prime()}
    primed_lengths = {group: len(body["messages"]) for group, body in primed.items()}
    assert len(primed) == AGENT_SESSIONS
    sent = [source.next() for _ in range(2 * AGENT_SESSIONS)]
    assert [r.group for r in sent[:AGENT_SESSIONS]] == [r.group for r in sent[AGENT_SESSIONS:]]
    for request in sent:
        body = json.loads(request.body)
        before = primed[request.group]
        assert body["messages"][:len(before["messages"])] == before["messages"]  # one step more
        assert [m["role"] for m in body["messages"][len(before["messages"]):]] == ["assistant", "user"]
        assert body["messages"][-1]["content"][0]["type"] == "tool_result"
        assert body["system"] == before["system"] and body["tools"] == before["tools"]
        assert _header(request, ":path") == "/v1/messages"
        assert _header(request, AGENT_SESSION_HEADER) == request.group
        primed[request.group] = body
    last = json.loads(sent[-1].body)
    for _ in range(AGENT_SESSIONS * AGENT_STEPS_MAX):  # however many: back to the primed history
        request = source.next()
        body = json.loads(request.body)
        assert len(body["messages"]) <= primed_lengths[request.group] + 2 * AGENT_STEPS_MAX
    words = len(last["system"].split()) + sum(
        len(m["content"].split()) if isinstance(m["content"], str) else
        sum(len((b.get("text") or b.get("content") or "").split()) for b in m["content"])
        for m in last["messages"])
    assert 90_000 < words < 110_000


@pytest.mark.unit
def test_agent_first_turns_share_the_system_prompt_in_fresh_sessions():
    source = AgentTurns(AGENT_FIRST_TURN, "m", _Words())  # type: ignore[arg-type]
    (first,) = source.prime()
    a, b = source.next(), source.next()
    bodies = [json.loads(r.body) for r in (first, a, b)]
    assert len({body["system"] for body in bodies}) == 1 and len(bodies[0]["system"].split()) == 20_000
    assert len({body["messages"][0]["content"] for body in bodies}) == 3  # each session its own task
    assert len({r.group for r in (first, a, b)}) == 3


@pytest.mark.unit
@pytest.mark.slow  # the session's model directory (trained once, ~20 s, shared with other tests)
def test_prompts_have_the_tokens_asked_for_in_the_pickers_own_tokenizer(model_dir):
    from dynamo_ppd.bench.client import TokenText
    from dynamo_ppd.picker.prompt import PromptTokenizer

    tokenizer = PromptTokenizer.from_model_dir(model_dir)
    text = TokenText(0)
    for tokens in (500, 2000, 8000):
        request = FirstTurns("k", tokens, "m", text).next()
        counted = len(tokenizer.tokens(json.loads(request.body), CHAT))
        assert abs(counted - tokens) <= 0.03 * tokens + 20, (tokens, counted)
        assert abs(request.prompt_tokens - counted) <= 0.02 * counted, (request.prompt_tokens, counted)
    conversation = Conversation("s", [], [])
    for role, words in (("user", 1000), ("assistant", 32), ("user", 900), ("assistant", 32)):
        conversation.messages.append({"role": role, "content": text(words)})
        conversation.message_tokens.append(words)
    follow = FollowUps([conversation], "m", text)
    for _ in range(5):
        request = follow.next()
        counted = len(tokenizer.tokens(json.loads(request.body), CHAT))
        assert abs(request.prompt_tokens - counted) <= 0.05 * counted, (request.prompt_tokens, counted)


# --- the figures --------------------------------------------------------------------------------

def _outcome(i: int, path_us: float, rate: float = 100.0, group: str | None = None, error: str | None = None,
             round_trip_us: float | None = None) -> Outcome:
    stages = {f"{s}_us": path_us / len(STAGES) for s in STAGES}
    due = i / rate
    return Outcome(group or f"r{i}", due, 0.0001, due + 0.002, round_trip_us or path_us + 1000.0,
                   None if error else {"path_us": path_us, **stages}, 100, error)


def _cpu(picks: int, picker_s: float = 1.0, wall_s: float = 2.0) -> CpuUse:
    return CpuUse(picker_s, 0.5, 1.5, wall_s, picks, {"picker": picker_s, "etcd": 0.1}, 0.01,
                  {"python": 0.8 * picker_s, "event_engine": 0.2 * picker_s})


@pytest.mark.unit
def test_a_point_has_percentiles_stage_means_and_cpu_per_pick():
    outcomes = [_outcome(i, 1000.0 + i) for i in range(200)]
    outcomes += [_outcome(200, 0, error="HTTP 400: too long"), _outcome(201, 0, error="gRPC UNAVAILABLE")]
    point = summarize("follow-up", "open", 100.0, outcomes, _cpu(picks=200))
    assert (point.sent, point.samples, point.refused, point.failed) == (202, 200, 1, 1)
    assert point.path_p50_us is not None and point.path_p50_us.value == pytest.approx(1099.5)
    assert point.path_p50_us.low <= 1099.5 <= point.path_p50_us.high
    assert point.path_p99_us == pytest.approx(1197.01)
    assert point.stage_mean_us[GRPC] == pytest.approx(1000.0)
    assert sum(point.stage_mean_us[s] for s in STAGES) == pytest.approx(point.path_mean_us)
    assert set(point.stage_mean_us) == set(COLUMNS)
    assert point.tail_stage_mean_us["plan"] > point.stage_mean_us["plan"]  # the slowest 1%
    assert point.picker_cpu_us_per_pick == pytest.approx(5000.0)  # 1 s of CPU over 200 picks
    assert point.picker_busy_us_per_pick == pytest.approx((1.0 - 0.01 * 2.0) / 200 * 1e6)
    assert point.picker_cores == pytest.approx(0.5) and point.machine_cores == pytest.approx(0.75)
    assert point.picker_threads_us_per_pick == pytest.approx({"python": 4000.0, "event_engine": 1000.0})
    # All answered 2 ms after they were due, every 10 ms: the point kept up with its 100/s.
    assert point.achieved_rate == pytest.approx(100.0, rel=0.02)


@pytest.mark.unit
def test_a_point_that_falls_behind_achieves_less_than_its_rate():
    # Due every 1 ms (1000/s), answered every 2 ms: 500/s.
    outcomes = [Outcome(f"r{i}", i / 1000, 0.0, (i + 1) / 500, 1500.0, {"path_us": 900.0}, 100)
                for i in range(1000)]
    point = summarize("first-2k", "open", 1000.0, outcomes, _cpu(1000))
    assert point.achieved_rate == pytest.approx(500, rel=0.01)


@pytest.mark.unit
def test_a_point_without_routes_has_no_intervals_and_renders():
    point = summarize("first-100k", "open", 20.0, [_outcome(0, 0, error="HTTP 400: no")], _cpu(0))
    assert point.samples == 0 and point.path_p50_us is None and point.picker_cpu_us_per_pick == 0
    assert "| first-100k | 20 | 0.0 | 0 (1 refused) | 100 | - | - | - | - |" in markdown(_report([point]))


def _point(rate: float, p99_us: float = 2000.0, achieved: float | None = None, picker: float = 0.3,
           driver: float = 0.3, machine: float = 1.0, failed: int = 0, kind: str = "follow-up") -> Point:
    return Point(kind=kind, loop="open", target_rate=rate, sent=100, samples=100 - failed, refused=0,
                 failed=failed, achieved_rate=rate if achieved is None else achieved, prompt_tokens=2000,
                 path_p50_us=None, path_p99_us=p99_us, round_trip_p50_us=None, round_trip_p99_us=p99_us,
                 path_mean_us=1000, stage_mean_us={c: 1.0 for c in COLUMNS}, picker_cpu_us_per_pick=1500,
                 picker_busy_us_per_pick=1400, picker_cores=picker, driver_cores=driver,
                 machine_cores=machine, late_p99_ms=1.0, wall_s=4.0)


@pytest.mark.unit
def test_the_sustained_rate_is_the_highest_below_the_first_miss():
    points = [_point(1), _point(50), _point(200), _point(500, p99_us=12_000), _point(750)]
    assert sustained_rate(points, 10_000) == 200  # 750 kept up, but 500 did not: the climb ended there
    assert sustained_rate([_point(50), _point(200, achieved=180)], 10_000) == 50  # under 95% of its rate
    assert sustained_rate([_point(50, failed=1)], 10_000) is None
    assert sustained_rate([_point(50, kind="first-2k")], 10_000) is None  # follow-ups only


@pytest.mark.unit
def test_what_held_a_point_back():
    assert limited_by(_point(200), 10_000, 2) == ""
    assert limited_by(_point(500, achieved=400, picker=0.95), 10_000, 2) == "picker (a core)"
    assert limited_by(_point(500, achieved=400, driver=0.95), 10_000, 2) == "driver (a core)"
    assert limited_by(_point(500, achieved=400, machine=1.9), 10_000, 2) == "machine (2 cores busy)"
    assert limited_by(_point(500, p99_us=20_000), 10_000, 2) == "p99 path over the limit"
    assert limited_by(_point(500, p99_us=20_000), None, 2) == ""  # first turns only need to keep up


@pytest.mark.unit
def test_a_jump_in_follow_up_tokenization_is_noted():
    import msgspec

    def tokenize(point: Point, us: float, messages: int) -> Point:
        return msgspec.structs.replace(point, stage_mean_us={**point.stage_mean_us, "tokenize": us},
                                       conversation_messages=messages)

    steady = [tokenize(_point(50), 400, 2000), tokenize(_point(200), 420, 4000)]
    assert encode_cache_note(steady, 8192) == []
    notes = encode_cache_note([*steady, tokenize(_point(750), 3000, 11_000)], 8192)
    assert len(notes) == 1 and "7.5-fold from 50/s" in notes[0] and "held 11,000 messages" in notes[0]


def _report(points: list[Point]) -> Report:
    return Report(command="uv run dynamo-ppd bench picker --out x", graph="ppd", arrivals="open loop",
                  conversations=8, duration_s=4, warmup_s=0.5, min_requests=10, max_requests=2000,
                  p99_limit_ms=10, cpus=2, load_before=[0.1, 0.2, 0.3], picker_idle_cores=0.01, wall_s=60,
                  points=points, sustained_follow_up_rate=sustained_rate(points, 10_000), notes=["a note"])


@pytest.mark.unit
def test_the_markdown_starts_with_the_command_and_has_a_row_per_point(tmp_path):
    points = [_point(50), _point(200), _point(500, achieved=400, machine=1.9)]
    text = markdown(_report(points))
    lines = text.splitlines()
    assert lines[0] == "# The endpoint picker's request path"
    assert lines[2] == "`uv run dynamo-ppd bench picker --out x`"
    assert sum(line.startswith("| follow-up | ") for line in lines) == 2 * len(points)  # times and stages
    assert "**Follow-ups: the picker sustained 200 requests/s** with p99 path <= 10 ms" in text
    assert "limited by machine (2 cores busy)" in text and "a core of its own would route ~" in text
    assert lines[-1] == "- a note"
    path = save(_report(points), tmp_path / "r.json")
    assert load(path) == _report(points)
    path.write_text(path.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ReportError, match="version 99"):
        load(path)
    path.write_text('{"version": 1, "points": "none"}')
    with pytest.raises(ReportError, match="not a picker-path report"):
        load(path)


# --- the command line ---------------------------------------------------------------------------

def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "picker", *flags])


@pytest.mark.unit
def test_the_command_line_defaults_and_the_ladders():
    args = _args()
    assert args.kinds == list(picker_path.KINDS) and args.out is None
    assert picker_path.ladder("follow-up", args) == [1, 50, 200, 500, 750, 1000, 1500, 2000]
    assert picker_path.ladder("first-2k", args) == [1, 50, 200, 500]
    assert picker_path.ladder("first-100k", args) == [1, 20]
    assert picker_path.ladder("agent-follow-up-100k", args) == [1, 20]
    assert picker_path.point_size(1, args) == (1, 10)  # at least --min-requests
    assert picker_path.point_size(200, args) == (100, 800)
    assert picker_path.point_size(2000, args) == (1000, 2000)  # at most --max-requests
    args = _args("--follow-up-rates", "none", "--rates", "5")
    assert picker_path.ladder("follow-up", args) == [5]
    assert build_parser().parse_args(["bench", "compare", "--systems", "pd"]).bench_command == "compare"


@pytest.mark.unit
@pytest.mark.parametrize("flags", [["--rates", "1,-2"], ["--kinds", "nope"], ["--duration", "0"],
                                   ["--warmup", "-1"], ["--closed-loop-kind", "follow-up"]])
def test_bad_flags_exit_2(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        _args(*flags)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("dynamo-ppd bench picker: error:")


@pytest.mark.unit
def test_settings_that_cannot_run_exit_2_with_one_line(capsys):
    assert picker_path.main(_args("--min-requests", "20", "--max-requests", "10")) == 2
    assert capsys.readouterr().err == "dynamo-ppd: error: --min-requests 20 is over --max-requests 10\n"
    nothing = _args("--kinds", "first-2k", "--rates", "none", "--closed-loop-concurrency", "0")
    assert picker_path.main(nothing) == 2
    assert "nothing to measure" in capsys.readouterr().err


# --- one tiny run -------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_against_the_real_graph(model_dir, tmp_path):
    args = _args("--kinds", "follow-up,first-0.5k", "--rates", "20", "--follow-up-rates", "none",
                 "--duration", "1", "--warmup", "0.2", "--min-requests", "5", "--conversations", "4",
                 # 100 closed-loop picks: enough CPU ticks (10 ms each in /proc) to measure with fastokens
                 "--closed-loop-concurrency", "2", "--closed-loop-requests", "100", "--closed-loop-kind",
                 "first-0.5k", "--out", str(tmp_path / "pp"))
    assert picker_path.main(args) == 0
    report = load(tmp_path / "pp.json")
    assert [(p.kind, p.loop) for p in report.points] == [("follow-up", "open"), ("first-0.5k", "open"),
                                                        ("first-0.5k", "closed")]
    for point in report.points:
        assert point.samples >= 4 and point.failed == 0 and point.refused == 0, point
        assert point.path_p50_us is not None and point.path_p50_us.value > 0
        assert point.round_trip_p50_us is not None
        assert point.round_trip_p50_us.value >= point.path_p50_us.value
        stages = sum(point.stage_mean_us[s] for s in STAGES)
        assert 0 < stages <= point.path_mean_us + 0.05 * len(STAGES)  # laps of one clock, 0.1 us rounding
        assert point.stage_mean_us["tokenize"] > 0 and point.stage_mean_us["plan"] > 0
        assert point.picker_cpu_us_per_pick > 0
    follow = report.points[0]
    assert follow.prompt_tokens > 2000  # the warm-up conversations' ~2K tokens, continued
    text = (tmp_path / "pp.md").read_text()
    assert text.splitlines()[2].startswith("`") and "| follow-up | 20 |" in text
    assert (tmp_path / "pp.png").stat().st_size > 10_000
