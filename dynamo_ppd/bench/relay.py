"""What the relay hop costs: `just bench-relay` (`python -m dynamo_ppd.bench.relay`).

The same load through (a) the PPD router (`graphs/ppd.yaml`; ``ppd-lean``: the same with
`LEAN_ROUTER_ARGS`), (b) the bare pass-through relay (`graphs/relay.yaml`,
`relay/passthrough.py`: every request decode-local, each chunk yielded unchanged; ``relay-pd``:
the same relay sending the requests the PPD router sends for this load, turn 1 through the
prefill worker and the follow-up decode-local, with none of its state) and (c)
Dynamo's frontend-native PD (`graphs/pd.yaml`), each on the same simulated workers, one system at
a time. Per system it prints the CPU time of every process per relayed token (utime + stime from
``/proc/<pid>/stat`` over the run, all threads: robust to other work on the machine, unlike
wall-clock figures), the relay processes' split by thread, the token rate at which one relay
process would saturate a core (1 / its CPU per token), and TTFT p50 at low load. With
``--router-replicas 1,2`` the PPD router runs as 1 and as 2 replicas behind the frontend; per
replica: CPU per token and its share of the tokens (the router's ``ppd_relayed_tokens_total``).

``picker`` is `graphs/ppd.yaml`, PPD off the token path: a gateway calls the endpoint picker over
ext_proc and Dynamo's frontend carries every token; ``gateway`` is the same graph with the
gateway in pass-through and no picker. For these, PPD's own processes (picker, gateway) are shown
per token beside the relay router and Dynamo's frontend, in total and less their idle CPU.

The load is the paper's decode-heavy synthetic ``syn-a-in32-out512`` (2-turn conversations: turn 1
512 prompt tokens -> 128, turn 2 appends 32 -> 512; no think time), Poisson at ``--rate`` conv/s
for ``--duration`` s. Tokens are counted from the client: every answer asks for exactly
``max_tokens`` with ``ignore_eos``, so a completed request relayed that many (a failed one counts
nothing and is reported). Intervals: each run is repeated ``--repeats`` times (fresh graph each
time); per-token CPU is given as the mean with the min-max over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

from ..argtypes import positive_floats
from ..experiment.stats import paired_difference
from ..launch import ServeOptions, start
from ..launch.graph import load_graph
from ..launch.process import free_port
from ..workloads.manifest import Manifest, ManifestConversation, ManifestHeader, ManifestTurn
from .client import run_manifest
from .compare import ppd_graph_with_mode
from .cpu import process_cpu_s, thread_cpu_s

WORKLOAD = "syn-a-in32-out512"
FIRST_TURN = (512, 128)  # (user tokens, max tokens)
FOLLOW_UP = (32, 512)
SYSTEMS = ("ppd", "ppd-lean", "relay", "relay-pd", "pd", "picker", "gateway")
# The relay process(es), by label prefix; for ``picker`` (the endpoint picker of `graphs/ppd.yaml`,
# which relays nothing) the process whose CPU is compared with the relays'.
RELAY_LABEL = {"ppd": "router", "ppd-lean": "router", "relay": "router", "relay-pd": "router", "pd": None,
               "picker": "picker", "gateway": None}
# picker: `graphs/ppd.yaml` (gateway -> ext_proc picker; Dynamo's frontend carries the tokens).
# gateway: the same graph with the gateway in pass-through and no picker, so the frontend's own
# KV routing and always-bypass conditional disaggregation route every turn: what the picker's
# callout adds is the difference.
GATEWAY_SYSTEMS = ("picker", "gateway")
IDLE_S = 3.0  # seconds of no load before each run: every process's idle CPU, subtracted per request
# ppd-lean: the PPD router without the two subscriptions whose cost follows the workers' activity
# rather than the tokens relayed (what each gives up: `python -m dynamo_ppd.relay --help`).
LEAN_ROUTER_ARGS = ["--no-load-reports", "--no-residency-recovery"]
# relay-pd: the bare relay sending the PPD router's requests for this load (turn 1 through the
# prefill worker, the follow-up decode-local on the same decode worker), without its state.
RELAY_PD_ARGS = ["--first-turn-via-prefill"]
WORKERS = ("simulated", "mocker")
MOCKER_SYSTEMS = ("ppd", "ppd-lean", "relay")  # no P/D route to take: the mocker workers are aggregated
# ``--workers mocker``: Dynamo's own mocker as 3 aggregated workers. Its engine runs in Rust and
# costs the machine far less per token than the simulated TensorRT-LLM worker (a Python handler
# per chunk), so at a high rate the relay, not the workers, runs out of CPU: the regime where
# coalescing is meant to pay. The system's own graph is used with its workers swapped
# (`_mocker_graph`); the PPD router runs in `--mode replica` there (same relay path:
# `dispatch.replica` -> `_stream` -> `coalesced`; sessions, residency and decisions as ever).
MOCKER_WORKER = ["{python}", "-m", "dynamo.mocker", "--model-path", "{model_dir}", "--model-name",
                 "{model_name}", "--disaggregation-mode", "agg", "--block-size", "32",
                 "--endpoint", "dyn://workers.agg.generate"]
# What each relay is told so that it reaches them (appended: the last flag wins over its graph's).
MOCKER_RELAY_ARGS = {"ppd": ["--mode", "replica", "--replica-component", "agg"],
                     "relay": ["--decode-component", "agg"]}


def syn_a_manifest(rate: float, duration_s: float, seed: int = 0) -> Manifest:
    """``syn-a-in32-out512`` at ``rate`` conv/s: Poisson arrivals, 2 turns, no think time."""
    from ..workloads.generators import poisson_arrivals

    turns = [ManifestTurn(FIRST_TURN[1], user_tokens=FIRST_TURN[0]),
             ManifestTurn(FOLLOW_UP[1], user_tokens=FOLLOW_UP[0])]
    header = ManifestHeader(workload=WORKLOAD, seed=seed, rate_conv_per_s=rate, duration_s=duration_s,
                            description="turn 1 in=512 out=128, turn 2 in=32 out=512 (relay benchmark)")
    return Manifest(header, [ManifestConversation(f"c{i:05d}", t, list(turns))
                             for i, t in enumerate(poisson_arrivals(rate, duration_s, seed))])


def _cpu_by_label(dep) -> dict[str, float]:
    return {p.label: process_cpu_s(p.popen.pid) for p in dep.processes() if p.popen and p.exit_code() is None}


def _threads_by_label(dep, system: str) -> dict[str, dict[str, float]]:
    """CPU seconds per thread name of the relay process(es) (none for frontend-native PD)."""
    prefix = RELAY_LABEL[system]
    if prefix is None:
        return {}
    return {p.label: thread_cpu_s(p.popen.pid) for p in dep.processes()
            if p.popen and p.exit_code() is None and _labelled(p.label, prefix)}


def _labelled(label: str, prefix: str) -> bool:
    """``label`` is the process ``prefix`` or one of its replicas (``router``, ``router-1``)."""
    return label == prefix or label.startswith(f"{prefix}-")


def _relayed(dep, what: str = "tokens") -> dict[str, float]:
    """Each PPD router replica's ``ppd_relayed_<what>_total`` (empty for other systems)."""
    out = {}
    for label, url in dep.metrics_urls.items():
        if label.startswith("router"):
            for line in httpx.get(url, timeout=10).text.splitlines():
                if line.startswith(f"ppd_relayed_{what}_total "):
                    out[label] = float(line.split()[1])
    return out


