"""What each route of a follow-up turn costs, from the engine profile's cost model: the request's own
TTFT and TPOT, and what it makes the other requests pay (`docs/decisions.md`, "The formula").

Decode-local (x=1): the session's decode worker computes the tokens it does not hold as an
append-prefill inside its running batch.
- TTFT: the stack's decode-local overhead, half a decode step (it arrives mid-iteration), the
  prompt tokens already queued on that worker, and the append's own iterations.
- TPOT: one decode step of the batch with this sequence in it. The request does not pay its own
  append in TPOT: its first token comes out of the append's last iteration.
- Others: the append's iterations are longer than plain decode steps by ``extra``; each sequence
  decoding there is delayed by ``extra`` once, its TPOT by ``extra`` over its reply's tokens: the
  sum is ``extra`` times the sum of 1 / reply length over the batch (`WorkerLoad.inverse_outputs`,
  the router's count of what it routed there). With nobody else on the worker nobody pays; a batch
  of short replies pays much more than one of long ones.

Via prefill (x=0): a prefill worker computes the prompt tokens it does not hold (it holds what it
computed before: after decode-local turns, turn 1's prompt only), after the tokens queued on it;
the whole prompt's KV crosses the link; the target decode worker (the session's, or the least
loaded one when the session's is clearly hotter, `moves_to_best`) admits it at its next step.
- Others: none counted. Joining the decode batch costs the others one sequence's step, as a
  decode-local turn does (the same on both sides). The prefill worker's time delays requests that
  arrive behind it; the router knows no per-worker arrival rate to price that, and a queue
  already there is ahead of this request, not behind it (it is in the TTFT, as `_queue_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.cost import CostModel, PrefillChunk
from ..engine.profile import EngineProfile
from .features import RequestFeatures, WorkerLoad, moves_to_best
from .score import Prediction


@dataclass(frozen=True, slots=True)
class RouteCosts:
    """One route's predicted cost: the request's own TTFT and TPOT (what can be observed and
    learned from), and the sum of what it adds to the TPOTs of the sequences it delays."""

    own: Prediction
    others_tpot_s: float = 0.0  # sum over the delayed sequences of their TPOT increase


class ProfilePredictor:
    """Cold-start predictions from the engine profile's cost model (the module docstring)."""

    def __init__(self, profile: EngineProfile):
        self.cost = CostModel(profile)
        self.kv_bytes_per_token = profile.gpu_kv_bytes_per_token  # each GPU pair moves its shard at once
        self.link_bandwidth = profile.transfer.link_bandwidth_bytes_s
        self.transfer_setup_s = profile.transfer.transfer_setup_s
        # The stack's fixed costs that differ between the routes (the request overhead is paid
        # by both and cancels out of the comparison).
        self.handoff_s = profile.stack.handoff_overhead_s
        self.decode_local_s = profile.stack.decode_local_overhead_s
        self.chunk_tokens = profile.engine.max_num_tokens
        full = self.chunk_tokens
        self._prefill_s_per_token = self.cost.iteration(0, 0, [PrefillChunk(full, 0, True)]).total_s / full

    def _decode_step_s(self, load: WorkerLoad, prompt_tokens: int) -> float:
        return self.cost.iteration(load.decode_requests + 1, load.decode_kv_tokens + prompt_tokens).total_s

    def _prefill_s(self, new_tokens: int, cached: int, load: WorkerLoad | None = None) -> tuple[float, float]:
        """(seconds, seconds beyond the plain decode steps of ``load``'s batch) of computing
        ``new_tokens`` after ``cached`` ones, in chunks of the engine's token budget, beside
        ``load``'s decoding batch (None: a prefill worker, no batch)."""
        batch, context = (load.decode_requests, load.decode_kv_tokens) if load else (0, 0)
        plain = self.cost.iteration(batch, context).total_s if batch else 0.0
        total = extra = 0.0
        done, chunks = 0, max(1, math.ceil(new_tokens / self.chunk_tokens))
        for k in range(chunks):
            size = max(1, min(self.chunk_tokens, new_tokens - done))
            chunk = PrefillChunk(size, cached + done, k == chunks - 1)
            step = self.cost.iteration(batch, context, [chunk]).total_s
            total += step
            extra += max(0.0, step - plain)
            done += size
        return total, extra

    def costs(self, f: RequestFeatures) -> tuple[RouteCosts, RouteCosts]:
        """(decode-local, via-prefill) costs of a follow-up turn."""
        others_out = max(1, f.expected_output_tokens)  # a reply the router does not know: as this one

        load = f.decode_load
        append, extra = self._prefill_s(max(1, f.new_tokens), f.cached_on_decode, load)
        local = RouteCosts(
            # Arriving mid-iteration, the append waits half a decode step on average, then
            # whatever prompt tokens are queued on the decode worker before it.
            own=Prediction(ttft_s=self.decode_local_s + self._decode_step_s(load, f.prompt_tokens) / 2
                           + self._queue_s(load) + append,
                           tpot_s=self._decode_step_s(load, f.prompt_tokens)),
            others_tpot_s=extra * _inverse_outputs(load, others_out))

        target = f.decode_load
        if f.best_decode_load is not None and moves_to_best(f.decode_load, f.best_decode_load):
            target = f.best_decode_load
        decode_step = self._decode_step_s(target, f.prompt_tokens)
        uncached_p = max(1, f.prompt_tokens - f.cached_on_prefill)
        prefill_s, _ = self._prefill_s(uncached_p, f.cached_on_prefill)
        transfer_s = self.transfer_setup_s + f.prompt_tokens * self.kv_bytes_per_token / self.link_bandwidth
        via = RouteCosts(
            own=Prediction(ttft_s=self._queue_s(f.prefill_load) + prefill_s + self.handoff_s + transfer_s
                           + decode_step / 2, tpot_s=decode_step))
        return local, via

    def predict(self, f: RequestFeatures) -> tuple[Prediction, Prediction]:
        """(decode-local, via-prefill) predictions of the request's own TTFT and TPOT."""
        local, via = self.costs(f)
        return local.own, via.own

    @property
    def prefill_s_per_token(self) -> float:
        """A prompt token's share of a full prefill chunk: the fluid queue's rate (`_queue_s`)."""
        return self._prefill_s_per_token

    def queue_s(self, load: WorkerLoad) -> float:
        return self._queue_s(load)

    def _queue_s(self, load: WorkerLoad) -> float:
        """Time the prompt tokens queued on a worker ahead of a new request add to its wait: their
        share of full prefill chunks, linear in the tokens. Not one iteration of that size: an
        iteration's fixed part (the weights streamed once) would make a cell's mean queue of a
        few tokens (a worker busy now and then) cost ~5 ms, and the online correction would then
        read an idle prefill worker as several ms faster than the cell it was measured in."""
        return load.pending_prefill_tokens * self._prefill_s_per_token


def _inverse_outputs(load: WorkerLoad, default_output: int) -> float:
    """The sum of 1 / reply length over the sequences decoding on a worker: this router's own
    requests there as it routed them, and any others the worker reports (another router's) as
    long as the mean of its own, or ``default_output`` without any."""
    others = max(0, load.decode_requests - load.inflight_requests)
    if load.inflight_requests and load.inverse_outputs:
        return load.inverse_outputs * (1 + others / load.inflight_requests)
    return load.decode_requests / default_output
