"""Engine profiles: the hardware, the model's shape, the parallelism, the cost constants and the
engine limits of one worker, in one validated YAML file. Everything else (weight bytes, FLOPs per
token, KV bytes per token, KV capacity, each per GPU of a tensor-parallel worker) is derived here,
never stored twice.

A worker is ``parallel.tensor_parallel`` GPUs (TP). Each holds 1/TP of every weight matrix (the
attention heads, the MLP's columns, the embedding and LM head by vocabulary: TensorRT-LLM's
tensor parallelism) and of every token's KV (its KV heads, at least one: a model with fewer KV
heads than GPUs repeats them), and does 1/TP of the FLOPs; the partial results are summed by two
all-reduces per layer (after the attention's output projection and after the MLP) over NVLink.
The `cost` model prices one GPU's shard and those all-reduces."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

# Value constraints of every schema (profiles here, PPD tables, the paper's data), defined once.
Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "h100-llama3.1-8b"


class Hardware(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    gpu_memory_bytes: PositiveInt
    peak_memory_bandwidth_bytes_s: Positive
    peak_bf16_flops: Positive
    peak_fp8_flops: Positive | None = None  # dense FP8 tensor-core FLOPs (FP8 weights or KV need it)
    # One TensorRT-LLM custom all-reduce of n bytes over the GPU's NVLink among k GPUs: a launch
    # and synchronization floor plus a ring's traffic, 2 (k-1)/k * n, its first
    # ``allreduce_knee_bytes`` at ``allreduce_bandwidth_bytes_s`` and the rest at
    # ``allreduce_large_bandwidth_bytes_s`` (small messages use a one-shot kernel that reaches
    # less of the link than large ones). For the TP degree of the profile; needed when
    # tensor_parallel > 1.
    allreduce_latency_s: NonNegative = 0.0
    allreduce_bandwidth_bytes_s: Positive | None = None
    allreduce_large_bandwidth_bytes_s: Positive | None = None  # None: the same as below the knee
    allreduce_knee_bytes: Positive = 8 * 2 ** 20


class ModelShape(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    bytes_per_param: PositiveInt = 2  # 2: bf16 weights; 1: FP8 (GEMMs on FP8 tensor cores)
    kv_bytes_per_element: PositiveInt = 2  # 2: bf16 KV cache; 1: FP8 (FP8 attention kernels)
    tie_word_embeddings: bool = False  # the LM head is the embedding table (one copy of it)

    @property
    def layer_params(self) -> int:
        """Parameters of the transformer layers (attention projections + gated MLP)."""
        q_and_o = 2 * self.hidden_size * self.num_attention_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (q_and_o + k_and_v + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Layers, LM head and the embedding table (one table when they are tied)."""
        return self.layer_params + (1 if self.tie_word_embeddings else 2) * self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.bytes_per_param

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights read from HBM every iteration: all GEMM weights (the embedding is a lookup)."""
        return (self.layer_params + self.lm_head_params) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs for one query token attending to one key token, all layers (QK^T and PV)."""
        return 4 * self.num_layers * self.num_attention_heads * self.head_dim


class Parallelism(msgspec.Struct, forbid_unknown_fields=True):
    """How many GPUs one worker spans: tensor parallelism (TP) within one NVLink domain."""

    tensor_parallel: PositiveInt = 1