def _pick_cpu_s(dep) -> float:
    """The endpoint pickers' CPU inside their per-request work (``ppd_picker_pick_cpu_seconds``)."""
    total = 0.0
    for label, url in dep.metrics_urls.items():
        if label.startswith("picker"):
            for line in httpx.get(url, timeout=10).text.splitlines():
                if line.startswith("ppd_picker_pick_cpu_seconds_total "):
                    total += float(line.split()[1])
    return total


@dataclass
class Run:
    """One system at one load: CPU seconds per process over the run, tokens relayed."""

    system: str
    replicas: int
    rate: float
    cpu_s: dict[str, float]
    tokens: int
    requests: int
    failed: int
    wall_s: float
    per_replica_tokens: dict[str, float] = field(default_factory=dict)
    lag_p99_ms: float = 0.0
    chunks: float | None = None  # chunks the PPD router sent for its tokens (fewer: coalesced)
    worker_speedup: float = 1.0
    errors: list[str] = field(default_factory=list)
    round: int = 0  # which round of repeats (every system runs once per round, back to back)
    # The relay processes' CPU seconds over the run per thread name (Python's main thread
    # "python", Dynamo's Rust runtime "tokio-rt-worker", gRPC's threads): where the CPU goes.
    threads_cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)
    workers: str = "simulated"  # the workers behind the relay (`WORKERS`)
    # Each process's CPU seconds per second with no load (`IDLE_S` before the run): its
    # subscriptions and timers, which the per-request figures subtract.
    idle_cpu_per_s: dict[str, float] = field(default_factory=dict)
    pick_cpu_s: float = 0.0  # the endpoint pickers' CPU inside their per-request work (`_pick_cpu_s`)

    def us_per_token(self, prefix: str) -> float:
        """CPU us per relayed token of the processes whose label starts with ``prefix``."""
        cpu = sum(v for k, v in self.cpu_s.items() if _labelled(k, prefix))
        return cpu / self.tokens * 1e6 if self.tokens else float("nan")

    def busy_us_per_token(self, prefix: str) -> float:
        """CPU us per token of ``prefix``'s processes less what they burn idle: the per-request work."""
        cpu = sum(v - self.idle_cpu_per_s.get(k, 0.0) * self.wall_s for k, v in self.cpu_s.items()
                  if _labelled(k, prefix))
        return cpu / self.tokens * 1e6 if self.tokens else float("nan")

    def relay_us_per_token(self) -> float | None:
        label = RELAY_LABEL[self.system]
        return None if label is None else self.us_per_token(label)


