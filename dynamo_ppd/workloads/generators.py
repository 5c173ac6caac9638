"""Workload generators: manifests for the paper's experiments and for ShareGPT/WildChat-like chat.

The paper's 18 controlled workloads (``small_tiny`` ... ``large_huge_paste``) follow the authors'
benchmark exactly, arrivals included (`paper_arrivals`); the other generators below use a plain
Poisson process over the duration.

The real data sets are not reachable offline (and tests must not need them), so the chat
workloads are synthetic with the data sets' published shape (turn counts, message-size medians
and tails; docs/manifest.md lists every parameter and how it was fitted). A user with the real
ShareGPT dump converts it with `load_sharegpt`.

Every generator is deterministic for its seed, and uses two random streams: conversation arrivals
(Poisson, from the seed alone, so every workload at one seed and rate arrives at the same
instants: common random numbers across compared workloads) and conversation contents (from the
workload name and seed, so conversation i is the same whatever the rate and duration).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from pathlib import Path
from statistics import NormalDist

import msgspec

from dynamo_ppd.sim import conversation as sim
from dynamo_ppd.sim.outcome import PAPER_TIMEOUT_S  # the one definition of the paper's timeout
from dynamo_ppd.workloads.manifest import (
    Manifest,
    ManifestConversation,
    ManifestError,
    ManifestHeader,
    ManifestProtocol,
    ManifestTurn,
    TokenCounter,
    to_sim,
)

_Z = NormalDist()
TurnPlan = Callable[[random.Random], list[ManifestTurn]]


class UnknownWorkload(KeyError):
    """A workload name that is not in `WORKLOADS`; the message lists the known names."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"unknown workload {self.name!r}; known workloads: {', '.join(WORKLOADS)}"


class TruncatedLogNormal:
    """Integer token counts from a lognormal truncated at ``cap`` (no spike at the cap, unlike
    clipping), fitted so that the *truncated* distribution's median and p90 are the targets,
    then rounded and floored at 1. A lognormal because message lengths are right-skewed over
    orders of magnitude; the fit is a fixed-point iteration (the cap moves the quantiles a little,
    the quantiles move the mass below the cap)."""

    def __init__(self, median: float, p90: float, cap: int):
        if not 0 < median < p90 < cap:
            raise ValueError("need 0 < median < p90 < cap")
        self.cap = cap
        self.sigma = math.log(p90 / median) / _Z.inv_cdf(0.9)
        self.mu = math.log(median)
        for _ in range(100):
            mass = _Z.cdf((math.log(cap) - self.mu) / self.sigma)
            z50, z90 = _Z.inv_cdf(0.5 * mass), _Z.inv_cdf(0.9 * mass)
            self.sigma = math.log(p90 / median) / (z90 - z50)
            self.mu = math.log(median) - self.sigma * z50
        self.mass = _Z.cdf((math.log(cap) - self.mu) / self.sigma)  # P(untruncated <= cap)

    def quantile(self, q: float) -> float:
        return math.exp(self.mu + self.sigma * _Z.inv_cdf(q * self.mass))

    def sample(self, rng: random.Random) -> int:
        u = max(rng.random() * self.mass, 1e-300)
        return min(self.cap, max(1, round(math.exp(self.mu + self.sigma * _Z.inv_cdf(u)))))