class CostConstants(msgspec.Struct, forbid_unknown_fields=True):
    iteration_overhead_s: Annotated[float, msgspec.Meta(ge=0)]
    memory_bandwidth_efficiency: Fraction
    gemm_flops_efficiency: Fraction
    attention_flops_efficiency: Fraction
    # Host time per sequence in an iteration (sampling, detokenizing and streaming its token):
    # ~0 in TensorRT-LLM's C++ executor, tens of microseconds in a Python engine loop (vLLM),
    # where it makes TPOT grow with the batch beyond what the kernels explain.
    per_sequence_overhead_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class EngineLimits(msgspec.Struct, forbid_unknown_fields=True):
    block_size: PositiveInt = 32
    max_batch_size: PositiveInt = 256
    max_num_tokens: PositiveInt = 8192
    free_gpu_memory_fraction: Fraction = 0.9
    runtime_reserved_bytes: Annotated[int, msgspec.Meta(ge=0)] = 3_000_000_000
    # vLLM V1's cascade attention: while every request holding KV blocks shares a cached prefix,
    # the attention reads that prefix once for the whole batch instead of once per sequence
    # (`use_cascade_attention` in vllm/v1/attention/backends/flash_attn.py, the common prefix
    # from `get_num_common_prefix_blocks` in vllm/v1/core/kv_cache_manager.py; on by default
    # unless --disable-cascade-attn). The heuristic is in `engine.cost.vllm_uses_cascade`.
    # Off for TensorRT-LLM: its attention reads every sequence's KV through its own block
    # table; its only cascade kernel (PR #14396, NVIDIA/TensorRT-LLM, 2026-05) is for the beams
    # of one request in beam search and off by default (TRTLLM_ENABLE_CASCADE_MMHA).
    cascade_attention: bool = False
    # Streaming multiprocessors of the GPU, for vLLM's cascade-vs-FlashDecoding kernel-count
    # rule (its model runner takes torch.cuda's multi_processor_count): 132 on H100/H200 SXM.
    gpu_sm_count: PositiveInt = 132