def _mocker_graph(system: str, workdir: Path) -> str:
    """The system's bundled graph (ppd or relay) with no prefill worker and its decode workers
    replaced by 3 aggregated mocker workers (`MOCKER_WORKER`), written under ``workdir``."""
    graph, _ = load_graph("ppd-relay" if system.startswith("ppd") else "relay")
    components = [msgspec.structs.replace(c, command=MOCKER_WORKER, replicas=3,
                                          description="aggregated Dynamo mocker worker")
                  if c.name == "decode" else c for c in graph.components if c.name != "prefill"]
    path = workdir / f"relay-mocker-{system}.yaml"
    graph = msgspec.structs.replace(graph, name=f"{graph.name}-mocker", components=components,
                                    description=f"{graph.name}'s frontend and relay in front of 3 aggregated "
                                    "Dynamo mocker workers (bench relay --workers mocker)")
    path.write_bytes(msgspec.yaml.encode(graph))
    return str(path)


def _passthrough_gateway_graph(workdir: Path) -> str:
    """`graphs/ppd.yaml` without its picker: the gateway in pass-through, written under ``workdir``."""
    graph, _ = load_graph("ppd")
    components = []
    for c in graph.components:
        if c.name == "picker":
            continue
        if c.name == "gateway":
            at = c.command.index("--picker")
            c = msgspec.structs.replace(c, command=c.command[:at] + c.command[at + 2:])
        components.append(c)
    path = workdir / "ppd-gateway-passthrough.yaml"
    path.write_bytes(msgspec.yaml.encode(msgspec.structs.replace(
        graph, name="ppd-gateway", components=components,
        description="the ppd graph's gateway in pass-through, no picker (bench relay)")))
    return str(path)


def _graph(system: str, workdir: Path, workers: str = "simulated") -> str:
    if workers == "mocker":
        return _mocker_graph(system, workdir)
    if system == "picker":
        return "ppd"
    if system == "gateway":
        return _passthrough_gateway_graph(workdir)
    if system.startswith("ppd"):
        return ppd_graph_with_mode("ppd", workdir)
    return "relay" if system == "relay-pd" else system


def _up(system: str, replicas: int, workdir: Path, tag: str, worker_speedup: float = 1.0,
        workers: str = "simulated", picker_args: Sequence[str] = ()):
    """``worker_speedup`` > 1: simulated workers faster than real time (their --speedup), so tokens
    arrive faster than one relay process forwards them one by one: the relay is the bottleneck,
    as on GPUs, instead of the workers sharing its cores. ``workers="mocker"``: Dynamo's mocker
    instead (`_mocker_graph`; ``worker_speedup`` is its --speedup-ratio)."""
    label = RELAY_LABEL[system]
    extra = {label: replicas} if label else {}
    if workers == "mocker":
        args = {"decode": ["--speedup-ratio", f"{worker_speedup:g}"],
                "router": MOCKER_RELAY_ARGS["ppd" if system.startswith("ppd") else system]}
    else:
        # The PPD router is told too, so its rate and learned latencies stay on the workers' clock.
        sped = (("prefill", "decode", "router") if system.startswith("ppd") else
                ("prefill", "decode", "picker") if system == "picker" else ("prefill", "decode"))
        args = {c: ["--speedup", f"{worker_speedup:g}"] for c in sped} if worker_speedup != 1 else {}
    own = {"ppd-lean": LEAN_ROUTER_ARGS, "relay-pd": RELAY_PD_ARGS}.get(system)
    if system == "picker" and picker_args:
        args["picker"] = [*args.get("picker", []), *picker_args]
    if own:
        args["router"] = [*args.get("router", []), *own]
    return start(ServeOptions(graph=_graph(system, workdir, workers), http_port=free_port(),
                              nats_port=free_port(), etcd_port=free_port(),
                              run_dir=workdir / f"{system}-{workers}-{tag}", replicas=extra,
                              extra_args=args),
                 log=lambda _m: None)


