"""`sim compare`'s load sweeps: the workloads where disaggregation should pay, each run up a ladder
of rates until every policy on every configuration has saturated.

The paper's grid (two small turns, 0.5-20 conv/s on 4 H100s) is mostly light load. Its own case
for P/D is long contexts and many turns near saturation (Fig. 1: 10k-token inputs, 100 out, 5
turns; Fig. 10: 2-16 turns). The sweeps run three such workloads
(`dynamo_ppd.workloads.generators`): ``long-context`` (the paper's), ``many-turn`` (2-16 turns,
chat-sized appends) and ``agent-32k`` (tool outputs appended to a context growing to 32K).

How saturation is found. Each (configuration, link, workload, policy) is a *lane*. Rung k of a
workload's ladder is ``start_rate * step**k`` conversations/s, arriving as a Poisson process
over the sweep's ``window_s``, or longer at a light rung so that a point holds at least
``min_conversations`` (a point holds ~rate x window conversations: the same first ones at every
rate, since arrivals scale with the rate and contents do not depend on it). Every lane
still going runs rung k (all lanes of a rung in one batch, so the process pool is kept busy);
a lane stops after its first *saturated* rung: one where fewer than 95% of requests succeed (the
paper's bar), or where the median TTFT of turn 1 or of turns 2+ exceeds ``SATURATION_FACTOR``
times the lane's own at its lightest rung and ``SATURATION_FLOOR_S`` (a queue that grows for
the whole window: below capacity a median TTFT moves by a small factor, past it by orders of
magnitude). A lane's saturation rate is its last rung before that; the saturated rung is kept
and shown, so the table shows the explosion, and nothing past it is simulated (the costliest
points, and the least informative).

Pure: no I/O; the caller runs the points (`policies.main`, in its process pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import msgspec

from ..sim import Conversation
from ..sim.outcome import CHAT_TIMEOUT_S, PAPER_TIMEOUT_S, SUCCESS_BAR
from ..workloads.generators import make_workload
from ..workloads.manifest import to_sim
from .policy_points import PolicyPoint

SATURATION_FACTOR = 4.0
SATURATION_FLOOR_S = 0.1  # a median TTFT under it has not exploded, whatever the factor
# A light rung's window stretches to hold this many conversations (expected): a handful would make
# its medians, the lane's baseline, and its intervals noise.
MIN_CONVERSATIONS = 20


class Sweep(msgspec.Struct, frozen=True):
    """One workload's ladder: ``rungs`` rates from ``start_rate`` (conversations/s), each
    ``step`` times the one below (saturation is known within that factor), ``window_s`` seconds
    of arrivals per point (longer where that would hold under ``min_conversations``), each
    request given ``timeout_s``."""

    workload: str
    start_rate: float
    step: float
    rungs: int
    window_s: float
    timeout_s: float
    min_conversations: int = MIN_CONVERSATIONS

    def rates(self) -> list[float]:
        return [round(self.start_rate * self.step ** k, 3) for k in range(self.rungs)]

    def window(self, rate: float) -> float:
        """Seconds of arrivals at ``rate``: the sweep's window, or enough for ~min_conversations."""
        return max(self.window_s, self.min_conversations / rate)


# Sized so that the whole `sim compare` (the paper/chat grid and these) stays under 25 minutes
# on 2 cores: the sweeps cost about a quarter of the grid's CPU (docs/policies.md says how long a
# run took). What a lane costs is the simulator's work for the conversations in flight at its top
# rungs, so the sizes are about those:
# - long-context saturates on prefill (10k-token first turns), cheap to reach: steps of 1.41 from
#   light load to past replicas' saturation, over the paper's own 10 s windows and 120 s timeout;
# - many-turn saturates on decode batches: ~1,000 conversations in flight on four GPUs. The
#   ladder doubles and stops at 32 conv/s (a 64 conv/s rung would cost ~20 CPU s a lane, ~40%
#   of all the sweeps); 1P3D, 2P2D and replicas sustain more and show ">= 32";
# - agent-32k saturates on KV (a 32K session holds 4 GB), with ~9 turns of 20-30k-token prompts
#   a session, each hashed and cached by the simulator: the ladder doubles up to 8 conv/s.
# Windows: long enough that conversations overlap as in a steady stream (a many-turn conversation
# lasts ~20 s at load, an agent session ~30 s). Start rates are light load on every
# configuration (their medians are the unloaded ones).
SWEEPS: dict[str, Sweep] = {
    "long-context": Sweep("long-context", start_rate=0.5, step=2 ** 0.5, rungs=12, window_s=10.0,
                          timeout_s=PAPER_TIMEOUT_S),
    "many-turn": Sweep("many-turn", start_rate=2.0, step=2.0, rungs=5, window_s=20.0,
                       timeout_s=CHAT_TIMEOUT_S),
    "agent-32k": Sweep("agent-32k", start_rate=0.25, step=2.0, rungs=6, window_s=30.0,
                       timeout_s=CHAT_TIMEOUT_S),
    # Coding agents (TraceLab's shapes): sessions of ~50 requests growing to ~100K tokens, with
    # human pauses of minutes; ~9 CPU s a policy for 60 sessions at 2P2D. Not in `sim compare`'s
    # default run (`OPT_IN`): its lanes alone would double it.
    "coding-agent": Sweep("coding-agent", start_rate=0.1, step=2.0, rungs=4, window_s=150.0,
                          timeout_s=CHAT_TIMEOUT_S),
}
OPT_IN = ("coding-agent",)  # swept only when named (`sim compare --workloads ...,coding-agent`)


