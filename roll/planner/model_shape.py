"""Model sizes from a Hugging Face ``config.json`` alone (no weights, no transformers import).

One formula set covers the families roll's strategies load (roll.models.megatron.families): dense
Llama / Qwen2 / Qwen3, the MoE Qwen3-MoE / Mixtral, DeepSeek-V3 (multi-latent attention,
shared experts, first-k dense layers; its multi-token-prediction layers are not counted, as roll
does not build them) and Qwen3-Next (Gated DeltaNet linear-attention layers between gated full
attention layers, a gated shared expert; its ``mtp.*`` module is not counted either). Counts are
those of the HF module tree.

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
from roll.models.megatron.qwen3_next import LINEAR, hybrid_layer_types

# model_type -> (q/k/v bias, RMSNorm per query/key head, MoE field names or None).
FAMILY_TRAITS: dict[str, tuple[bool, bool, str | None]] = {
    "llama": (False, False, None),
    "qwen2": (True, False, None),
    "qwen3": (False, True, None),
    "qwen3_moe": (False, True, "qwen3_moe"),
    "mixtral": (False, False, "mixtral"),
    "deepseek_v3": (False, False, "deepseek_v3"),
    "qwen3_next": (False, True, "qwen3_next"),
}
# transformers' Qwen3NextConfig defaults (the published 80B-A3B values) for keys a file leaves out.
_QWEN3_NEXT_DEFAULTS = {
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
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
    # Qwen3-Next: q_proj also makes a sigmoid output gate per head (``attn_gate``); the shared
    # expert has a sigmoid gate [1, hidden] (``shared_gate``); ``linear_layers`` of the layers are
    # Gated DeltaNet (key / value heads and widths, the causal conv's kernel), the rest full attention.
    attn_gate: bool = False
    shared_gate: bool = False
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def q_out(self) -> int:
        """q_proj's output width: the queries, and their output gates where the model has them."""
        return self.q_dim * (2 if self.attn_gate else 1)

    @property
    def attention_layers(self) -> int:
        """Layers with (full) softmax attention, the ones that keep K and V."""
        return self.layers - self.linear_layers

    @property
    def linear_conv_dim(self) -> int:
        """Gated DeltaNet's q, k and v channels (what its causal conv runs over)."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias, + per-head q/k norms) and the two layer norms."""
        if self.mla:
            return self._mla_params()
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        count = h * self.q_out + 2 * h * kv + q * h + 2 * h
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

    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer's attention and two layer norms: in_proj_qkvz, in_proj_ba, the
        conv, dt_bias and A_log, the gated output norm, out_proj."""
        h, v = self.hidden, self.linear_v_heads * self.linear_v_dim
        in_proj = h * (self.linear_conv_dim + v + 2 * self.linear_v_heads)
        conv = self.linear_conv_dim * self.conv_kernel
        return in_proj + conv + 2 * self.linear_v_heads + self.linear_v_dim + v * h + 2 * h

    def expert_params(self) -> int:
        """Every expert of every MoE layer (gate, up, down)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_ffn

    def layer_dense_params(self) -> int:
        """Every layer's parameters but the experts: attention, norms, dense MLPs, routers."""
        dense_mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.ffn
        dense_mlp += self.moe_layers * 3 * self.hidden * self.shared_ffn
        routers = self.moe_layers * (self.experts + int(self.shared_gate)) * self.hidden
        attention = self.attention_layers * self.attention_params()
        return attention + self.linear_layers * self.linear_attention_params() + dense_mlp + routers

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
        attention = {"q_proj": (h, self.q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        names = [*attention, *mlp] if LORA_ALL_LINEAR in targets else targets
        count = 0
        for name in names:
            if name in attention:
                count += self.attention_layers * sum(attention[name])
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
        other factor 1/TP; dense-MLP layers only (expert MLPs carry none), full-attention layers
        only (Gated DeltaNet layers carry none)."""
        h, q, kv, ffn = self.hidden, self.q_dim, self.kv_dim, self.ffn
        dense_layers = self.layers - self.moe_layers
        every = LORA_ALL_LINEAR in targets
        # (targeted, layers, in, out, row-parallel)
        modules = (
            (
                every or {"q_proj", "k_proj", "v_proj"} & set(targets),
                self.attention_layers,
                h,
                self.q_out + 2 * kv,
                False,
            ),
            (every or "o_proj" in targets, self.attention_layers, q, h, True),
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
            shape |= dict(experts=experts, moe_ffn=cfg["moe_intermediate_size"])
            shape |= dict(top_k=cfg["num_experts_per_tok"], moe_layers=_qwen3_moe_layers(cfg, layers))
        elif moe == "mixtral":
            shape |= dict(experts=cfg["num_local_experts"], moe_ffn=cfg["intermediate_size"])
            shape |= dict(top_k=cfg["num_experts_per_tok"], moe_layers=layers)
        elif moe == "deepseek_v3":
            shape |= _deepseek_v3(cfg, layers)
        elif moe == "qwen3_next":
            shape |= _qwen3_next(cfg, layers)
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


def _qwen3_next(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-Next's hybrid attention (``layer_types``, else every ``full_attention_interval``-th
    layer full) and its MoE layers (Qwen3-MoE's pattern) with a gated shared expert."""
    get = {**_QWEN3_NEXT_DEFAULTS, **cfg}.get
    types = hybrid_layer_types(cfg.get("layer_types"), get("full_attention_interval"), layers)
    return dict(
        attn_gate=True,
        shared_gate=True,
        linear_layers=types.count(LINEAR),
        linear_k_heads=get("linear_num_key_heads"),
        linear_v_heads=get("linear_num_value_heads"),
        linear_k_dim=get("linear_key_head_dim"),
        linear_v_dim=get("linear_value_head_dim"),
        conv_kernel=get("linear_conv_kernel_dim"),
        experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        moe_ffn=cfg["moe_intermediate_size"],
        shared_ffn=cfg["shared_expert_intermediate_size"],
        moe_layers=_qwen3_moe_layers(cfg, layers),
    )


def _qwen3_moe_layers(cfg: dict[str, Any], layers: int) -> int:
    """Qwen3-MoE's (and Qwen3-Next's) MoE layers: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def load_model_shape(model_dir: str, key: str = "model_args.model_name_or_path") -> ModelShape:
    """Read ``model_dir/config.json`` (only that file) into a ``ModelShape``."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    return shape_from_config(cfg, key)
