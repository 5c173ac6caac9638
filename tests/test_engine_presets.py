"""Profiles for other models, TP degrees and precisions (`engine.presets`, `dynamo-ppd engine
profile`) and what tensor parallelism does to the cost model."""

from __future__ import annotations

import json

import msgspec
import pytest

from dynamo_ppd.cli import main as cli_main
from dynamo_ppd.engine import CostModel, PrefillChunk, load_profile
from dynamo_ppd.engine.presets import GPUS, MODELS, build_profile, model_config, profile_name
from dynamo_ppd.engine.profile import ProfileError

pytestmark = pytest.mark.unit


def llama70b(tp: int, dtype: str = "bf16", gpu: str = "h100"):
    name, config = model_config("Llama-3.1-70B-Instruct")
    return build_profile(config, name, gpu=gpu, tp=tp, dtype=dtype)


def test_a_shipped_model_by_its_name_in_any_spelling():
    for spelling in ("Qwen/Qwen3-32B", "qwen3-32b", "QWEN3-32B"):
        name, config = model_config(spelling)
        assert name == "Qwen/Qwen3-32B" and config["num_hidden_layers"] == 64
    with pytest.raises(ProfileError, match="no shipped config for model 'Qwen3-33B'; shipped: "):
        model_config("Qwen3-33B")


def test_the_8b_config_gives_the_hand_written_profiles_model():
    """The hand-written profile's model section, derived from the config.json instead."""
    name, config = model_config("meta-llama/Llama-3.1-8B-Instruct")
    built, shipped = build_profile(config, name, gpu="h100"), load_profile("h100-llama3.1-8b")
    assert built.model == shipped.model and built.name == "h100-llama3.1-8b"
    assert built.kv_capacity_blocks() == shipped.kv_capacity_blocks()
    assert built.hardware.peak_memory_bandwidth_bytes_s == shipped.hardware.peak_memory_bandwidth_bytes_s
    assert (built.cost.memory_bandwidth_efficiency, built.cost.gemm_flops_efficiency) == \
        (shipped.cost.memory_bandwidth_efficiency, shipped.cost.gemm_flops_efficiency)
    assert built.cost.iteration_overhead_s == pytest.approx(shipped.cost.iteration_overhead_s)  # 32 layers


def test_a_config_file_of_your_own(tmp_path):
    config = dict(model_config("Qwen3-8B")[1])
    config.update(architectures=["MistralForCausalLM"], num_hidden_layers=40, tie_word_embeddings=True)
    config.pop("head_dim")  # Mistral's configs may leave it out: hidden / heads
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    name, loaded = model_config(str(path))
    profile = build_profile(loaded, name, gpu="h200", tp=2)
    assert name == "my-model" and profile.name == "h200-my-model-tp2"
    assert profile.model.head_dim == 4096 // 32 and profile.model.num_layers == 40
    untied = msgspec.structs.replace(profile.model, tie_word_embeddings=False)
    assert untied.total_params - profile.model.total_params == profile.model.lm_head_params


def test_a_mixture_of_experts_or_unknown_model_is_refused_in_one_line():
    moe = dict(model_config("Qwen3-8B")[1], architectures=["Qwen3MoeForCausalLM"], num_experts=128,
               moe_intermediate_size=768)
    with pytest.raises(ProfileError, match="mixture-of-experts model .*num_experts.*dense decoders only"):
        build_profile(moe, "Qwen/Qwen3-30B-A3B", gpu="h100")
    mixtral = dict(model_config("Qwen3-8B")[1], architectures=["MixtralForCausalLM"], num_local_experts=8)
    with pytest.raises(ProfileError, match="mixture-of-experts"):
        build_profile(mixtral, "mixtral", gpu="h100")
    other = dict(model_config("Qwen3-8B")[1], architectures=["GPT2LMHeadModel"])
    with pytest.raises(ProfileError, match="architecture GPT2LMHeadModel is not one this models"):
        build_profile(other, "gpt2", gpu="h100")
    with pytest.raises(ProfileError, match="config.json has no 'vocab_size'"):
        build_profile({k: v for k, v in model_config("Qwen3-8B")[1].items() if k != "vocab_size"}, "x",
                      gpu="h100")


def test_tp_shards_weights_heads_and_kv_and_frees_memory_for_the_cache():
    tp4, tp8 = llama70b(4), llama70b(8)
    model = tp4.model
    assert tp4.gpu_weight_bytes == pytest.approx(model.weight_bytes / 4, abs=1)
    assert (tp4.kv_heads_per_gpu, tp8.kv_heads_per_gpu) == (2, 1)  # 8 KV heads
    assert tp4.gpu_kv_bytes_per_token == model.kv_bytes_per_token / 4
    assert tp8.gpu_attention_flops_per_pair == model.attention_flops_per_pair / 8
    # Half the weights per GPU and half the KV per token: more than twice the tokens.
    assert tp8.kv_capacity_blocks() > 2 * tp4.kv_capacity_blocks()
    with pytest.raises(ProfileError, match="no memory left for the KV cache .*raise the TP degree"):
        llama70b(1)
    with pytest.raises(ProfileError, match="64 attention heads do not split over tensor_parallel 3"):
        llama70b(3)
    with pytest.raises(ProfileError, match="more than one NVLink domain of 8 GPUs"):
        llama70b(16)
    # More KV heads than GPUs would share one: a model with 8 KV heads at TP8 keeps one each.
    assert llama70b(8).gpu_kv_bytes_per_token * 8 == model.kv_bytes_per_token


