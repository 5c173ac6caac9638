"""Two turns of one conversation through a running graph (`uv run dynamo-ppd serve`), with the
OpenAI SDK as any client would send them: turn 2 sends the history back under the same session
header, and its usage shows the decode worker reusing it. Cached tokens count whole 32-token KV
blocks, so they are the history rounded down to a multiple of 32.

    uv run python scripts/two_turns.py [--url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the graph's OpenAI endpoint")
    parser.add_argument("--session", default="demo-1", help="x-dynamo-session-id of the conversation")
    parser.add_argument("--stream", action="store_true",
                        help="stream the answers (stream_options.include_usage), as chat clients do")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Hello! Who are you?"}]
    for turn, follow_up in ((1, "Tell me more."), (2, None)):
        headers = {"x-dynamo-session-id": args.session}
        if args.stream:
            text, usage = "", None
            for chunk in client.chat.completions.create(
                    model=model, messages=messages, max_tokens=32, stream=True,
                    stream_options={"include_usage": True}, extra_headers=headers):
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
                usage = chunk.usage or usage
        else:
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=32, extra_headers=headers)
            text = answer.choices[0].message.content or ""
            usage = answer.usage
        details = usage.prompt_tokens_details if usage else None
        cached = (details.cached_tokens if details else None) or 0
        print(f"turn {turn}: {usage.prompt_tokens if usage else '?'} prompt tokens, {cached} cached; "
              f"answer: {text[:60]}...")
        if follow_up:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]


if __name__ == "__main__":
    main()