def _warm_up(dep) -> None:
    """A few conversations first, so connection set-up and first-use costs stay out of the run."""
    asyncio.run(run_manifest(dep.base_url, syn_a_manifest(4.0, 1.0, seed=99), seed=99))


def measure_load(system: str, replicas: int, rate: float, duration_s: float, workdir: Path, tag: str,
                 seed: int = 0, worker_speedup: float = 1.0, workers: str = "simulated",
                 picker_args: Sequence[str] = ()) -> Run:
    manifest = syn_a_manifest(rate, duration_s, seed)
    dep = _up(system, replicas, workdir, tag, worker_speedup, workers, picker_args)
    try:
        _warm_up(dep)
        idle_before = _cpu_by_label(dep)
        time.sleep(IDLE_S)
        idle = {k: (v - idle_before[k]) / IDLE_S for k, v in _cpu_by_label(dep).items() if k in idle_before}
        tokens_before, chunks_before = _relayed(dep), _relayed(dep, "chunks")
        pick_before = _pick_cpu_s(dep)
        before, threads_before = _cpu_by_label(dep), _threads_by_label(dep, system)
        started = time.monotonic()
        results = asyncio.run(run_manifest(dep.base_url, manifest, seed=seed))
        wall = time.monotonic() - started
        after, threads_after = _cpu_by_label(dep), _threads_by_label(dep, system)
        tokens_after, chunks_after = _relayed(dep), _relayed(dep, "chunks")
        pick_cpu = _pick_cpu_s(dep) - pick_before
    finally:
        dep.stop()
    by_key = {(c.conversation_id, i + 1): t.max_tokens for c in manifest.conversations
              for i, t in enumerate(c.turns)}
    ok = [r for r in results if r.ok]
    lags = sorted(r.lag_s for r in results)
    return Run(system, replicas, rate, {k: after[k] - before[k] for k in after if k in before},
               sum(by_key[(r.conversation_id, r.turn)] for r in ok), len(results), len(results) - len(ok),
               wall, {k: tokens_after[k] - tokens_before.get(k, 0.0) for k in tokens_after},
               lags[int(0.99 * (len(lags) - 1))] * 1e3 if lags else 0.0,
               sum(chunks_after.values()) - sum(chunks_before.values()) if chunks_after else None,
               worker_speedup, sorted({r.error or "?" for r in results if not r.ok}),
               threads_cpu_s={label: {name: cpu - threads_before.get(label, {}).get(name, 0.0)
                                      for name, cpu in threads.items()}
                              for label, threads in threads_after.items()},
               workers=workers, idle_cpu_per_s=idle, pick_cpu_s=pick_cpu)


def _ttft_ms(client: httpx.Client, base_url: str, model: str, messages: list[dict], max_tokens: int,
             session: str) -> tuple[float, str]:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": messages}
    sent = time.perf_counter()
    first, text = None, ""
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60,
                       headers={"x-dynamo-session-id": session}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        first = first or (time.perf_counter() - sent) * 1e3
                        text += content
    if first is None:
        raise RuntimeError("no token came back")
    return first, text


@dataclass(frozen=True)
class TtftSetup:
    """The low-load TTFT test: 2-turn conversations (turn 1 ``first_words`` fresh words, turn 2
    32 more; 4 output tokens each), ``concurrency`` of them in flight at a time (1: one after
    another, with gaps), the workers at ``worker_speedup``."""

    conversations: int = 40
    first_words: int = FIRST_TURN[0]
    concurrency: int = 1
    worker_speedup: float = 1.0

    def describe(self) -> str:
        at_a_time = ("one 2-turn conversation at a time" if self.concurrency == 1 else
                     f"{self.concurrency} 2-turn conversations in flight")
        speed = f", workers at {self.worker_speedup:g}x" if self.worker_speedup != 1 else ""
        return f"{at_a_time}, turn 1 {self.first_words:,} fresh words, turn 2 +32, 4 output tokens{speed}"