def poisson_arrivals(rate_conv_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of the given rate in [0, duration_s), to the µs."""
    if not (rate_conv_per_s > 0 and duration_s > 0):
        raise ValueError("rate and duration must be positive")
    rng = random.Random(f"arrivals:{seed}")
    out: list[float] = []
    t = rng.expovariate(rate_conv_per_s)
    while t < duration_s:
        out.append(round(t, 6))
        t += rng.expovariate(rate_conv_per_s)
    return out


def _think(rng: random.Random, mean_s: float) -> float:
    return round(rng.expovariate(1 / mean_s), 3) if mean_s > 0 else 0.0


def _build(name: str, description: str, rate_conv_per_s: float, duration_s: float, seed: int,
           plan: TurnPlan) -> Manifest:
    arrivals = poisson_arrivals(rate_conv_per_s, duration_s, seed)
    rng = random.Random(f"{name}:{seed}")
    header = ManifestHeader(workload=name, seed=seed, description=description,
                            rate_conv_per_s=rate_conv_per_s, duration_s=duration_s)
    return Manifest(header, [ManifestConversation(f"c{i:05d}", t, plan(rng)) for i, t in enumerate(arrivals)])


def _fixed_plan(first: tuple[int, int], follow_up: tuple[int, int], turns: int,
                think_time_s: float) -> TurnPlan:
    if think_time_s < 0:
        raise ValueError("think time cannot be negative")
    plan = [ManifestTurn(first[1], user_tokens=first[0])]
    plan += [ManifestTurn(follow_up[1], user_tokens=follow_up[0], think_time_s=think_time_s)] * (turns - 1)
    return lambda rng: list(plan)


# --- the paper's controlled experiments -----------------------------------------------------
# Exactly the authors' benchmark (freelulul/vllm-ppd, ppd/scripts/benchmark/
# comprehensive_benchmark.py at commit baaceea6: T1_CONFIGS, T2_CONFIGS, QPS_POINTS,
# DURATION_PER_POINT_SEC, REQUEST_TIMEOUT_SEC, TEST_POINT_TIMEOUT_SEC, run_benchmark_point_inner),
# which produced the measurements in `dynamo_ppd/paper/data/paper_comprehensive.csv`.

PAPER_T1: dict[str, tuple[int, int]] = {"small": (128, 128), "large": (1024, 1024)}
"""First turn (prompt tokens, output tokens): the history a follow-up appends to."""
PAPER_T2: dict[str, tuple[int, int]] = {
    "tiny": (16, 32), "short_gen": (32, 256), "long_gen": (32, 512), "very_long_gen": (64, 1024),
    "small_bal": (64, 64), "mid_bal": (128, 128), "mid_paste": (256, 64), "big_paste": (512, 64),
    "huge_paste": (1024, 32)}
"""Second turn (new input tokens, output tokens), decode-heavy (long_gen) to prefill-heavy."""
PAPER_WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    f"{t1}_{t2}": (PAPER_T1[t1], PAPER_T2[t2]) for t1 in PAPER_T1 for t2 in PAPER_T2}
"""The 18 workloads by the data's names (``small_tiny`` ... ``large_huge_paste``): (T1, T2)."""
PAPER_QPS: tuple[float, ...] = (0.5, 1, 2, 4, 6, 8, 10, 12, 16, 20)
"""The rates of every workload, in conversations per second."""
PAPER_ARRIVAL_WINDOW_S = 10.0
PAPER_TURNS = 2
PAPER_KILL_AFTER_S = 600.0  # a point still running this long after its start is abandoned (0% success)
PAPER_MAX_CONNECTIONS = 50
"""The client's connection pool (``aiohttp.TCPConnector(limit=50)``): at most 50 requests in
flight; a new conversation's turn 1 waits for a free connection, and that wait is inside its
TTFT and its 120 s timeout. Turn 2, sent the instant turn 1's stream ends, takes the connection
turn 1 just released (the measured turn-2 TTFT shows no pool wait), so in effect at most 50
conversations are in flight. This is why the measured turn-1 TTFT reaches ~30 s at 20 conv/s with
``large`` T1 while TPOT stays near 10 ms: the pool, not the servers, queues the excess."""


def paper_protocol(arrival_window_s: float = PAPER_ARRIVAL_WINDOW_S) -> ManifestProtocol:
    """How a paper workload must be run, as its manifest header records it."""
    return ManifestProtocol(arrival="paper-poisson", arrival_window_s=arrival_window_s,
                            turns=PAPER_TURNS, request_timeout_s=PAPER_TIMEOUT_S,
                            kill_after_s=PAPER_KILL_AFTER_S, max_connections=PAPER_MAX_CONNECTIONS)


def paper_arrivals(rate_conv_per_s: float, seed: int,
                   window_s: float = PAPER_ARRIVAL_WINDOW_S) -> list[float]:
    """The authors' arrival process: ``int(rate * window)`` exponential gaps drawn, their running
    sums kept only while below the window. So a point holds at most rate x window conversations
    and on average fewer (E[min(Poisson(rate x window), int(rate x window))]: 8.75 at 1 conv/s,
    194 at 20 conv/s), which is what the measured
    ``total_requests`` column shows; a plain Poisson process over the window would not cap it."""
    if not (rate_conv_per_s > 0 and window_s > 0):
        raise ValueError("rate and arrival window must be positive")
    rng = random.Random(f"paper-arrivals:{seed}")
    out: list[float] = []
    t = 0.0
    for _ in range(int(rate_conv_per_s * window_s)):
        t += rng.expovariate(rate_conv_per_s)
        if t < window_s:
            out.append(round(t, 6))
    return out


def paper_manifest(name: str, rate_conv_per_s: float, window_s: float = PAPER_ARRIVAL_WINDOW_S,
                   seed: int = 0) -> Manifest:
    """One of the paper's 18 workloads at one rate: `paper_arrivals`, exactly 2 turns (T1 then T2
    of the name), no think time; the header's protocol says how to run it (timeout, pool, kill).
    The prompts' sizes are the nominal token counts (the authors generate ~0.75 words per token,
    so their real counts are close to, not exactly, these); the simulator's chat template adds 5
    tokens per turn, the authors' text template a few as well."""
    try:
        (t1_in, t1_out), (t2_in, t2_out) = PAPER_WORKLOADS[name]
    except KeyError:
        raise UnknownWorkload(name) from None
    plan = [ManifestTurn(t1_out, user_tokens=t1_in), ManifestTurn(t2_out, user_tokens=t2_in)]
    arrivals = paper_arrivals(rate_conv_per_s, seed, window_s)
    header = ManifestHeader(
        workload=name, seed=seed, rate_conv_per_s=rate_conv_per_s, duration_s=window_s,
        description=f"paper: turn 1 in={t1_in} out={t1_out}, turn 2 in={t2_in} out={t2_out}",
        protocol=paper_protocol(window_s))
    convs = [ManifestConversation(f"c{i:05d}", t, list(plan)) for i, t in enumerate(arrivals)]
    return Manifest(header, convs)


def paper_workload(name: str, qps: float, seed: int = 0) -> list[sim.Conversation]:
    """The simulator's conversations of one paper point (workload ``name`` at ``qps``
    conversations/s over the 10 s window): what `dynamo-ppd sim paper` runs."""
    return to_sim(paper_manifest(name, qps, PAPER_ARRIVAL_WINDOW_S, seed))


def long_context(rate_conv_per_s: float, duration_s: float, seed: int = 0,
                 think_time_s: float = 0.0) -> Manifest:
    """The paper's long-context workload, "10k in, 100 out, 5 turns", read as: the first turn
    sends 10,000 tokens, each of the 4 follow-ups appends 100 new tokens, and every turn asks for
    100 output tokens (so the history grows from 10k to ~10.9k: tiny appends on a long context,
    where re-prefilling or re-transferring the history is most wasteful)."""
    return _build("long-context", "long context: turn 1 in=10000, follow-ups in=100, every turn out=100",
                  rate_conv_per_s, duration_s, seed, _fixed_plan((10_000, 100), (100, 100), 5, think_time_s))


def turn_scaling(turns: int, rate_conv_per_s: float, duration_s: float, seed: int = 0,
                 think_time_s: float = 0.0) -> Manifest:
    """Conversations of exactly ``turns`` turns (the paper sweeps 2..16) with moderate sizes:
    turn 1 sends 512 tokens, each follow-up 256, every turn asks for 128 (16 turns end at ~6.4k
    tokens of context, within an 8B model's usual window)."""
    if turns < 1:
        raise ValueError("a conversation has at least one turn")
    return _build(f"turns-{turns}", f"{turns} turns: turn 1 in=512, follow-ups in=256, every turn out=128",
                  rate_conv_per_s, duration_s, seed, _fixed_plan((512, 128), (256, 128), turns, think_time_s))


# --- chat data sets' shapes -----------------------------------------------------------------

# ShareGPT turn counts (94k conversations; docs/manifest.md, "ShareGPT-like"); the 11% of 7+ is
# spread over 7..12 with geometrically falling shares (ratio 0.758) chosen so the mean is the data
# set's 3.5 turns.
SHAREGPT_TURN_SHARES = {1: 0.25, 2: 0.18, 3: 0.15, 4: 0.14, 5: 0.10, 6: 0.07,
                        7: 0.033, 8: 0.025, 9: 0.019, 10: 0.014, 11: 0.011, 12: 0.008}
SHAREGPT_FIRST_USER = TruncatedLogNormal(median=24, p90=432, cap=4096)
SHAREGPT_LATER_USER = TruncatedLogNormal(median=16, p90=86, cap=4096)
# Cap 814 puts the p99 at 769 (the data set's), with the median 255 and p90 549 fitted.
SHAREGPT_ASSISTANT = TruncatedLogNormal(median=255, p90=549, cap=814)

# WildChat: turn counts from a mixture of two geometrics (86% casual chats with mean 1.6 turns,
# 14% long sessions with mean 8), capped at 50: mean 2.5 turns, 3.7% over 10. Messages are
# longer than ShareGPT's; the medians/p90s below put the P90 of a conversation's final context
# at ~5,115 tokens (checked by simulation in the tests).
WILDCHAT_SHORT_SHARE, WILDCHAT_SHORT_MEAN, WILDCHAT_LONG_MEAN, WILDCHAT_MAX_TURNS = 0.86, 1.6, 8.0, 50
WILDCHAT_USER = TruncatedLogNormal(median=62, p90=950, cap=8192)
WILDCHAT_ASSISTANT = TruncatedLogNormal(median=400, p90=1000, cap=4096)

DEFAULT_THINK_TIME_MEAN_S = 1.0


def _geometric(rng: random.Random, mean: float) -> int:
    """1, 2, ... with P(k) = p (1-p)^(k-1), p = 1/mean."""
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))