def conversations(workload: str, rate: float, seed: int) -> tuple[list[Conversation], float]:
    """One sweep point's conversations and their timeout."""
    sweep = SWEEPS[workload]
    return to_sim(make_workload(workload, rate, sweep.window(rate), seed)), sweep.timeout_s


def saturated(point: PolicyPoint, lightest: PolicyPoint) -> bool:
    """The point is past its lane's saturation (module docstring): under the success bar, no
    follow-up answered, or a median TTFT (turn 1, turns 2+) over `SATURATION_FACTOR` times the
    lane's lightest rung's and over `SATURATION_FLOOR_S`."""
    if point.success_rate < SUCCESS_BAR or point.turn2_p50_ttft_s is None:
        return True
    for now, base in ((point.turn1_p50_ttft_s, lightest.turn1_p50_ttft_s),
                      (point.turn2_p50_ttft_s, lightest.turn2_p50_ttft_s)):
        if now is not None and base and now > max(SATURATION_FACTOR * base, SATURATION_FLOOR_S):
            return True
    return False


class Lane(NamedTuple):
    config: str
    link: str
    workload: str
    policy: str
    seed: int = 0  # each seed's lane climbs the ladder to its own saturation


def lane_of(point: PolicyPoint) -> Lane:
    return Lane(point.config, point.link, point.workload, point.policy, point.seed)


RunRung = Callable[[list[tuple[Lane, float]], int], list[PolicyPoint]]


def sweep(lanes: Iterable[Lane], run: RunRung) -> list[PolicyPoint]:
    """Every lane up its workload's ladder until it saturates or the ladder ends; ``run`` gets
    rung k's (lane, rate) pairs and k, and returns their points in that order. Returns every
    point run."""
    active = list(dict.fromkeys(lanes))
    lightest: dict[Lane, PolicyPoint] = {}
    points: list[PolicyPoint] = []
    for k in range(max((SWEEPS[lane.workload].rungs for lane in active), default=0)):
        todo = [(lane, SWEEPS[lane.workload].rates()[k]) for lane in active
                if k < SWEEPS[lane.workload].rungs]
        if not todo:
            break
        going = []
        for (lane, _), point in zip(todo, run(todo, k), strict=True):
            points.append(point)
            if not saturated(point, lightest.setdefault(lane, point)):
                going.append(lane)
        active = going
    return points


class Saturation(NamedTuple):
    """Where a lane saturated: ``sustained`` is its highest rate before the first saturated
    rung (None: saturated at the lightest), ``saturated_at`` that rung's rate (None: never, up
    to the last rung run)."""

    sustained: float | None
    saturated_at: float | None

    def text(self) -> str:
        if self.saturated_at is None:
            return f">= {self.sustained:g}"
        return f"< {self.saturated_at:g}" if self.sustained is None else f"{self.sustained:g}"


def saturation_rates(points: Sequence[PolicyPoint]) -> dict[Lane, Saturation]:
    """Each lane's saturation, read back from its points (rung order: by rate)."""
    by_lane: dict[Lane, list[PolicyPoint]] = {}
    for p in sorted(points, key=lambda p: p.rate):
        by_lane.setdefault(lane_of(p), []).append(p)
    out = {}
    for lane, lane_points in by_lane.items():
        sustained = None
        for p in lane_points:
            if saturated(p, lane_points[0]):
                out[lane] = Saturation(sustained, p.rate)
                break
            sustained = p.rate
        else:
            out[lane] = Saturation(sustained, None)
    return out
