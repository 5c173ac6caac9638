"""The routing decision for one request, pure and deterministic (no I/O, no clock).

Turn 1 (nothing cached anywhere) always goes through a prefill worker. A follow-up turn either
runs on the conversation's decode worker as an append-prefill (``decode_local``, x=1) or goes
through a prefill worker again (``via_prefill``, x=0). Which one depends on the mode:

- ``pd``: always via prefill (classic disaggregation).
- ``local``: always decode-local when the decode worker still holds the history.
- ``fraction``: decode-local for a fixed, deterministic share of follow-ups.
- ``ppd``: the score S of decode-local against via prefill, decode-local when S >= 0. Without
  a table (the default), S is the cost model's, priced as the fleet pays it (`predictor`: the
  request's own TTFT and TPOT and what its append costs the sequences it delays; `congestion`:
  the TTFT its work costs the requests that reach the same pool after it; over the fleet's mean
  follow-up TTFT and TPOT), its predictions corrected per route and bucket by observed outcomes
  (`learning`); where S is within the error of those corrected means (its margin), a route not
  seen lately in the request's bucket is explored now and then.
  With a table (``--table auto|PATH``), S is the paper's: the measured score of the request's
  grid cell plus an online correction, how much the cost model says the score moves from the
  conditions the cell was measured under (its representative context and workload, the loads
  seen then) to this request's real ones.
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

from .congestion import PoolTraffic
from .features import RequestFeatures, WorkerLoad, moves_to_best
from .learning import Calibration, FleetMeans, bucket_of
from .predictor import ProfilePredictor, RouteCosts
from .score import Prediction, score
from .table import PpdTable, Weights

__all__ = ["Calibration", "Decision", "Mode", "Observed", "Policy", "PolicyConfig", "ProfilePredictor",
           "RequestFeatures", "Route", "RouteCosts", "WorkerLoad", "moves_to_best"]


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
    margin: float | None = None  # the score's uncertainty: via prefill only below -margin


class RoutePredictor(Protocol):
    def costs(self, features: RequestFeatures) -> tuple[RouteCosts, RouteCosts]:
        """(decode-local, via-prefill) costs of a follow-up turn (`predictor.ProfilePredictor`)."""
        ...


@dataclass(frozen=True, slots=True)
class Observed:
    """What one finished request taught the policy: its route, its calibration bucket, and how far
    the (calibrated) prediction was from the outcome, as observed/predicted - 1."""

    route: Route
    bucket: str
    ttft_error: float
    tpot_error: float | None


@dataclass(frozen=True)
class PolicyConfig:
    mode: Mode = Mode.PPD
    local_fraction: float = 0.5
    w_ttft: float = 1.0
    w_tpot: float = 1.0
    # A follow-up is decode-local only if the decode worker holds at least this share of the
    # history it sent before (less means it was evicted: the turn is a full prefill again).
    min_resident_fraction: float = 0.5


# Exploration: where the margin is thin, a follow-up whose bucket has not seen the other route
# within its last EXPLORE_AFTER outcomes (or too few times to have its own correction) goes that
# way with this probability (hashed per request). At 5% it cost up to 13 points of the paper
# grid's share at w_tpot 6 (short runs, an exact model); at 1% nothing measurable.
EXPLORE_SHARE = 0.01
EXPLORE_AFTER = 200


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
        self.fleet = FleetMeans()
        self.pools = PoolTraffic()  # what each pool is sent, for the congestion a route adds
        self.set_table(table)
        self._weights = Weights(config.w_ttft, config.w_tpot)

    def decide(self, f: RequestFeatures, history_tokens: int) -> Decision:
        """Route one request. ``history_tokens``: how much of this prompt the conversation had
        already sent and received (what the decode worker should hold)."""
        mode = self.config.mode
        if mode is Mode.REPLICA:
            return Decision(Route.REPLICA, "replica_mode")
        if f.turn <= 1 or not f.has_session_decode:
            self._sent(Route.VIA_PREFILL, f)
            return Decision(Route.VIA_PREFILL, "first_turn" if f.turn <= 1 else "no_decode_worker")
        if history_tokens and f.cached_on_decode < self.config.min_resident_fraction * history_tokens:
            self._sent(Route.VIA_PREFILL, f)
            return Decision(Route.VIA_PREFILL, "history_evicted")
        if mode is Mode.PD:
            return Decision(Route.VIA_PREFILL, "pd_mode")
        if mode is Mode.LOCAL:
            return Decision(Route.DECODE_LOCAL, "local_mode")
        if mode is Mode.FRACTION:
            local = _unit_hash(f.decision_key) < self.config.local_fraction
            return Decision(Route.DECODE_LOCAL if local else Route.VIA_PREFILL, "fraction_mode")
        assert self.predictor is not None
        bucket = bucket_of(f)
        local_c, via_c = self.predictor.costs(f)
        local_p, via_p = self._calibrated(local_c, via_c, bucket)
        if self.table is None:
            ref = self._reference(via_p)
            local_q, via_q = self._congestion(f, local_c, via_c, local_p, via_p)
            s, measured, key = self._score(local_c, via_p, local_p, ref, local_q, via_q), None, None
            margin = self._margin(local_p, via_p, bucket, ref)
            reason = "predicted"
        else:
            # The paper's table: the cell's measured score (its outcomes hold what its appends
            # cost the other sequences), and, with online correction, how far the cost model says
            # this request's conditions move it, in the paper's per-request units.
            key = self.cell_key(f)
            (cell_local, cell_via), (n_local, n_via) = self._cell(key)
            w_ttft, w_tpot = self.config.w_ttft, self.config.w_tpot
            s = measured = score(cell_local, cell_via, w_ttft, w_tpot)
            margin, reason = 0.0, "table"  # a measured score is an outcome, not a prediction
            if self.online_correction:
                # The nominal conditions go through the same calibration as the live ones, so
                # that only the conditions differ: the model's own bias is already in the
                # measured score, and an uncalibrated nominal would add it again (flipping cells
                # with a small margin).
                nominal = score(*self._calibrated(n_local, n_via, bucket), w_ttft, w_tpot)
                s += score(local_p, via_p, w_ttft, w_tpot) - nominal
                reason = "table_corrected"
        # The route the corrected score favours, whatever its margin: an error that can go either
        # way favours neither route, and holding turns local until via prefill was proven kept
        # them on a busy decode worker (3P1D at high rates) long after it stopped paying. The
        # margin says where the call is thin: there a route not seen lately is explored.
        route = Route.VIA_PREFILL if s < 0 else Route.DECODE_LOCAL
        other = Route.VIA_PREFILL if route is Route.DECODE_LOCAL else Route.DECODE_LOCAL
        if (self.online_correction and abs(s) < margin
                and self.calibration.stale(other.value, bucket, EXPLORE_AFTER)
                and _unit_hash("explore:" + f.decision_key) < EXPLORE_SHARE):
            # A thin margin, and the other route has not been seen here for a while: try it now
            # and then, or its correction goes stale and the margin never shrinks.
            route, reason = other, "explore"
        raw = local_c.own if route is Route.DECODE_LOCAL else via_c.own
        self._sent(route, f)
        return Decision(route, reason, s, local_p, via_p, key, measured, raw=raw, bucket=bucket,
                        margin=margin)

    def _calibrated(self, local: RouteCosts, via: RouteCosts, bucket: str) -> tuple[Prediction, Prediction]:
        if not self.online_correction:
            return local.own, via.own
        return (self.calibration.apply(Route.DECODE_LOCAL.value, bucket, local.own),
                self.calibration.apply(Route.VIA_PREFILL.value, bucket, via.own))

    def _reference(self, via: Prediction) -> Prediction:
        """What the score's seconds are divided by: the fleet's mean follow-up TTFT and TPOT once
        outcomes have been seen (a point's score is on those means), else this request's own
        via-prefill predictions (the paper's per-request score)."""
        if self.fleet.ttft_s and self.fleet.tpot_s:
            return Prediction(self.fleet.ttft_s, self.fleet.tpot_s)
        return via

    def _score(self, local_c: RouteCosts, via: Prediction, local: Prediction, ref: Prediction,
               local_q: float = 0.0, via_q: float = 0.0) -> float:
        """The score priced as the fleet pays it: the TTFT this request gains or loses, the TPOT
        it and the sequences its append delays pay (`predictor`), and the TTFT each route's
        queued work costs the requests after it (``local_q``, ``via_q``: `congestion`), each
        over ``ref``."""
        others = 0.0
        if local_c.own.tpot_s:
            # The others' delay is the model's; it is corrected as this worker's TPOT is.
            others = local_c.others_tpot_s * local.tpot_s / local_c.own.tpot_s
        charged = Prediction(local.ttft_s + local_q, local.tpot_s + others)
        return score(charged, Prediction(via.ttft_s + via_q, via.tpot_s), self.config.w_ttft,
                     self.config.w_tpot, ref)

    def _work_s(self, route: Route, f: RequestFeatures) -> float:
        """The prompt work (seconds of prefill, the predictor's fluid rate) ``route`` puts on its
        pool: the append's new tokens on the decode worker, or what the prefill worker does not hold."""
        if not isinstance(self.predictor, ProfilePredictor):
            return 0.0
        tokens = f.new_tokens if route is Route.DECODE_LOCAL else f.prompt_tokens - f.cached_on_prefill
        return max(1, tokens) * self.predictor.prefill_s_per_token

    def _sent(self, route: Route, f: RequestFeatures) -> None:
        if self.config.mode is Mode.PPD and isinstance(self.predictor, ProfilePredictor):
            self.pools.record(route is Route.VIA_PREFILL, self._work_s(route, f))

    def _congestion(self, f: RequestFeatures, local_c: RouteCosts, via_c: RouteCosts, local: Prediction,
                    via: Prediction) -> tuple[float, float]:
        """(decode-local, via-prefill) seconds of TTFT the route's work costs the requests that
        reach its pool after it (`congestion`), scaled as the route's TTFT is corrected."""
        if not isinstance(self.predictor, ProfilePredictor):
            return 0.0, 0.0
        out = []
        for route, costs, corrected, pool, load, workers in (
                (Route.DECODE_LOCAL, local_c, local, self.pools.decode, f.decode_load, f.decode_workers),
                (Route.VIA_PREFILL, via_c, via, self.pools.prefill, f.prefill_load, f.prefill_workers)):
            ratio = corrected.ttft_s / costs.own.ttft_s if costs.own.ttft_s > 0 else 1.0
            out.append(pool.congestion_s(self._work_s(route, f) * ratio, self.predictor.queue_s(load) * ratio,
                                         f.qps, workers))
        return out[0], out[1]

    def _margin(self, local: Prediction, via: Prediction, bucket: str, ref: Prediction) -> float:
        """The score's uncertainty from the errors of the routes' learned mean predictions (root
        sum of squares of each term's error), in the score's units."""
        lt, lp = self.calibration.mean_error(Route.DECODE_LOCAL.value, bucket)
        vt, vp = self.calibration.mean_error(Route.VIA_PREFILL.value, bucket)
        ttft = math.hypot(lt * local.ttft_s, vt * via.ttft_s) / ref.ttft_s
        tpot = math.hypot(lp * local.tpot_s, vp * via.tpot_s) / ref.tpot_s
        return self.config.w_ttft * ttft + self.config.w_tpot * tpot

    def set_table(self, table: PpdTable | None) -> None:
        """Use another table (the router switches when the live P:D configuration changes)."""
        self.table = table
        self._cells = table.index() if table else {}
        # Per cell: its measured means and the costs of its conditions.
        self._cell_cache: dict[tuple[str, str, float],
                               tuple[tuple[Prediction, Prediction], tuple[RouteCosts, RouteCosts]]] = {}
        self._workload_points = ([(w.name, math.log(w.input_tokens), math.log(w.output_tokens))
                                  for w in table.grid.workload_classes] if table else [])

    def _cell(self, key: tuple[str, str, float]) -> tuple[tuple[Prediction, Prediction],
                                                          tuple[RouteCosts, RouteCosts]]:
        """A cell's measured (decode-local, via-prefill) means and the costs of its conditions."""
        cached = self._cell_cache.get(key)
        if cached is None:
            assert self.predictor is not None
            cell = self._cells[key]
            cached = ((cell.decode_local.prediction(), cell.via_prefill.prediction()),
                      self.predictor.costs(self.nominal(key)))
            self._cell_cache[key] = cached
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
        if self.online_correction and chosen is not None:
            self.calibration.observe(decision.route.value, decision.bucket, decision.raw, chosen, ttft_s,
                                     tpot_s)
            self.fleet.observe(ttft_s, tpot_s)
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
        # The cell's batch: its conversations' first and second turns, about half each.
        batch = round(seen.decode_batch)
        inverse = batch / 2 * (1 / max(1, context.first_output_tokens) + 1 / max(1, workload.output_tokens))
        return RequestFeatures(
            decision_key=f"{key}", turn=2, prompt_tokens=context.representative_tokens,
            cached_on_decode=cached, cached_on_prefill=on_prefill,
            expected_output_tokens=workload.output_tokens,
            has_session_decode=True,
            decode_load=WorkerLoad(inflight_requests=batch, decode_requests=batch,
                                   decode_kv_tokens=round(seen.decode_kv_tokens), inverse_outputs=inverse),
            prefill_load=WorkerLoad(pending_prefill_tokens=round(cell.via_prefill.conditions.prefill_queue_tokens)),
            qps=key[2])


def _unit_hash(key: str) -> float:
    """A deterministic number in [0, 1) per key (the same request id always routes the same)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64
