"""How long one engine iteration takes, and how long a KV transfer takes.

An iteration runs every layer once for all scheduled tokens. Its time is a roofline sum over the
kernel classes that run one after another in each layer:

- GEMMs (QKV/O projections, MLP, and the LM head for sampled positions): the larger of streaming
  the weights from HBM and doing 2 FLOPs per weight per token. At small batches this is weight-
  bound (~5 ms for Llama-3.1-8B on H100), at large token counts compute-bound.
- Decode attention: each decoding sequence reads its whole KV cache (memory-bound). With vLLM's
  cascade attention (a profile flag; see `vllm_uses_cascade`) a prefix common to the whole batch
  is read once by one kernel for all query tokens, and each sequence reads only the rest.
- Prefill attention: new tokens attend to their cached context and to each other, the larger of
  reading that KV and doing the FLOPs (compute-bound for long prompts: quadratic).
- A fixed per-iteration overhead (scheduling, sampling, launch), plus a host cost per sequence
  in the batch (zero for TensorRT-LLM; a Python engine loop's per-request work otherwise).
- With tensor parallelism (a worker of TP GPUs), every term above is one GPU's shard (1/TP of
  the weights, heads and FLOPs; its KV heads), plus two all-reduces per layer of the iteration's
  activations over NVLink (`EngineProfile.allreduce_s`: a latency floor and bus bandwidths).

Why append-prefill disturbs decoding so little: an append of m tokens onto n cached ones adds m
tokens of GEMM work (often hidden under the weight streaming that decoding pays anyway) and
m*(n+m/2) attention pairs, whereas a full prefill of n+m tokens adds n+m tokens of GEMM work and
(n+m)^2/2 attention pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profile import EngineProfile

# vLLM V1's thresholds for cascade attention (vllm/v1/attention/backends/flash_attn.py,
# `use_cascade_attention`, in the authors' fork freelulul/vllm-ppd at d6d4efb3, which vendors
# upstream vLLM main at b95d054d of 2025-12-18 with no change under vllm/v1/): "arbitrary"
# thresholds by vLLM's own comments.
CASCADE_MIN_PREFIX_TOKENS = 256
CASCADE_MIN_REQUESTS = 8
CASCADE_TILE = 128  # flash-attn's default query and KV tile sizes in the CTA-count rule


def vllm_uses_cascade(common_prefix_tokens: int, num_requests: int, all_decode: bool,
                      num_query_heads: int, num_kv_heads: int, num_sms: int) -> bool:
    """vLLM's `use_cascade_attention` for a full-attention model without ALiBi, sliding window or
    decode context parallelism (Llama): a common prefix of at least 256 tokens, at least 8
    requests scheduled; then, if the normal path would be FlashDecoding (grouped-query attention
    and every request decoding one token), only when the cascade's prefix kernel needs fewer
    waves of CTAs than FlashDecoding's split-KV launch; otherwise (any prefill in the batch, or
    no GQA) always."""
    if common_prefix_tokens < CASCADE_MIN_PREFIX_TOKENS or num_requests < CASCADE_MIN_REQUESTS:
        return False
    queries_per_kv = num_query_heads // num_kv_heads
    if not (queries_per_kv > 1 and all_decode):
        return True
    prefix_tiles = math.ceil(common_prefix_tokens / CASCADE_TILE)
    cascade_waves = math.ceil(num_query_heads * math.ceil(num_requests / CASCADE_TILE) / num_sms)
    cascade_time = cascade_waves * prefix_tiles
    flash_decoding_ctas = (num_requests * num_kv_heads * math.ceil(queries_per_kv / CASCADE_TILE)
                           * prefix_tiles)
    return cascade_time < math.ceil(flash_decoding_ctas / num_sms)


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
    # Cascade attention's first kernel: every query token against the batch's common prefix,
    # whose KV is read once (the two attention terms above then cover only each suffix).
    shared_prefix_attention_s: float = 0.0
    allreduce_s: float = 0.0  # tensor parallelism's all-reduces (0 at TP1)


class CostModel:
    def __init__(self, profile: EngineProfile):
        hw, cost = profile.hardware, profile.cost
        self.profile = profile
        self.bandwidth = hw.peak_memory_bandwidth_bytes_s * cost.memory_bandwidth_efficiency
        self.gemm_flops = profile.gemm_peak_flops * cost.gemm_flops_efficiency
        self.attention_flops = profile.attention_peak_flops * cost.attention_flops_efficiency
        self.overhead_s = cost.iteration_overhead_s
        self.per_sequence_s = cost.per_sequence_overhead_s
        # One GPU's shard of a tensor-parallel worker (the whole model at TP1).
        self.weight_stream_s = profile.gpu_streamed_weight_bytes / self.bandwidth
        # The LM head's weights are read only in iterations that sample a token.
        self.lm_head_stream_s = profile.gpu_lm_head_bytes / self.bandwidth
        self.layer_flops_per_token = profile.gpu_layer_flops_per_token
        self.lm_head_flops_per_sample = profile.gpu_lm_head_flops_per_sample
        self.kv_bytes_per_token = profile.gpu_kv_bytes_per_token
        self.attention_flops_per_pair = profile.gpu_attention_flops_per_pair
        self.allreduce = profile.allreduce_cost()  # None at TP1

    def iteration(self, num_decode: int, decode_context_tokens: int,
                  prefill: tuple[PrefillChunk, ...] | list[PrefillChunk] = (),
                  shared_prefix_tokens: int = 0) -> IterationCost:
        """Time of one iteration with ``num_decode`` decoding sequences that together attend to
        ``decode_context_tokens`` cached tokens, plus the given prefill chunks.

        ``shared_prefix_tokens`` > 0: cascade attention over a prefix of that many tokens that
        every scheduled sequence (decoding or prefilling) has in its cached context; the caller
        decides (`vllm_uses_cascade`) and guarantees each context holds it."""
        if num_decode == 0 and not prefill:
            return IterationCost(0.0, 0.0, 0.0, 0.0, 0.0)
        tokens = num_decode + sum(c.new_tokens for c in prefill)
        samples = num_decode + sum(1 for c in prefill if c.samples)
        gemm_compute_s = (self.layer_flops_per_token * tokens
                          + self.lm_head_flops_per_sample * samples) / self.gemm_flops
        weights_s = self.weight_stream_s - (0.0 if samples else self.lm_head_stream_s)
        gemm_s = max(weights_s, gemm_compute_s)
        allreduce_s = self.allreduce.seconds(tokens) if self.allreduce is not None else 0.0
        shared = shared_prefix_tokens
        shared_prefix_attention_s = 0.0
        if shared:
            # One non-causal kernel: all query tokens of the batch against the prefix, its KV
            # read once; then the per-sequence kernel reads only what follows the prefix.
            shared_prefix_attention_s = self._attention_s(shared, tokens * shared)
            decode_context_tokens -= num_decode * shared
        # Decode attention: one query per sequence over its cache; bytes dominate FLOPs.
        decode_attention_s = self._attention_s(decode_context_tokens, decode_context_tokens)
        prefill_attention_s = 0.0
        for chunk in prefill:
            context = chunk.context_tokens - shared
            pairs = chunk.new_tokens * (context + chunk.new_tokens / 2)
            prefill_attention_s += self._attention_s(context + chunk.new_tokens, pairs)
        overhead_s = self.overhead_s + self.per_sequence_s * (num_decode + len(prefill))
        total = (overhead_s + gemm_s + allreduce_s + decode_attention_s + prefill_attention_s
                 + shared_prefix_attention_s)
        return IterationCost(total, overhead_s, gemm_s, decode_attention_s, prefill_attention_s,
                             shared_prefix_attention_s, allreduce_s)

    def decode_run_s(self, num_decode: int, decode_context_tokens: int, count: int) -> list[float]:
        """``iteration(num_decode, k).total_s`` for the ``count`` decode-only iterations from
        ``decode_context_tokens`` on, each sequence one token longer in each (a simulator's run
        of iterations): the same arithmetic in the same order, so the same floats, for a
        fraction of the work (the batch's fixed part once, then one roofline per iteration)."""
        if num_decode <= 0:
            raise ValueError("a decode run needs at least one decoding sequence")
        fixed = self.iteration(num_decode, 0)
        # total = overhead + gemm + all-reduce + attention (+ 0.0s), added in that order
        base = fixed.overhead_s + fixed.gemm_s + fixed.allreduce_s
        per_token_bytes, bandwidth = self.kv_bytes_per_token, self.bandwidth
        per_pair, flops = self.attention_flops_per_pair, self.attention_flops
        durations = []
        context = decode_context_tokens
        for _ in range(count):
            durations.append(base + max(context * per_token_bytes / bandwidth, context * per_pair / flops))
            context += num_decode
        return durations

    def _attention_s(self, kv_tokens_read: float, pairs: float) -> float:
        """An attention kernel's roofline: reading ``kv_tokens_read`` tokens' KV from HBM against
        the FLOPs of ``pairs`` query-key pairs."""
        return max(kv_tokens_read * self.kv_bytes_per_token / self.bandwidth,
                   pairs * self.attention_flops_per_pair / self.attention_flops)


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
