"""What the endpoint picker's tokenizing costs on agent traffic (`/v1/messages`), in process.

The issue-41 figures: `PromptTokenizer.tokens` (the conversion to the frontend's chat, the chat
template, the encoding with its cache of the text between added tokens) on the simulated model's
tokenizer, CPU time of this thread, median of ``--repeat`` runs each:

- a session's first request whose ~``--system-tokens``-token system prompt and tool schemas every
  session shares: the first session's (nothing cached), then another session's (the shared prompt's
  pieces cached, its own task new);
- a follow-up on a ~``--context-tokens``-token tool loop, whose history the cache holds but its last
  tool result.

    uv run python scripts/agent_prompt_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from dynamo_ppd.model import default_model_dir, init_model_dir
from dynamo_ppd.picker.prompt import PromptTokenizer

WORDS = "berth crane manifest tide pilot ballast draft quay mooring hawser reefer lashing gantry".split()
TOOLS = [{"name": f"tool_{k}", "description": f"tool number {k}: " + " ".join(WORDS),
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}} for k in range(12)]


def _text(tokens: int, seed: int) -> str:
    # A word and a number are ~4.3 tokens with the simulated model's tokenizer.
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(round(tokens / 4.3)))


def _loop(system: str, task: str, steps: int, append: int, seed: int) -> list[dict]:
    messages: list[dict] = [{"role": "user", "content": task}]
    for k in range(steps):
        messages += [{"role": "assistant", "content": [
                          {"type": "text", "text": _text(200, seed + k)},
                          {"type": "tool_use", "id": f"t{k}", "name": "tool_0", "input": {"path": f"f{k}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                   "content": _text(append, seed + 1000 + k)}]}]
    return messages


def _cpu_ms(tokenizer: PromptTokenizer, body: dict) -> tuple[float, int]:
    started = time.thread_time()
    ids = tokenizer.tokens(body, "/v1/messages")
    return (time.thread_time() - started) * 1e3, len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--system-tokens", type=int, default=20_000, help="the shared system prompt")
    p.add_argument("--context-tokens", type=int, default=100_000, help="the follow-up's context")
    p.add_argument("--append", type=int, default=875, help="each tool result (TraceLab's median append)")
    p.add_argument("--repeat", type=int, default=7, help="runs of each measurement (fresh tokenizers)")
    args = p.parse_args()
    directory = default_model_dir()
    if not directory.exists():
        init_model_dir(directory)
    system = _text(args.system_tokens, 1)
    steps = max(1, (args.context_tokens - args.system_tokens) // (args.append + 230))
    rows: dict[str, list[float]] = {"first session, first request": [], "next session, first request": [],
                                    "follow-up, history cached": [], "follow-up, nothing cached": []}
    sizes: dict[str, int] = {}
    for r in range(args.repeat):
        tokenizer = PromptTokenizer.from_model_dir(directory)
        first = {"max_tokens": 8, "system": system, "tools": TOOLS,
                 "messages": [{"role": "user", "content": _text(300, 10 + r)}]}
        other = {**first, "messages": [{"role": "user", "content": _text(300, 500 + r)}]}
        for name, body in (("first session, first request", first), ("next session, first request", other)):
            ms, n = _cpu_ms(tokenizer, body)
            rows[name].append(ms)
            sizes[name] = n
        history = _loop(system, _text(300, 10 + r), steps, args.append, 100 * r)
        before = {**first, "messages": history[:-2]}
        _cpu_ms(tokenizer, before)  # the turn before: its pieces are cached now
        ms, n = _cpu_ms(tokenizer, {**first, "messages": history})
        rows["follow-up, history cached"].append(ms)
        sizes["follow-up, history cached"] = n
        ms, n = _cpu_ms(PromptTokenizer.from_model_dir(directory), {**first, "messages": history})
        rows["follow-up, nothing cached"].append(ms)
        sizes["follow-up, nothing cached"] = n
    print("$ uv run python scripts/agent_prompt_cost.py")
    print(f"CPU ms of PromptTokenizer.tokens on /v1/messages, median (min-max) of {args.repeat}:")
    print("| request | prompt tokens | CPU ms |")
    print("|---|---|---|")
    for name, values in rows.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"| {name} | {sizes[name]} | {statistics.median(values):.2f} ({spread}) |")


if __name__ == "__main__":
    main()
