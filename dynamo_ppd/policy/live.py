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
import json
import random
import statistics
import time

import httpx

from ..engine.profile import DEFAULT_PROFILE
from .build import Progress, _order
from .grid import GridSpec, default_grid
from .table import TABLE_FORMAT_VERSION, BuildInfo, Cell, Measurement, PpdTable, Weights, decide

TIMEOUT_S = 30.0
FORCE = "x-ppd-route:"


class _Text:
    """User messages of about N tokens: words of the served model's vocabulary when it is the
    local simulated model (one token each), else short words (about one token each)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        try:
            from tokenizers import Tokenizer

            from .. import model

            info = model.load_model_info(model.default_model_dir())
            tok = Tokenizer.from_file(str(model.default_model_dir() / "tokenizer.json"))
            low, high = info.generation_token_range
            self.words = [tok.decode([i]) for i in range(low, min(high, low + 2000))]
            self.joiner = ""
        except Exception:  # noqa: BLE001 (a real model: plain words)
            self.words = [f"w{i}" for i in range(2000)]
            self.joiner = " "

    def __call__(self, tokens: int) -> str:
        return self.joiner.join(self.rng.choices(self.words, k=max(1, tokens)))


async def _turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                session: str, annotations: list[str]) -> tuple[float, float | None, str] | None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "nvext": {"annotations": annotations}}
    sent = time.monotonic()
    stamps, text = [], ""
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S,
                                 headers={"x-dynamo-session-id": session}) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    stamps.append(time.monotonic())
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    except (httpx.HTTPError, asyncio.TimeoutError):
        return None
    if not stamps or stamps[-1] - sent > TIMEOUT_S:
        return None
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return stamps[0] - sent, tpot, text


async def _measure(url: str, model: str, context: int, n_in: int, n_out: int, qps: float, seconds: float,
                   route: str, seed: int) -> Measurement:
    rng = random.Random(seed)
    text = _Text(seed)
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
        second = await _turn(client, url, model, messages, n_out, session, [FORCE + route])
        arrivals += 1
        if second is None:
            failures += 1
            ttfts.append(TIMEOUT_S)
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
    return Measurement(follow_up_ttft_s=max(statistics.fmean(ttfts) if ttfts else TIMEOUT_S, 1e-6),
                       tpot_s=max(statistics.fmean(tpots) if tpots else TIMEOUT_S, 1e-6), requests=arrivals,
                       achieved_rps=arrivals / seconds, success_rate=(arrivals - failures) / total)


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
    cells.sort(key=lambda c: _order(grid, (c.context_class, c.workload_class, c.qps)))
    return PpdTable(format_version=TABLE_FORMAT_VERSION, profile=profile, config=config.upper(),
                    weights=weights, grid=grid, cells=cells,
                    build=BuildInfo(backend="live", seed=seed, seconds_per_cell=seconds_per_cell,
                                    build_seconds=round(time.monotonic() - started, 1),
                                    created_unix=time.time(), target=url))
