"""Transformer layer specs for megatron-core GPT models, with or without TransformerEngine.

With TransformerEngine importable, ``build_layer_spec`` returns megatron-core's TE spec. Without it
(the GPU machines here have no TE, apex or flash-attn) it returns a plain-torch spec built from
megatron-core's *local* spec, so every module and parameter keeps the local spec's name (the HF
weight tables in ``weight_mapping.py`` rely on that), with these modules swapped in:

- ``TorchNorm``: RMSNorm/LayerNorm whose weight is marked ``sequence_parallel`` so that
  ``finalize_model_grads`` all-reduces its gradient across TP (megatron's ``WrappedTorchNorm``
  refuses ``sequence_parallel=True``);
- ``SDPAttention``: core attention on ``F.scaled_dot_product_attention`` (causal, GQA, megatron's
  ``[s, b, heads, dim]`` layout and boolean "True = masked" attention masks), and on packed rows
  (``thd``) attention confined to each sequence by ``packing_attention``
  (``roll.models.packed_attention``), with context parallelism over a zig-zag split and a K/V
  all-gather (``roll.models.context_parallel``);
- ``TorchTopKRouter``: megatron's top-k router with the gating GEMM in plain torch (0.16.1 calls
  an undefined ``te_general_gemm`` when TE is absent);
- ``TorchGroupedMLP`` (``moe_grouped_gemm: true``): the local ``SequentialMLP`` parameters, computed
  with ``torch._grouped_mm`` where torch offers it, else the per-expert loop.

Options that need TE raise a ``ConfigError`` naming the key (see ``check_te_requirements``).
Multi-latent attention (DeepSeek-V3) and hybrid models (Qwen3-Next, whose Gated DeltaNet layers
``model_builder`` swaps in from ``roll.models.megatron.gated_delta_net``) take the plain-torch
spec even where TE imports.

>>> spec = build_layer_spec(transformer_config, megatron_cfg, num_experts=None)   # one dense layer

``model_builder.build_model_chunks`` uses this as its default ``layer_spec_fn`` and takes the final
norm from the layer's ``input_layernorm`` (so it is ``TorchNorm`` here too).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.context_parallel import cp_packed_attention
from roll.models.packed_attention import packed_attention

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
_PATH = "strategy_args.strategy_config"


# --------------------------------------------------------------------------------------------- norms
class TorchNorm(torch.nn.Module):
    """RMSNorm / LayerNorm in plain torch that works with sequence parallelism.

    Same parameter names as torch.nn.RMSNorm/LayerNorm (``weight``, ``bias``). The normalisation runs
    in fp32 and is cast back before the weight is applied (as HF's Llama/Qwen norms do).
    """

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        super().__init__()
        self.kind = normalization or config.normalization
        if self.kind not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"TorchNorm: normalization must be RMSNorm or LayerNorm, got {self.kind!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma or zero_centered_gamma)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype, device=device))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        for param in self.parameters():
            # With SP each TP rank sees its own sequence shard: finalize_model_grads sums these grads.
            param.sequence_parallel = bool(config.sequence_parallel)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        if self.kind == "RMSNorm" and self.zero_centered_gamma:
            # Qwen3-Next's order: (1 + weight) applied in fp32, then one cast.
            return (F.rms_norm(x.float(), shape, eps=self.eps) * (1 + self.weight.float())).to(x.dtype)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.kind == "RMSNorm":
            return weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
        return F.layer_norm(x.float(), shape, eps=self.eps).to(x.dtype) * weight + self.bias


# ---------------------------------------------------------------------------------------- attention
def _sdpa_mask(attention_mask: torch.Tensor | None, causal: bool, sq: int, sk: int, device) -> Any:
    """(attn_mask, is_causal) for SDPA from megatron's conventions (bool mask, True = masked)."""
    if attention_mask is not None:
        return ~attention_mask.to(torch.bool), False
    if not causal or sq == 1:
        return None, False
    if sq == sk:
        return None, True
    # Fewer queries than keys (chunked prefill): causal aligned to the last key.
    q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
    return torch.arange(sk, device=device)[None, :] <= q_pos, False


class SDPAttention(torch.nn.Module):
    """Core attention on torch SDPA, a drop-in for megatron's ``DotProductAttention``.

    Inputs are megatron's ``query [sq, b, heads, d]``, ``key/value [sk, b, groups, d]`` for this TP
    rank (value may be narrower, as in multi-latent attention); output is ``[sq, b, heads * dv]``. ``attention_mask`` (optional) is boolean and True where
    attention is NOT allowed, broadcastable to ``[b, heads, sq, sk]``; it is used as given (it must
    include causality). Without a mask, causal layers use SDPA's fused causal kernels.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        packing_attention: str = "auto",
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ConfigError(
                f"{_PATH}.transformer_config_kwargs",
                "softmax_type other than 'vanilla' and sliding windows need TransformerEngine",
            )
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self._causal_types = {AttnMaskType.causal, AttnMaskType.padding_causal}
        # Multi-latent attention passes its query/key and value widths (and its own softmax scale).
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.softmax_scale is not None and softmax_scale is None:
            self.softmax_scale = config.softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.packing_attention = packing_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention bias needs TransformerEngine")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b, heads = query.shape[:3]
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        mask, is_causal = _sdpa_mask(
            attention_mask, mask_type in self._causal_types, sq, key.shape[0], query.device
        )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._sdpa(q, k, v, mask, is_causal, dropout)
        else:
            out = self._sdpa(q, k, v, mask, is_causal, 0.0)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])

    def _packed(self, query, key, value, params: Any) -> torch.Tensor:
        """thd layout: ``query [t, heads, d]`` (megatron squeezed the batch dim), attention confined
        to each sequence of ``params.cu_seqlens_q``; output ``[t, heads * d]``."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention: packed sequences must be 'thd', got {params.qkv_format!r}")
        dropout = self.dropout_p if self.training else 0.0
        kind = self.packing_attention

        cp = self.config.context_parallel_size > 1
        if cp and dropout > 0:
            raise ValueError("SDPAttention: no attention dropout under context parallelism")

        def run() -> torch.Tensor:
            if cp:
                from megatron.core import parallel_state as ps

                group = ps.get_context_parallel_group()
                return cp_packed_attention(query, key, value, params.cu_seqlens_q, self.softmax_scale, group)
            return packed_attention(
                query, key, value, params.cu_seqlens_q, self.softmax_scale, kind, dropout, params.max_seqlen_q
            )

        if dropout > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = run()
        else:
            out = run()
        return out.reshape(out.shape[0], -1)

    def _sdpa(self, q, k, v, mask, is_causal: bool, dropout: float) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=gqa,
        )


