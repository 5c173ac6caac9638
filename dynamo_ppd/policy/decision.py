"""The routing decision for one request, pure and deterministic (no I/O, no clock).

Turn 1 (nothing cached anywhere) always goes through a prefill worker. A follow-up turn either
runs on the conversation's decode worker as an append-prefill (``decode_local``, x=1) or goes
through a prefill worker again (``via_prefill``, x=0). Which one depends on the mode:

- ``pd``: always via prefill (classic disaggregation).
- ``local``: always decode-local when the decode worker still holds the history.
- ``fraction``: decode-local for a fixed, deterministic share of follow-ups.
- ``ppd``: the paper's score (`score.score`), decode-local when S > 0. With a table, S is the
  measured score of the request's grid cell plus an online correction: how much the cost model
  says the score moves from the conditions the cell was measured under (its representative
  context and workload, the loads seen then) to this request's real ones (its cached and new
  tokens, the prefill queue, the decode worker's batch). A hot decode worker, a cold prefill
  worker or a workload unlike the grid's therefore move the decision; with no drift the table
  decides alone. Without a table (cold start), S comes from the cost model's predictions alone.
- ``replica``: aggregated workers only (no disaggregation), as the paper's Replica baseline.

Whatever the mode, a follow-up whose history the decode worker no longer holds (evicted, or the
worker is gone) is not an append-prefill any more and goes through a prefill worker.
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

from ..engine.cost import CostModel, PrefillChunk
from ..engine.profile import EngineProfile
from .score import Prediction, score
from .table import PpdTable, Weights


class Mode(str, enum.Enum):
    PD = "pd"
    LOCAL = "local"
    FRACTION = "fraction"
    PPD = "ppd"
    REPLICA = "replica"


class Route(str, enum.Enum):
    DECODE_LOCAL = "decode_local"
    VIA_PREFILL = "via_prefill"
    REPLICA = "replica"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the router knows about a worker's load right now."""

    inflight_requests: int = 0  # requests this router has running there
    pending_prefill_tokens: int = 0  # prompt tokens routed there and not yet prefilled
    decode_requests: int = 0  # sequences decoding there (as last reported)
    decode_kv_tokens: int = 0  # their total context


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    decision_key: str  # session and turn: the fraction mode's coin is fixed per key
    turn: int  # 1-based turn of the conversation, as the router counts it
    prompt_tokens: int
    cached_on_decode: int  # prompt tokens the session's decode worker still holds (0 if none)
    cached_on_prefill: int  # prompt tokens the best prefill worker holds
    expected_output_tokens: int
    has_session_decode: bool  # the conversation has a live decode worker
    decode_load: WorkerLoad
    prefill_load: WorkerLoad
    qps: float = 0.0  # request rate the router sees (sliding window)
    # The least loaded decode worker's load: a turn sent through a prefill worker can move there
    # (`moves_to_best`, applied by `placement.place`), so its via-prefill TPOT is that worker's,
    # not the session's.
    best_decode_load: WorkerLoad | None = None

    @property
    def new_tokens(self) -> int:
        """Tokens an append-prefill on the session's decode worker would compute."""
        return self.prompt_tokens - self.cached_on_decode


@dataclass(frozen=True, slots=True)
class Decision:
    route: Route
    reason: str  # why, for metrics and the debug line
    score: float | None = None
    local: Prediction | None = None
    via_prefill: Prediction | None = None
    cell: tuple[str, str, float] | None = None  # the table cell used, if any
    table_score: float | None = None  # the cell's measured score (before the online correction)
    raw: Prediction | None = None  # the chosen route's prediction before calibration
    bucket: str = ""  # the calibration bucket the request fell in (context, append, load)


@dataclass(frozen=True, slots=True)
class Observed:
    """What one finished request taught the policy: its route, its calibration bucket, and how far
    the (calibrated) prediction was from the outcome, as observed/predicted - 1."""

    route: Route
    bucket: str
    ttft_error: float
    tpot_error: float | None


