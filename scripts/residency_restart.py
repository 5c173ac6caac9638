"""Router restarted mid-workload: what share of follow-ups still run decode-local?

The issue-10 figure: on the ppd graph (1P3D simulated workers), 40 conversations that share a
1,500-token system prompt start one every ``--spacing`` seconds; the router is SIGKILLed
``--restart-at`` seconds in and started again with the same command. Counted: the follow-ups SENT
``--after`` (10) seconds or more after the restart, and how many of them ran decode-local.

Exactness: at restart + ``--after`` the client stops sending for a moment, waits until every request
already sent has its first token (its route is decided), reads the new router's decision counters,
then goes on; the follow-ups counted are the counters' increase from that snapshot to the end, and
the client checks that it sent exactly that many follow-ups after the gate.

    uv run python scripts/residency_restart.py            # prints the share and the command
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dynamo_ppd.bench.compare import ppd_graph_with_mode
from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.process import free_port
from dynamo_ppd.launch.servers import live_dynamo_keys, revoke_leases

# ~1,500 tokens with the simulated model's tokenizer (measured and printed below).
SYSTEM = ("You are the operations assistant of a container port. Follow the safety manual, quote "
          "berth numbers exactly, and keep answers short. ") * 19


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=40, help="conversations (default 40)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6)")
    p.add_argument("--spacing", type=float, default=0.6, help="seconds between conversation starts")
    p.add_argument("--think", type=float, default=1.0, help="seconds between a conversation's turns")
    p.add_argument("--restart-at", type=float, default=8.0, help="seconds in: SIGKILL the router")
    p.add_argument("--after", type=float, default=10.0,
                   help="count follow-ups sent this long after the restart or later (default 10)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length (default 32)")
    p.add_argument("--mode", default="local",
                   help="router --mode (default local: every follow-up whose history the decode worker "
                        "holds runs there, so the share measures residency alone; ppd: the policy "
                        "may also choose prefill for load)")
    p.add_argument("--no-restart", action="store_true",
                   help="control run: the same workload and counting window, the router left alone")
    return p.parse_args(argv)


def router_metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("ppd_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def follow_ups(metrics: dict[str, float]) -> tuple[float, float]:
    """(decode-local follow-ups, all follow-ups) in the router's decision counters."""
    rows = {k: v for k, v in metrics.items()
            if k.startswith("ppd_decisions_total") and 'turn="follow_up"' in k}
    return sum(v for k, v in rows.items() if 'route="decode_local"' in k), sum(rows.values())