def sharegpt_turn_count(rng: random.Random) -> int:
    return rng.choices(list(SHAREGPT_TURN_SHARES), weights=list(SHAREGPT_TURN_SHARES.values()))[0]


def wildchat_turn_count(rng: random.Random) -> int:
    mean = WILDCHAT_SHORT_MEAN if rng.random() < WILDCHAT_SHORT_SHARE else WILDCHAT_LONG_MEAN
    return min(WILDCHAT_MAX_TURNS, _geometric(rng, mean))


def sharegpt_like(rate_conv_per_s: float, duration_s: float, seed: int = 0,
                  think_time_mean_s: float = DEFAULT_THINK_TIME_MEAN_S) -> Manifest:
    """ShareGPT-shaped chat: turn counts as `SHAREGPT_TURN_SHARES`, first user message
    median 24 / p90 432 tokens, later ones 16 / 86, replies 255 / 549 / p99 769. Think times are
    exponential with mean ``think_time_mean_s`` (the paper does not say; 1 s keeps several turns
    of a conversation inside a short benchmark point while still spacing them)."""

    def plan(rng: random.Random) -> list[ManifestTurn]:
        return [ManifestTurn(SHAREGPT_ASSISTANT.sample(rng),
                             user_tokens=(SHAREGPT_FIRST_USER if k == 0 else SHAREGPT_LATER_USER).sample(rng),
                             think_time_s=_think(rng, think_time_mean_s) if k else 0.0)
                for k in range(sharegpt_turn_count(rng))]

    return _build("sharegpt", "ShareGPT-like chat (synthetic, fitted to the data set's statistics)",
                  rate_conv_per_s, duration_s, seed, plan)


