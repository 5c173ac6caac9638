"""The local model directory: Llama-3.1-8B's shape, and token ids that survive a turn."""

from __future__ import annotations

import json
import random

import pytest

from dynamo_ppd import model

pytestmark = pytest.mark.unit
# The tests on `model_dir` are marked slow: the session's model directory trains its tokenizer
# first (5-15 s on 2 cores), paid by whichever test asks for it first.


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer  # here: importing transformers costs 1-2 s of test-fast

    return AutoTokenizer.from_pretrained(str(model_dir))


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.slow
def test_config_is_llama31_8b_shaped(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["hidden_size"],
            config["torch_dtype"]) == (32, 32, 8, 128, 4096, "bfloat16")
    kv_bytes_per_token = (2 * config["num_key_value_heads"] * config["head_dim"] * 2
                          * config["num_hidden_layers"])
    assert kv_bytes_per_token == 128 * 1024  # 128 KiB per token (README, "The local model directory")


@pytest.mark.slow
def test_tokenizer_vocab_and_specials(model_dir, tokenizer):
    info = model.load_model_info(model_dir)
    assert len(tokenizer) == info.vocab_size >= 4096
    assert tokenizer.convert_ids_to_tokens(info.bos_token_id) == model.BOS
    assert tokenizer.convert_ids_to_tokens(info.eot_token_id) == model.EOT
    # The mocker's id range must lie inside the round-trip range.
    assert info.generation_token_range[0] <= model.MOCKER_RANGE[0]
    assert info.generation_token_range[1] >= model.MOCKER_RANGE[1]


@pytest.mark.slow
@pytest.mark.parametrize("id_range", ["mocker", "full"])
def test_generated_ids_round_trip_through_next_turn(model_dir, tokenizer, id_range):
    """Ids a worker generates, detokenized and sent back as history, re-tokenize to the same ids,
    and the previous turn's prompt stays a prefix of the next one (so its KV can be reused)."""
    info = model.load_model_info(model_dir)
    low, high = model.MOCKER_RANGE if id_range == "mocker" else info.generation_token_range
    rng = random.Random(7)
    for trial in range(200):
        messages = [{"role": "user", "content": f"Question {trial}: what is it, really?"}]
        prompt = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        for _turn in range(3):
            generated = [rng.randrange(low, high) for _ in range(rng.randint(1, 80))]
            reply = tokenizer.decode(generated)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"And then? ({rng.random():.3f})"}]
            next_prompt = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            assert next_prompt[:len(prompt)] == prompt
            assert next_prompt[len(prompt):len(prompt) + len(generated)] == generated, reply
            assert next_prompt[len(prompt) + len(generated)] == info.eot_token_id
            prompt = next_prompt


def test_missing_model_dir_says_how_to_fix(tmp_path):
    with pytest.raises(model.ModelDirError, match="dynamo-ppd model init"):
        model.load_model_info(tmp_path)


@pytest.mark.slow
def test_init_is_idempotent_and_validated(model_dir, tmp_path):
    before = (model_dir / "tokenizer.json").stat().st_mtime_ns
    assert model.init_model_dir(model_dir) == model_dir
    assert (model_dir / "tokenizer.json").stat().st_mtime_ns == before
    with pytest.raises(model.ModelDirError, match="at least 4096"):
        model.init_model_dir(tmp_path / "small", vocab_size=1000)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "dynamo_ppd_model.json").write_text('{"format_version": "one"}')
    with pytest.raises(model.ModelDirError, match="format_version"):
        model.load_model_info(tmp_path / "bad")


def test_init_refuses_to_overwrite_a_foreign_directory(tmp_path):
    real = tmp_path / "llama"
    real.mkdir()
    (real / "model.safetensors").write_text("weights")
    with pytest.raises(model.ModelDirError, match="refusing to overwrite"):
        model.init_model_dir(real, force=True)
    assert (real / "model.safetensors").read_text() == "weights"


@pytest.mark.slow
def test_chat_template_tokens_are_what_the_template_adds_around_each_message(model_dir, tokenizer):
    """`chat_template_tokens` against transformers' own rendering of whole conversations."""
    template = model.chat_template_tokens(model_dir)
    low, _ = model.load_model_info(model_dir).generation_token_range
    words = [tokenizer.decode([i]) for i in range(low, low + 40)]  # one token each, as the bench's text

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    first, second = "".join(words[:20]), "".join(words[20:31])
    reply_ids = list(range(low + 100, low + 130))
    turn1 = _ids(tokenizer.apply_chat_template([{"role": "user", "content": first}],
                                               add_generation_prompt=True))
    assert len(turn1) == template.first_prefix + count(first) + template.suffix
    turn2 = _ids(tokenizer.apply_chat_template(
        [{"role": "user", "content": first}, {"role": "assistant", "content": tokenizer.decode(reply_ids)},
         {"role": "user", "content": second}], add_generation_prompt=True))
    assert len(turn2) == len(turn1) + len(reply_ids) + template.next_prefix + count(second) + template.suffix
    assert template.first_prefix + template.suffix > 5  # more than the simulator's own template adds
