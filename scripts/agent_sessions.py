"""Agent sessions sharing a long system prompt, with no session header: does each follow-up stay on
its own session's decode worker?

The issue-41 check, on the `ppd` graph (gateway -> endpoint picker -> Dynamo's frontend, 1 prefill +
3 simulated decode workers): ``--sessions`` Claude Code-like sessions over ``/v1/messages`` start
``--spacing`` seconds apart, all with the same ``--system-tokens``-token system prompt and tool
schemas, none with a session header (the picker must tell them apart by their prompts). Each runs
``--steps`` requests of a tool loop (an assistant tool call, its tool result of ``--append`` tokens,
a sub-second tool gap), answers of ``--max-tokens`` tokens.

Counted per follow-up, from the answers alone: it found *its own* history when the frontend reports
at least its session's first request cached (``usage.cache_read_input_tokens``, less one partly
filled KV block): that request ends in a task no other session has, so the follow-up ran where its
session left its KV; a follow-up sent elsewhere finds at most the shared system prompt. And the
picker's decision counters: follow-ups it routed decode-local.

    uv run python scripts/agent_sessions.py            # prints the shares and the command
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port

WORDS = ("berth crane manifest tide pilot ballast draft quay mooring hawser reefer lashing stevedore "
         "gantry bollard fender dredge").split()
BLOCK = 32  # the simulated workers' KV block (cached tokens count whole blocks)
TOOLS = [{"name": name, "description": f"{name} in the repository",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}
         for name in ("read_file", "edit_file", "run_tests", "grep")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sessions", type=int, default=16, help="agent sessions")
    p.add_argument("--steps", type=int, default=6,
                   help="requests per session (the first and its follow-ups)")
    p.add_argument("--system-tokens", type=int, default=20_000,
                   help="shared system prompt, about this many tokens")
    p.add_argument("--append", type=int, default=300,
                   help="tool result of each step, about this many tokens")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length")
    p.add_argument("--spacing", type=float, default=0.5, help="seconds between session starts")
    p.add_argument("--gap", type=float, default=0.4,
                   help="seconds between a session's requests (tool time)")
    p.add_argument("--graph", default="ppd", help="graph to serve")
    return p.parse_args(argv)


def _text(tokens: int, seed: int) -> str:
    # A word and a number are ~4.3 tokens with the simulated model's tokenizer (measured).
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 97)
                    for i in range(round(tokens / 4.3)))


class Counts:
    def __init__(self) -> None:
        self.follow_ups = 0
        self.own_history = 0
        self.failed = 0
        self.cached: list[int] = []
        self.first_prompts: list[int] = []


async def session(client: httpx.AsyncClient, dep, args, index: int, counts: Counts) -> None:
    system = _text(args.system_tokens, 0)
    messages: list[dict] = [{"role": "user", "content": f"Task {index}: {_text(200, 1000 + index)}"}]
    for step in range(args.steps):
        body = {"model": dep.model_name, "max_tokens": args.max_tokens, "system": system,
                "tools": TOOLS, "messages": messages}
        response = await client.post(f"{dep.base_url}/v1/messages", json=body, timeout=120)
        if response.status_code != 200:
            counts.failed += 1
            print(f"session {index} step {step}: HTTP {response.status_code} {response.text[:200]}",
                  file=sys.stderr)
            return
        reply = response.json()
        usage = reply["usage"]
        cached = usage.get("cache_read_input_tokens") or 0
        if step == 0:
            first = usage["input_tokens"] + cached  # the system prompt, the tools and this task
            counts.first_prompts.append(first)
        else:
            counts.follow_ups += 1
            counts.cached.append(cached)
            # Its own first turn (the task only this session has) is in the cache, less at most
            # one partly filled KV block: it ran where its session left its KV.
            if cached >= first - BLOCK:
                counts.own_history += 1
        text = "".join(b.get("text", "") for b in reply["content"] if b.get("type") == "text")
        call = f"toolu_{index}_{step}"
        messages += [{"role": "assistant", "content": [
                          {"type": "text", "text": text or "ok"},
                          {"type": "tool_use", "id": call, "name": "read_file",
                           "input": {"path": f"f{step}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                   "content": _text(args.append, 100 * index + step)}]}]
        await asyncio.sleep(args.gap)


def picker_follow_ups(dep) -> tuple[float, float]:
    local = total = 0.0
    for name, url in dep.metrics_urls.items():
        if not name.startswith("picker"):
            continue
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("ppd_decisions_total") and 'turn="follow_up"' in line:
                value = float(line.rsplit(" ", 1)[1])
                total += value
                local += value if 'route="decode_local"' in line else 0.0
    return local, total


async def run(dep, args) -> Counts:
    counts = Counts()
    async with httpx.AsyncClient() as client:
        tasks = []
        for i in range(args.sessions):
            tasks.append(asyncio.create_task(session(client, dep, args, i, counts)))
            await asyncio.sleep(args.spacing)
        await asyncio.gather(*tasks)
    return counts


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        dep = start(ServeOptions(graph=args.graph, http_port=free_port(), nats_port=free_port(),
                                 etcd_port=free_port(), run_dir=Path(tmp) / "run"), log=lambda _m: None)
        try:
            counts = asyncio.run(run(dep, args))
            local, total = picker_follow_ups(dep)
        finally:
            dep.stop()
    print(f"$ uv run python scripts/agent_sessions.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"{args.sessions} sessions x {args.steps} requests over /v1/messages, a shared "
          f"~{args.system_tokens}-token system prompt, no session header, graph {args.graph}: "
          f"{time.monotonic() - started:.0f} s")
    share = counts.own_history / counts.follow_ups if counts.follow_ups else 0.0
    print(f"follow-ups that found their own session's history: {counts.own_history} of "
          f"{counts.follow_ups} ({share:.1%}); failed requests: {counts.failed}")
    if counts.cached:
        print(f"first requests {min(counts.first_prompts)}-{max(counts.first_prompts)} prompt tokens; "
              f"cached per follow-up: min {min(counts.cached)}, max {max(counts.cached)}")
    print(f"the picker's follow-up decisions: {local:.0f} decode-local of {total:.0f}")


if __name__ == "__main__":
    main()
