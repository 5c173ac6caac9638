"""The helpers several modules share (one copy each): argparse types and the one-line error, the
progress bar, the streamed-chat reader, the P->D handoff legs."""

import argparse
import asyncio
import json

import httpx
import pytest

from dynamo_ppd.argtypes import cli_error, positive_float, positive_int, positive_seconds
from dynamo_ppd.bench.client import chat_body, chat_stream, stream_chat
from dynamo_ppd.engine.cost import TransferLink
from dynamo_ppd.engine.handoff import decode_leg, prefill_leg, ship_prompt_kv
from dynamo_ppd.engine.scheduler import RequestKind
from dynamo_ppd.experiment.progress import Progress

pytestmark = pytest.mark.unit


def test_positive_types_name_the_bad_text():
    assert positive_seconds("1.5") == 1.5 and positive_float("2") == 2.0 and positive_int("3") == 3
    for parse, text, message in [(positive_seconds, "x", "'x' is not a number of seconds"),
                                 (positive_int, "2.5", "'2.5' is not a whole number"),
                                 (positive_int, "0", "'0': must be positive"),
                                 (positive_float, "-1", "'-1': must be positive")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_cli_error_is_one_line_and_the_exit_code(capsys):
    assert cli_error(ValueError("no such graph")) == 2
    assert cli_error("the run failed", 1) == 1
    assert capsys.readouterr().err == "dynamo-ppd: error: no such graph\ndynamo-ppd: error: the run failed\n"


def test_progress_off_a_terminal_prints_tenths_and_a_closing_line(capsys):
    bar = Progress(20, "table", "cells")
    for _ in range(20):
        bar.step()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11 and lines[0].startswith("table: 1/20 cells")
    assert lines[-1].startswith("table: 20/20")
    live = Progress(4, "pd @ 1 conv/s", "requests", every_s=0.0)
    for failed in (False, True, False):
        live.step(failed=failed)
    live.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].startswith("pd @ 1 conv/s: 2/4 requests, 1 failed")
    assert lines[-1].startswith("pd @ 1 conv/s: 3 requests, 1 failed")


def _sse(lines: list[str], status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["x-dynamo-session-id"] == "s1"
        if status != 200:
            return httpx.Response(status, content=b"no workers")
        return httpx.Response(200, content=("\n".join(lines) + "\n").encode())
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _content(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"delta": {"content": text}, "finish_reason": finish}]})


def test_stream_chat_reads_text_usage_and_errors():
    usage = "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
    body = chat_body("m", [], 2, annotations=("x-ppd-route:via_prefill",))
    assert body["nvext"] == {"annotations": ["x-ppd-route:via_prefill"]} and body["ignore_eos"]

    async def scenario():
        ok = await stream_chat(_sse([_content("a"), _content("b", "length"), usage, "data: [DONE]"]),
                               "http://x", body, "s1", 5.0)
        assert (ok.text, len(ok.stamps), ok.finish_reason, ok.usage) == ("ab", 2, "length",
                                                                         {"completion_tokens": 2})
        broken = [_content("a"), 'data: {"error": "worker died"}', _content("b")]
        stopped = await stream_chat(_sse(broken), "http://x", body, "s1", 5.0)
        read_on = await stream_chat(_sse(broken), "http://x", body, "s1", 5.0, stop_at_error=False)
        assert (stopped.text, stopped.error_chunk) == ("a", "worker died") and read_on.text == "ab"
        down = await stream_chat(_sse([], status=503), "http://x", body, "s1", 5.0)
        assert down.http_error == "HTTP 503: b'no workers'" and down.ttft_s is None
        ttft, e2e, gaps, text, error = await chat_stream(_sse(broken), "http://x", "m", [], 2, "s1")
        assert (ttft, e2e, text, error) == (None, None, "a", "worker died")

    asyncio.run(scenario())


def test_the_handoff_legs_and_the_prompt_kv_on_the_prefill_link():
    prefill = prefill_leg("r1", [1, 2, 3])
    assert (prefill.kind, prefill.max_tokens) == (RequestKind.CONTEXT_ONLY, 1)
    link = TransferLink(bandwidth_bytes_s=1000.0, setup_s=0.5)
    assert ship_prompt_kv(link, 3, 100, ready_at=1.0) == (300, 1.0, 1.8)
    assert ship_prompt_kv(link, 3, 100, ready_at=1.0) == pytest.approx((300, 1.8, 2.6))  # queued behind
    decode = decode_leg("r1", [1, 2, 3], 16, first_token=7, kv_ready_at=2.6)
    assert (decode.kind, decode.first_token, decode.kv_ready_at) == (RequestKind.GENERATION_ONLY, 7, 2.6)
