"""How long one engine iteration takes, and how long a KV transfer takes.

An iteration runs every layer once for all scheduled tokens. Its time is a roofline sum over the
kernel classes that run one after another in each layer:

- GEMMs (QKV/O projections, MLP, and the LM head for sampled positions): the larger of streaming
  the weights from HBM and doing 2 FLOPs per weight per token. At small batches this is weight-
  bound (~5 ms for Llama-3.1-8B on H100), at large token counts compute-bound.
- Decode attention: each decoding sequence reads its whole KV cache (memory-bound).
- Prefill attention: new tokens attend to their cached context and to each other, the larger of
  reading that KV and doing the FLOPs (compute-bound for long prompts: quadratic).
- A fixed per-iteration overhead (scheduling, sampling, launch), plus a host cost per sequence
  in the batch (zero for TensorRT-LLM; a Python engine loop's per-request work otherwise).

Why append-prefill disturbs decoding so little: an append of m tokens onto n cached ones adds m
tokens of GEMM work (often hidden under the weight streaming that decoding pays anyway) and
m*(n+m/2) attention pairs, whereas a full prefill of n+m tokens adds n+m tokens of GEMM work and
(n+m)^2/2 attention pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profile import EngineProfile


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    new_tokens: int  # tokens computed in this iteration
    context_tokens: int  # tokens before them whose KV is already in cache
    samples: bool  # last chunk of its prompt: the LM head runs for it and a token is sampled


@dataclass(frozen=True, slots=True)
class IterationCost:
    total_s: float
    overhead_s: float
    gemm_s: float
    decode_attention_s: float
    prefill_attention_s: float


class CostModel:
    def __init__(self, profile: EngineProfile):
        hw, model, cost = profile.hardware, profile.model, profile.cost
        self.profile = profile
        self.bandwidth = hw.peak_memory_bandwidth_bytes_s * cost.memory_bandwidth_efficiency
        self.gemm_flops = hw.peak_bf16_flops * cost.gemm_flops_efficiency
        self.attention_flops = hw.peak_bf16_flops * cost.attention_flops_efficiency
        self.overhead_s = cost.iteration_overhead_s
        self.per_sequence_s = cost.per_sequence_overhead_s
        self.weight_stream_s = model.streamed_weight_bytes / self.bandwidth
        # The LM head's weights are read only in iterations that sample a token.
        self.lm_head_stream_s = model.lm_head_params * model.bytes_per_param / self.bandwidth
        self.layer_flops_per_token = 2 * model.layer_params
        self.lm_head_flops_per_sample = 2 * model.lm_head_params
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.attention_flops_per_pair = model.attention_flops_per_pair

    def iteration(self, num_decode: int, decode_context_tokens: int,
                  prefill: tuple[PrefillChunk, ...] | list[PrefillChunk] = ()) -> IterationCost:
        """Time of one iteration with ``num_decode`` decoding sequences that together attend to
        ``decode_context_tokens`` cached tokens, plus the given prefill chunks."""
        if num_decode == 0 and not prefill:
            return IterationCost(0.0, 0.0, 0.0, 0.0, 0.0)
        tokens = num_decode + sum(c.new_tokens for c in prefill)
        samples = num_decode + sum(1 for c in prefill if c.samples)
        gemm_compute_s = (self.layer_flops_per_token * tokens
                          + self.lm_head_flops_per_sample * samples) / self.gemm_flops
        weights_s = self.weight_stream_s - (0.0 if samples else self.lm_head_stream_s)
        gemm_s = max(weights_s, gemm_compute_s)
        # Decode attention: one query per sequence over its cache; bytes dominate FLOPs.
        decode_attention_s = max(decode_context_tokens * self.kv_bytes_per_token / self.bandwidth,
                                 decode_context_tokens * self.attention_flops_per_pair / self.attention_flops)
        prefill_attention_s = 0.0
        for chunk in prefill:
            pairs = chunk.new_tokens * (chunk.context_tokens + chunk.new_tokens / 2)
            read_s = (chunk.context_tokens + chunk.new_tokens) * self.kv_bytes_per_token / self.bandwidth
            prefill_attention_s += max(read_s, pairs * self.attention_flops_per_pair / self.attention_flops)
        overhead_s = self.overhead_s + self.per_sequence_s * (num_decode + len(prefill))
        total = overhead_s + gemm_s + decode_attention_s + prefill_attention_s
        return IterationCost(total, overhead_s, gemm_s, decode_attention_s, prefill_attention_s)


class TransferLink:
    """The outgoing link of one prefill worker: transfers queue on it first come, first served, so
    a burst of large transfers delays the later ones (network load shows up as TTFT)."""

    def __init__(self, bandwidth_bytes_s: float, setup_s: float = 0.0):
        if bandwidth_bytes_s <= 0:
            raise ValueError("link bandwidth must be positive")
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.setup_s = setup_s
        self.free_at = 0.0
        self.bytes_sent = 0

    def schedule(self, num_bytes: int, ready_at: float) -> tuple[float, float]:
        """Queue a transfer whose data is ready at ``ready_at``; return (start, finish) times."""
        start = max(ready_at, self.free_at)
        finish = start + self.setup_s + num_bytes / self.bandwidth_bytes_s
        self.free_at = finish
        self.bytes_sent += num_bytes
        return start, finish

    def backlog_s(self, now: float) -> float:
        """Seconds of queued transfer time still ahead of a transfer issued ``now``."""
        return max(0.0, self.free_at - now)
