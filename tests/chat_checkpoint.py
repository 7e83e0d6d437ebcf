"""A small Hugging Face checkpoint the way a user brings one: a byte-level BPE
tokenizer trained here on the task texts with ``tokenizers``, Qwen's special
tokens and a Qwen-style chat template (``<|im_end|>`` ends a turn;
``<|endoftext|>`` pads and is a second eos, as in Qwen3's
generation_config.json), and random qwen3_moe weights of the smoke size."""

import json
from dataclasses import replace
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tracefp4.components.architecture import get_preset
from tracefp4.components.checkpoint import save_model
from tracefp4.components.model import build_model
from tracefp4.components.tasks import format_example, split
from tracefp4.components.tokenizer import GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG

# Qwen2/Qwen3's pre-tokenization (transformers' Qwen2Tokenizer applies it whatever tokenizer.json says): digits
# one by one, words with their leading punctuation, newlines apart
PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5/Qwen3's template without the system prompt and tool branches
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(vocab_size: int = 317) -> Tokenizer:
    """Byte-level BPE over the three tasks' prompts and answers (seeded generation: the same merges every call)."""
    texts = []
    for task in ("arithmetic", "countdown", "program"):
        train, _ = split(task, 64, 8, seed=0, difficulty=1)
        texts += [format_example(p) for p in train] + [p.answer for p in train]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([ENDOFTEXT, IM_START, IM_END])  # after the vocabulary, as Qwen's 151643-151645
    return tok


def tokenizer_files(tok: Tokenizer, template: str = TEMPLATE, eos: object = "qwen") -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json as Qwen3 lays them out."""
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": IM_END, "pad_token": ENDOFTEXT, "bos_token": None}
    config["chat_template"] = template
    if eos == "qwen":
        eos = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    pad = tok.token_to_id(ENDOFTEXT)
    generation = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad, "temperature": 0.6, "top_p": 0.95}
    return {
        TOKENIZER: tok.to_str().encode(),
        TOKENIZER_CONFIG: json.dumps(config).encode(),
        GENERATION_CONFIG: json.dumps(generation).encode(),
    }


def chat_checkpoint(folder: Path, seed: int = 0, tok: Tokenizer | None = None) -> Path:
    """A qwen3_moe checkpoint of the smoke size whose vocabulary is the BPE tokenizer's, saved at ``folder``."""
    tok = tok or train_bpe()
    model = build_model(replace(get_preset("smoke"), vocab_size=tok.get_vocab_size()), seed=seed)
    return save_model(model, folder, extra=tokenizer_files(tok))
