"""Build megatron-core GPTModel chunks for an HF model under the layout megatron's parallel_state holds.

The caller has initialised ``megatron.core.parallel_state`` (``roll.models.megatron.parallel``).
Weights are not initialised here (``perform_initialization=False``): ``hf_io.load_hf_weights``
fills every parameter from the checkpoint next.

>>> chunks = build_model_chunks(hf_config, megatron_cfg, torch.bfloat16)   # one per VPP stage, TP weights tagged
>>> load_hf_weights(chunks, model_dir)

The layer spec comes from ``roll.models.megatron.layer_spec.build_layer_spec`` (TransformerEngine
or plain torch, same parameter names as megatron-core's local spec); pass ``layer_spec_fn`` to
choose another, e.g. ``local_layer_spec`` (megatron-core's own local spec).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.megatron import families, model_fit
from roll.models.megatron.gated_delta_net import VARIANT as GDN_VARIANT

# (transformer_config, megatron_cfg, num_experts or None) -> one transformer layer's ModuleSpec
LayerSpecFn = Callable[[Any, MegatronConfig, "int | None"], Any]

_DTYPE_FLAGS = {torch.float32: {}, torch.bfloat16: {"bf16": True}, torch.float16: {"fp16": True}}


def _parallel_kwargs(cfg: MegatronConfig, moe: bool) -> dict[str, Any]:
    vpp = cfg.virtual_pipeline_model_parallel_size
    kwargs: dict[str, Any] = {
        "tensor_model_parallel_size": cfg.tensor_model_parallel_size,
        "pipeline_model_parallel_size": cfg.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": vpp if vpp and vpp > 1 else None,
        "context_parallel_size": cfg.context_parallel_size,
        "sequence_parallel": cfg.sequence_parallel,
        "recompute_granularity": cfg.recompute_granularity,
        "recompute_method": cfg.recompute_method,
        "recompute_num_layers": cfg.recompute_num_layers,
        "account_for_embedding_in_pipeline_split": cfg.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": cfg.account_for_loss_in_pipeline_split,
        "num_layers_in_first_pipeline_stage": cfg.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": cfg.num_layers_in_last_pipeline_stage,
        # megatron parses it again (its PipelineParallelLayerLayout) and places each chunk's layers
        # by it: get_num_layers_to_build / get_transformer_layer_offset, which roll's readers use.
        "pipeline_model_parallel_layout": cfg.pipeline_model_parallel_layout,
        # With two pipeline stages the previous and the next stage are the same rank, and the
        # interleaved schedule's steady state sends an activation and a gradient of the same shape
        # to it in one batched call: batched point-to-point ops pair sends and receives per peer in
        # issue order, which swaps the two (micro-batches past the first PP ones trained on
        # gradients as activations). The unbatched path orders them by rank parity.
        "batch_p2p_comm": not (cfg.pipeline_model_parallel_size == 2 and vpp is not None and vpp > 1),
    }
    if moe:
        kwargs.update(
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_layer_recompute=cfg.moe_layer_recompute,
            moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        )
        if cfg.freeze_moe_router:
            # A frozen router keeps its expert bias too (megatron's aux-loss-free bias update).
            kwargs["moe_router_bias_update_rate"] = 0.0
    return kwargs


def transformer_config_from_hf(
    hf_config: Any, megatron_cfg: MegatronConfig, dtype: torch.dtype, path: str = model_fit.STRATEGY_PATH
) -> Any:
    """megatron-core TransformerConfig for ``hf_config`` under ``megatron_cfg``'s layout.

    Model shape and MoE routing come from the family (``families.transformer_kwargs``), parallel
    sizes and recompute from ``megatron_cfg``, and ``megatron_cfg.transformer_config_kwargs`` last.
    Parameters live on the current CUDA device, or on CPU where CUDA is absent.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if dtype not in _DTYPE_FLAGS:
        raise ValueError(f"dtype must be one of {list(_DTYPE_FLAGS)}, got {dtype}")
    model_fit.check_model_fits(hf_config, megatron_cfg, path)
    kwargs = families.transformer_kwargs(hf_config)
    kwargs.update(_parallel_kwargs(megatron_cfg, moe="num_moe_experts" in kwargs))
    kwargs.update(_DTYPE_FLAGS[dtype])
    kwargs.update(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,
    )
    kwargs.update(megatron_cfg.transformer_config_kwargs)
    config_class = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    # megatron-core 0.16.1 asserts CP == 1 for its own Gated DeltaNet, which has none; roll's runs
    # CP (gdn_context_parallel), so the config is built at CP 1 and given the real size after.
    cp = kwargs.get("context_parallel_size", 1)
    gdn_cp = cp > 1 and kwargs.get("experimental_attention_variant") == GDN_VARIANT
    if gdn_cp:
        kwargs["context_parallel_size"] = 1
    try:
        config = config_class(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{path}.transformer_config_kwargs", str(err)) from err
    if gdn_cp:
        config.context_parallel_size = cp
    return config


def local_layer_spec(transformer_config: Any, megatron_cfg: MegatronConfig, num_experts: int | None) -> Any:
    """megatron-core's local (no TransformerEngine) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mla = bool(getattr(transformer_config, "multi_latent_attention", False))
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=megatron_cfg.moe_grouped_gemm,
        qk_layernorm=transformer_config.qk_layernorm,
        multi_latent_attention=mla,
        normalization=transformer_config.normalization,
    )
    if mla:  # the HF tables hold MLA's down projections whole on every TP rank
        from roll.models.megatron.layer_spec import mla_down_projections, mla_without_te

        mla_without_te()
        mla_down_projections(spec.submodules.self_attention.submodules)
    return spec


def default_layer_spec_fn() -> LayerSpecFn:
    """roll's ``build_layer_spec`` where that module exists, else megatron-core's local spec."""
    try:
        from roll.models.megatron.layer_spec import build_layer_spec
    except ModuleNotFoundError as err:
        if err.name != "roll.models.megatron.layer_spec":
            raise
        return local_layer_spec
    return build_layer_spec


def _final_norm(layer_spec: Any) -> Any:
    """The final norm: the layer's own norm module, or megatron's default where the layer fuses its
    norms into the linears (TransformerEngine)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import LayerNormImpl

    norm = layer_spec.submodules.input_layernorm
    return LayerNormImpl if norm is IdentityOp else norm


def moe_layer_pattern(config: Any) -> list[int]:
    """Per global layer: 1 for an MoE layer, 0 for a dense one (``moe_layer_freq``)."""
    freq = config.moe_layer_freq if config.num_moe_experts else 0
    if isinstance(freq, list):
        return list(freq)
    return [int(bool(freq) and i % freq == 0) for i in range(config.num_layers)]


def decoder_block_spec(
    config: Any, megatron_cfg: MegatronConfig, layer_spec_fn: LayerSpecFn, vp_stage: int | None
) -> Any:
    """This pipeline chunk's layer specs (dense or MoE per ``config.moe_layer_freq``; Gated DeltaNet
    attention per ``config.linear_attention_freq``) and final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from roll.models.megatron.gated_delta_net import linear_attention_layer, linear_attention_pattern

    experts = config.num_moe_experts
    kinds = list(zip(moe_layer_pattern(config), linear_attention_pattern(config)))
    specs = {}
    for moe, linear in sorted(set(kinds)):
        spec = layer_spec_fn(config, megatron_cfg, experts if moe else None)
        specs[moe, linear] = linear_attention_layer(spec) if linear else spec
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [specs[kind] for kind in kinds[offset : offset + count]]
    norm = _final_norm(next(iter(specs.values())))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def build_model_chunks(
    hf_config: Any,
    megatron_cfg: MegatronConfig,
    dtype: torch.dtype,
    layer_spec_fn: LayerSpecFn | None = None,
    *,
    transformer_config: Any = None,
) -> list[Any]:
    """One megatron-core GPTModel per virtual pipeline stage of this rank (one without VPP).

    ``pre_process``/``post_process`` follow megatron's parallel_state; each chunk carries
    ``roll_hf_info`` (``weight_mapping.ConversionInfo``) for ``hf_io``. Pass ``transformer_config``
    to use a config you adjusted from ``transformer_config_from_hf``.
    """
    from megatron.core import parallel_state as ps

    config = transformer_config
    if config is None:
        config = transformer_config_from_hf(hf_config, megatron_cfg, dtype)
    spec_fn = layer_spec_fn or default_layer_spec_fn()
    info = families.conversion_info(hf_config, megatron_cfg)
    model_kwargs = families.rope_kwargs(hf_config)
    gpt_class, class_kwargs = _model_class(hf_config)  # GPTModel, or a VL model's with its vision tower
    max_positions = families.language_config(hf_config).max_position_embeddings
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        model = gpt_class(
            config,
            decoder_block_spec(config, megatron_cfg, spec_fn, vp_stage),
            vocab_size=info.padded_vocab_size,
            max_sequence_length=max_positions,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=info.tie_word_embeddings,
            vp_stage=vp_stage,
            **model_kwargs,
            **class_kwargs,
        )
        model.roll_hf_info = info
        chunks.append(model)
    mark_tensor_parallel_params(chunks)
    return chunks


def mark_tensor_parallel_params(chunks: list[torch.nn.Module]) -> None:
    """Tag TP-sharded weights (``tensor_model_parallel``, ``partition_dim``) as megatron's init would.

    megatron-core sets these in its weight initialisers, which ``perform_initialization=False``
    skips (weights come from the checkpoint); without them the gradient norm counts every TP
    shard of those weights on TP rank 0 only, so clipping and the reported norm come out wrong.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
    for chunk in chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            dim = next((d for kind, d in dims if isinstance(module, kind)), None)
            if dim is not None and isinstance(weight, torch.nn.Parameter):
                if not getattr(weight, "tensor_model_parallel", False):
                    set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _model_class(hf_config: Any) -> tuple[type, dict[str, Any]]:
    """The GPTModel class for ``hf_config`` and its extra constructor arguments."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if getattr(hf_config, "model_type", None) in families.VISION_FAMILIES:
        return families.vision_module(hf_config).MODEL_CLASS, {"hf_config": hf_config}
    return GPTModel, {}
