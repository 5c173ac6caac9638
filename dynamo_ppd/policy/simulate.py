"""The PPD policy inside the virtual-clock simulation: the same `Policy` the router runs, fed the
same kind of features from the simulated cluster, and the cell measurements tables are built
from (each cell run at x=0 and x=1)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.profile import EngineProfile
from ..engine.scheduler import LoadSnapshot
from ..sim import Cluster, Conversation, DecodeLocal, SimRequestFeatures, ViaPrefill, simulate
from ..sim.cluster import ClusterView
from ..sim.conversation import TEMPLATE_TOKENS, Turn
from ..sim.outcome import CHAT_TIMEOUT_S, PAPER_TIMEOUT_S
from ..sim.routing import least_loaded_prefill, local_router, pd_router
from ..sim.run import SimResult
from ..workloads.generators import PAPER_KILL_AFTER_S, PAPER_TURNS, paper_arrivals
from .decision import Decision, Mode, Observed, Policy, PolicyConfig, ProfilePredictor, Route, WorkerLoad
from .grid import ContextClass, WorkloadClass
from .placement import ClusterState, Placement, Routed, TurnRequest, place
from .qps import SlidingWindowRate
from .table import Conditions, Measurement, PpdTable, Weights, reweight


def prefill_queue_tokens(view: ClusterView, worker: str) -> int:
    load = view.load(worker)
    return load.waiting_prompt_tokens + load.prefill_tokens_remaining


def worker_load(view: ClusterView, worker: str | None, load: LoadSnapshot | None = None,
                own: Routed | None = None) -> WorkerLoad:
    """A worker's load as the live router sees it (`dynamo_ppd.routing.state.Loads.of`): for each
    figure, its own count of what it routed there (`Routed`) or the worker's report (its engine
    now), whichever is larger. ``load``, ``own``: the worker's snapshot and `routed` counts, if
    the caller has them already."""
    if worker is None:
        return WorkerLoad()
    load = load or view.load(worker)
    own = own if own is not None else routed(view, worker)
    reported_prefill = load.waiting_prompt_tokens + load.prefill_tokens_remaining
    reported_decode = load.decode_requests + load.awaiting_kv_requests
    reported_kv = load.decode_kv_tokens + load.awaiting_kv_tokens
    return WorkerLoad(inflight_requests=own.requests,
                      pending_prefill_tokens=max(own.prefill_tokens, reported_prefill),
                      decode_requests=max(own.requests, reported_decode),
                      decode_kv_tokens=max(own.context_tokens, reported_kv),
                      inverse_outputs=own.inverse_outputs)


def routed(view: ClusterView, worker: str) -> Routed:
    """What the router has routed to the worker and not seen end, counted as the live router
    counts it (`routing.Loads`): the requests, and their prompts' tokens, as prefill work on a prefill
    worker (its prefill legs) and as context on a decode worker, from the moment they are routed.
    (Not the worker's KV: a decode worker's context grows as it answers, the router's count
    does not; ranking new conversations by the KV sent them to other workers than the live
    router's, docs/bench/dilation.md.)"""
    prompts = view.inflight_prompt_tokens(worker)
    if worker in view.prefill_workers:
        return Routed(requests=0, prefill_tokens=prompts)  # the live router counts no requests on P
    return Routed(requests=view.inflight(worker), context_tokens=prompts,
                  inverse_outputs=view.inflight_inverse_outputs(worker))


def cluster_state(view: ClusterView, tokens: list[int], session: str | None = None) -> ClusterState[str]:
    """What placement reads, from the simulated cluster as the live router gathers it: what the
    prefill workers and the session's decode worker hold of the prompt (KV events: the router's
    residency index), each worker's load as the policy reads it (`worker_load`), and this
    router's own counts (`routed`; the simulator has one router, so they are all the traffic)."""
    counts = {worker: routed(view, worker) for worker in [*view.prefill_workers, *view.decode_workers]}
    loads = {worker: worker_load(view, worker, own=own) for worker, own in counts.items()}
    holders = [*view.prefill_workers, *([session] if session is not None else [])]
    cached = {worker: view.cached_prefix_tokens(worker, tokens) for worker in holders}
    # The KV each decode worker holds (the live router counts it from KV events, `Residency`).
    resident = {worker: view.load(worker).kv_used_blocks * view.block_size for worker in view.decode_workers}
    return ClusterState(view.prefill_workers, view.decode_workers, loads, counts, cached, resident)


class PredictionLog:
    """What a `PolicyRouter` predicted at its follow-up decisions and what the turns then took,
    as running sums (`sim compare` reports the means at PPD's worst points): the mean predicted
    decode-local and via-prefill TTFT/TPOT over the follow-ups decided (`Decision.local`,
    `Decision.via_prefill`, where the decision has them), and the mean observed TTFT/TPOT of the
    finished follow-ups per route taken. Only this router's own decisions and the turns it was
    told of (`on_finish`) count."""

    FIELDS = ("local_ttft_s", "local_tpot_s", "via_ttft_s", "via_tpot_s", "observed_local_ttft_s",
              "observed_local_tpot_s", "observed_via_ttft_s", "observed_via_tpot_s")

    def __init__(self) -> None:
        self.decisions = 0  # follow-up decisions
        self._sums = dict.fromkeys(self.FIELDS, 0.0)
        self._counts = dict.fromkeys(self.FIELDS, 0)
        # Each finished follow-up's prediction error (observed / predicted - 1, the policy's
        # `Observed`) by the route it took: (TTFT error, TPOT error or None).
        self.errors: dict[str, list[tuple[float, float | None]]] = {}

    def observed(self, observed: Observed) -> None:
        self.errors.setdefault(observed.route.value, []).append((observed.ttft_error, observed.tpot_error))

    def error_summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per route: follow-ups, and the TTFT and TPOT errors' median, 10th and 90th percentiles
        and mean absolute value (None where there is none)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for route, pairs in sorted(self.errors.items()):
            row: dict[str, float | int | None] = {"follow_ups": len(pairs)}
            for name, values in (("ttft", sorted(t for t, _ in pairs)),
                                 ("tpot", sorted(p for _, p in pairs if p is not None))):
                for label, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
                    row[f"{name}_error_{label}"] = values[int(q * (len(values) - 1))] if values else None
                row[f"{name}_abs_error_mean"] = sum(abs(v) for v in values) / len(values) if values else None
            out[route] = row
        return out

    def _add(self, name: str, value: float | None) -> None:
        if value is not None:
            self._sums[name] += value
            self._counts[name] += 1

    def decided(self, decision: Decision) -> None:
        self.decisions += 1
        for prefix, prediction in (("local", decision.local), ("via", decision.via_prefill)):
            if prediction is not None:
                self._add(f"{prefix}_ttft_s", prediction.ttft_s)
                self._add(f"{prefix}_tpot_s", prediction.tpot_s)

    def finished(self, route: Route, ttft_s: float, tpot_s: float | None) -> None:
        prefixes = {Route.DECODE_LOCAL: "observed_local", Route.VIA_PREFILL: "observed_via"}
        prefix = prefixes.get(route)
        if prefix is None:
            return  # a replica's turn: neither route
        self._add(f"{prefix}_ttft_s", ttft_s)
        self._add(f"{prefix}_tpot_s", tpot_s)

    def means(self) -> dict[str, float | None]:
        """Each figure's mean (None where nothing was recorded)."""
        return {name: self._sums[name] / self._counts[name] if self._counts[name] else None
                for name in self.FIELDS}


class PolicyRouter:
    """A simulation router that places turns as the live router does (`placement.place`: the same
    prefill and decode choice, the same policy call, a hot decode worker left for a cooler one on
    via-prefill turns), reading a sliding-window rate, and feeding each finished turn's TTFT and
    TPOT back to the policy (pass `on_finish` to `simulate`). ``predictions`` logs what it
    predicted at its follow-up decisions and what those turns took (`PredictionLog`)."""

    def __init__(self, policy: Policy, window_s: float = 10.0):
        self.policy = policy
        self.rate = SlidingWindowRate(window_s)
        self._pending: dict[tuple[str, int], Decision] = {}
        self.predictions = PredictionLog()

    def place(self, f: SimRequestFeatures, view: ClusterView) -> Placement[str]:
        """The turn's placement (no side effect on the cluster; records the arrival's rate)."""
        self.rate.record(f.now)
        session = f.decode_worker if f.decode_worker in view.decode_workers else None
        request = TurnRequest(decision_key=f"{f.conversation_id}:{f.turn}", turn=f.turn,
                              prompt_tokens=f.prompt_tokens, expected_output_tokens=f.max_tokens,
                              session_decode=session, history_tokens=f.prompt_tokens - f.new_tokens,
                              qps=self.rate.rate(f.now))
        return place(self.policy, cluster_state(view, f.token_ids, session), request)

    def __call__(self, f: SimRequestFeatures, view: ClusterView):
        placed = self.place(f, view)
        self._pending[(f.conversation_id, f.turn)] = placed.decision
        if f.turn > 1:
            self.predictions.decided(placed.decision)
        if placed.decision.route is Route.DECODE_LOCAL:
            return DecodeLocal(placed.decode)
        assert placed.prefill is not None  # `place` is decode-local without prefill workers
        return ViaPrefill(placed.prefill, placed.decode)

    def on_finish(self, record) -> None:
        decision = self._pending.pop((record.conversation_id, record.turn), None)
        if decision is not None and record.turn > 1:
            self.predictions.finished(decision.route, record.ttft_s, record.tpot_s)
            observed = self.policy.observe(decision, record.ttft_s, record.tpot_s)
            if observed is not None:
                self.predictions.observed(observed)


def policy_router(policy: Policy, window_s: float = 10.0) -> PolicyRouter:
    return PolicyRouter(policy, window_s)


def ppd_router(profile: EngineProfile, weights: Weights, table: PpdTable | None = None) -> PolicyRouter:
    """PPD as the router runs it with ``--mode ppd``: ``table``'s decisions at ``weights`` plus
    online correction, or without a table the profile's predictions (``--table none``)."""
    if table is not None:
        table = reweight(table, weights)
    policy = Policy(PolicyConfig(Mode.PPD, w_ttft=weights.w_ttft, w_tpot=weights.w_tpot),
                    ProfilePredictor(profile), table)
    return PolicyRouter(policy)


@dataclass
class _Recorder:
    """Wraps a router to remember the conditions at each follow-up decision."""

    router: Callable
    samples: list[Conditions] = field(default_factory=list)

    def __call__(self, f: SimRequestFeatures, view: ClusterView):
        route = self.router(f, view)
        if f.turn > 1:
            decode = route.decode
            load = worker_load(view, decode)
            prefill = route.prefill if isinstance(route, ViaPrefill) else least_loaded_prefill(view)
            self.samples.append(Conditions(prefill_queue_tokens=prefill_queue_tokens(view, prefill),
                                           decode_batch=load.decode_requests,
                                           decode_kv_tokens=load.decode_kv_tokens))
        return route


def summarize(result: SimResult, duration_s: float, samples: list[Conditions]) -> Measurement:
    """A cell's measurement from the run's outcome (`dynamo_ppd.sim.outcome`, under the timeout
    the run had): follow-up TTFT = the mean over follow-ups sent with each failed one counted at
    the timeout; TPOT = the mean over successful requests of both turns; success = the share of
    all requests sent (both turns) that succeeded, as the paper's per-point success rate;
    requests = all requests sent. A run where nothing succeeded gets the timeout as its TPOT
    (not an optimistic 0)."""
    outcome = result.outcome()
    worst = result.timeout_s if result.timeout_s is not None else CHAT_TIMEOUT_S
    ttft = outcome.turn2_ttft_mean_with_timeouts_s
    tpot = outcome.tpot_mean_s
    arrived = sum(1 for t in result.turn_results() if t.arrival_s < duration_s)

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    return Measurement(
        follow_up_ttft_s=max(ttft if ttft is not None else worst, 1e-6),
        tpot_s=max(tpot if tpot is not None else worst, 1e-6), requests=outcome.total_requests,
        achieved_rps=arrived / duration_s, success_rate=outcome.success_share,
        conditions=Conditions(prefill_queue_tokens=mean([c.prefill_queue_tokens for c in samples]),
                              decode_batch=mean([c.decode_batch for c in samples]),
                              decode_kv_tokens=mean([c.decode_kv_tokens for c in samples])))


def cell_workload(context: ContextClass, workload: WorkloadClass, qps: float, duration_s: float,
                  seed: int) -> list[Conversation]:
    """A cell's conversations, in the paper's protocol (`dynamo_ppd.workloads.generators`): two turns,
    turn 2 sent as turn 1 ends, arrivals drawn as the authors draw them (`paper_arrivals`) over a
    ``duration_s`` window. Turn 1 is the context class's paper T1 (``first_turn``; without one,
    sized so that turn 2's prompt is ``representative_tokens``), turn 2 the workload class.

    ``qps`` is the table's level, the request rate the router measures: conversations arrive at
    ``qps / 2`` (two requests each). A draw with no conversation in the window (likely at the
    lowest levels: about 8% at 0.25 conversations/s over 10 s) is redrawn with the next seeds,
    because a cell without traffic measures nothing."""
    if context.first_turn is not None:
        first = context.first_turn
    else:
        template = 2 * TEMPLATE_TOKENS  # BOS + user header on turn 1, end-of-turn + header on turn 2
        rest = context.representative_tokens - context.first_output_tokens - workload.input_tokens - template
        first = (max(1, rest), context.first_output_tokens)
    plan = [Turn(*first), Turn(workload.input_tokens, workload.output_tokens)]
    for attempt in range(_MAX_REDRAWS):
        draw = seed + attempt * _REDRAW_STRIDE
        arrivals = paper_arrivals(qps / PAPER_TURNS, draw, duration_s)
        if arrivals:
            return [Conversation(f"c{i:05d}", t, list(plan), seed=draw) for i, t in enumerate(arrivals)]
    raise ValueError(f"no conversation arrives within {duration_s:g} s at {qps:g} requests/s "
                     f"in {_MAX_REDRAWS} draws; use a longer duration")


_MAX_REDRAWS = 50
_REDRAW_STRIDE = 1_000_003  # far from the next seeds a caller might use


def measure_cell(profile: EngineProfile, config: str, context: ContextClass, workload: WorkloadClass,
                 qps: float, duration_s: float, seed: int, link_bandwidth_bytes_s: float | None = None,
                 timeout_s: float = PAPER_TIMEOUT_S) -> tuple[Measurement, Measurement]:
    """(x=0, x=1) measurements of one cell on a fresh simulated cluster each, in the paper's
    protocol: its arrivals (`cell_workload`), a turn not answered within ``timeout_s`` (120 s)
    fails and ends its conversation, and the point is cut at 600 s. Not modelled: the authors'
    client's 50-connection pool (`PAPER_MAX_CONNECTIONS`), a benchmark artefact a router in
    production does not see, so a cell keeps every conversation's own arrival time."""
    out = []
    for router in (pd_router, local_router):
        conversations = cell_workload(context, workload, qps, duration_s, seed)
        recorder = _Recorder(router)
        cluster = Cluster.from_config(profile, config, seed=seed,
                                      link_bandwidth_bytes_s=link_bandwidth_bytes_s)
        result = simulate(cluster, conversations, recorder, until_s=PAPER_KILL_AFTER_S, timeout_s=timeout_s)
        out.append(summarize(result, duration_s, recorder.samples))
    return out[0], out[1]
