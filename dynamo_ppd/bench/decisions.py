"""Decision latency of the router, in process: `just bench-decisions`
(`python -m dynamo_ppd.bench.decisions`).

Times the router's real decision path, `Routing.plan_turn`: Dynamo's block hashing of the prompt
and its prefix ids, the session lookup (by the x-dynamo-session-id header, or by the longest
known prefix), the residency index's answer for each worker (`routing.residency`: a set lookup per
block), the loads, and the pure `routing.planner.plan` (placement and the policy), for follow-up
turns of many conversations whose histories the decode workers hold (their KV events applied
beforehand). Prints percentiles. No network, no etcd: the session table is filled directly. The
paper's proxy claims < 1 ms per decision; our goal is p99 < 100 us.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from ..engine.blocks import dynamo_block_hasher, prefix_chain
from ..relay.router import PpdRouter
from ..routing.args import parse_args
from ..routing.metrics import RoutingMetrics
from ..routing.sessions import SessionRecord, history_hashes
from ..routing.start import build_policy


class _Instances:
    def __init__(self, ids: list[int]):
        self._ids = ids

    def instance_ids(self) -> list[int]:
        return self._ids


def build(num_sessions: int, history_tokens: int, mode: str, seed: int = 0, table: str = "none"):
    """A router with `num_sessions` conversations spread over 3 decode workers (1 prefill); ``table``
    as the router's ``--table``."""
    config = parse_args(["--mode", mode, "--table", table])
    decode_ids, prefill_ids = [11, 12, 13], [1]
    router = PpdRouter(None, config, build_policy(config), RoutingMetrics(),
                       clients={"decode": _Instances(decode_ids), "prefill": _Instances(prefill_ids)})
    block_hashes = dynamo_block_hasher()
    rng = random.Random(seed)
    histories = []
    for i in range(num_sessions):
        history = [rng.randrange(1000, 8000) for _ in range(history_tokens)]
        local = block_hashes(history, config.block_size)
        decode = decode_ids[i % len(decode_ids)]
        blocks = [{"block_hash": (i << 20) + b, "tokens_hash": h} for b, h in enumerate(local)]
        router.residency.apply(decode, {"event_id": i, "data": {"stored": {"parent_hash": None,
                                                                          "blocks": blocks}}})
        anchor, digest = history_hashes(prefix_chain(local), history, config.block_size)
        router.sessions.table.put(SessionRecord(
            f"s{i}", decode_worker=decode, prefill_worker=1, turn=1, context_tokens=len(history),
            history_hash=anchor, history_digest=digest, last_access=time.time()))
        histories.append(history)
    return router, histories


async def measure(router: PpdRouter, histories: list[list[int]], decisions: int, with_header: bool,
                  new_tokens: int = 64, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    tails = [[rng.randrange(1000, 8000) for _ in range(new_tokens)] for _ in range(64)]
    samples = []
    for n in range(decisions):
        index = n % len(histories)
        tokens = histories[index] + tails[n % len(tails)]
        request = {"token_ids": tokens, "stop_conditions": {"max_tokens": 128}}
        if with_header:
            request["agent_context"] = {"session_id": f"s{index}"}
        start = time.perf_counter_ns()
        await router.plan_turn(request, tokens)
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.decisions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=100_000, help="decisions to time")
    parser.add_argument("--sessions", type=int, default=1000, help="conversations known to the router")
    parser.add_argument("--history-tokens", type=int, default=2048, help="history length per conversation")
    parser.add_argument("--mode", default="ppd", help="router mode (ppd uses the cost-model predictor)")
    args = parser.parse_args(argv)
    router, histories = build(args.sessions, args.history_tokens, args.mode)
    print(f"{args.decisions} decisions, mode {args.mode}, {args.sessions} sessions, prompts of "
          f"{args.history_tokens}+64 tokens")
    print(f"{'session found by':<22}{'p50 us':>9}{'p90 us':>9}{'p99 us':>9}{'mean us':>9}")
    for label, header in (("x-dynamo-session-id", True), ("longest prefix", False)):
        samples = asyncio.run(measure(router, histories, args.decisions, header))
        q = statistics.quantiles(samples, n=100)
        print(f"{label:<22}{q[49]:>9.1f}{q[89]:>9.1f}{q[98]:>9.1f}{statistics.mean(samples):>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