def test_fp8_halves_weights_and_kv_and_runs_gemms_on_fp8_tensor_cores():
    bf16, fp8 = llama70b(4), llama70b(4, "fp8")
    assert fp8.gpu_weight_bytes * 2 == pytest.approx(bf16.gpu_weight_bytes, abs=2)
    assert fp8.gpu_kv_bytes_per_token * 2 == bf16.gpu_kv_bytes_per_token
    assert (fp8.gemm_peak_flops, bf16.gemm_peak_flops) == (1979e12, 989e12)
    assert fp8.attention_peak_flops == 1979e12
    no_fp8 = msgspec.structs.replace(fp8, hardware=msgspec.structs.replace(fp8.hardware, peak_fp8_flops=None))
    with pytest.raises(ProfileError, match="FP8 weights need hardware.peak_fp8_flops"):
        no_fp8.check()


def test_an_iteration_at_tp_is_one_gpus_shard_plus_two_allreduces_per_layer():
    tp4 = llama70b(4)
    model = CostModel(tp4)
    hw = tp4.hardware
    ring = 2 * 3 / 4
    for tokens in (1, 64, 4096):  # below the 8 MiB knee: 8192 * 2 bytes a token -> 512 tokens
        small = min(tokens, 512) * 8192 * 2
        large = max(0, tokens - 512) * 8192 * 2
        one = (hw.allreduce_latency_s + ring * small / hw.allreduce_bandwidth_bytes_s
               + ring * large / hw.allreduce_large_bandwidth_bytes_s)
        assert tp4.allreduce_s(tokens) == pytest.approx(2 * 80 * one)
    decode = model.iteration(64, 64 * 2049)
    assert decode.allreduce_s == pytest.approx(tp4.allreduce_s(64))
    assert decode.total_s == pytest.approx(decode.overhead_s + decode.gemm_s + decode.allreduce_s
                                           + decode.decode_attention_s)
    prefill = model.iteration(0, 0, [PrefillChunk(4096, 0, True)])
    assert prefill.allreduce_s == pytest.approx(tp4.allreduce_s(4096))
    # The decode-run shortcut adds the same terms in the same order: the same floats.
    assert model.decode_run_s(64, 64 * 2049, 3) == [model.iteration(64, 64 * 2049 + 64 * i).total_s
                                                    for i in range(3)]
    # At TP1 there is no all-reduce at all.
    assert CostModel(load_profile("h100-llama3.1-8b")).iteration(64, 64 * 2049).allreduce_s == 0.0


def test_more_gpus_per_worker_decode_faster():
    """A 70B model's decode step at batch 32, 2K context: TP8 under TP4 (weights per GPU halve;
    the all-reduces and the fixed time do not)."""
    t4 = CostModel(llama70b(4)).iteration(32, 32 * 2049).total_s
    t8 = CostModel(llama70b(8)).iteration(32, 32 * 2049).total_s
    assert 0.5 * t4 < t8 < 0.85 * t4


def test_bundled_profile_names_follow_the_builder():
    assert profile_name("h100", "meta-llama/Llama-3.1-70B-Instruct", 4, "bf16") == "h100-llama3.1-70b-tp4"
    assert profile_name("h100", "Qwen/Qwen3-8B", 1, "fp8") == "h100-qwen3-8b-fp8"
    assert set(GPUS) == {"h100", "h200", "b200"} and len(MODELS) == 4


def test_cli_writes_a_profile_every_command_can_load(tmp_path, capsys):
    out = tmp_path / "q32.yaml"
    assert cli_main(["engine", "profile", "--model", "Qwen3-32B", "--tp", "2", "--gpu", "h200",
                     "--out", str(out)]) == 0
    assert "h200-qwen3-32b-tp2: Qwen/Qwen3-32B at TP2" in capsys.readouterr().err
    loaded = load_profile(out)
    name, config = model_config("Qwen3-32B")
    assert loaded == build_profile(config, name, gpu="h200", tp=2)
    assert out.read_text().startswith("# Built by `dynamo-ppd engine profile")


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "Llama-3.1-70B-Instruct", "--tp", "3"], "do not split over tensor_parallel 3"),
    (["--model", "Llama-3.1-70B-Instruct"], "no memory left for the KV cache"),
    (["--model", "nope"], "no shipped config for model 'nope'"),
])
def test_cli_bad_input_exits_2_in_one_line(argv, message, capsys):
    assert cli_main(["engine", "profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_cli_refuses_a_moe_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_config("Qwen3-8B")[1], num_experts=64)))
    assert cli_main(["engine", "profile", "--config", str(path)]) == 2
    assert "mixture-of-experts" in capsys.readouterr().err
