"""`sse.DatalessEventFilter`: events a client cannot parse (a name, maybe a comment, no
data: Dynamo 1.6.1's ``x-bypass-remote-prefill`` annotation) leave the stream; everything else
reaches the client byte for byte, however the body is cut into pieces."""

from __future__ import annotations

import itertools

import pytest

from dynamo_ppd.sse import DatalessEventFilter, is_event_stream

pytestmark = pytest.mark.unit

BYPASS = b"event: x-bypass-remote-prefill\n: true\n\n"
CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"delta":{"content":"hi"}}]}\n\n'
NAMED = b'event: message_start\ndata: {"type":"message_start"}\n\n'
DONE = b"data: [DONE]\n\n"


def run(pieces: list[bytes]) -> tuple[bytes, int]:
    f = DatalessEventFilter()
    out = b"".join(f.feed(p) for p in pieces) + f.end()
    return out, f.dropped


def test_the_bypass_annotation_goes_and_the_answer_stays():
    out, dropped = run([BYPASS, CHUNK, CHUNK, DONE])
    assert out == CHUNK + CHUNK + DONE and dropped == 1


def test_every_cut_of_the_body_gives_the_same_answer():
    body = BYPASS + CHUNK + b": keep-alive\n\n" + NAMED + CHUNK.replace(b"\n", b"\r\n") + BYPASS + DONE
    expected = CHUNK + b": keep-alive\n\n" + NAMED + CHUNK.replace(b"\n", b"\r\n") + DONE
    for i, j in itertools.combinations(range(1, len(body)), 2):
        if (i * 7 + j) % 5:  # a fifth of the ~60K cuts keeps this quick
            continue
        out, dropped = run([body[:i], body[i:j], body[j:]])
        assert out == expected and dropped == 2, (i, j)


@pytest.mark.parametrize("event", [b"event: ping\n\n", b"id: 7\n\n", b"retry: 3000\n\n",
                                   b"event: x\r\n: c\r\n\r\n", b"event\n\n"])
def test_any_field_without_data_goes(event):
    assert run([event + CHUNK]) == (CHUNK, 1)


def test_comments_and_data_with_fields_stay():
    body = b": keep-alive\n\n" + b"id: 3\nevent: delta\ndata: {}\n\n" + b"data\n\n"
    assert run([body]) == (body, 0)


def test_an_unterminated_last_event_is_passed_on_as_it_came():
    assert run([CHUNK, b"data: {\"partial\""]) == (CHUNK + b"data: {\"partial\"", 0)


def test_only_event_streams_are_filtered():
    assert is_event_stream([("content-type", "text/event-stream; charset=utf-8")])
    assert not is_event_stream([("content-type", "application/json")])
