"""``dynamo-ppd table build --backend live --url URL``: phase 1 on a running deployment.

For each grid cell, two-turn conversations arrive (Poisson) at the cell's rate for
``seconds_per_cell``; every second turn carries the annotation ``x-ppd-route:via_prefill`` or
``x-ppd-route:decode_local``, which the PPD router obeys only when started with
``--allow-forced-route`` (off by default: clients do not choose routes). The client measures
follow-up TTFT and TPOT over streamed chat completions, the rate reached and the success share
(a request over 30 s or an error fails, as in the paper). The router's load at decision time is
not visible from the client, so cells record no conditions (the online correction then compares
against an idle cluster).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from ..bench.client import TokenText, chat_stream
from ..engine.handoff import FORCED_ROUTE_ANNOTATION
from ..engine.profile import DEFAULT_PROFILE
from ..experiment.progress import Progress
from ..policy.grid import GridSpec, cell_order, default_grid
from ..policy.table import TABLE_FORMAT_VERSION, BuildInfo, Cell, Measurement, PpdTable, Weights, decide
from ..sim.outcome import CHAT_TIMEOUT_S


async def _turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                session: str, annotations: list[str]) -> tuple[float, float | None, str] | None:
    """(TTFT, TPOT, reply) of one streamed turn, or None if it failed."""
    ttft, e2e, gaps, text, error = await chat_stream(client, url, model, messages, max_tokens, session,
                                                     tuple(annotations))
    if error is not None or ttft is None or e2e is None or e2e > CHAT_TIMEOUT_S:
        return None
    return ttft, (sum(gaps) / len(gaps) if gaps else None), text


async def _measure(url: str, model: str, context: int, n_in: int, n_out: int, qps: float, seconds: float,
                   route: str, seed: int) -> Measurement:
    rng = random.Random(seed)
    text = TokenText(seed)
    ttfts: list[float] = []
    tpots: list[float] = []
    failures = 0
    arrivals = 0

    async def conversation(index: int, start: float, client: httpx.AsyncClient) -> None:
        nonlocal failures, arrivals
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        session = f"table-{seed}-{route}-{index}-{time.time_ns()}"
        messages = [{"role": "user", "content": text(max(1, context - 128 - n_in))}]
        first = await _turn(client, url, model, messages, 128, session, [])
        arrivals += 1
        if first is None:
            failures += 1
            return
        if first[1] is not None:
            tpots.append(first[1])
        messages += [{"role": "assistant", "content": first[2]}, {"role": "user", "content": text(n_in)}]
        second = await _turn(client, url, model, messages, n_out, session, [FORCED_ROUTE_ANNOTATION + route])
        arrivals += 1
        if second is None:
            failures += 1
            ttfts.append(CHAT_TIMEOUT_S)
            return
        ttfts.append(second[0])
        if second[1] is not None:
            tpots.append(second[1])

    begin = time.monotonic()
    starts, t = [], rng.expovariate(qps / 2)
    while t < seconds:
        starts.append(begin + t)
        t += rng.expovariate(qps / 2)
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(conversation(i, s, client) for i, s in enumerate(starts)))
    total = max(1, arrivals)
    return Measurement(follow_up_ttft_s=max(statistics.fmean(ttfts) if ttfts else CHAT_TIMEOUT_S, 1e-6),
                       tpot_s=max(statistics.fmean(tpots) if tpots else CHAT_TIMEOUT_S, 1e-6),
                       requests=arrivals, achieved_rps=arrivals / seconds,
                       success_rate=(arrivals - failures) / total)


def build_live_table(url: str, config: str, weights: Weights, grid: GridSpec | None = None,
                     seconds_per_cell: float = 10.0, seed: int = 0, profile: str = DEFAULT_PROFILE,
                     progress: bool = True) -> PpdTable:
    grid = grid or default_grid()
    grid.validate()
    url = url.rstrip("/")
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    model = models[0]["id"]
    started = time.monotonic()
    bar = Progress(len(grid.context_classes) * len(grid.workload_classes) * len(grid.qps_levels),
                   f"live table {config}") if progress else None
    cells = []
    for ctx in grid.context_classes:
        for wl in grid.workload_classes:
            for qps in grid.qps_levels:
                args = (url, model, ctx.representative_tokens, wl.input_tokens, wl.output_tokens, qps,
                        seconds_per_cell)
                x0 = asyncio.run(_measure(*args, route="via_prefill", seed=seed))
                x1 = asyncio.run(_measure(*args, route="decode_local", seed=seed))
                s, decision = decide(x0, x1, weights)
                cells.append(Cell(context_class=ctx.name, workload_class=wl.name, qps=qps, via_prefill=x0,
                                  decode_local=x1, score=s, decision=decision))
                if bar:
                    bar.step()
    cells.sort(key=lambda c: cell_order(grid, (c.context_class, c.workload_class, c.qps)))
    return PpdTable(format_version=TABLE_FORMAT_VERSION, profile=profile, config=config.upper(),
                    weights=weights, grid=grid, cells=cells,
                    build=BuildInfo(backend="live", seed=seed, seconds_per_cell=seconds_per_cell,
                                    build_seconds=round(time.monotonic() - started, 1),
                                    created_unix=time.time(), target=url))
