"""Building a PPD table: the paper's phase 1, every grid cell measured at x=0 and x=1.

``--backend sim`` runs each cell on the virtual-clock simulation (fresh cluster per cell and
route, seeded), cells in parallel processes; ``--backend live`` (see `table_live`) drives a running
deployment through the router's forced routes. Either way the table records the rate actually
reached in each cell next to the rate asked for.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from ..engine.profile import EngineProfile, load_profile
from ..experiment.progress import Progress
from ..policy.grid import GridSpec, cell_order, default_grid
from ..policy.simulate import measure_cell
from ..policy.table import TABLE_FORMAT_VERSION, BuildInfo, Cell, Measurement, PpdTable, Weights, decide


def _measure(args: tuple) -> tuple[tuple[str, str, float], Measurement, Measurement]:
    profile_name, config, ctx, wl, qps, seconds, seed = args
    profile = load_profile(profile_name)
    x0, x1 = measure_cell(profile, config, ctx, wl, qps, seconds, seed)
    return (ctx.name, wl.name, qps), x0, x1


def build_sim_table(profile_name: str, config: str, weights: Weights, grid: GridSpec | None = None,
                    seconds_per_cell: float = 10.0, seed: int = 0, jobs: int | None = None,
                    progress: bool = True) -> PpdTable:
    """Measure every cell in the simulation and return the table (deterministic for a seed)."""
    grid = grid or default_grid()
    grid.validate()
    profile: EngineProfile = load_profile(profile_name)
    tasks = [(profile_name, config, ctx, wl, qps, seconds_per_cell, seed)
             for ctx in grid.context_classes for wl in grid.workload_classes for qps in grid.qps_levels]
    started = time.monotonic()
    results: dict[tuple[str, str, float], tuple[Measurement, Measurement]] = {}
    bar = Progress(len(tasks), f"table {profile.name} {config}") if progress else None
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    if jobs <= 1:
        for task in tasks:
            key, x0, x1 = _measure(task)
            results[key] = (x0, x1)
            if bar:
                bar.step()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(_measure, t) for t in tasks]):
                key, x0, x1 = future.result()
                results[key] = (x0, x1)
                if bar:
                    bar.step()
    cells = []
    for (ctx, wl, qps), (x0, x1) in sorted(results.items(), key=lambda kv: cell_order(grid, kv[0])):
        s, decision = decide(x0, x1, weights)
        cells.append(Cell(context_class=ctx, workload_class=wl, qps=qps, via_prefill=x0, decode_local=x1,
                          score=s, decision=decision))
    return PpdTable(
        format_version=TABLE_FORMAT_VERSION, profile=profile.name, config=config.upper(), weights=weights,
        grid=grid, cells=cells,
        build=BuildInfo(backend="sim", seed=seed, seconds_per_cell=seconds_per_cell,
                        build_seconds=round(time.monotonic() - started, 1), created_unix=time.time(),
                        target=f"virtual-clock simulation, {config.upper()}, profile {profile.name}"))

