"""Hugging Face <-> megatron-core weight tables: which HF tensors make which Megatron parameter.

Each table row (``WeightSpec``) names one megatron-core parameter under a transformer layer (local
spec naming), the HF tensors it is built from (under ``model.layers.{layer}.``) and the *layout*
that says how the HF tensors are fused and split across tensor-parallel (TP) ranks:

==============  =======  ==========================================================================
layout          TP dim   Megatron parameter of TP rank r
==============  =======  ==========================================================================
``replicated``  --       the HF tensor (norms, router)
``column``      0        rows r*n/tp ... (r+1)*n/tp of the HF tensor
``row``         1        columns r*n/tp ... of the HF tensor
``vocab``       0        rows of the vocab padded to ``padded_vocab_size``; padding rows are zero
``qkv``         0        the rank's query groups, each as [its q heads, k, v] (megatron's linear_qkv)
``gate_up``     0        [gate rows of rank r; up rows of rank r] (megatron's swiglu linear_fc1)
``qkv_gated``   0        ``qkv`` with each group's output gates after its q heads (Qwen3-Next)
``gdn_in``      0        Gated DeltaNet's in_proj [q; k; v; z; beta; alpha] of rank r's heads
``gdn_conv``    0        Gated DeltaNet's conv1d [q; k; v] of rank r's heads (three blocks of HF rows)
``gdn_in_split`` 0       ``gdn_in`` from Qwen3.5's four projections (in_proj_qkv in three blocks)
==============  =======  ==========================================================================

The last four are Qwen3-Next's and Qwen3.5's (``hybrid_layouts`` has their row orders).

The fused layouts split every HF tensor into ``tp`` equal contiguous pieces along the TP dim
(``gdn_conv``: each of its three sections), so a rank reads only its pieces (``read_ranges``) and
fuses them (``fuse``); export unfuses each rank's shard into pieces, concatenates the pieces of
all ranks and joins them into HF tensors (``unfuse``, ``join``). Expert parameters use the
expert-TP group. The tables name each expert's tensors; a checkpoint that stores them stacked and
transposed (Qwen3-VL-MoE, ``ConversionInfo.stacked``) is read and written through
``stacked_experts``.

Megatron names differ by backend; ``MegatronNaming.detect`` reads them off the built model:
TransformerEngine fuses the layer norms into the next linear (``linear_qkv.layer_norm_weight``) and
TE's grouped experts name their weights ``experts.linear_fc1.weight{i}``.

>>> weights = chunk_weights(model, info, MegatronNaming.detect(n for n, _ in model.named_parameters()))
>>> weights[0].mcore, weights[0].hf, weights[0].layout
('embedding.word_embeddings.weight', ('model.embed_tokens.weight',), 'vocab')
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from roll.models.megatron import hybrid_layouts as hybrid
from roll.models.megatron.hybrid_layouts import LinearHeads
from roll.models.megatron.stacked_experts import Stack, StackedNames

REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP = "replicated", "column", "row", "vocab", "qkv", "gate_up"
QKV_GATED, GDN_IN, GDN_CONV = "qkv_gated", "gdn_in", "gdn_conv"
GDN_IN_SPLIT = "gdn_in_split"
# Dim of the HF tensors (and of the Megatron parameter) split across TP ranks.
TP_DIM: dict[str, int | None] = {
    REPLICATED: None,
    COLUMN: 0,
    ROW: 1,
    VOCAB: 0,
    QKV: 0,
    GATE_UP: 0,
    QKV_GATED: 0,
    GDN_IN: 0,
    GDN_CONV: 0,
    GDN_IN_SPLIT: 0,
}

HF_LAYER = "model.layers.{layer}."
# Buffers (not parameters) that are HF weights: the MoE router's score-correction bias.
HF_BUFFER_SUFFIXES = (".mlp.router.expert_bias",)
MCORE_LAYER = "decoder.layers.{layer}."
# Megatron names of one local expert's weights, by naming scheme.
SEQUENTIAL_EXPERT = "mlp.experts.local_experts.{expert}.{linear}.weight"
GROUPED_EXPERT = "mlp.experts.{linear}.weight{expert}"
_GROUPED_EXPERT_RE = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")
_LEGACY_GROUPED_RE = re.compile(r"\.mlp\.experts\.weight[12]$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightSpec:
    """One row of a table. ``mcore`` is relative to a layer (or the model for global weights); for
    expert weights it is the linear's name ("linear_fc1") and ``hf`` carries ``{expert}``."""

    mcore: str
    hf: tuple[str, ...]
    layout: str
    # The Megatron name when TransformerEngine fuses this norm into the following linear.
    fused_norm_name: str | None = None
    expert: bool = False