# ---------------------------------------------------------------------------------------------- MoE
def _router_class() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class TorchTopKRouter(TopKRouter):
        """megatron's TopKRouter with the gating GEMM in plain torch (no ``te_general_gemm``).

        Its ``expert_bias`` buffers (sigmoid routing with expert bias) are created on
        ``torch.cuda.current_device()``; without CUDA they go to the CPU."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                super().__init__(*args, **kwargs)
                return
            from unittest import mock

            with mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")):
                super().__init__(*args, **kwargs)

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            for param in (self.weight, self.bias):
                if param is not None and param.device != input.device:  # built on CPU by megatron
                    param.data = param.data.to(input.device)
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
                self.config.moe_router_dtype, input.dtype
            )
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(input.to(dtype), self.weight.to(dtype), bias)

    return TorchTopKRouter


def grouped_mm_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's grouped GEMM serves this dtype/device (CUDA: bf16 on sm90+; CPU: any float)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    )


def _grouped_mlp_class() -> type:
    from megatron.core.transformer.moe.experts import SequentialMLP

    class TorchGroupedMLP(SequentialMLP):
        """``SequentialMLP`` (same parameters, same checkpoints) computed with one grouped GEMM per
        projection via ``torch._grouped_mm``; falls back to the per-expert loop where torch's grouped
        GEMM does not serve the dtype/device.

        Tensor-parallel experts (expert-TP, which defaults to TP) group too: each rank holds its
        shard of every local expert (``linear_fc1`` by output rows, its gate and up halves each
        split alike; ``linear_fc2`` by input columns), the loop's experts communicate nothing
        themselves (the dispatcher gathers their tokens and reduce-scatters their partial sums),
        so one grouped GEMM over the shards computes what the loop does. The loop runs one
        ``MLP`` forward per local expert: at a decode step (a few tokens per expert) that is most
        of the host's work (64 local experts per layer in the 4-GPU Qwen3-30B-A3B example)."""

        def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
            if not self._can_group(hidden):
                return super().forward(hidden, tokens_per_expert, probs)
            offs = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)
            w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
            w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
            inter = torch._grouped_mm(hidden, w1, offs=offs)
            inter = self._activation(inter)
            inter = (inter * probs.unsqueeze(-1)).to(hidden.dtype)
            return torch._grouped_mm(inter, w2, offs=offs), None

        def _activation(self, x: torch.Tensor) -> torch.Tensor:
            if self.config.gated_linear_unit:
                gate, up = torch.chunk(x, 2, dim=-1)
                return self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
            return self.config.activation_func(x)

        def _can_group(self, hidden: torch.Tensor) -> bool:
            cfg = self.config
            return (
                self.num_local_experts > 1
                and not cfg.add_bias_linear
                and not cfg.moe_apply_probs_on_input
                and not (cfg.fp8 or cfg.fp4)
                and cfg.activation_func_clamp_value is None
                and grouped_mm_supported(hidden.dtype, hidden.device)
            )

    return TorchGroupedMLP


