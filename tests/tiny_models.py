"""Tiny Qwen2 models and a byte-level BPE tokenizer, built from configs and saved like real checkpoints.

Tests load them back through the real loading code (``roll.models.loading``), so nothing here
touches a model hub.

>>> path = build_tiny_model_dir(tmp_path / "tiny")          # model + tokenizer in one directory
>>> tok = load_tokenizer(str(path)); tok.pad_token_id, tok.eos_token_id
(0, 1)
>>> prompts, mask = encode_prompts(["1 + 2 =", "what is 3?"], prompt_length=12)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import pre_tokenizers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
# Qwen2 pads its embedding beyond the tokenizer (259 tokens); keep unused ids to exercise that.
VOCAB_SIZE = 272


def build_tiny_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer (every byte one token, no merges) with pad (0), eos (1), bos (2).

    It is built with the ``tokenizers`` library the way transformers' Qwen2Tokenizer builds its
    own, so ``AutoTokenizer`` reloads a saved copy next to a Qwen2 config.json unchanged.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet)}
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tok.padding_side = "left"
    return tok


def tiny_qwen2_config(tie_word_embeddings: bool = True, num_hidden_layers: int = 2) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )


def tiny_qwen3_moe_config(**overrides) -> Any:
    """A tiny Qwen3-MoE (8 experts, top-2, q/k norms, untied): the family of the 4-GPU MoE examples."""
    from transformers import Qwen3MoeConfig

    shape = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    return Qwen3MoeConfig(**{**shape, **overrides})


def tiny_qwen3_next_config(**overrides) -> Any:
    """A tiny Qwen3-Next (layers: Gated DeltaNet, full attention, Gated DeltaNet with a dense MLP,
    full attention; 2 key / 4 value linear heads; 4 experts top-2 plus a gated shared expert)."""
    from transformers import Qwen3NextConfig

    shape = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[2],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
    )
    return Qwen3NextConfig(**{**shape, **overrides})


def build_tiny_model(
    seed: int = 0, tie_word_embeddings: bool = True, num_hidden_layers: int = 2
) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 tiny Qwen2 (deterministic for ``seed``)."""
    torch.manual_seed(seed)
    config = tiny_qwen2_config(tie_word_embeddings, num_hidden_layers)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # Larger random weights than the HF default init, so sampled tokens and log-probs vary.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID)
    return model


def build_tiny_model_dir(
    path: str | Path, seed: int = 0, tie_word_embeddings: bool = True, num_hidden_layers: int = 2
) -> Path:
    """Save a tiny model (safetensors) and its tokenizer under ``path``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_model(seed, tie_word_embeddings, num_hidden_layers).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def encode_prompts(texts: list[str], prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad tokenized ``texts`` to ``prompt_length``: (prompts [B, P], prompt_mask [B, P])."""
    tok = build_tiny_tokenizer()
    prompts = torch.full((len(texts), prompt_length), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(texts), prompt_length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"][-prompt_length:]
        prompts[row, prompt_length - len(ids) :] = torch.tensor(ids)
        mask[row, prompt_length - len(ids) :] = 1
    return prompts, mask


def save_random_model(config, path: Path, std: float = 0.1, seed: int = 0) -> Path:
    """An fp32 model of ``config`` with every parameter drawn from N(0, std), saved with the tiny
    tokenizer (distinct, non-trivial values for bit-exact conversion checks)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``, by name."""
    from safetensors.torch import load_file

    return {n: t for f in sorted(directory.glob("*.safetensors")) for n, t in load_file(f).items()}


def tensor_differences(tag: str, original: dict, again: dict) -> list[str]:
    """What a round trip changed: differing name sets, then each tensor not bit-equal."""
    bad = []
    if original.keys() != again.keys():
        bad.append(f"{tag}: names differ: {sorted(original.keys() ^ again.keys())[:4]}")
    return bad + [
        f"{tag}: {n} differs"
        for n in original.keys() & again.keys()
        if not torch.equal(original[n], again[n])
    ]
