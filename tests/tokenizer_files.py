"""Real Hugging Face tokenizer files, made offline in a test's tmp_path (nothing downloads)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

# A ChatML template as Qwen2.5 and many vLLM models ship it (without the default system
# prompt): every message is <|im_start|>role\ncontent<|im_end|>\n.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is the weather in Paris today? It is sunny and 21 degrees in Paris.",
    "user assistant system tool function call output result",
    "Please summarise the refund policy for order 42 and tell me the next step.",
]


def word_level(directory: Path, template: str | None = CHATML) -> Path:
    """A WordLevel tokenizer split on whitespace and punctuation: one token per word, so a
    rendered conversation costs exactly the sum of its parts (an exact test)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    return _save(directory, tokenizer, template)


def byte_bpe(directory: Path, template: str | None = CHATML) -> Path:
    """A byte-level BPE (GPT-2 style) trained on a small corpus: any text encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return _save(directory, tokenizer, template)


def _save(directory: Path, tokenizer: Tokenizer, template: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": None, "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def template_count(directory: Path, messages: list[dict[str, str]]) -> int:
    """What a vLLM server counts for `messages` (POST /tokenize with messages): the chat
    template rendered with the generation prompt, tokenized without added special tokens."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config = json.loads((directory / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True
    )
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