class Workload:
    def __init__(self, dep, args: argparse.Namespace):
        self.dep, self.args = dep, args
        self.gate = asyncio.Event()
        self.gate.set()
        self.undecided = 0  # requests sent that have no first token yet
        self.sent_after_gate = 0  # follow-ups sent once the gate reopened
        self.gate_passed = False
        self.failures = 0  # attempts that failed (the router was down): retried
        self.prompt_tokens: list[int] = []

    async def chat(self, client: httpx.AsyncClient, session: str, messages: list[dict],
                   follow_up: bool) -> str:
        body = {"model": self.dep.model_name, "messages": messages, "max_tokens": self.args.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        while True:
            await self.gate.wait()
            if follow_up and self.gate_passed:
                self.sent_after_gate += 1
            self.undecided += 1
            decided = False
            text, usage = "", None
            try:
                async with client.stream("POST", f"{self.dep.base_url}/v1/chat/completions", json=body,
                                         headers={"x-dynamo-session-id": session}, timeout=60) as response:
                    if response.status_code != 200:
                        raise httpx.HTTPStatusError(str(response.status_code), request=response.request,
                                                    response=response)
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise httpx.HTTPError(str(chunk["error"]))
                        if not decided:
                            decided = True
                            self.undecided -= 1
                        for choice in chunk.get("choices", []):
                            text += choice.get("delta", {}).get("content") or ""
                        usage = chunk.get("usage") or usage
                if usage:
                    self.prompt_tokens.append(usage["prompt_tokens"])
                return text
            except httpx.HTTPError:
                self.failures += 1
                if follow_up and self.gate_passed:
                    self.sent_after_gate -= 1  # only the attempt that is answered counts
                await asyncio.sleep(0.5)
            finally:
                if not decided:
                    self.undecided -= 1

    async def conversation(self, client: httpx.AsyncClient, index: int) -> None:
        await asyncio.sleep(index * self.args.spacing)
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(self.args.turns):
            messages.append({"role": "user", "content": f"Conversation {index}, question {turn + 1}: "
                                                        f"which vessel is at berth {index * 7 + turn}?"})
            answer = await self.chat(client, f"restart-{index}", messages, follow_up=turn > 0)
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(self.args.think)

    async def hold_gate_and_snapshot(self, at: float, url: str) -> dict[str, float]:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        self.gate.clear()
        while self.undecided > 0:
            await asyncio.sleep(0.01)
        snapshot = await asyncio.to_thread(router_metrics, url)
        self.gate_passed = True
        self.gate.set()
        return snapshot


def restart_router(dep) -> float:
    """SIGKILL the router, drop what it left in etcd (as its lease would expire), start the same
    command again; returns the monotonic time of the kill."""
    [router] = [p for p in dep.workers if p.label.startswith("router")]
    killed_at = time.monotonic()
    router.signal_group(signal.SIGKILL)
    router.wait_stopped(time.monotonic() + 10)
    left = [(key, lease) for key, lease in live_dynamo_keys(dep.endpoints.etcd_url, "ppd")
            if b"router" in key]
    revoke_leases(dep.endpoints.etcd_url, left)
    router.start()
    return killed_at


async def run(dep, args: argparse.Namespace) -> dict:
    work = Workload(dep, args)
    url = next(u for label, u in dep.metrics_urls.items() if label.startswith("router"))
    started = time.monotonic()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as client:
        conversations = [asyncio.create_task(work.conversation(client, i)) for i in range(args.conversations)]
        await asyncio.sleep(args.restart_at)
        killed_at = time.monotonic() if args.no_restart else await asyncio.to_thread(restart_router, dep)
        snapshot = await work.hold_gate_and_snapshot(killed_at + args.after, url)
        await asyncio.gather(*conversations)
    end = router_metrics(url)
    local0, all0 = follow_ups(snapshot)
    local1, all1 = follow_ups(end)
    counted, local = all1 - all0, local1 - local0
    resyncs = {k.split('"')[1]: v for k, v in end.items() if k.startswith("ppd_residency_resyncs_total")}
    by_reason = {k[len("ppd_decisions_total"):]: end[k] - snapshot.get(k, 0.0) for k in end
                 if k.startswith("ppd_decisions_total") and 'turn="follow_up"' in k
                 and end[k] > snapshot.get(k, 0.0)}
    return {"follow_ups_counted": int(counted), "decode_local": int(local),
            "share": local / counted if counted else 0.0, "client_sent_after_gate": work.sent_after_gate,
            "failed_attempts_retried": work.failures, "restart_at_s": round(killed_at - started, 2),
            "smallest_prompt_tokens": min(work.prompt_tokens) if work.prompt_tokens else None,
            "resyncs_by_reason": resyncs, "residency_misses": end.get("ppd_residency_misses_total", 0.0),
            "orphans": end.get("ppd_residency_orphans_total", 0.0), "counted_by_reason": by_reason}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ppd-restart-") as tmp:
        graph = ppd_graph_with_mode(args.mode, Path(tmp)) if args.mode != "ppd" else "ppd"
        dep = start(ServeOptions(graph=graph, http_port=free_port(), nats_port=free_port(),
                                 etcd_port=free_port(), run_dir=Path(tmp) / "run"), log=lambda _m: None)
        try:
            result = asyncio.run(run(dep, args))
        finally:
            dep.stop()
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["uv run python scripts/residency_restart.py", *given])
    print(json.dumps(result, indent=2))
    what = "the moment the router was left alone" if args.no_restart else "the router restart"
    print(f"{result['decode_local']}/{result['follow_ups_counted']} follow-ups sent >= {args.after:g} s "
          f"after {what} ran decode-local ({100 * result['share']:.1f}%); command: {command.strip()}")


if __name__ == "__main__":
    main()