class TransferConstants(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One P -> D KV link: a transfer of n bytes takes ``transfer_setup_s + n / bandwidth``
    once it reaches the head of its prefill worker's queue."""

    link_bandwidth_bytes_s: Positive  # effective (what a transfer achieves), not the wire's peak
    transfer_setup_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # fixed cost per transfer


# Links measured in published P/D deployments, not the wire's peak (which would make PD look
# better than any measurement):
# - intra-node (NVLink, NIXL/UCX): Dynamo + vLLM + NIXL on H100 moved a 7,500-token prompt's KV
#   (~0.98 GB for Llama-3.1-8B) in 8 ms with 128-token pages and in 20 ms with 16-token pages,
#   ~50-120 GB/s effective (LMCache blog, 2025-04-29, "pdbench"). TensorRT-LLM's cache
#   transceiver spends 0.4-8 ms preparing each transfer besides queueing (its own breakdown,
#   NVIDIA/TensorRT-LLM PR #12273). With TensorRT-LLM's 32-token blocks we take 60 GB/s and 2 ms.
# - cross-node (RDMA through the NIC): Dynamo's "Disaggregated Inference Communication Guide"
#   (docs.nvidia.com/dynamo, kubernetes-deployment/deployment-guide/disagg-communication) gives
#   20-50 GB/s for InfiniBand and 10-25 GB/s for RoCE; we take 25 GB/s and 3 ms (the same
#   preparation plus the remote handshake). The same guide says pods cannot use NVLink between
#   them, so a Kubernetes deployment moves KV this way even within one node.
LINK_PRESETS: dict[str, TransferConstants] = {
    "intra-node": TransferConstants(link_bandwidth_bytes_s=60e9, transfer_setup_s=0.002),
    "cross-node": TransferConstants(link_bandwidth_bytes_s=25e9, transfer_setup_s=0.003),
}


def link_preset(name: str) -> TransferConstants:
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise ProfileError(f"no KV link preset {name!r}; choose one of {', '.join(LINK_PRESETS)}") from None


def believed_link(text: str | None, truth: TransferConstants) -> TransferConstants:
    """The KV link a router's predictions assume (``--router-link-bandwidth``), given the link the
    workers have (``truth``): None or "" the truth; "4x" (or "0.25x") that many times its
    bandwidth; a number, that many GB/s (1e9 bytes/s). The transfer's setup cost is the truth's.
    ProfileError for anything else."""
    if not text:
        return truth
    try:
        value = float(text[:-1]) if text.endswith("x") else float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ProfileError(f"link bandwidth {text!r} is neither GB/s (e.g. 25) nor a factor of the "
                           "workers' link (e.g. 4x, 0.25x)")
    bandwidth = truth.link_bandwidth_bytes_s * value if text.endswith("x") else value * 1e9
    return TransferConstants(link_bandwidth_bytes_s=bandwidth, transfer_setup_s=truth.transfer_setup_s)


class StackCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Fixed costs of the serving stack around the engines, per request, applied by the
    simulated cluster. Zero for a stack whose costs are not modeled (the TensorRT-LLM profiles:
    the live router and frontend are real processes there, measured by themselves). The
    paper-stack profile fits them to the authors' measurements.

    - ``request_overhead_s``: from the client's send to the first worker's queue, plus the
      first token's way back (HTTP, the proxy, tokenization, detokenization, streaming).
    - ``handoff_overhead_s``: a request through a prefill worker, from P's first token to the
      moment its KV may start moving to D (the proxy waits for P's whole answer, then sends the
      request to D, whose connector handshakes with P).
    - ``decode_local_overhead_s``: a request that prefills on a disaggregated decode worker
      (what its KV connector does for a request with no remote KV).
    """

    request_overhead_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    handoff_overhead_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    decode_local_overhead_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


@dataclass(frozen=True, slots=True)
class AllReduceCost:
    """One iteration's all-reduces over t tokens: ``fixed_s + small * min(t, knee_tokens) +
    large * max(0, t - knee_tokens)`` (seconds per token below and beyond the knee)."""

    fixed_s: float
    small_s_per_token: float
    knee_tokens: float
    large_s_per_token: float

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        knee = self.knee_tokens
        return (self.fixed_s + self.small_s_per_token * min(tokens, knee)
                + self.large_s_per_token * max(0.0, tokens - knee))


class EngineProfile(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    hardware: Hardware
    model: ModelShape
    cost: CostConstants
    engine: EngineLimits = msgspec.field(default_factory=EngineLimits)
    transfer: TransferConstants = msgspec.field(default_factory=lambda: LINK_PRESETS["cross-node"])
    stack: StackCosts = msgspec.field(default_factory=StackCosts)
    parallel: Parallelism = msgspec.field(default_factory=Parallelism)

    # -- one GPU's shard of a worker (the module docstring) ------------------------------------

    @property
    def tp(self) -> int:
        return self.parallel.tensor_parallel

    @property
    def gpu_weight_bytes(self) -> int:
        """Weights one GPU holds."""
        return math.ceil(self.model.weight_bytes / self.tp)

    @property
    def gpu_streamed_weight_bytes(self) -> int:
        """Weights one GPU reads from HBM every iteration (all its GEMM weights)."""
        return math.ceil(self.model.streamed_weight_bytes / self.tp)

    @property
    def gpu_lm_head_bytes(self) -> int:
        return math.ceil(self.model.lm_head_params * self.model.bytes_per_param / self.tp)

    @property
    def gpu_layer_flops_per_token(self) -> float:
        return 2 * self.model.layer_params / self.tp

    @property
    def gpu_lm_head_flops_per_sample(self) -> float:
        return 2 * self.model.lm_head_params / self.tp

    @property
    def kv_heads_per_gpu(self) -> int:
        return math.ceil(self.model.num_kv_heads / self.tp)

    @property
    def gpu_kv_bytes_per_token(self) -> int:
        """KV bytes one GPU holds per token; also what each of the worker's GPUs sends of it in a
        P->D handoff, all of them at once, each over its own link (TP1: the model's whole KV)."""
        m = self.model
        return 2 * m.num_layers * self.kv_heads_per_gpu * m.head_dim * m.kv_bytes_per_element

    @property
    def gpu_attention_flops_per_pair(self) -> float:
        """One query token against one key token on one GPU (its heads), all layers."""
        return self.model.attention_flops_per_pair / self.tp

    @property
    def gemm_peak_flops(self) -> float:
        """The tensor cores the GEMMs run on: FP8 for FP8 weights, else bf16."""
        if self.model.bytes_per_param == 1:
            return self._fp8_peak("FP8 weights")
        return self.hardware.peak_bf16_flops

    @property
    def attention_peak_flops(self) -> float:
        """The tensor cores attention runs on: FP8 with an FP8 KV cache, else bf16."""
        return (self._fp8_peak("an FP8 KV cache") if self.model.kv_bytes_per_element == 1
                else self.hardware.peak_bf16_flops)

    def _fp8_peak(self, what: str) -> float:
        if self.hardware.peak_fp8_flops is None:
            raise ProfileError(f"profile {self.name!r}: {what} need hardware.peak_fp8_flops")
        return self.hardware.peak_fp8_flops

    def allreduce_cost(self) -> AllReduceCost | None:
        """The two all-reduces per layer of one iteration, over each token's bf16 activations
        (hidden_size each); None at TP1."""
        if self.tp == 1:
            return None
        hw = self.hardware
        if hw.allreduce_bandwidth_bytes_s is None:
            raise ProfileError(f"profile {self.name!r}: tensor_parallel {self.tp} needs "
                               "hardware.allreduce_bandwidth_bytes_s")
        per_layer = 2 * self.model.num_layers
        token_bytes = self.model.hidden_size * 2
        ring = 2 * (self.tp - 1) / self.tp
        large = hw.allreduce_large_bandwidth_bytes_s or hw.allreduce_bandwidth_bytes_s
        return AllReduceCost(per_layer * hw.allreduce_latency_s,
                             per_layer * ring * token_bytes / hw.allreduce_bandwidth_bytes_s,
                             hw.allreduce_knee_bytes / token_bytes,
                             per_layer * ring * token_bytes / large)

    def allreduce_s(self, tokens: int) -> float:
        """The all-reduces of one iteration over ``tokens`` tokens (0 at TP1)."""
        cost = self.allreduce_cost()
        return cost.seconds(tokens) if cost is not None else 0.0

    def check(self) -> None:
        """What the schema's types cannot say: the shard divides, the precisions have their tensor
        cores, TP has its link, and the model leaves room for a KV cache."""
        heads, tp = self.model.num_attention_heads, self.tp
        if heads % tp:
            raise ProfileError(f"profile {self.name!r}: {heads} attention heads do not split over "
                               f"tensor_parallel {tp}; choose a TP that divides {heads}")
        _ = (self.gemm_peak_flops, self.attention_peak_flops)  # raise if FP8 has no peak
        self.allreduce_cost()
        self.kv_capacity_blocks()

    def kv_capacity_blocks(self) -> int:
        """KV blocks a worker holds: TensorRT-LLM gives the KV pool a fraction of the memory left
        on each GPU after its shard of the weights and the runtime's reservations (each GPU holds
        its shard of every token's KV, so a worker's capacity is one GPU's)."""
        free = self.hardware.gpu_memory_bytes - self.gpu_weight_bytes - self.engine.runtime_reserved_bytes
        pool = free * self.engine.free_gpu_memory_fraction
        block_bytes = self.gpu_kv_bytes_per_token * self.engine.block_size
        blocks = math.floor(pool / block_bytes)
        if blocks < 1:
            raise ProfileError(f"profile {self.name!r}: no memory left for the KV cache "
                               f"({self.hardware.gpu_memory_bytes} bytes of GPU memory, "
                               f"{self.gpu_weight_bytes} of weights per GPU at TP{self.tp}): "
                               "raise the TP degree or use a GPU with more memory")
        return blocks


class ProfileError(Exception):
    """A profile file is missing or invalid; the message names the file and field."""


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> EngineProfile:
    """Load a bundled profile by name or a profile YAML by path, validated."""
    path = Path(name_or_path)
    if not path.is_file():
        bundled = PROFILE_DIR / f"{name_or_path}.yaml"
        if bundled.is_file():
            path = bundled
        elif path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
            raise ProfileError(f"engine profile {path} does not exist")
        else:
            raise ProfileError(f"no engine profile named {str(name_or_path)!r}; bundled: "
                               f"{', '.join(bundled_profiles())} (or pass a path to a .yaml file)")
    try:
        profile = msgspec.yaml.decode(path.read_bytes(), type=EngineProfile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProfileError(f"{path}: invalid engine profile: {exc}") from exc
    profile.check()  # fail early if the model does not fit or split
    return profile


def dump_profile(profile: EngineProfile) -> bytes:
    return msgspec.yaml.encode(profile)