@dataclass(frozen=True)
class LayerTables:
    """The rows of one transformer layer: ``dense`` (dense MLP) and ``moe`` (MoE MLP) layers;
    ``linear``: the tables of the layers whose attention is linear (Qwen3-Next's Gated DeltaNet)."""

    dense: tuple[WeightSpec, ...] | None
    moe: tuple[WeightSpec, ...] | None = None
    linear: LayerTables | None = None


@dataclass(frozen=True)
class HeadLayout:
    """What the ``qkv`` layout needs: dims per head and query heads per key/value group."""

    head_dim: int
    heads_per_group: int
    # Gated DeltaNet heads (``gdn_in`` / ``gdn_conv``), for models with such layers.
    linear: LinearHeads | None = None


@dataclass(frozen=True)
class ConversionInfo:
    """Everything about the HF model the conversion needs; attached to each built GPTModel chunk as
    ``roll_hf_info`` by ``model_builder.build_model_chunks``."""

    model_type: str
    tables: LayerTables
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    num_layers: int
    num_experts: int
    moe_layers: tuple[bool, ...]
    heads: HeadLayout
    # Layers stored after the decoder layers that roll does not build (DeepSeek-V3's
    # multi-token-prediction layers): their HF tensors are skipped on load.
    extra_layers: int = 0
    # Per layer: whether its attention is linear (``tables.linear``); empty: none is.
    linear_layers: tuple[bool, ...] = ()
    # HF tensors of other modules roll does not build (Qwen3-Next's ``mtp.``), skipped on load.
    skipped_prefixes: tuple[str, ...] = ()
    # A vision-language model's vision tower tensors (``visual.*``): held whole on every rank of the
    # first pipeline stage under the same name as in the HF checkpoint (replicated).
    vision_names: tuple[str, ...] = ()
    # A vision-language model's (roll's name prefix, HF name prefix) pairs (``module_name``).
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    # Checkpoints storing each layer's experts stacked and transposed (Qwen3-VL-MoE): the tables'
    # per-expert tensors are slices of those (``stacked_experts``); None: stored per expert.
    stacked: StackedNames | None = None

    def skipped(self, hf_name: str) -> bool:
        """Whether ``hf_name`` belongs to one of the ``extra_layers`` or ``skipped_prefixes``."""
        if self.skipped_prefixes and hf_name.startswith(self.skipped_prefixes):
            return True
        match = _HF_LAYER_RE.match(hf_name)
        return match is not None and self.num_layers <= int(match[1]) < self.num_layers + self.extra_layers


@dataclass(frozen=True)
class MegatronNaming:
    """Which of megatron-core's naming schemes a built model uses (read from its parameter names)."""

    fused_norms: bool = False
    grouped_experts: bool = False

    @classmethod
    def detect(cls, param_names: Iterable[str]) -> MegatronNaming:
        names = list(param_names)
        if any(_LEGACY_GROUPED_RE.search(n) for n in names):
            raise ValueError(
                "the legacy GroupedMLP (experts.weight1/weight2, local spec with moe_grouped_gemm) is not "
                "supported by the HF conversion; use the plain-torch or TransformerEngine layer spec"
            )
        return cls(
            fused_norms=any(n.endswith(".self_attention.linear_qkv.layer_norm_weight") for n in names),
            grouped_experts=any(_GROUPED_EXPERT_RE.search(n) for n in names),
        )


