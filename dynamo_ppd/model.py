"""The local model directory: a tokenizer trained here and a config.json shaped like Llama-3.1-8B.

Nothing is downloaded from a model hub. `dynamo-ppd model init` writes everything Dynamo's frontend
and workers read from a model directory:

- ``tokenizer.json``: a byte-level BPE tokenizer (vocab 8192 by default) trained on a seeded,
  synthetic corpus of pseudo-English, with Llama 3's special tokens.
- ``tokenizer_config.json``: a Llama-3-style chat template (same headers and special tokens).
- ``config.json``: the shape of Llama-3.1-8B (32 layers, 32 heads, 8 KV heads, head_dim 128,
  hidden 4096, bf16). Later issues derive KV bytes per token and weight bytes from it.
- ``generation_config.json`` and ``dynamo_ppd_model.json`` (our own metadata, see `ModelInfo`).

Why the token layout matters: multi-turn prefix reuse only works if the ids a worker generates,
once detokenized and put back into the next turn's chat template, tokenize to the *same* ids.
With a byte-level BPE that holds for tokens that are a space followed by letters (" word"): the
pre-tokenizer cuts text at every such boundary and BPE maps each piece back to its single token.
We renumber the vocabulary so that one contiguous id range holds only such tokens, starting at id
1000: Dynamo's mocker emits ids in [1000, 2000), and our simulated worker draws from the range
recorded in ``dynamo_ppd_model.json``. The template, unlike Llama's, does not ``trim`` message
content, because trimming would drop the first generated token's leading space.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec

DEFAULT_MODEL_NAME = "llama-3.1-8b-sim"
DEFAULT_VOCAB_SIZE = 8192
GENERATION_RANGE_START = 1000  # Dynamo's mocker emits ids in [1000, 2000)
MOCKER_RANGE = (1000, 2000)
MODEL_FORMAT_VERSION = 1

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [
    BOS,
    EOS,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT,
    "<|finetune_right_pad_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]

# Llama 3's chat template without `| trim` on the content (see the module docstring).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B-Instruct), minus the weights.
LLAMA31_8B_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    # The real embedding size: weight-memory math uses it; our tokenizer's ids are all below it.
    "vocab_size": 128256,
}


class ModelInfo(msgspec.Struct, forbid_unknown_fields=True):
    """``dynamo_ppd_model.json``: what a worker needs to know about the local model directory."""

    format_version: int
    served_model_name: str
    vocab_size: int
    # Ids in [start, end) are " word" tokens that survive decode -> chat template -> encode.
    generation_token_range: tuple[int, int]
    bos_token_id: int
    eot_token_id: int
    eos_token_ids: list[int]


class ModelDirError(Exception):
    """A model directory is missing or malformed; the message says how to fix it."""


def default_cache_dir() -> Path:
    if env := os.environ.get("DYNAMO_PPD_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynamo-ppd"


def default_model_dir() -> Path:
    return default_cache_dir() / "models" / DEFAULT_MODEL_NAME


# ---------------------------------------------------------------------------------------------
# Corpus: seeded pseudo-English, so training is reproducible and needs no data set.

_ONSETS = ("b c d f g h j k l m n p r s t v w y z "
           "bl br ch cl cr dr fl fr gl gr pl pr sh sl sp st th tr").split()
_VOWELS = "a e i o u ai ea ee ie oa ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt"]


def _lexicon(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.choices([1, 2, 3], weights=[5, 4, 1])[0]
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(syllables))
        words.add(word)
    return sorted(words)


def synthetic_corpus(seed: int = 0, sentences: int = 20000, lexicon_size: int = 20000) -> Iterator[str]:
    """Yield lines of pseudo-English with a Zipf word distribution, punctuation and numbers."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng, lexicon_size)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    for _ in range(sentences):
        n = rng.randint(4, 18)
        words = rng.choices(lexicon, weights=weights, k=n)
        words[0] = words[0].capitalize()
        if rng.random() < 0.15:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2030)))
        if rng.random() < 0.2:
            words[rng.randrange(len(words))] += ","
        yield " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":"])


# ---------------------------------------------------------------------------------------------
# Training and writing.

_WORD_PIECE = re.compile(r"^Ġ[a-z]+$")  # byte-level BPE shows a leading space as "Ġ"