def wildchat_like(rate_conv_per_s: float, duration_s: float, seed: int = 0,
                  think_time_mean_s: float = DEFAULT_THINK_TIME_MEAN_S) -> Manifest:
    """WildChat-shaped chat: mean 2.5 turns with 3.7% over 10, user messages median 62 / p90
    950 tokens, replies 400 / 1000, P90 final context ~5,115 tokens; think times as
    `sharegpt_like`."""

    def plan(rng: random.Random) -> list[ManifestTurn]:
        return [ManifestTurn(WILDCHAT_ASSISTANT.sample(rng), user_tokens=WILDCHAT_USER.sample(rng),
                             think_time_s=_think(rng, think_time_mean_s) if k else 0.0)
                for k in range(wildchat_turn_count(rng))]

    return _build("wildchat", "WildChat-like chat (synthetic, fitted to the data set's statistics)",
                  rate_conv_per_s, duration_s, seed, plan)


# --- where disaggregation should pay: many turns, long agent contexts -----------------------

MANY_TURN_RANGE = (2, 16)  # the paper's turn sweep (Fig. 10: 2..16 turns)
# Short replies: the turn count is the variable here, and a sweep to saturation costs the
# simulator the output tokens of the ~1,000 conversations that fill 4 GPUs' decode batches, so
# ShareGPT's (median 255) would cost ~3x for the same finding.
MANY_TURN_REPLY = TruncatedLogNormal(median=64, p90=192, cap=512)


