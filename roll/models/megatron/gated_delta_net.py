"""Gated DeltaNet (linear-attention) layers for megatron-core GPT models, as Qwen3-Next has them.

The module is megatron-core 0.16.1's ``GatedDeltaNet`` (its parameters, their names, shapes, TP
sharding and dist-checkpoint layout: ``in_proj`` [q; k; v; z; beta; alpha] per TP rank,
``conv1d`` [q; k; v], ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``) with roll's forward:

- megatron's forward needs flash-linear-attention (fla) and refuses packed rows; roll's runs the
  gated delta rule through ``roll.models.megatron.gated_delta_rule`` (fla's Triton kernel on a GPU
  where fla is installed, plain torch otherwise, e.g. on CPU) and takes packed rows (``thd``):
  the convolution and the recurrent state restart at every sequence;
- the output norm (``GatedRMSNorm``) has a plain weight, as transformers' Qwen3-Next (whose other
  norms are zero-centred), and its gradient is summed over TP in backward (each rank normalises
  its own heads), which megatron's ``finalize_model_grads`` does not do for it;
- context parallelism: the conv and the delta rule run over whole sequences on ``1 / CP`` of the
  heads, between two all-to-alls over the CP group (``roll.models.megatron.gdn_context_parallel``);
- on machines without CUDA, megatron's CUDA placements go to the default device.

Key-value caching (megatron_infer's generation) is not built: the forward refuses an inference
context, and ``kv_generate`` refuses such a model before it starts.

>>> spec = linear_attention_layer(layer_spec)        # the same layer with Gated DeltaNet attention
>>> linear_attention_pattern(config)                 # per layer: 1 Gated DeltaNet, 0 full attention
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from roll.models.megatron.gated_delta_rule import causal_conv, gated_delta_rule
from roll.models.megatron.gdn_context_parallel import HeadExchange

VARIANT = "gated_delta_net"


def linear_attention_pattern(config: Any) -> list[int]:
    """Per layer of ``config`` (a TransformerConfig): 1 for a Gated DeltaNet layer, 0 otherwise
    (megatron's ``linear_attention_freq``: a list, or N for N-1 linear layers then a full one)."""
    if config.experimental_attention_variant != VARIANT:
        return [0] * config.num_layers
    freq = config.linear_attention_freq
    if isinstance(freq, list):
        return [int(bool(x)) for x in freq]
    return [int((i + 1) % freq != 0) for i in range(config.num_layers)]


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over each value head times SiLU of the output gate (transformers'
    ``Qwen3NextRMSNormGated``): fp32 normalisation cast back, then the plain weight, then the gate
    in fp32. The weight's gradient is summed over the TP group in backward."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.eps = eps
        self.tp_group: Any = None  # set by the owning layer

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (weight * normed * F.silu(gate.float())).to(x.dtype)


def _module_class() -> type:
    from megatron.core.ssm import gated_delta_net as mgdn

    class TorchGatedDeltaNet(mgdn.GatedDeltaNet):
        """megatron's GatedDeltaNet with roll's forward (see the module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            with ExitStack() as stack:
                if not mgdn.HAVE_FLA:  # megatron refuses to build without fla; roll's forward needs none
                    stack.enter_context(mock.patch.object(mgdn, "HAVE_FLA", True))
                if not torch.cuda.is_available():
                    stack.enter_context(
                        mock.patch.object(torch.cuda, "current_device", torch.get_default_device)
                    )
                super().__init__(*args, **kwargs)
            for param in (self.conv1d.weight, self.dt_bias, self.A_log):
                param.partition_dim, param.partition_stride = 0, 1
            self.out_norm.tp_group = self.pg_collection.tp

        def forward(
            self,
            hidden_states: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            key_value_states: Any = None,
            inference_context: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
            sequence_len_offset: Any = None,
            *,
            inference_params: Any = None,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            """[s, b, hidden] (this rank's sequence shard under SP) -> (output, bias) like megatron's."""
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("Gated DeltaNet layers keep no key-value cache (no generation)")
            cu_seqlens = None
            if packed_seq_params is not None:
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"packed rows must be 'thd', got {packed_seq_params.qkv_format!r}")
                cu_seqlens = packed_seq_params.cu_seqlens_q
            mixed, _ = self.in_proj(hidden_states)  # [s, b, in_proj] (s: this CP rank's tokens)
            exchange = None
            cp = self.pg_collection.cp
            if cp is not None and cp.size() > 1:  # gdn_context_parallel: all tokens, 1/CP of the heads
                exchange = HeadExchange(cp, cu_seqlens, mixed.shape[0])
                mixed = exchange.to_heads(mixed, self._sections())
            core, gate = self._mix(mixed.transpose(0, 1), cu_seqlens, exchange)
            out = self.out_norm(core, gate).flatten(2).transpose(0, 1)
            if exchange is not None:
                out = exchange.to_sequence(out)
            return self.out_proj(out.contiguous())

        def _sections(self) -> list[int]:
            """Widths of in_proj's q, k, v, z, beta, alpha on this TP rank."""
            tp, heads = self.tp_size, self.num_v_heads_local_tp
            qk, v = self.qk_dim // tp, self.v_dim // tp
            return [qk, qk, v, v, heads, heads]

        def _mix(
            self, mixed: torch.Tensor, cu_seqlens: torch.Tensor | None, exchange: HeadExchange | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """[b, s, in_proj of this rank's heads] -> (delta-rule output, output gate), [b, s, hv, dv].
            Under CP (``exchange``) ``mixed`` holds the CP rank's block of the heads, which read the
            same block of the conv weight, ``dt_bias`` and ``A_log``."""
            sections = self._sections()
            conv, dt_bias, a_log = self.conv1d.weight, self.dt_bias, self.A_log
            if exchange is not None:
                conv = exchange.block(conv, sections[:3])
                dt_bias, a_log = exchange.block(dt_bias), exchange.block(a_log)
                sections = [width // exchange.size for width in sections]
            q_w, k_w, v_w, z_w, b_w, a_w = sections
            qkv, gate, beta, alpha = torch.split(mixed, [q_w + k_w + v_w, z_w, b_w, a_w], dim=-1)
            qkv = causal_conv(qkv.transpose(1, 2), conv, cu_seqlens).transpose(1, 2)
            q, k, v = torch.split(qkv, [q_w, k_w, v_w], dim=-1)
            q, k = (t.unflatten(-1, (-1, self.key_head_dim)) for t in (q, k))
            v = v.unflatten(-1, (-1, self.value_head_dim))
            repeat = self.num_value_heads // self.num_key_heads
            if repeat > 1:  # value head j reads key head j // repeat
                q, k = (t.repeat_interleave(repeat, dim=2) for t in (q, k))
            g = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias)
            core = gated_delta_rule(q, k, v, g, beta.sigmoid(), cu_seqlens)
            return core, gate.unflatten(-1, (-1, self.value_head_dim))

    return TorchGatedDeltaNet


_CLASS: list[type] = []


def module_class() -> type:
    """``TorchGatedDeltaNet`` (built once, on first use: it subclasses a megatron class)."""
    if not _CLASS:
        _CLASS.append(_module_class())
    return _CLASS[0]


def linear_attention_layer(layer_spec: Any) -> Any:
    """A copy of ``layer_spec`` (a TransformerLayer ModuleSpec) whose ``self_attention`` is Gated
    DeltaNet with megatron's tensor-parallel linears (the layer's norms and MLP unchanged)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    spec.submodules.self_attention = ModuleSpec(
        module=module_class(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear
        ),
    )
    return spec