WARM_UP_CONVERSATIONS = 3


def measure_ttft(system: str, setup: TtftSetup, workdir: Path, tag: str,
                 picker_args: Sequence[str] = ()) -> tuple[list[float], list[float]]:
    """TTFT (ms) of turn 1 and turn 2 of each conversation (`TtftSetup`), in conversation order;
    every system gets the same prompts (one seed), so conversation i is the same on each."""
    dep = _up(system, 1, workdir, tag, worker_speedup=setup.worker_speedup, picker_args=picker_args)
    rng = random.Random(0)
    words = [f"w{n}" for n in range(2000)]
    total = setup.conversations + WARM_UP_CONVERSATIONS
    prompts = [(" ".join(rng.choices(words, k=setup.first_words)),
                " ".join(rng.choices(words, k=FOLLOW_UP[0]))) for _ in range(total)]

    def one(client: httpx.Client, c: int) -> tuple[float, float]:
        first, follow = prompts[c]
        messages = [{"role": "user", "content": first}]
        t1, reply = _ttft_ms(client, dep.base_url, dep.model_name, messages, 4, f"ttft-{tag}-{c}")
        time.sleep(0.05)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
        t2, _ = _ttft_ms(client, dep.base_url, dep.model_name, messages, 4, f"ttft-{tag}-{c}")
        time.sleep(0.05)
        return t1, t2

    try:
        with httpx.Client(limits=httpx.Limits(max_connections=setup.concurrency + 4)) as client:
            for c in range(WARM_UP_CONVERSATIONS):
                one(client, c)
            with ThreadPoolExecutor(setup.concurrency) as pool:
                timed = list(pool.map(lambda c: one(client, c), range(WARM_UP_CONVERSATIONS, total)))
    finally:
        dep.stop()
    return [t1 for t1, _ in timed], [t2 for _, t2 in timed]


def callout_added(ttft: dict[str, tuple[list[float], list[float]]], system: str = "picker",
                  base: str = "gateway") -> list[str]:
    """What ``system`` adds to TTFT over ``base`` (the same gateway in pass-through): the
    difference of medians, paired by conversation (the same prompts), with its 95% interval."""
    if system not in ttft or base not in ttft:
        return []
    rows = []
    for turn, index in (("turn 1", 0), ("turn 2", 1)):
        a = {str(i): [v] for i, v in enumerate(ttft[system][index])}
        b = {str(i): [v] for i, v in enumerate(ttft[base][index])}
        added = paired_difference(a, b)
        if added is not None:
            rows.append(f"| {turn} | {added.text(2)} ms | {added.conversations} |")
    if not rows:
        return []
    return ["", f"TTFT {system} adds over {base} (difference of medians, paired by conversation, 95% "
            "bootstrap interval):", "", "| turn | added | conversations |", "|---|---|---|", *rows]