def many_turn(rate_conv_per_s: float, duration_s: float, seed: int = 0,
              think_time_mean_s: float = 0.0) -> Manifest:
    """Chat with many turns: each conversation's turn count is drawn uniformly from 2..16 (the
    paper's Fig. 10 range, every count equally likely: mean 9, where ShareGPT's mean is 3.5),
    with ShareGPT-sized user messages (the first median 24 / p90 432 tokens, later ones 16 / 86:
    small appends) and short replies (median 64 / p90 192, cap 512; `MANY_TURN_REPLY`).
    No think time by default: the paper's protocol sends a turn as soon as the previous answer
    ends (a mean > 0 draws exponential think times as `sharegpt_like`)."""
    low, high = MANY_TURN_RANGE

    def plan(rng: random.Random) -> list[ManifestTurn]:
        return [ManifestTurn(MANY_TURN_REPLY.sample(rng),
                             user_tokens=(SHAREGPT_FIRST_USER if k == 0 else SHAREGPT_LATER_USER).sample(rng),
                             think_time_s=_think(rng, think_time_mean_s) if k else 0.0)
                for k in range(rng.randint(low, high))]

    return _build("many-turn", f"many-turn chat: {low}-{high} turns (uniform), ShareGPT-sized user messages, "
                  "replies ~64 tokens",
                  rate_conv_per_s, duration_s, seed, plan)


# An agent's loop (a coding or browsing agent over tool calls): turn 1 is the system prompt, the
# tool schemas and the task; every later "user" message is a tool's output (a file, a search
# result, a command's log) appended to the whole history; every reply is short (a tool call and a
# line of reasoning). The context grows until the model's window: the conversation ends when the
# next turn would pass AGENT_CONTEXT_TOKENS. Sizes are assumptions, not fitted to a data set.
AGENT_CONTEXT_TOKENS = 32_768
AGENT_MAX_TURNS = 40
AGENT_FIRST = TruncatedLogNormal(median=6000, p90=12000, cap=16000)  # system prompt + tools + task
AGENT_TOOL_OUTPUT = TruncatedLogNormal(median=2500, p90=6000, cap=8192)
AGENT_REPLY = TruncatedLogNormal(median=80, p90=300, cap=1024)
AGENT_TOOL_TIME_MEAN_S = 1.0  # the tool runs between a reply and the next turn (the "think time")


