"""Model sizes from a Hugging Face ``config.json`` alone (no weights, no transformers import).

One formula set covers the families roll's strategies load (roll.models.megatron.families): dense
Llama / Qwen2 / Qwen3, the MoE Qwen3-MoE / Mixtral, and DeepSeek-V3 (multi-latent attention,
shared experts, first-k dense layers; its multi-token-prediction layers are not counted, as roll
does not build them). Counts are those of the HF module tree.

    shape = load_model_shape("models/Qwen2.5-7B", "actor_train.model_args.model_name_or_path")
    shape.total_params()            # 7_615_616_512
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.role import LORA_ALL_LINEAR

# model_type -> (q/k/v bias, RMSNorm per query/key head, MoE field names or None).
FAMILY_TRAITS: dict[str, tuple[bool, bool, str | None]] = {
    "llama": (False, False, None),
    "qwen2": (True, False, None),
    "qwen3": (False, True, None),
    "qwen3_moe": (False, True, "qwen3_moe"),
    "mixtral": (False, False, "mixtral"),
    "deepseek_v3": (False, False, "deepseek_v3"),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder-only model's memory."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0  # one expert's MLP width
    moe_layers: int = 0  # layers whose MLP is the experts
    shared_ffn: int = 0  # the shared experts' MLP width in each MoE layer (DeepSeek)
    # Multi-latent attention (DeepSeek): q LoRA rank (0: a plain q projection), kv LoRA rank, and
    # the per-head widths; ``head_dim`` is then the query/key width (nope + rope).
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias, + per-head q/k norms) and the two layer norms."""
        if self.mla:
            return self._mla_params()
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        count = h * q + 2 * h * kv + q * h + 2 * h
        if self.qkv_bias:
            count += q + 2 * kv
        if self.qk_norm:
            count += 2 * self.head_dim
        return count

    def _mla_params(self) -> int:
        """Multi-latent attention: q (LoRA down + norm + up, or one projection), the kv down
        projection with the shared RoPE key + its norm, the kv up projection, o, two layer norms."""
        h, heads, q_head = self.hidden, self.heads, self.head_dim
        q = h * q_head * heads
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * q_head
        kv_down = h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
        kv_up = self.kv_lora_rank * heads * (q_head - self.qk_rope_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * h + 2 * h

    def expert_params(self) -> int:
        """Every expert of every MoE layer (gate, up, down)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_ffn

    def layer_dense_params(self) -> int:
        """Every layer's parameters but the experts: attention, norms, dense MLPs, routers."""
        dense_mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.ffn
        dense_mlp += self.moe_layers * 3 * self.hidden * self.shared_ffn
        routers = self.moe_layers * self.experts * self.hidden
        return self.layers * self.attention_params() + dense_mlp + routers

    def embedding_params(self) -> int:
        """Input embedding, output head (0 when tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def total_params(self) -> int:
        return self.embedding_params() + self.layer_dense_params() + self.expert_params()

    def lora_params(self, targets: list[str], rank: int) -> int:
        """LoRA A and B (rank x (in + out)) on every decoder-layer linear module whose name ends with
        one of ``targets`` ("all-linear": all of them); a name not below counts as hidden x hidden."""
        h, q, kv, ffn = self.hidden, self.q_dim, self.kv_dim, self.ffn
        dense_layers = self.layers - self.moe_layers
        mlp = {"gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        names = [*attention, *mlp] if LORA_ALL_LINEAR in targets else targets
        count = 0
        for name in names:
            if name in attention:
                count += self.layers * sum(attention[name])
            elif name in mlp:
                experts = self.moe_layers * self.experts * (h + self.moe_ffn)  # every expert's copy
                count += dense_layers * sum(mlp[name]) + experts
            else:
                count += self.layers * 2 * h
        return rank * count

    def megatron_lora_params(self, targets: list[str], rank: int, tp: int = 1) -> int:
        """LoRA A and B on one TP rank of megatron_train (``roll.models.megatron.lora``): one
        adapter on the fused q/k/v layer when any of q/k/v_proj is targeted, one on gate/up; the
        column-parallel layers' A [rank, in] and the row-parallel ones' B [out, rank] whole, the
        other factor 1/TP; dense-MLP layers only (expert MLPs carry none)."""
        h, q, kv, ffn = self.hidden, self.q_dim, self.kv_dim, self.ffn
        dense_layers = self.layers - self.moe_layers
        every = LORA_ALL_LINEAR in targets
        # (targeted, layers, in, out, row-parallel)
        modules = (
            (every or {"q_proj", "k_proj", "v_proj"} & set(targets), self.layers, h, q + 2 * kv, False),
            (every or "o_proj" in targets, self.layers, q, h, True),
            (every or {"gate_proj", "up_proj"} & set(targets), dense_layers, h, 2 * ffn, False),
            (every or "down_proj" in targets, dense_layers, ffn, h, True),
        )
        count = 0
        for targeted, layers, fan_in, fan_out, row in modules:
            if targeted:
                count += layers * (fan_in // tp + fan_out if row else fan_in + fan_out // tp)
        return rank * count


def shape_from_config(cfg: dict[str, Any], key: str = "config.json") -> ModelShape:
    """A ``ModelShape`` from the dict of a ``config.json``; ConfigError for an unknown family."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILY_TRAITS:
        raise ConfigError(
            key, f"model_type {model_type!r} has no size formula; known: {', '.join(sorted(FAMILY_TRAITS))}"
        )
    bias, qk_norm, moe = FAMILY_TRAITS[model_type]
    try:
        hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        shape = dict(
            model_type=model_type,
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            ffn=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", bias)),
            qk_norm=qk_norm,
        )
        # Published Qwen3-MoE files say num_experts; transformers 5 writes num_local_experts.
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if moe == "qwen3_moe" and experts:
            step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
            moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
            shape |= dict(experts=experts, moe_ffn=cfg["moe_intermediate_size"])
            shape |= dict(top_k=cfg["num_experts_per_tok"], moe_layers=moe_layers)
        elif moe == "mixtral":
            shape |= dict(experts=cfg["num_local_experts"], moe_ffn=cfg["intermediate_size"])
            shape |= dict(top_k=cfg["num_experts_per_tok"], moe_layers=layers)
        elif moe == "deepseek_v3":
            shape |= _deepseek_v3(cfg, layers)
    except KeyError as exc:
        raise ConfigError(key, f"config.json has no {exc.args[0]!r} (needed for the memory plan)") from None
    return ModelShape(**shape)


def _deepseek_v3(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """MLA and MoE sizes of a DeepSeek-V3 config.json (the first ``first_k_dense_replace`` layers
    dense, every other layer routed + shared experts)."""
    moe_ffn = cfg["moe_intermediate_size"]
    return dict(
        head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        kv_heads=cfg["num_attention_heads"],
        mla=True,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        experts=cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        moe_ffn=moe_ffn,
        shared_ffn=moe_ffn * (cfg.get("n_shared_experts") or 0),
        moe_layers=max(layers - (cfg.get("first_k_dense_replace") or 0), 0),
    )


def load_model_shape(model_dir: str, key: str = "model_args.model_name_or_path") -> ModelShape:
    """Read ``model_dir/config.json`` (only that file) into a ``ModelShape``."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    return shape_from_config(cfg, key)