class Report(msgspec.Struct):
    """What `--json` writes: every run, and the low-load TTFT samples per system."""

    workload: str
    runs: list[dict]
    ttft_ms: dict[str, dict[str, list[float]]]
    uptime: str


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.mean(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def paired_ratios(runs: list[Run], base: str = "relay") -> list[str]:
    """Each relay system's CPU per token over the bare relay's in the same round (run back to back,
    so under the same background load): the ratio people compare, mean [min-max] over rounds."""
    by_round: dict[tuple[int, float, float, int], dict[str, float]] = {}
    for run in runs:
        value = run.relay_us_per_token()
        if value is not None:
            key = (run.replicas, run.rate, run.worker_speedup, run.round)
            by_round.setdefault(key, {})[run.system] = value
    ratios: dict[tuple[str, int, float, float], list[float]] = {}
    for (replicas, rate, speedup, _round), systems in by_round.items():
        for system, value in systems.items():
            if system != base and base in systems:
                ratios.setdefault((system, replicas, rate, speedup), []).append(value / systems[base])
    if not ratios:
        return []
    out = ["", f"CPU per relayed token against the bare relay in the same round ({base} = 1):", "",
           "| system | relay processes | conv/s | workers' speedup | rounds | ratio mean [min-max] |",
           "|---|---|---|---|---|---|"]
    for (system, replicas, rate, speedup), values in ratios.items():
        spread = (f"{values[0]:.2f}" if len(values) == 1 else
                  f"{statistics.mean(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        out.append(f"| {system} | {replicas} | {rate:g} | {speedup:g} | {len(values)} | {spread} |")
    return out


def gateway_table(runs: list[Run]) -> list[str]:
    """PPD's own processes per token beside Dynamo's frontend: total, and less their idle CPU (the
    per-request work), and the endpoint picker's over the relay router's (``ppd``) in the same round."""
    shown = [r for r in runs if r.system in (*GATEWAY_SYSTEMS, "ppd", "ppd-lean") and r.tokens]
    if not shown or not any(r.system in GATEWAY_SYSTEMS for r in shown):
        return []
    out = ["", "PPD's own processes and Dynamo's frontend, CPU us per token, total / less idle (mean "
           "[min-max] over repeats; idle: each process's CPU with no load, for "
           f"{IDLE_S:g} s before each run):", "",
           "| system | conv/s | relay router | endpoint picker | gateway | frontend |",
           "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, float], list[Run]] = {}
    for run in shown:
        groups.setdefault((run.system, run.rate), []).append(run)

    def cell(group: list[Run], prefix: str) -> str:
        if not any(_labelled(k, prefix) for r in group for k in r.cpu_s):
            return "-"
        return (f"{_spread([r.us_per_token(prefix) for r in group])} / "
                f"{_spread([r.busy_us_per_token(prefix) for r in group])}")

    for (system, rate), group in groups.items():
        out.append(f"| {system} | {rate:g} | {cell(group, 'router')} | {cell(group, 'picker')} | "
                   f"{cell(group, 'gateway')} | {cell(group, 'frontend')} |")
    rounds: dict[tuple[float, int], dict[str, Run]] = {}
    for run in shown:
        rounds.setdefault((run.rate, run.round), {})[run.system] = run
    ratios = [(r["picker"].us_per_token("picker") / r["ppd"].us_per_token("router"),
               r["picker"].busy_us_per_token("picker") / r["ppd"].busy_us_per_token("router"),
               r["picker"].pick_cpu_s / r["picker"].tokens * 1e6 / r["ppd"].us_per_token("router"))
              for r in rounds.values() if "picker" in r and "ppd" in r]
    picks = [r.pick_cpu_s / r.tokens * 1e6 for r in shown if r.system == "picker"]
    if picks:
        out += ["", f"The endpoint picker's per-request work proper (its event loop's CPU inside the "
                f"pick: parse, tokenize, plan, record): {_spread(picks)} us per token."]
    if ratios:
        def spread(xs: tuple[float, ...]) -> str:
            return f"{statistics.mean(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"

        total, busy, pick = zip(*ratios, strict=True)
        out += ["", f"Endpoint picker over the relay router (`ppd`), CPU per token in the same round "
                f"({len(ratios)} rounds): whole process {spread(total)}; less idle {spread(busy)}; "
                f"the pick alone {spread(pick)}."]
    return out


MAIN_THREAD, RUNTIME_THREAD = "python", "tokio-rt-worker"  # Linux thread names (comm, 15 chars)


def thread_breakdown(runs: list[Run]) -> list[str]:
    """The relay processes' CPU per relayed token by thread: Python's main thread (the event loop:
    the component's own code, the bindings' conversions, nats-py, aetcd) against Dynamo's Rust
    runtime threads (the request plane, the event plane, Dynamo's own indexers and trackers) and
    the rest (gRPC's, NATS'). Mean over repeats."""
    groups: dict[tuple[str, int, float, float], list[Run]] = {}
    for run in runs:
        if run.threads_cpu_s and run.tokens:
            groups.setdefault((run.system, run.replicas, run.rate, run.worker_speedup), []).append(run)
    if not groups:
        return []
    out = ["", "Where the relay processes' CPU goes, us per relayed token by thread (mean over repeats):",
           "", "| system | relay processes | conv/s | workers' speedup | Python main thread "
           "| Dynamo runtime (tokio) | other threads |", "|---|---|---|---|---|---|---|"]

    def per_token(group: list[Run], pick) -> float:
        return statistics.mean(sum(cpu for threads in r.threads_cpu_s.values()
                                   for name, cpu in threads.items() if pick(name)) / r.tokens * 1e6
                               for r in group)

    for (system, replicas, rate, speedup), group in groups.items():
        main = per_token(group, lambda name: name == MAIN_THREAD)
        runtime = per_token(group, lambda name: name == RUNTIME_THREAD)
        other = per_token(group, lambda name: name not in (MAIN_THREAD, RUNTIME_THREAD))
        out.append(f"| {system} | {replicas} | {rate:g} | {speedup:g} | {main:.0f} | {runtime:.0f} "
                   f"| {other:.0f} |")
    return out


def render(runs: list[Run], ttft: dict[str, tuple[list[float], list[float]]],
           setup: TtftSetup = TtftSetup()) -> str:
    """Markdown: CPU per relayed token per process, saturation rate, replicas, low-load TTFT."""
    if not runs:  # --no-load: the TTFT test alone
        return "\n".join(ttft_table(ttft, setup)).lstrip("\n")
    out = [f"Load: `{WORKLOAD}` (turn 1 512 -> 128 tokens, turn 2 +32 -> 512), Poisson arrivals. "
           "CPU us per relayed token, mean [min-max] over repeats; tokens counted from the client.", ""]
    if any(r.workers == "mocker" for r in runs):
        out[-1:-1] = ["Workers: Dynamo's mocker, 3 aggregated (the speedup column is its --speedup-ratio); "
                      "the PPD router in `--mode replica`."]
    groups: dict[tuple[str, int, float, float], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.system, run.replicas, run.rate, run.worker_speedup), []).append(run)
    out += ["| system | relay processes | conv/s | workers' speedup | tokens/run | failed "
            "| relay us/token (per process) | one relay process saturates a core at | tokens per chunk out "
            "| frontend us/token | decode workers us/token | client lag p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (system, replicas, rate, speedup), group in groups.items():
        relay = [r.relay_us_per_token() for r in group]
        relay_text = "-" if relay[0] is None else _spread([v for v in relay if v is not None])
        # With N replicas each relays ~1/N of the tokens on ~1/N of the CPU: the relay figure (all
        # replicas' CPU over all tokens) is also each replica's CPU per token it relayed.
        per_process = [v for v in relay if v is not None]
        sat = f"{1e6 / statistics.mean(per_process):,.0f} tok/s" if per_process else "-"
        per_chunk = [r.tokens / r.chunks for r in group if r.chunks]
        out.append(f"| {system} | {replicas if RELAY_LABEL[system] else '-'} | {rate:g} | {speedup:g} | "
                   f"{statistics.mean(r.tokens for r in group):,.0f} | {sum(r.failed for r in group)} | "
                   f"{relay_text} | {sat} | {f'{statistics.mean(per_chunk):.2f}' if per_chunk else '-'} | "
                   f"{_spread([r.us_per_token('frontend') for r in group])} | "
                   f"{_spread([r.us_per_token('decode') for r in group])} | "
                   f"{max(r.lag_p99_ms for r in group):.0f} |")
    out += gateway_table(runs)
    out += thread_breakdown(runs)
    out += paired_ratios(runs)
    if any(r.system == "relay-pd" for r in runs):  # what the PPD router costs over its own routes
        out += paired_ratios(runs, base="relay-pd")
    multi = [r for r in runs if r.replicas > 1 and r.per_replica_tokens]
    if multi:
        out += ["", "Per router replica (each replica's CPU over the tokens it relayed):", "",
                "| run | replica | tokens | share | CPU us/token |", "|---|---|---|---|---|"]
        for n, run in enumerate(multi):
            total = sum(run.per_replica_tokens.values())
            for label, tokens in sorted(run.per_replica_tokens.items()):
                out.append(f"| {run.system} x{run.replicas} @ {run.rate:g} #{n + 1} | {label} | "
                           f"{tokens:,.0f} | {tokens / total:.1%} | {run.cpu_s[label] / tokens * 1e6:.0f} |")
    out += ttft_table(ttft, setup)
    return "\n".join(out)


def ttft_table(ttft: dict[str, tuple[list[float], list[float]]], setup: TtftSetup) -> list[str]:
    """The TTFT test's markdown: each system's p50 [p10-p90], then what the picker adds."""
    if not ttft:
        return []
    out = ["", f"TTFT (ms, p50 [p10-p90]; {setup.describe()}):", "",
           "| system | n | turn 1 | turn 2 |", "|---|---|---|---|"]
    for system, (first, follow) in ttft.items():
        def q(xs: list[float]) -> str:
            d = statistics.quantiles(xs, n=10)
            return f"{statistics.median(xs):.2f} [{d[0]:.2f}-{d[8]:.2f}]"
        out.append(f"| {system} | {len(first)} | {q(first)} | {q(follow)} |")
    return out + callout_added(ttft)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="ppd,relay,pd",
                        help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--rate", type=positive_floats("rates"), default=[2.0],
                        help="conversation arrival rates (conv/s)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system and rate (fresh graph each)")
    parser.add_argument("--router-replicas", type=positive_floats("replica counts"), default=[1.0],
                        help="relay replica counts (PPD router and bare relay) to run, e.g. 1,2")
    parser.add_argument("--worker-speedup", type=float, default=1.0,
                        help="the simulated workers' --speedup (e.g. 20: tokens come 20x faster than real "
                        "time, so the relay, not the workers, is the bottleneck on this machine)")
    parser.add_argument("--workers", choices=WORKERS, default="simulated",
                        help="the workers behind the relays: the simulated TensorRT-LLM workers (1 prefill, "
                        "3 decode), or Dynamo's mocker (3 aggregated, Rust, far cheaper per token: the relay "
                        f"runs out of CPU first; systems {','.join(MOCKER_SYSTEMS)} only, no TTFT)")
    parser.add_argument("--ttft-conversations", type=int, default=40,
                        help="low-load TTFT samples per system (0: skip)")
    parser.add_argument("--ttft-first-words", type=int, default=FIRST_TURN[0],
                        help="fresh words in the TTFT test's first turns (100000: a ~100K-token prompt)")
    parser.add_argument("--ttft-concurrency", type=int, default=1,
                        help="TTFT test conversations in flight at a time (1: one after another)")
    parser.add_argument("--no-load", action="store_true",
                        help="skip the CPU-per-token runs (--rate, --duration, --repeats): TTFT only")
    parser.add_argument("--picker-args", default="",
                        help="more arguments for the picker of system picker, one string (e.g. "
                        "'--no-token-ids': the frontend tokenizes every prompt itself)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown[0] if unknown else '(none)'}; "
                     f"choose from {','.join(SYSTEMS)}")
    if args.workers == "mocker" and (set(systems) - set(MOCKER_SYSTEMS) or args.ttft_conversations):
        parser.error(f"--workers mocker: --systems from {','.join(MOCKER_SYSTEMS)} only, and "
                     "--ttft-conversations 0 (the mocker has no P/D route to time)")
    if "relay-pd" in systems and max(args.router_replicas) > 1:
        parser.error("--systems relay-pd runs one replica only (it remembers each session's decode worker "
                     "in its own process); drop it or use --router-replicas 1")
    if args.repeats < 1 or args.duration <= 0 or args.worker_speedup <= 0:
        parser.error("--repeats must be >= 1, --duration and --worker-speedup > 0")
    if args.ttft_first_words < 1 or args.ttft_concurrency < 1:
        parser.error("--ttft-first-words and --ttft-concurrency must be >= 1")
    picker_args = shlex.split(args.picker_args)
    setup = TtftSetup(args.ttft_conversations, args.ttft_first_words, args.ttft_concurrency,
                      args.worker_speedup)
    runs: list[Run] = []
    ttft: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ppd-relay-") as tmp:
        work = Path(tmp)
        for rate in [] if args.no_load else args.rate:
            # Repeats outermost: each round runs every system once, back to back, so systems
            # compared within a round saw the same background load on the machine.
            for repeat in range(args.repeats):
                for system in systems:
                    counts = [int(n) for n in args.router_replicas] if RELAY_LABEL[system] else [1]
                    for replicas in counts:
                        tag = f"{replicas}-{rate:g}-{repeat}"
                        sys.stderr.write(f"{system} x{replicas} @ {rate:g} conv/s, run {repeat + 1} ...\n")
                        run = measure_load(system, replicas, rate, args.duration, work, tag,
                                           worker_speedup=args.worker_speedup, workers=args.workers,
                                           picker_args=picker_args)
                        run.round = repeat
                        sys.stderr.write(f"  {run.tokens:,} tokens, {run.failed} failed; relay "
                                         f"{run.relay_us_per_token() or 0:.0f} us/token "
                                         f"{'; errors: ' + ', '.join(run.errors) if run.errors else ''}\n")
                        runs.append(run)
        if args.ttft_conversations:
            for system in systems:
                sys.stderr.write(f"{system}: TTFT at low load ...\n")
                ttft[system] = measure_ttft(system, setup, work, "ttft", picker_args)
    table = render(runs, ttft, setup)
    print(table)
    load = os.getloadavg()
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"# Relay benchmark\n\n`python -m dynamo_ppd.bench.relay "
                                 f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n{table}\n")
    if args.json:
        report = Report(WORKLOAD, [r.__dict__ for r in runs],
                        {s: {"turn1": a, "turn2": b} for s, (a, b) in ttft.items()},
                        f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
