"""What a route leaves behind for the requests that arrive after it: the congestion it adds to a
pool of workers, priced in the seconds of TTFT it costs them (issue 50, "the decision priced over
time").

A follow-up's own TTFT and TPOT (`predictor`) see the queues that are there when it arrives, and
the sequences it delays now (an append's ``extra`` over their replies). What they miss is that the
prompt tokens a route adds to a worker's queue delay every prompt that arrives there before that
queue next drains. Sent through a prefill worker, a follow-up re-prefills its whole history there
(``n - c_P`` tokens); kept local, it appends ``n - c_D`` on its decode worker. Per-request choice
that ignores this keeps sending work to the pool whose queue grows, until every later turn pays.

Each pool (the prefill workers, the decode workers' appends) is priced as a single-server queue of
prompt tokens (the same fluid queue the predictor's ``queue`` term is: `ProfilePredictor._queue_s`).
A request adding ``s`` seconds of work to a worker whose queue now holds ``w`` seconds extends the
worker's busy period by ``(w + s) / (1 - rho)`` in expectation (M/G/1: each arrival during it
brings more work), and every one of the ``lambda`` arrivals a second during that time waits ``s``
longer:

    congestion = lambda * s * (w + s) / (1 - rho),      rho = lambda * E[s]

``lambda`` (requests a second reaching one worker of the pool) and ``E[s]`` come from what the
policy itself routes (`PoolTraffic`): the router's request rate, the share of requests each pool
got, the pool's worker count and the mean work of those requests, all exponentially weighted over
the last ~50 decisions. Nothing here is fitted to a workload: the queue model is the predictor's,
the rates are observed. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.02  # each decision's weight in the pools' running shares and means (~50 decisions)
RHO_CAP = 0.9  # beyond this the queue model's 1 / (1 - rho) is not worth more than its 10x


@dataclass
class Pool:
    """One pool's arrivals as the policy routes them: the share of requests sent to it and the
    mean prompt work (seconds of prefill) of those."""

    share: float = 0.0
    work_s: float = 0.0  # mean over the requests sent here
    seen: int = 0

    def record(self, sent: bool, work_s: float) -> None:
        self.seen += 1
        alpha = max(ALPHA, 1.0 / self.seen)  # a plain mean until it has ~1/ALPHA decisions
        self.share += alpha * ((1.0 if sent else 0.0) - self.share)
        if sent:
            self.work_s = work_s if self.work_s == 0.0 else self.work_s + alpha * (work_s - self.work_s)

    def congestion_s(self, work_s: float, queue_s: float, qps: float, workers: int) -> float:
        """Seconds of TTFT that adding ``work_s`` of prompt work behind ``queue_s`` costs the
        requests arriving at the worker after it (the module docstring)."""
        if work_s <= 0 or qps <= 0 or self.share <= 0:
            return 0.0
        arrivals = qps * self.share / max(1, workers)  # requests a second at one worker
        rho = min(RHO_CAP, arrivals * self.work_s)
        return arrivals * work_s * (queue_s + work_s) / (1.0 - rho)


@dataclass
class PoolTraffic:
    """The two pools a follow-up chooses between: the prefill workers (every first turn, every
    via-prefill follow-up) and the decode workers' appends (decode-local follow-ups)."""

    prefill: Pool = field(default_factory=Pool)
    decode: Pool = field(default_factory=Pool)

    def record(self, via_prefill: bool, work_s: float) -> None:
        """One routed request: through a prefill worker or appended on its decode worker, with
        its prompt work there (seconds)."""
        self.prefill.record(via_prefill, work_s)
        self.decode.record(not via_prefill, work_s)
