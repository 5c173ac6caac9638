"""`tests/sse_grammar.py`, the SSE parser and the APIs' event grammars the client conformance
suite (`test_clients_e2e.py`) checks raw streams with, on bytes written here."""

from __future__ import annotations

import json

import pytest
import sse_grammar

pytestmark = pytest.mark.unit

CHUNK = '{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}'
USAGE = '{"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"completion_tokens":1}}'


def test_the_parser_follows_the_sse_spec_on_line_ends_fields_and_comments():
    for end in ("\n", "\r\n", "\r"):
        text = end.join([": keep-alive", "", "event: a", "data:x", "data:  y", "id: 7", "retry: 15",
                         "retry: soon", "", "data", "", "data: tail", ""])
        stream = sse_grammar.parse(text.encode())
        assert stream.keepalives == 1
        first, bare = stream.events
        assert (first.type, first.data, first.id, first.retry) == ("a", "x\n y", "7", 15)
        assert (bare.type, bare.data) == ("message", "")  # `data` alone: an empty data line
        assert stream.tail == "data: tail"  # never dispatched: no blank line after it
    assert sse_grammar.parse(b"\xef\xbb\xbfdata: 1\n\n").events[0].data == "1"  # the BOM is dropped


def test_the_grammars_pass_good_streams_and_name_what_is_wrong():
    good = f"data: {CHUNK}\n\ndata: {USAGE}\n\ndata: [DONE]\n\n"
    assert sse_grammar.openai_problems(sse_grammar.parse(good), "chat", include_usage=True) == []
    # Dynamo 1.6.1's bypass annotation, as the ppd graph's decode-local follow-ups open with it.
    bypass = sse_grammar.parse("event: x-bypass-remote-prefill\n: true\n\n" + good)
    problems = sse_grammar.openai_problems(bypass, "chat", include_usage=True)
    assert any("has no data" in p for p in problems) and any("named events" in p for p in problems)
    assert sse_grammar.openai_problems(sse_grammar.parse(good), "chat", include_usage=False) != []
    messages = "".join(f"event: {t}\ndata: {json.dumps({'type': t, **extra})}\n\n" for t, extra in [
        ("message_start", {}), ("ping", {}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
        ("content_block_stop", {"index": 0}), ("message_delta", {}), ("message_stop", {})])
    assert sse_grammar.messages_problems(sse_grammar.parse(messages)) == []
    done = sse_grammar.parse(messages + "data: [DONE]\n\n")
    assert sse_grammar.messages_problems(done) != []
    assert sse_grammar.messages_problems(done, allow_done=True) == []
    out_of_order = messages.replace("event: message_delta", "event: message_deltx")
    assert sse_grammar.messages_problems(sse_grammar.parse(out_of_order)) != []
    responses = "".join(f"event: {t}\ndata: {json.dumps({'type': t, 'sequence_number': n, **extra})}\n\n"
                        for n, (t, extra) in enumerate([
                            ("response.created", {"response": {"id": "r"}}),
                            ("response.output_text.delta", {"delta": "hi"}),
                            ("response.completed", {"response": {"id": "r"}})]))
    assert sse_grammar.responses_problems(sse_grammar.parse(responses)) == []
    renamed = responses.replace("event: response.output_text.delta", "event: delta")
    assert sse_grammar.responses_problems(sse_grammar.parse(renamed)) != []