# -------------------------------------------------------------------------------------- TE options
# (MegatronConfig field or TransformerConfig attribute, predicate on its value, what it is)
_TE_ONLY: tuple[tuple[str, Any, str], ...] = (
    ("fp8", lambda v: bool(v), "fp8 training"),
    ("fp4", lambda v: bool(v), "fp4 training"),
    ("tp_comm_overlap", lambda v: bool(v), "TP communication overlap"),
    ("moe_permute_fusion", lambda v: bool(v), "fused MoE permutation"),
    ("moe_router_fusion", lambda v: bool(v), "fused MoE router top-k"),
    ("cpu_offloading", lambda v: bool(v), "activation CPU offloading"),
    ("window_size", lambda v: v is not None, "sliding-window attention"),
    ("softmax_type", lambda v: v not in (None, "vanilla"), "non-vanilla softmax"),
    ("cuda_graph_impl", lambda v: v == "transformer_engine", "TE CUDA graphs"),
)


def check_te_requirements(megatron_cfg: MegatronConfig, transformer_config: Any = None) -> None:
    """Raise a ConfigError naming the first option that needs TransformerEngine when it is missing."""
    if HAVE_TE:
        return
    for key, needs_te, what in _TE_ONLY:
        if hasattr(megatron_cfg, key):
            value, path = getattr(megatron_cfg, key), f"{_PATH}.{key}"
        elif key in megatron_cfg.transformer_config_kwargs:
            value, path = (
                megatron_cfg.transformer_config_kwargs[key],
                f"{_PATH}.transformer_config_kwargs.{key}",
            )
        elif transformer_config is not None and hasattr(transformer_config, key):
            value, path = getattr(transformer_config, key), f"{_PATH}.transformer_config_kwargs.{key}"
        else:
            continue
        if needs_te(value):
            raise ConfigError(
                path,
                f"{what} needs TransformerEngine, which is not installed "
                f"(got {value!r}); install transformer_engine or turn it off",
            )
    if megatron_cfg.moe_token_dispatcher_type == "flex" and importlib.util.find_spec("deep_ep") is None:
        raise ConfigError(f"{_PATH}.moe_token_dispatcher_type", "'flex' needs DeepEP, which is not installed")