def agent_32k(rate_conv_per_s: float, duration_s: float, seed: int = 0,
              tool_time_mean_s: float = AGENT_TOOL_TIME_MEAN_S) -> Manifest:
    """Agent-like sessions growing to a 32K context: turn 1 sends median 6,000 / p90 12,000
    tokens (system prompt, tool schemas, task), each later turn appends a tool output of median
    2,500 / p90 6,000 tokens (cap 8,192: a file, a search result, a command's log), every reply
    is median 80 / p90 300 tokens (cap 1,024);
    turns go on while the whole context (user tokens, replies and the simulator's template
    tokens) stays within 32,768 tokens (at most 40 turns, at least 2: a tool output that would
    overflow is cut to fit). Tool time between turns is exponential, mean ``tool_time_mean_s``.
    Prefill-heavy appends on a long cached history: where re-prefilling or re-sending the
    history costs most."""

    def plan(rng: random.Random) -> list[ManifestTurn]:
        first_tokens = AGENT_FIRST.sample(rng)
        first = ManifestTurn(AGENT_REPLY.sample(rng), user_tokens=first_tokens)
        turns = [first]
        context = first_tokens + first.max_tokens + sim.TEMPLATE_TOKENS
        while len(turns) < AGENT_MAX_TURNS:
            user, reply = AGENT_TOOL_OUTPUT.sample(rng), AGENT_REPLY.sample(rng)
            room = AGENT_CONTEXT_TOKENS - context - reply - sim.TEMPLATE_TOKENS
            if room < 1 or (user > room and len(turns) > 1):
                break
            user = min(user, room)  # only the second turn is cut to fit: every session has a tool turn
            turns.append(ManifestTurn(reply, user_tokens=user, think_time_s=_think(rng, tool_time_mean_s)))
            context += user + reply + sim.TEMPLATE_TOKENS
        return turns

    return _build("agent-32k", f"agent-like: turn 1 ~6k, tool outputs ~2.5k, replies ~80 tokens, "
                  f"context up to {AGENT_CONTEXT_TOKENS}", rate_conv_per_s, duration_s, seed, plan)


# --- coding agents (TraceLab) ---------------------------------------------------------------
# TraceLab (arXiv 2606.30560; github.com/uw-syfi/TraceLab, data CC BY 4.0): 357K LLM rounds of 43
# developers' Claude Code and Codex sessions (../shared/ppd-brief.md §10). Its figures: a session
# averages 9.2 user requests (p99 137), each 8.8 LLM steps (10.8 tool calls); a step appends median
# 875 uncached tokens, 90% of steps under 1K; outputs median 214 tokens; tool calls mostly well under
# a second (Read p50 36 ms, Edit 95 ms, Bash ~409 ms), 70-88% under 10 s, 3-5% over a minute; a user's
# next request follows a median ~2 min gap; median cached prefix 119K tokens. The values marked
# "ours" are not TraceLab's: chosen to meet its figures where it gives only some of a distribution.
CODING_SHARED_PREFIX = 16_000  # system prompt + tool schemas, sent by every session (ours)
CODING_CONTEXT_TOKENS = 131_072  # Llama 3.1's window: a session ends there (a client would compact)
CODING_REQUESTS_MEAN = 9.2  # user requests per session (geometric with TraceLab's mean)
CODING_REQUESTS_MAX = 137  # TraceLab's p99, as the cap
CODING_STEPS_MEAN = 8.8  # LLM steps per user request (geometric with TraceLab's mean)
CODING_TASK = TruncatedLogNormal(median=300, p90=2000, cap=16_000)  # a user's request (ours)
# A step's tool output: 90% a lognormal under 1K, 10% a heavy tail (files, logs) above it (ours);
# together: median ~860, 90% under 1K, as TraceLab's.
CODING_APPEND = TruncatedLogNormal(median=860, p90=985, cap=1_000)
CODING_APPEND_TAIL = TruncatedLogNormal(median=3_000, p90=12_000, cap=32_000)
CODING_REPLY = TruncatedLogNormal(median=214, p90=900, cap=4_096)  # TraceLab's median; p90 ours
# Tool time (s): 85% quick (median 0.3, p90 3), 15% slow (median 20, p90 120): ~89% under 10 s,
# ~4% over a minute (ours, to TraceLab's shares). A user's next request: median 120 s, p90 600 (ours).
CODING_TOOL_QUICK, CODING_TOOL_SLOW, CODING_TOOL_SLOW_SHARE = (0.3, 3.0), (20.0, 120.0), 0.15
CODING_HUMAN_PAUSE = (120.0, 600.0)


