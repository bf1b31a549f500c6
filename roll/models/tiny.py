"""The default example's tokenizer and model, built locally (no hub access needed).

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the task's own text:
every digit is its own token (as in Qwen2), any byte string encodes (the 256 byte symbols are in the
alphabet), and it carries Qwen2's special tokens and chat template, so ``apply_chat_template`` gives
``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``. The model is a small
``Qwen2ForCausalLM`` built from a ``Qwen2Config``, so every code path that loads Qwen2 checkpoints
(HF, Megatron conversion, vLLM) works with it.

    tok = build_tokenizer(texts)                      # texts: the prompts and targets of the task
    model = build_tiny_qwen2(tok, TinyModelSpec(), seed=0)
    save_model_and_tokenizer(model, tok, "output/default_example/base_model")
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, whitespace. The
# same split Qwen2Tokenizer applies when transformers loads the checkpoint, so both loaders agree.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's chat template without the default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny Qwen2 model (defaults: ~0.5M parameters; on 2 CPU cores it samples thousands
    of tokens per second and learns the default task's column arithmetic in under 1000 steps)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` (deterministic for the same texts) and wrap it as a
    ``PreTrainedTokenizerFast`` with pad/bos = ``<|endoftext|>``, eos = ``<|im_end|>`` and the chat
    template above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinyModelSpec.max_position_embeddings,
        padding_side="left",
    )


def build_tiny_qwen2(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised (from ``seed``) Qwen2 causal LM whose vocabulary matches ``tokenizer``."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(spec),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def save_model_and_tokenizer(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path
) -> None:
    """Save both as one Hugging Face checkpoint directory (safetensors weights)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
