"""An engine profile for your model on your GPUs: from a model's ``config.json``, a TP degree and
a precision on a named GPU (`dynamo-ppd engine profile`). Pure: the caller reads the file.

- The model's shape comes from its Hugging Face ``config.json`` (dense decoders: Llama, Qwen2/3,
  Mistral; a mixture-of-experts config is refused, its experts are not modelled). The configs of
  the models the project ships profiles for are in ``models/`` (`MODELS`), so ``--model NAME``
  needs no download.
- The GPU comes from `GPUS`: its memory, HBM bandwidth, dense bf16/FP8 tensor-core peaks (NVIDIA's
  datasheets) and its NVLink all-reduce per TP degree (latency floor and bus bandwidth, fitted to
  TensorRT-LLM's custom all-reduce as NVIDIA AIConfigurator 0.12.0 measured it,
  ``systems/data/<gpu>/comm/trtllm/1.3.0rc20``, over messages of 8 KiB-256 MiB: a decode step's
  to a long prefill chunk's, the first 8 MiB at one bus bandwidth and the rest at another).
  Up to 8 GPUs: one NVLink domain.
- The four cost constants start from the GPU's fitted Llama-3.1-8B TP1 profile (refit to
  AIConfigurator, docs/engine-aic.md), with the fixed per-iteration time scaled by the number of
  layers: on an H200, constants fitted to Llama-3.1-8B predicted a 64-layer Qwen3-32B's kernels at
  9.7% mean with no refit, the GEMM and attention efficiencies carrying over (0.59 -> 0.60,
  0.33 -> 0.34) and the fixed time not (3.4 -> 9.7 ms). `dynamo-ppd engine aic` then compares the
  profile with AIConfigurator at its TP and precision and refits the four constants.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from .profile import (
    CostConstants,
    EngineProfile,
    Hardware,
    ModelShape,
    Parallelism,
    ProfileError,
    load_profile,
)

MODEL_DIR = Path(__file__).parent / "models"
Dtype = Literal["bf16", "fp8"]
DTYPES: tuple[Dtype, ...] = ("bf16", "fp8")

# Dense models whose configs ship (copies of their config.json as AIConfigurator 0.12.0 ships
# them, `model_configs/`; the Llama-3.1 Instruct models share the base models' architecture).
MODELS = {
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama--Llama-3.1-8B-Instruct.json",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama--Llama-3.1-70B-Instruct.json",
    "Qwen/Qwen3-8B": "Qwen--Qwen3-8B.json",
    "Qwen/Qwen3-32B": "Qwen--Qwen3-32B.json",
}
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# A config that names experts is a mixture-of-experts model (Mixtral, Qwen3-MoE, DeepSeek, ...).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


class AllReduce(msgspec.Struct, frozen=True):
    latency_s: float
    bandwidth_bytes_s: float  # a message's first 8 MiB
    large_bandwidth_bytes_s: float  # beyond


class GpuPreset(msgspec.Struct, frozen=True):
    hardware: Hardware  # its all-reduce fields are set per TP degree from ``allreduce``
    base_profile: str  # the fitted TP1 profile whose cost constants a new profile starts from
    allreduce: dict[int, AllReduce]  # by TP degree
    source: str

    def hardware_at(self, tp: int) -> Hardware:
        """The GPU with the all-reduce of ``tp`` GPUs (a degree between two measured ones takes
        the larger one's)."""
        if tp == 1:
            return self.hardware
        degrees = sorted(d for d in self.allreduce if d >= tp)
        if not degrees:
            raise ProfileError(f"tensor_parallel {tp} spans more than one NVLink domain of "
                               f"{max(self.allreduce)} GPUs; choose at most {max(self.allreduce)}")
        ar = self.allreduce[degrees[0]]
        return msgspec.structs.replace(self.hardware, allreduce_latency_s=ar.latency_s,
                                       allreduce_bandwidth_bytes_s=ar.bandwidth_bytes_s,
                                       allreduce_large_bandwidth_bytes_s=ar.large_bandwidth_bytes_s)


# Datasheet figures (dense tensor-core peaks, no sparsity); the all-reduce from AIC's tables.
GPUS: dict[str, GpuPreset] = {
    "h100": GpuPreset(
        Hardware(name="NVIDIA H100 SXM5 80GB", gpu_memory_bytes=80_000_000_000,
                 peak_memory_bandwidth_bytes_s=3.35e12, peak_bf16_flops=989e12, peak_fp8_flops=1979e12),
        "h100-llama3.1-8b",
        {2: AllReduce(2.76e-6, 275e9, 273e9), 4: AllReduce(3.18e-6, 178e9, 355e9),
         8: AllReduce(3.80e-6, 144e9, 475e9)},
        "NVIDIA H100 datasheet (80 GB HBM3, 3.35 TB/s, 989 bf16 / 1,979 FP8 dense TFLOPS); the "
        "all-reduce fitted to AIC's h100_sxm custom all-reduce (median error 4% / 3% / 11% at TP2/4/8)"),
    "h200": GpuPreset(
        Hardware(name="NVIDIA H200 SXM 141GB", gpu_memory_bytes=141_000_000_000,
                 peak_memory_bandwidth_bytes_s=4.8e12, peak_bf16_flops=989e12, peak_fp8_flops=1979e12),
        "h200-llama3.1-8b",
        {2: AllReduce(2.70e-6, 291e9, 276e9), 4: AllReduce(3.17e-6, 195e9, 350e9),
         8: AllReduce(3.82e-6, 153e9, 479e9)},
        "NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 bf16 / 1,979 FP8 dense TFLOPS); the "
        "all-reduce fitted to AIC's h200_sxm custom all-reduce (median error 4% / 2% / 9% at TP2/4/8)"),
    "b200": GpuPreset(
        Hardware(name="NVIDIA B200 SXM 180GB", gpu_memory_bytes=180_000_000_000,
                 peak_memory_bandwidth_bytes_s=8.0e12, peak_bf16_flops=2250e12, peak_fp8_flops=4500e12),
        "h100-llama3.1-8b",
        {2: AllReduce(4.80e-6, 550e9, 454e9), 4: AllReduce(4.95e-6, 304e9, 577e9),
         8: AllReduce(5.83e-6, 230e9, 645e9)},
        "NVIDIA DGX B200 datasheet (180 GB HBM3e and 8 TB/s per GPU, 2,250 bf16 / 4,500 FP8 dense "
        "TFLOPS); the all-reduce fitted to AIC's b200_sxm custom all-reduce (median error 5% / 5% / "
        "7% at TP2/4/8); no fitted B200 profile yet: the H100's efficiencies until `engine aic` refits"),
}


def gpu_names() -> list[str]:
    return list(GPUS)


def model_config(name_or_path: str) -> tuple[str, dict[str, Any]]:
    """(the model's name, its config.json) for a shipped model's name (``Qwen/Qwen3-32B`` or just
    ``Qwen3-32B``, any case) or a path to a config.json."""
    path = Path(name_or_path)
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ProfileError(f"cannot read the model config {path}: {exc}") from exc
        if not isinstance(config, dict):
            raise ProfileError(f"{path} is not a config.json (a JSON object)")
        default = path.parent.name if path.name == "config.json" else path.stem
        return str(config.get("_name_or_path") or default), config
    wanted = name_or_path.lower()
    for name, file in MODELS.items():
        if wanted in (name.lower(), name.split("/")[-1].lower()):
            return name, json.loads((MODEL_DIR / file).read_text())
    raise ProfileError(f"no shipped config for model {name_or_path!r}; shipped: {', '.join(MODELS)} "
                       "(or pass --config PATH to the model's config.json)")


def model_shape(name: str, config: dict[str, Any], dtype: Dtype) -> ModelShape:
    """The profile's model section from a dense decoder's config.json at ``dtype`` (weights and
    KV cache alike: bf16, or FP8 weights with an FP8 KV cache)."""
    moe = [k for k in MOE_KEYS if config.get(k)]
    architectures = config.get("architectures") or []
    if moe or any("moe" in str(a).lower() for a in architectures):
        raise ProfileError(f"{name} is a mixture-of-experts model ({', '.join(moe) or architectures[0]}): "
                           "its experts' weights and routing are not modelled; dense decoders only "
                           f"({', '.join(DENSE_ARCHITECTURES)})")
    if architectures and not any(a in DENSE_ARCHITECTURES for a in architectures):
        raise ProfileError(f"{name}: architecture {architectures[0]} is not one this models; dense "
                           f"decoders only ({', '.join(DENSE_ARCHITECTURES)})")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelShape(
            name=name, num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
            num_attention_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            bytes_per_param=1 if dtype == "fp8" else 2, kv_bytes_per_element=1 if dtype == "fp8" else 2,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as exc:
        raise ProfileError(f"{name}: config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{name}: config.json has a field that is not a number: {exc}") from None


def profile_name(gpu: str, model: str, tp: int, dtype: Dtype) -> str:
    """``h100-llama3.1-70b-tp4``, ``h100-qwen3-8b-fp8``: the bundled profiles' naming."""
    short = model.split("/")[-1].lower().removesuffix("-instruct").replace("llama-3.1", "llama3.1")
    return f"{gpu}-{short}" + (f"-tp{tp}" if tp > 1 else "") + ("-fp8" if dtype == "fp8" else "")


def build_profile(config: dict[str, Any], model: str, *, gpu: str, tp: int = 1, dtype: Dtype = "bf16",
                  name: str | None = None) -> EngineProfile:
    """A profile for ``model`` (its config.json) on ``tp`` GPUs of kind ``gpu`` at ``dtype``; its
    cost constants start from the GPU's fitted profile (the module docstring)."""
    preset = GPUS.get(gpu.lower())
    if preset is None:
        raise ProfileError(f"no GPU {gpu!r}; choose one of {', '.join(GPUS)}")
    if dtype not in DTYPES:
        raise ProfileError(f"no dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    shape = model_shape(model, config, dtype)
    base = load_profile(preset.base_profile)
    per_layer = base.cost.iteration_overhead_s / base.model.num_layers
    cost = CostConstants(
        iteration_overhead_s=round(per_layer * shape.num_layers, 7),
        memory_bandwidth_efficiency=base.cost.memory_bandwidth_efficiency,
        gemm_flops_efficiency=base.cost.gemm_flops_efficiency,
        attention_flops_efficiency=base.cost.attention_flops_efficiency)
    profile = EngineProfile(
        name=name or profile_name(gpu.lower(), model, tp, dtype), hardware=preset.hardware_at(tp),
        model=shape, cost=cost, engine=base.engine, transfer=base.transfer,
        parallel=Parallelism(tensor_parallel=tp))
    profile.check()
    return profile


TP_CHOICES = (1, 2, 4, 8)


def tp_profiles(config: dict[str, Any], model: str, *, gpu: str, dtype: Dtype = "bf16",
                choices: tuple[int, ...] | list[int] = TP_CHOICES) -> dict[int, EngineProfile]:
    """The model's profile at each TP degree of ``choices`` it fits and splits over; where a
    bundled profile of the same name is this model at that degree, the bundled (refit) one."""
    out, why = {}, []
    for tp in choices:
        try:
            built = build_profile(config, model, gpu=gpu, tp=tp, dtype=dtype)
        except ProfileError as exc:
            why.append(str(exc))
            continue
        try:
            bundled = load_profile(built.name)
        except ProfileError:
            bundled = None
        same = bundled is not None and (bundled.model, bundled.parallel) == (built.model, built.parallel)
        out[tp] = bundled if same and bundled is not None else built
    if not out:
        raise ProfileError(f"{model} fits no TP degree of {list(choices)} on {gpu}: " + "; ".join(why))
    return out


def kv_tokens(profile: EngineProfile) -> int:
    """The KV cache of one worker, in tokens."""
    return profile.kv_capacity_blocks() * profile.engine.block_size


def describe(profile: EngineProfile) -> str:
    """One line: what a worker of this profile holds."""
    gib = 2 ** 30
    return (f"{profile.name}: {profile.model.name} at TP{profile.tp} on {profile.hardware.name}, "
            f"{profile.gpu_weight_bytes / gib:.1f} GiB of weights and "
            f"{kv_tokens(profile):,} tokens of KV per worker "
            f"({math.ceil(profile.gpu_kv_bytes_per_token / 1024)} KiB per token per GPU)")