def _lognormal_s(rng: random.Random, median_p90: tuple[float, float]) -> float:
    median, p90 = median_p90
    return round(median * math.exp(math.log(p90 / median) / _Z.inv_cdf(0.9) * rng.gauss(0.0, 1.0)), 3)


def coding_agent(rate_conv_per_s: float, duration_s: float, seed: int = 0) -> Manifest:
    """Claude Code / Codex-like sessions from TraceLab's published distributions (the constants
    above): every session's first message follows the same `CODING_SHARED_PREFIX`-token system
    prompt (the manifest's ``shared_prefix_tokens``); then user requests (a task of median 300
    tokens after a human pause of median 2 min), each a run of LLM steps whose tool outputs (median
    ~860 tokens, a tail to 32K) come back after sub-second tool gaps with a tail of minutes; replies
    median 214 tokens. A session ends after its requests, or where the next turn would pass the
    model's context window (131,072 tokens): long sessions reach ~100K-token contexts."""

    def plan(rng: random.Random) -> list[ManifestTurn]:
        turns: list[ManifestTurn] = []
        context = CODING_SHARED_PREFIX
        requests = min(CODING_REQUESTS_MAX, _geometric(rng, CODING_REQUESTS_MEAN))
        for request in range(requests):
            steps = _geometric(rng, CODING_STEPS_MEAN)
            for step in range(steps):
                if step == 0:
                    user = CODING_TASK.sample(rng)
                    pause = _lognormal_s(rng, CODING_HUMAN_PAUSE) if request else 0.0
                else:
                    tail = rng.random() < 0.1
                    user = (CODING_APPEND_TAIL if tail else CODING_APPEND).sample(rng)
                    slow = rng.random() < CODING_TOOL_SLOW_SHARE
                    pause = _lognormal_s(rng, CODING_TOOL_SLOW if slow else CODING_TOOL_QUICK)
                reply = CODING_REPLY.sample(rng)
                grown = context + user + reply + sim.TEMPLATE_TOKENS
                if grown > CODING_CONTEXT_TOKENS and turns:
                    return turns
                turns.append(ManifestTurn(reply, user_tokens=user, think_time_s=pause))
                context = grown
        return turns

    manifest = _build("coding-agent", f"coding agents (TraceLab): a shared {CODING_SHARED_PREFIX}-token "
                      "system prompt, ~9 requests of ~9 steps, appends ~860, replies ~214 tokens",
                      rate_conv_per_s, duration_s, seed, plan)
    assert manifest.header is not None  # (`_build` always writes one)
    header = msgspec.structs.replace(manifest.header, shared_prefix_tokens=CODING_SHARED_PREFIX)
    return Manifest(header, manifest.conversations)


# --- a real ShareGPT file -------------------------------------------------------------------

_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "chatgpt", "assistant", "bard", "bing", "model"}


def _approx_reply_tokens(text: str) -> int:
    return round(len(text.split()) * 1.3)  # ~1.3 Llama tokens per English word