def _train(vocab_size: int, seed: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    return tok


def _renumbered(tok, vocab_size: int) -> tuple[dict, tuple[int, int]]:
    """Return tokenizer JSON with " word" tokens moved to one id range starting at 1000."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    by_id = sorted(vocab, key=vocab.__getitem__)

    def round_trips(piece: str) -> bool:
        text = tok.decode([vocab[piece]])
        return tok.encode(text, add_special_tokens=False).ids == [vocab[piece]]

    words = [p for p in by_id if _WORD_PIECE.match(p) and round_trips(p)]
    others = [p for p in by_id if p not in set(words)]
    if len(words) < MOCKER_RANGE[1] - MOCKER_RANGE[0]:
        raise ModelDirError(f"only {len(words)} round-trip word tokens; raise the vocab size")
    order = others[:GENERATION_RANGE_START] + words + others[GENERATION_RANGE_START:]
    spec["model"]["vocab"] = {piece: new_id for new_id, piece in enumerate(order)}
    first_special = len(order)
    spec["added_tokens"] = [
        {"id": first_special + i, "content": t, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    ]
    assert first_special + len(SPECIAL_TOKENS) == vocab_size
    return spec, (GENERATION_RANGE_START, GENERATION_RANGE_START + len(words))


def init_model_dir(model_dir: Path | None = None, *, served_model_name: str = DEFAULT_MODEL_NAME,
                   vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0, force: bool = False) -> Path:
    """Write the model directory (idempotent unless ``force``); return its path."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir or default_model_dir())
    if not force and is_complete(model_dir):
        return model_dir
    ours = (model_dir / "dynamo_ppd_model.json").is_file()
    if model_dir.is_dir() and any(model_dir.iterdir()) and not ours:
        # Never replace somebody's real model (e.g. a downloaded Llama) with the simulated one.
        raise ModelDirError(f"{model_dir} holds files but is not a dynamo-ppd model directory; refusing "
                            f"to overwrite it (for a real model run deploy/prepare_model.py on it first)")
    if vocab_size < 4096:
        raise ModelDirError(f"vocab size {vocab_size} is too small; use at least 4096")
    trained = _train(vocab_size, seed)
    spec, gen_range = _renumbered(trained, vocab_size)
    tok = Tokenizer.from_str(json.dumps(spec))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    info = ModelInfo(
        format_version=MODEL_FORMAT_VERSION,
        served_model_name=served_model_name,
        vocab_size=vocab_size,
        generation_token_range=gen_range,
        bos_token_id=ids[BOS],
        eot_token_id=ids[EOT],
        eos_token_ids=[ids[EOT], ids[EOS], ids["<|eom_id|>"]],
    )
    # Write into a sibling temp dir and rename, so a crash never leaves a half-written model.
    tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", {
        "bos_token": BOS,
        "eos_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": LLAMA31_8B_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(tmp / "config.json", {
        **LLAMA31_8B_CONFIG, "bos_token_id": info.bos_token_id, "eos_token_id": info.eos_token_ids,
    })
    _write_json(tmp / "generation_config.json", {
        "bos_token_id": info.bos_token_id, "eos_token_id": info.eos_token_ids,
        "do_sample": True, "temperature": 0.6, "top_p": 0.9,
    })
    (tmp / "dynamo_ppd_model.json").write_bytes(msgspec.json.format(msgspec.json.encode(info)))
    if model_dir.exists():
        import shutil

        shutil.rmtree(model_dir)
    tmp.rename(model_dir)
    return model_dir


_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "dynamo_ppd_model.json")


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in _REQUIRED_FILES)


def ensure_model_dir(model_dir: Path | None = None) -> Path:
    """``model_dir`` (default: the cache's), made first if it is missing; its path."""
    path = model_dir or default_model_dir()
    if not is_complete(path):
        init_model_dir(path)
    return path


def load_model_info(model_dir: Path) -> ModelInfo:
    path = Path(model_dir) / "dynamo_ppd_model.json"
    if not path.is_file():
        raise ModelDirError(f"{model_dir} is not a dynamo-ppd model directory "
                            f"(no dynamo_ppd_model.json); run `dynamo-ppd model init`")
    try:
        info = msgspec.json.decode(path.read_bytes(), type=ModelInfo)
    except msgspec.ValidationError as exc:
        raise ModelDirError(f"{path}: {exc}; re-create it with `dynamo-ppd model init --force`") from exc
    if info.format_version != MODEL_FORMAT_VERSION:
        raise ModelDirError(f"{path}: format_version {info.format_version} is not "
                            f"{MODEL_FORMAT_VERSION}; run `dynamo-ppd model init --force`")
    return info


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def chat_template_tokens(model_dir: Path | None = None):  # -> sim.conversation.ChatTemplate
    """How many tokens the model directory's chat template puts around each user message, as the
    frontend renders and tokenizes a conversation: what the simulator's prompts must add to be as
    long as the live ones (`bench compare`'s twin; docs/bench/dilation.md, "Why ppd runs slower
    than its twin"). Counted on a rendering with marker messages, each piece tokenized alone."""
    import jinja2
    from tokenizers import Tokenizer

    from .sim.conversation import ChatTemplate

    directory = model_dir or default_model_dir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    template = jinja2.Environment().from_string(config["chat_template"])

    def render(messages: list[dict]) -> str:
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=config.get("bos_token", ""), eos_token=config.get("eos_token", ""))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    first, rest = render([{"role": "user", "content": "\x00"}]).split("\x00")
    turns = render([{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x01"},
                    {"role": "user", "content": "\x02"}])
    between = turns.split("\x01")[1].split("\x02")[0]
    return ChatTemplate(first_prefix=count(first), next_prefix=count(between), suffix=count(rest))