@dataclass(frozen=True)
class BoundWeight:
    """A table row bound to one parameter of one model chunk: full Megatron and HF names."""

    mcore: str
    hf: tuple[str, ...]
    layout: str
    expert: bool = False
    # False for the tied output layer of the last stage: a copy of the embedding, not exported.
    export: bool = True


# ------------------------------------------------------------------------------------------ tables
def _norm(mcore: str, hf: str, fused_name: str | None = None) -> WeightSpec:
    return WeightSpec(mcore, (hf,), REPLICATED, fused_norm_name=fused_name)


_ATTENTION = (
    _norm("input_layernorm.weight", "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    WeightSpec(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    WeightSpec("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
)
_QKV_BIAS = (
    WeightSpec(
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        QKV,
    ),
)
_QK_NORM = (
    _norm("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    _norm("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_DENSE_MLP = (
    _norm("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    WeightSpec("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    WeightSpec("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW),
)


def _moe_mlp(block: str, gate: str, up: str, down: str) -> tuple[WeightSpec, ...]:
    """MoE rows; ``block`` is the HF module of the MoE layer and gate/up/down its expert linears."""
    expert = f"{block}.experts.{{expert}}."
    return (
        # MoE layers keep a separate pre-MLP norm even with TransformerEngine.
        _norm("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        WeightSpec("mlp.router.weight", (f"{block}.gate.weight",), REPLICATED),
        WeightSpec("linear_fc1", (f"{expert}{gate}.weight", f"{expert}{up}.weight"), GATE_UP, expert=True),
        WeightSpec("linear_fc2", (f"{expert}{down}.weight",), ROW, expert=True),
    )


LLAMA = LayerTables(dense=_ATTENTION + _DENSE_MLP)
QWEN2 = LayerTables(dense=_ATTENTION + _QKV_BIAS + _DENSE_MLP)
QWEN3 = LayerTables(dense=_ATTENTION + _QK_NORM + _DENSE_MLP)
QWEN3_MOE = LayerTables(
    dense=_ATTENTION + _QK_NORM + _DENSE_MLP,
    moe=_ATTENTION + _QK_NORM + _moe_mlp("mlp", "gate_proj", "up_proj", "down_proj"),
)
# Qwen3-VL-MoE's checkpoints: each layer's experts stacked and transposed (the tables are QWEN3_MOE's).
QWEN3_VL_MOE_STACKS = (
    Stack("gate_up_proj", ("gate_proj", "up_proj")),
    Stack("down_proj", ("down_proj",), out_is_hidden=True),
)
# Mixtral's experts: w1 = gate, w3 = up, w2 = down.
MIXTRAL = LayerTables(dense=None, moe=_ATTENTION + _moe_mlp("block_sparse_moe", "w1", "w3", "w2"))

# DeepSeek-V3: multi-latent attention (the down projections whole on every TP rank, see
# layer_spec.mla_down_projections; the up projections column-parallel by heads), shared experts,
# the router's score-correction bias.
_MLA_Q_LORA = (
    WeightSpec("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), REPLICATED),
    _norm("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    WeightSpec("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), COLUMN),
)
_MLA_Q = (WeightSpec("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), COLUMN),)
_MLA_KV = (
    WeightSpec(
        "self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), REPLICATED
    ),
    _norm("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    WeightSpec("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), COLUMN),
    WeightSpec("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
)
_DEEPSEEK_MOE = _moe_mlp("mlp", "gate_proj", "up_proj", "down_proj") + (
    WeightSpec("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), REPLICATED),
    WeightSpec(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        GATE_UP,
    ),
    WeightSpec("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), ROW),
)
_INPUT_NORM = (_norm("input_layernorm.weight", "input_layernorm.weight"),)


def _deepseek(q: tuple[WeightSpec, ...]) -> LayerTables:
    attention = _INPUT_NORM + q + _MLA_KV
    return LayerTables(dense=attention + _DENSE_MLP, moe=attention + _DEEPSEEK_MOE)


DEEPSEEK_V3 = _deepseek(_MLA_Q_LORA)
DEEPSEEK_V3_NO_Q_LORA = _deepseek(_MLA_Q)

# Qwen3-Next: gated full attention (q_proj holds each head's query and output gate) with q/k norms,
# Gated DeltaNet linear attention, MoE with a shared expert scaled by a sigmoid gate.
_GATED_ATTENTION = (
    *_INPUT_NORM,
    WeightSpec(
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV_GATED,
    ),
    WeightSpec("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW),
    *_QK_NORM,
)
_GATED_DELTA_NET = (
    *_INPUT_NORM,
    WeightSpec(
        "self_attention.in_proj.weight",
        ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"),
        GDN_IN,
    ),
    WeightSpec("self_attention.conv1d.weight", ("linear_attn.conv1d.weight",), GDN_CONV),
    WeightSpec("self_attention.dt_bias", ("linear_attn.dt_bias",), COLUMN),
    WeightSpec("self_attention.A_log", ("linear_attn.A_log",), COLUMN),
    _norm("self_attention.out_norm.weight", "linear_attn.norm.weight"),
    WeightSpec("self_attention.out_proj.weight", ("linear_attn.out_proj.weight",), ROW),
)
_QWEN3_NEXT_MOE = _moe_mlp("mlp", "gate_proj", "up_proj", "down_proj") + (
    WeightSpec(
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        GATE_UP,
    ),
    WeightSpec("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), ROW),
    WeightSpec("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), REPLICATED),
)
QWEN3_NEXT = LayerTables(
    dense=_GATED_ATTENTION + _DENSE_MLP,
    moe=_GATED_ATTENTION + _QWEN3_NEXT_MOE,
    linear=LayerTables(dense=_GATED_DELTA_NET + _DENSE_MLP, moe=_GATED_DELTA_NET + _QWEN3_NEXT_MOE),
)

# Qwen3.5 (``qwen3_5_text`` / ``qwen3_5_moe_text``): Qwen3-Next's layers with the Gated DeltaNet
# input projection stored as four tensors (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each in
# head order, no per-key-head interleave); the dense model has a plain MLP in every layer, the MoE
# model routed experts and the gated shared expert in every layer.
_GATED_DELTA_NET_SPLIT = (
    *_INPUT_NORM,
    WeightSpec(
        "self_attention.in_proj.weight",
        tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
        GDN_IN_SPLIT,
    ),
    *_GATED_DELTA_NET[2:],
)
QWEN3_5 = LayerTables(
    dense=_GATED_ATTENTION + _DENSE_MLP, linear=LayerTables(dense=_GATED_DELTA_NET_SPLIT + _DENSE_MLP)
)
QWEN3_5_MOE = LayerTables(
    dense=None,
    moe=_GATED_ATTENTION + _QWEN3_NEXT_MOE,
    linear=LayerTables(dense=None, moe=_GATED_DELTA_NET_SPLIT + _QWEN3_NEXT_MOE),
)

EMBEDDING = WeightSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)
FINAL_NORM = WeightSpec("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED)
OUTPUT = WeightSpec("output_layer.weight", ("lm_head.weight",), VOCAB)


# ------------------------------------------------------------------------------------- binding
def layer_table(info: ConversionInfo, layer: int) -> tuple[WeightSpec, ...]:
    """The rows of global layer ``layer`` (0-based)."""
    linear = bool(info.linear_layers) and info.linear_layers[layer]
    tables = info.tables.linear if linear else info.tables
    table = None if tables is None else tables.moe if info.moe_layers[layer] else tables.dense
    if table is None:
        kind = ("linear-attention " if linear else "") + ("MoE" if info.moe_layers[layer] else "dense")
        raise ValueError(f"model_type {info.model_type!r} has no {kind} layers, but layer {layer} is {kind}")
    return table


def _bind(
    spec: WeightSpec, naming: MegatronNaming, local: int, layer: int, experts: list[int]
) -> list[BoundWeight]:
    mcore_prefix, hf_prefix = MCORE_LAYER.format(layer=local), HF_LAYER.format(layer=layer)
    if not spec.expert:
        name = spec.fused_norm_name if naming.fused_norms and spec.fused_norm_name else spec.mcore
        hf = tuple(hf_prefix + h for h in spec.hf)
        return [BoundWeight(mcore_prefix + name, hf, spec.layout)]
    template = GROUPED_EXPERT if naming.grouped_experts else SEQUENTIAL_EXPERT
    return [
        BoundWeight(
            mcore_prefix + template.format(expert=local_expert, linear=spec.mcore),
            tuple(hf_prefix + h.format(expert=global_expert) for h in spec.hf),
            spec.layout,
            expert=True,
        )
        for local_expert, global_expert in enumerate(experts)
    ]


def layer_weights(
    info: ConversionInfo, naming: MegatronNaming, layer: int, local: int, experts: list[int]
) -> list[BoundWeight]:
    """The weights of global layer ``layer``, held as ``decoder.layers.{local}`` of a chunk whose MoE
    layers hold the global experts ``experts`` (local expert i is ``experts[i]``)."""
    return [w for spec in layer_table(info, layer) for w in _bind(spec, naming, local, layer, experts)]


def chunk_weights(model, info: ConversionInfo, naming: MegatronNaming) -> list[BoundWeight]:
    """Every parameter of one GPTModel chunk (unwrapped), bound to its HF tensors, in a fixed
    order that is the same on every rank of a TP / expert-TP group."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    bound: list[BoundWeight] = []
    if model.pre_process:
        bound.append(BoundWeight(EMBEDDING.mcore, EMBEDDING.hf, VOCAB))
        bound.extend(BoundWeight(name, (name,), REPLICATED) for name in info.vision_names)
    offset = get_transformer_layer_offset(model.config, vp_stage=model.vp_stage)
    for local, layer_module in enumerate(model.decoder.layers):
        layer = offset + local
        experts = list(getattr(layer_module.mlp, "local_expert_indices", []))
        bound.extend(layer_weights(info, naming, layer, local, experts))
    if model.post_process:
        bound.append(BoundWeight(FINAL_NORM.mcore, FINAL_NORM.hf, REPLICATED))
        if not info.tie_word_embeddings:
            bound.append(BoundWeight(OUTPUT.mcore, OUTPUT.hf, VOCAB))
        elif not model.pre_process:
            # Tied weights on a stage without the embedding: megatron keeps a synced copy here.
            bound.append(BoundWeight(OUTPUT.mcore, EMBEDDING.hf, VOCAB, export=False))
    if info.vision_names:
        return [replace(w, hf=tuple(module_name(info, h) for h in w.hf)) for w in bound]
    return bound


# A vision-language model's HF names: its checkpoints store the language model under "model." and the
# vision tower under "visual."; transformers 5's modules (roll's wire, vLLM's loader, HF exports) are
# "model.language_model." and "model.visual.". The tables and the megatron model ("visual.") use
# the checkpoint's; the HF side of a vision-language model's bound weights uses the modules'
# (``ConversionInfo.hf_prefixes``; Qwen3-Omni's put everything under "thinker.", its checkpoint's).
VL_LANGUAGE, VL_VISION = "model.language_model.", "model.visual."
VL_PREFIXES = (("visual.", VL_VISION), ("model.", VL_LANGUAGE))


def module_name(info: ConversionInfo | None, name: str) -> str:
    """``name`` (a checkpoint's or roll's table name, or already an HF one) as the model's HF name
    (``info.hf_prefixes``); unchanged for a text model."""
    if info is None or not info.hf_prefixes or name.startswith(tuple(h for _, h in info.hf_prefixes)):
        return name
    for ours, theirs in info.hf_prefixes:
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name


def expected_hf_names(info: ConversionInfo) -> set[str]:
    """The HF tensor names of the whole model (every layer, every expert)."""
    names = set(EMBEDDING.hf) | set(FINAL_NORM.hf) | set(info.vision_names)
    if not info.tie_word_embeddings:
        names |= set(OUTPUT.hf)
    experts = list(range(info.num_experts))
    for layer in range(info.num_layers):
        for weight in layer_weights(info, MegatronNaming(), layer, layer, experts):
            names.update(weight.hf)
    return {module_name(info, name) for name in names}


# ---------------------------------------------------------------------------------- layouts
def shard_range(layout: str, length: int, tp_size: int, tp_rank: int, padded_length: int) -> tuple[int, int]:
    """[start, stop) of TP rank ``tp_rank`` along the TP dim of an HF tensor of ``length``.

    For ``vocab`` the split is of ``padded_length`` and the range is clipped to the real rows.
    """
    if layout == VOCAB:
        per_rank = padded_length // tp_size
        start = min(tp_rank * per_rank, length)
        return start, min(start + per_rank, length)
    if length % tp_size:
        raise ValueError(f"dim of size {length} does not split into {tp_size} tensor-parallel shards")
    per_rank = length // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def read_ranges(
    layout: str, length: int, tp_size: int, tp_rank: int, padded_length: int, heads: HeadLayout
) -> list[tuple[int, int]]:
    """The [start, stop) blocks along the TP dim of an HF tensor of ``length`` that TP rank
    ``tp_rank`` reads, one piece each (one block but for ``gdn_conv``)."""
    if layout == GDN_CONV:
        return hybrid.conv_ranges(length, _linear(heads), tp_size, tp_rank)
    if layout == GDN_IN_SPLIT and (
        ranges := hybrid.split_in_ranges(length, _linear(heads), tp_size, tp_rank)
    ):
        return ranges
    return [shard_range(layout, length, tp_size, tp_rank, padded_length)]


def _linear(heads: HeadLayout) -> LinearHeads:
    if heads.linear is None:
        raise ValueError("a Gated DeltaNet layout on a model without linear-attention heads")
    return heads.linear


def fuse(layout: str, pieces: list[torch.Tensor], heads: HeadLayout) -> torch.Tensor:
    """Megatron parameter (of one TP rank) from that rank's pieces of the HF tensors."""
    if layout == QKV_GATED:
        return hybrid.fuse_qkv_gated(pieces, heads.head_dim, heads.heads_per_group)
    if layout == GDN_IN:
        return hybrid.fuse_gdn_in(pieces, _linear(heads))
    if layout in (GDN_CONV, GDN_IN_SPLIT):
        return torch.cat(pieces, dim=0)
    if layout == QKV:
        q, k, v = pieces
        groups, rest = k.shape[0] // heads.head_dim, q.shape[1:]
        parts = (
            q.reshape(groups, heads.heads_per_group * heads.head_dim, *rest),
            k.reshape(groups, heads.head_dim, *rest),
            v.reshape(groups, heads.head_dim, *rest),
        )
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    if layout == GATE_UP:
        return torch.cat(pieces, dim=0)
    (piece,) = pieces
    return piece


def unfuse(layout: str, shard: torch.Tensor, heads: HeadLayout) -> list[torch.Tensor]:
    """Inverse of ``fuse``: one TP rank's pieces of the HF tensors from its Megatron shard (for
    ``gdn_conv`` the three blocks of its one HF tensor: ``join`` puts them together)."""
    if layout == QKV_GATED:
        return hybrid.unfuse_qkv_gated(shard, heads.head_dim, heads.heads_per_group)
    if layout == GDN_IN:
        return hybrid.unfuse_gdn_in(shard, _linear(heads))
    if layout == GDN_CONV:
        return hybrid.unfuse_gdn_conv(shard, _linear(heads))
    if layout == GDN_IN_SPLIT:
        return hybrid.unfuse_gdn_in_split(shard, _linear(heads))
    if layout == QKV:
        q_rows = heads.heads_per_group * heads.head_dim
        per_group, rest = q_rows + 2 * heads.head_dim, shard.shape[1:]
        grouped = shard.reshape(shard.shape[0] // per_group, per_group, *rest)
        q, k, v = grouped.split([q_rows, heads.head_dim, heads.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if layout == GATE_UP:
        return list(torch.chunk(shard, 2, dim=0))
    return [shard]


def join(layout: str, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors from their pieces (each concatenated over the TP ranks already)."""
    if layout == GDN_CONV:
        return [torch.cat(pieces, dim=0)]
    if layout == GDN_IN_SPLIT:
        return hybrid.join_gdn_in_split(pieces)
    return pieces