def moves_to_best(session: WorkerLoad, best: WorkerLoad) -> bool:
    """A turn going through a prefill worker moves from its decode worker to the least loaded one
    when the session's is clearly hotter: it gets its KV by transfer anyway, and one hot worker
    should not keep every conversation that ever landed on it."""
    return session.decode_requests > best.decode_requests + max(8, best.decode_requests // 2)


class Calibration:
    """Online correction from outcomes: per route, an exponentially weighted ratio of observed to
    predicted TTFT and TPOT, applied to later predictions. It catches what no signal names: a
    slower link, other hardware, a workload the profile did not foresee."""

    def __init__(self, alpha: float = 0.1, floor: float = 0.25, cap: float = 4.0):
        self.alpha, self.floor, self.cap = alpha, floor, cap
        self.ratios = {route: [1.0, 1.0] for route in (Route.DECODE_LOCAL, Route.VIA_PREFILL)}

    def observe(self, route: Route, predicted: Prediction, ttft_s: float, tpot_s: float | None) -> None:
        if route not in self.ratios or predicted.ttft_s <= 0:
            return
        ratios = self.ratios[route]
        observed = (ttft_s / predicted.ttft_s, (tpot_s / predicted.tpot_s) if tpot_s else None)
        for i, value in enumerate(observed):
            if value is not None:
                value = min(self.cap, max(self.floor, value))
                ratios[i] += self.alpha * (value - ratios[i])

    def apply(self, route: Route, p: Prediction) -> Prediction:
        ttft, tpot = self.ratios[route]
        return Prediction(p.ttft_s * ttft, p.tpot_s * tpot)


class RoutePredictor(Protocol):
    def predict(self, features: RequestFeatures) -> tuple[Prediction, Prediction]:
        """(decode-local, via-prefill) predictions for a follow-up turn."""
        ...


class ProfilePredictor:
    """Cold-start predictions from the engine profile's cost model.

    - via prefill: the prefill worker computes the tokens it does not hold, after the prompt
      tokens already queued on it; the whole prompt's KV crosses the link; the decode worker then
      decodes at its current batch.
    - decode-local: the decode worker computes the tokens it does not hold inside its current
      batch (one iteration with that chunk), after the prompt tokens already queued on it; its TPOT
      pays that iteration's extra time spread over the request's output tokens.
    - A via-prefill turn may move to the least loaded decode worker (`moves_to_best`).
    """

    def __init__(self, profile: EngineProfile):
        self.cost = CostModel(profile)
        self.kv_bytes_per_token = profile.gpu_kv_bytes_per_token  # each GPU pair moves its shard at once
        self.link_bandwidth = profile.transfer.link_bandwidth_bytes_s
        self.transfer_setup_s = profile.transfer.transfer_setup_s
        # The stack's fixed costs that differ between the routes (the request overhead is paid
        # by both and cancels out of the comparison).
        self.handoff_s = profile.stack.handoff_overhead_s
        self.decode_local_s = profile.stack.decode_local_overhead_s
        full = profile.engine.max_num_tokens
        self._prefill_s_per_token = self.cost.iteration(0, 0, [PrefillChunk(full, 0, True)]).total_s / full

    def _decode_step_s(self, load: WorkerLoad, prompt_tokens: int) -> float:
        return self.cost.iteration(load.decode_requests + 1, load.decode_kv_tokens + prompt_tokens).total_s

    def predict(self, f: RequestFeatures) -> tuple[Prediction, Prediction]:
        target = f.decode_load
        if f.best_decode_load is not None and moves_to_best(f.decode_load, f.best_decode_load):
            target = f.best_decode_load
        decode_step = self._decode_step_s(target, f.prompt_tokens)
        queued = self._queue_s(f.prefill_load)
        uncached_p = max(1, f.prompt_tokens - f.cached_on_prefill)
        prefill_s = self.cost.iteration(0, 0, [PrefillChunk(uncached_p, f.cached_on_prefill, True)]).total_s
        transfer_s = self.transfer_setup_s + f.prompt_tokens * self.kv_bytes_per_token / self.link_bandwidth
        via_prefill = Prediction(ttft_s=queued + prefill_s + self.handoff_s + transfer_s + decode_step / 2,
                                 tpot_s=decode_step)

        load = f.decode_load
        decode_step = self._decode_step_s(load, f.prompt_tokens)
        append = self.cost.iteration(load.decode_requests, load.decode_kv_tokens,
                                     [PrefillChunk(max(1, f.new_tokens), f.cached_on_decode, True)]).total_s
        extra = max(0.0, append - self.cost.iteration(load.decode_requests, load.decode_kv_tokens).total_s)
        outputs = max(1, f.expected_output_tokens)
        # Arriving mid-iteration, the append waits half a decode step on average, then whatever
        # prompt tokens are queued on the decode worker before it.
        local = Prediction(ttft_s=self.decode_local_s + decode_step / 2 + self._queue_s(load) + append,
                           tpot_s=decode_step + extra / outputs)
        return local, via_prefill

    def _queue_s(self, load: WorkerLoad) -> float:
        """Time the prompt tokens queued on a worker ahead of a new request add to its wait: their
        share of full prefill chunks, linear in the tokens. Not one iteration of that size: an
        iteration's fixed part (the weights streamed once) would make a cell's mean queue of a
        few tokens (a worker busy now and then) cost ~5 ms, and the online correction would then
        read an idle prefill worker as several ms faster than the cell it was measured in."""
        return load.pending_prefill_tokens * self._prefill_s_per_token


@dataclass(frozen=True)
class PolicyConfig:
    mode: Mode = Mode.PPD
    local_fraction: float = 0.5
    w_ttft: float = 1.0
    w_tpot: float = 1.0
    # A follow-up is decode-local only if the decode worker holds at least this share of the
    # history it sent before (less means it was evicted: the turn is a full prefill again).
    min_resident_fraction: float = 0.5


class Policy:
    def __init__(self, config: PolicyConfig, predictor: RoutePredictor | None = None,
                 table: PpdTable | None = None, online_correction: bool = True):
        if config.mode is Mode.PPD and predictor is None:
            raise ValueError("ppd mode needs a route predictor (the engine profile's)")
        if not 0.0 <= config.local_fraction <= 1.0:
            raise ValueError("local fraction must be within [0, 1]")
        self.config = config
        self.predictor = predictor
        self.table = table
        self.online_correction = online_correction
        self.calibration = Calibration()
        self.set_table(table)
        self._weights = Weights(config.w_ttft, config.w_tpot)

    def decide(self, f: RequestFeatures, history_tokens: int) -> Decision:
        """Route one request. ``history_tokens``: how much of this prompt the conversation had
        already sent and received (what the decode worker should hold)."""
        mode = self.config.mode
        if mode is Mode.REPLICA:
            return Decision(Route.REPLICA, "replica_mode")
        if f.turn <= 1 or not f.has_session_decode:
            return Decision(Route.VIA_PREFILL, "first_turn" if f.turn <= 1 else "no_decode_worker")
        if history_tokens and f.cached_on_decode < self.config.min_resident_fraction * history_tokens:
            return Decision(Route.VIA_PREFILL, "history_evicted")
        if mode is Mode.PD:
            return Decision(Route.VIA_PREFILL, "pd_mode")
        if mode is Mode.LOCAL:
            return Decision(Route.DECODE_LOCAL, "local_mode")
        if mode is Mode.FRACTION:
            local = _unit_hash(f.decision_key) < self.config.local_fraction
            return Decision(Route.DECODE_LOCAL if local else Route.VIA_PREFILL, "fraction_mode")
        assert self.predictor is not None
        w_ttft, w_tpot = self.config.w_ttft, self.config.w_tpot
        raw_local, raw_prefill = self.predictor.predict(f)
        local_p, prefill_p = raw_local, raw_prefill
        if self.online_correction:
            local_p = self.calibration.apply(Route.DECODE_LOCAL, raw_local)
            prefill_p = self.calibration.apply(Route.VIA_PREFILL, raw_prefill)
        live = score(local_p, prefill_p, w_ttft, w_tpot)
        if self.table is None:
            route = _route(live)
            return Decision(route, "predicted", live, local_p, prefill_p,
                            raw=raw_local if route is Route.DECODE_LOCAL else raw_prefill)
        key = self.cell_key(f)
        measured, (nominal_local, nominal_prefill) = self._cell_scores(key)
        s = measured
        if self.online_correction:
            # How far this request's conditions move the score from the cell's. The nominal
            # conditions go through the same calibration as the live ones, so that only the
            # conditions differ: the model's own bias is already in the measured score, and an
            # uncalibrated nominal would add it again (flipping cells with a small margin).
            nominal = score(self.calibration.apply(Route.DECODE_LOCAL, nominal_local),
                            self.calibration.apply(Route.VIA_PREFILL, nominal_prefill), w_ttft, w_tpot)
            s += live - nominal
        route = _route(s)
        raw = raw_local if route is Route.DECODE_LOCAL else raw_prefill
        return Decision(route, "table_corrected" if self.online_correction else "table", s, local_p,
                        prefill_p, key, measured, raw=raw)

    def set_table(self, table: PpdTable | None) -> None:
        """Use another table (the router switches when the live P:D configuration changes)."""
        self.table = table
        self._cells = table.index() if table else {}
        # Per cell, fixed for given weights: (measured score, the predictions of its conditions).
        self._cell_score_cache: dict[tuple[str, str, float], tuple[float, tuple[Prediction, Prediction]]] = {}
        self._workload_points = ([(w.name, math.log(w.input_tokens), math.log(w.output_tokens))
                                  for w in table.grid.workload_classes] if table else [])

    def _cell_scores(self, key: tuple[str, str, float]) -> tuple[float, tuple[Prediction, Prediction]]:
        cached = self._cell_score_cache.get(key)
        if cached is None:
            assert self.predictor is not None
            w_ttft, w_tpot = self.config.w_ttft, self.config.w_tpot
            cell = self._cells[key]
            measured = score(cell.decode_local.prediction(), cell.via_prefill.prediction(), w_ttft, w_tpot)
            cached = (measured, self.predictor.predict(self.nominal(key)))
            self._cell_score_cache[key] = cached
        return cached

    def cell_key(self, f: RequestFeatures) -> tuple[str, str, float]:
        """The table cell of a request: context class, nearest workload class, QPS level."""
        assert self.table is not None
        grid = self.table.grid
        x, y = math.log(max(1, f.new_tokens)), math.log(max(1, f.expected_output_tokens))
        workload = min(self._workload_points, key=lambda p: (p[1] - x) ** 2 + (p[2] - y) ** 2)[0]
        return grid.context_class(f.prompt_tokens).name, workload, grid.qps_level(f.qps)

    def observe(self, decision: Decision, ttft_s: float, tpot_s: float | None) -> Observed | None:
        """Learn from a finished request routed by ``decision`` (its uncalibrated prediction);
        returns the prediction's error, for metrics (None where nothing was predicted)."""
        if self.predictor is None or decision.raw is None:
            return None
        chosen = decision.local if decision.route is Route.DECODE_LOCAL else decision.via_prefill
        observed = None
        if chosen is not None and chosen.ttft_s > 0:
            observed = Observed(decision.route, decision.bucket, ttft_s / chosen.ttft_s - 1,
                                (tpot_s / chosen.tpot_s - 1) if tpot_s and chosen.tpot_s > 0 else None)
        if self.online_correction:
            self.calibration.observe(decision.route, decision.raw, ttft_s, tpot_s)
        return observed

    def cell_of(self, f: RequestFeatures) -> tuple[tuple[str, str, float], RequestFeatures]:
        """The table cell of a request, and the features the cell was measured under."""
        key = self.cell_key(f)
        return key, self.nominal(key)

    def nominal(self, key: tuple[str, str, float]) -> RequestFeatures:
        """A cell's conditions at x=1 (what a decode-local follow-up met there): the representative
        context, cached but for the workload's new tokens, and the loads seen then."""
        assert self.table is not None
        grid = self.table.grid
        context = next(c for c in grid.context_classes if c.name == key[0])
        workload = next(w for w in grid.workload_classes if w.name == key[1])
        cell = self._cells[key]
        seen = cell.decode_local.conditions
        cached = max(0, context.representative_tokens - workload.input_tokens)
        # The prefill worker holds turn 1's prompt, which it computed, but never turn 1's answer
        # (decoded elsewhere): a cell's via-prefill follow-up recomputed that answer there. Not
        # counting it made every live follow-up look slower through P than the cell's nominal
        # one, and the online correction then flipped cells that were measured decode-local.
        on_prefill = max(0, cached - context.first_output_tokens)
        return RequestFeatures(
            decision_key=f"{key}", turn=2, prompt_tokens=context.representative_tokens,
            cached_on_decode=cached, cached_on_prefill=on_prefill,
            expected_output_tokens=workload.output_tokens,
            has_session_decode=True,
            decode_load=WorkerLoad(decode_requests=round(seen.decode_batch),
                                   decode_kv_tokens=round(seen.decode_kv_tokens)),
            prefill_load=WorkerLoad(pending_prefill_tokens=round(cell.via_prefill.conditions.prefill_queue_tokens)),
            qps=key[2])


def _route(s: float) -> Route:
    return Route.DECODE_LOCAL if s > 0 else Route.VIA_PREFILL


def _unit_hash(key: str) -> float:
    """A deterministic number in [0, 1) per key (the same request id always routes the same)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64
