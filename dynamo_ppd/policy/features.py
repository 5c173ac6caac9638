"""What the policy decides a follow-up turn on: the request and the loads of the workers it could
run on, as a router gathers them (`placement.features`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the router knows about a worker's load right now."""

    inflight_requests: int = 0  # requests this router has running there
    pending_prefill_tokens: int = 0  # prompt tokens routed there and not yet prefilled
    decode_requests: int = 0  # sequences decoding there (as last reported)
    decode_kv_tokens: int = 0  # their total context
    inverse_outputs: float = 0.0  # sum of 1 / reply length of the requests this router has there


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
    # The pools' sizes: how many workers the requests sent to each are spread over (`congestion`).
    prefill_workers: int = 1
    decode_workers: int = 1

    @property
    def new_tokens(self) -> int:
        """Tokens an append-prefill on the session's decode worker would compute."""
        return self.prompt_tokens - self.cached_on_decode


def moves_to_best(session: WorkerLoad, best: WorkerLoad) -> bool:
    """A turn going through a prefill worker moves from its decode worker to the least loaded one
    when the session's is clearly hotter: it gets its KV by transfer anyway, and one hot worker
    should not keep every conversation that ever landed on it."""
    return session.decode_requests > best.decode_requests + max(8, best.decode_requests // 2)