# ---------------------------------------------------------------------------------------- the specs
def _use_te(megatron_cfg: MegatronConfig) -> bool:
    return HAVE_TE and megatron_cfg.attention_backend != "local"


def _plain_torch_layer(
    spec: Any, transformer_config: Any, megatron_cfg: MegatronConfig, num_experts: int | None
):
    """Swap our modules into a copy of megatron's local layer spec (names unchanged)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = TorchNorm
    sub.pre_mlp_layernorm = TorchNorm
    attn = sub.self_attention.submodules
    if megatron_cfg.attention_backend == "sdpa":
        attn.core_attention = ModuleSpec(
            module=SDPAttention, params={"packing_attention": megatron_cfg.packing_attention}
        )
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attn, name, IdentityOp) is not IdentityOp:
            setattr(attn, name, TorchNorm)
    if getattr(transformer_config, "multi_latent_attention", False):
        mla_down_projections(attn)
    if num_experts:
        moe = sub.mlp.submodules
        sub.mlp.submodules = replace(moe, router=_router_class())
        if megatron_cfg.moe_grouped_gemm:
            sub.mlp.submodules.experts.module = _grouped_mlp_class()
    return spec


def mla_without_te() -> None:
    """megatron-core 0.16.1's MLA module sets ``HAVE_TE`` whenever its TE extension module imports
    (it does without TE, with mock classes) and then calls ``isinstance(linear_proj, TELinear)`` on
    the mock, which raises; without TE the flag must be False."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def mla_down_projections(attn: Any) -> None:
    """MLA's q / kv down projections as whole (duplicated) weights on every TP rank, on this rank's
    sequence shard under SP, as TE's MLA spec has them.

    The local spec makes them column-parallel and gathers their output over TP, but then the
    gradient of the shared RoPE key (``k_pos_emb``, used by every head) stays the sum over this
    rank's heads only: TP2 + SP training had a 0.7% wrong gradient norm on a tiny DeepSeek-V3.
    Duplicated, the key is gathered from the sequence shards and its gradient reduce-scattered
    (summed over all heads); the weights' gradients are summed over TP (``sequence_parallel``).
    megatron's MLA accepts exactly megatron's modelopt ``Linear`` for this (a plain
    ``torch.nn.Linear`` that marks its weights so)."""
    from megatron.core.post_training.modelopt.layers import Linear

    attn.linear_q_down_proj = Linear
    attn.linear_kv_down_proj = Linear


def build_layer_spec(transformer_config: Any, megatron_cfg: MegatronConfig, num_experts: int | None) -> Any:
    """One transformer layer's ModuleSpec (MoE when ``num_experts``): TE's spec when TE imports,
    else the plain-torch spec described in the module docstring."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    check_te_requirements(megatron_cfg, transformer_config)
    qk = bool(transformer_config.qk_layernorm)
    mla = bool(getattr(transformer_config, "multi_latent_attention", False))
    hybrid = getattr(transformer_config, "experimental_attention_variant", None) is not None
    # Multi-latent attention always takes the plain-torch spec: the HF tables (weight_mapping's
    # DEEPSEEK_V3) follow the local spec, where TE's MLA spec replicates the down projections.
    # So do hybrid models (Qwen3-Next): TE's spec fuses the norms their tables keep apart and
    # would make every norm zero-centred, Gated DeltaNet's output norm included.
    if _use_te(megatron_cfg) and not mla and not hybrid:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=megatron_cfg.moe_grouped_gemm, qk_layernorm=qk
        )
    if mla and not HAVE_TE:
        mla_without_te()
    local = specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk,
        multi_latent_attention=mla,
        normalization=transformer_config.normalization,
    )
    return _plain_torch_layer(local, transformer_config, megatron_cfg, num_experts)