def _sharegpt_turns(messages: object, count: TokenCounter) -> list[ManifestTurn]:
    """The (human, reply) pairs from the start of a conversation; stops at the first message out
    of order or empty, since a history with a hole cannot be replayed faithfully."""
    if not isinstance(messages, list):
        return []
    msgs = [m for m in messages if isinstance(m, dict)]
    while msgs and msgs[0].get("from") not in _HUMAN:  # a system prompt or greeting first
        msgs.pop(0)
    turns = []
    for human, reply in zip(msgs[::2], msgs[1::2], strict=False):
        text, answer = human.get("value"), reply.get("value")
        if (human.get("from") not in _HUMAN or reply.get("from") not in _ASSISTANT
                or not isinstance(text, str) or not isinstance(answer, str) or not text.strip()):
            break
        turns.append(ManifestTurn(max(1, count(answer)), user_text=text))
    return turns


def load_sharegpt(path: str | Path, tokenizer_count: TokenCounter | None = None,
                  max_conversations: int | None = None, rate_conv_per_s: float = 1.0, seed: int = 0,
                  think_time_mean_s: float = 0.0) -> Manifest:
    """A manifest from a ShareGPT json (a list of {"id", "conversations": [{"from", "value"}]}):
    each human message is a turn's text, and its ``max_tokens`` is the recorded reply's length
    (``tokenizer_count`` of it, or ~1.3 tokens per word). Conversations arrive as a Poisson
    process of ``rate_conv_per_s`` in file order; think time 0 unless a mean is given."""
    records = msgspec.json.decode(Path(path).read_bytes())
    if not isinstance(records, list):
        raise ManifestError(f"{path}: expected a JSON list of conversations")
    count = tokenizer_count or _approx_reply_tokens
    rng = random.Random(f"sharegpt-file:{seed}")
    arrivals = random.Random(f"arrivals:{seed}")
    convs: list[ManifestConversation] = []
    ids: set[str] = set()
    t = 0.0
    for i, record in enumerate(records):
        if max_conversations is not None and len(convs) >= max_conversations:
            break
        if not isinstance(record, dict):
            continue
        turns = _sharegpt_turns(record.get("conversations"), count)
        if not turns:
            continue
        turns = [turns[0]] + [msgspec.structs.replace(x, think_time_s=_think(rng, think_time_mean_s))
                              for x in turns[1:]]
        cid = str(record.get("id", f"sharegpt-{i}")) or f"sharegpt-{i}"
        base, n = cid, 2
        while cid in ids:  # ShareGPT dumps repeat some ids
            cid, n = f"{base}#{n}", n + 1
        ids.add(cid)
        t += arrivals.expovariate(rate_conv_per_s)
        convs.append(ManifestConversation(cid, round(t, 6), turns))
    header = ManifestHeader(workload="sharegpt-file", seed=seed,
                            description=f"converted from {Path(path).name}",
                            rate_conv_per_s=rate_conv_per_s, duration_s=t)
    return Manifest(header, convs)


# --- registry -------------------------------------------------------------------------------

def _paper_factory(name: str) -> Callable[..., Manifest]:
    """A paper workload as a registry entry: ``duration_s`` is its arrival window."""
    def factory(rate_conv_per_s: float, duration_s: float = PAPER_ARRIVAL_WINDOW_S,
                seed: int = 0) -> Manifest:
        return paper_manifest(name, rate_conv_per_s, duration_s, seed)
    return factory


WORKLOADS: dict[str, Callable[..., Manifest]] = {
    **{name: _paper_factory(name) for name in PAPER_WORKLOADS},
    "long-context": long_context,
    **{f"turns-{n}": functools.partial(turn_scaling, n) for n in range(2, 17)},
    "sharegpt": sharegpt_like,
    "wildchat": wildchat_like,
    "many-turn": many_turn,
    "agent-32k": agent_32k,
    "coding-agent": coding_agent,
}
"""Every named workload, called as ``(rate_conv_per_s, duration_s, seed=0) -> Manifest``."""


def make_workload(name: str, rate_conv_per_s: float, duration_s: float, seed: int = 0) -> Manifest:
    """The named workload's manifest; `UnknownWorkload` (a KeyError) lists the names."""
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise UnknownWorkload(name) from None
    return factory(rate_conv_per_s, duration_s, seed)
