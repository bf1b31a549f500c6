"""Qwen3-VL on megatron-core: transformers' vision tower in front of a GPTModel.

The language model is megatron-core's GPTModel as for Qwen3 (q/k norms), or for Qwen3-MoE
(Qwen3-VL-MoE: megatron's MoE layers, EP; its checkpoints stack each layer's experts transposed,
which ``stacked_experts`` reads and writes), with two things of Qwen3-VL's own:

- **interleaved multimodal RoPE**: each rotary frequency takes its position from one axis, in the
  order T H W T H W ... (``mrope_section`` says how many frequencies H and W take; the rest, and the
  tail, are T's). megatron-core 0.16's ``MultimodalRotaryEmbedding`` only has the sectioned layout
  of Qwen2-VL (all T's frequencies, then H's, then W's), so ``interleaved_mrope.InterleavedMRoPE`` replaces it.
- **deepstack**: the vision tower also returns features of some of its inner blocks
  (``deepstack_visual_indexes``); the k-th is added to the hidden states after decoder layer k at
  the visual-token positions. The features ride to the layers as the decoder's ``context`` argument
  ([k, s, b, h], zero off the visual tokens): megatron passes it unchanged through every GPT layer
  (whose cross-attention is an identity) and saves it with the inputs of a recomputed layer chunk, so
  ``recompute_granularity: full`` and pipelined micro-batches each see their own features; a forward
  hook on decoder layer k adds ``context[k]`` to the layer's output. The deepstack layers must sit in
  the first pipeline chunk, beside the tower (``check_layout``).

The vision tower (patch embedding, blocks, merger and the deepstack mergers) is transformers' own
module, held whole on every rank of the first pipeline stage as ``visual`` (the checkpoint's name).
Rope positions come from transformers' ``get_rope_index`` (a video's temporal patches each their own
grid: the prompt holds each patch's time, ``roll.models.video_prompt``). Images and videos run
through the tower in two calls, as transformers runs them; each kind's deepstack features go to its
own tokens. Padded rows, and packed (thd) rows with context parallelism as Qwen2.5-VL runs them
(``packed_vision``): each sequence's positions from the whole packed row (``InterleavedMRoPE``
returns the whole row's frequencies and megatron's thd RoPE picks each CP rank's zig-zag chunks),
the vision features and the deepstack features ([k, s, 1, h], s this CP rank's packed tokens) of
each rank's own tokens. A text-only training forward runs the tower on a dummy image times 0 (its
deepstack mergers included), so every rank's DDP buckets get gradients.

>>> model = Qwen3VLGPTModel(config, block_spec, hf_config=hf, vocab_size=..., ...)
>>> logits = model(input_ids, position_ids, None, pixel_values=pv, image_grid_thw=grid)
>>> logits = model(ids, None, None, packed_seq_params=thd, packed_input_ids=row, pixel_values=pv, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.configs.errors import ConfigError
from roll.models.megatron.interleaved_mrope import InterleavedMRoPE
from roll.models.megatron.packed_vision import placed_features, with_vision_features
from roll.models.megatron.qwen2_5_vl import (
    Qwen2_5_VLGPTModel,
    build_vision_tower,
    tower_tensor_names,
)
from roll.models.rope_index import rope_index_positions

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def _classes(hf_config: Any) -> tuple[Any, Any]:
    """(vision tower class, model class whose ``get_rope_index`` computes the rope positions)."""
    if hf_config.model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

        return m.Qwen3VLMoeVisionModel, m.Qwen3VLMoeModel
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    return m.Qwen3VLVisionModel, m.Qwen3VLModel


def vision_tensor_names(hf_config: Any) -> tuple[str, ...]:
    """The vision tower's parameter names (``visual.*``), deepstack mergers included."""
    return tower_tensor_names(_classes(hf_config)[0], hf_config)


def deepstack_layers(hf_config: Any) -> int:
    """How many decoder layers (the first ones) get deepstack features added to their output."""
    return len(hf_config.vision_config.deepstack_visual_indexes or ())


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    hf_config: Any,
    video_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, S] Qwen3-VL rope positions of rows starting at column 0 (transformers' own
    ``get_rope_index``); text rows count up on all three axes."""
    return rope_index_positions(
        _classes(hf_config)[1],
        input_ids,
        hf_config,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
    )


class Qwen3VLGPTModel(Qwen2_5_VLGPTModel):
    """GPTModel with Qwen3-VL's vision tower on the first pipeline stage, interleaved mrope and
    deepstack (see the module docstring). ``forward`` is Qwen2.5-VL's (padded or packed rows, images
    and videos, the idle tower on a text-only training forward) with Qwen3-VL's rope positions
    (``_row_positions``) and embedding (``_embed_with_vision``, which also hands the decoder the
    deepstack features as its layers' ``context``)."""

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        GPTModel.__init__(self, config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = hf_config
        if self.pre_process:
            self.visual = build_vision_tower(_classes(hf_config)[0], hf_config, self, config.params_dtype)
        self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)
        self.roll_deepstack_layers = deepstack_layers(hf_config)
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < self.roll_deepstack_layers:
                layer.register_forward_hook(partial(_add_deepstack, layer.layer_number - 1), with_kwargs=True)

    def _row_positions(
        self,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        second_per_grid_ts: Any,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Qwen3-VL's prompt holds each video patch's time: no ``second_per_grid_ts``."""
        return partial(
            mrope_positions,
            image_grid_thw=image_grid_thw,
            hf_config=self.roll_vl_config,
            video_grid_thw=video_grid_thw,
        )

    def _embed_with_vision(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        local: torch.Tensor | None,
        parts: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The decoder input [s, b, h] (vision tokens' embeddings replaced by the tower's output) and
        ``{"context": deepstack features [k, s, b, h]}`` (zero off the vision tokens; nothing without
        deepstack), both of this rank's tokens: ``rows`` and ``local`` as
        ``packed_vision.placed_features`` takes them (its CP share of a packed row), its sequence
        share under SP."""
        outputs = [
            (token, self.visual(pixels.to(self.config.params_dtype), grid_thw=grid, return_dict=True))
            for token, pixels, grid in parts
        ]
        words = self.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp), b, h]
        sp = self.config.sequence_parallel
        features = [(token, out.pooler_output) for token, out in outputs]
        decoder_input = with_vision_features(words, rows, features, local, sp)
        if not self.roll_deepstack_layers:
            return decoder_input, {}
        deepstack = [
            placed_features(rows, [(t, o.deepstack_features[k]) for t, o in outputs], local, sp, words.dtype)[
                0
            ]
            for k in range(self.roll_deepstack_layers)
        ]
        return decoder_input, {"context": torch.stack(deepstack).contiguous()}


def _add_deepstack(index: int, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of decoder layer ``index``: add the deepstack features (the ``context``) to its
    output hidden states; a row batch without images has no context and passes unchanged."""
    context = kwargs.get("context")
    if context is None:
        return output
    hidden, out_context = output
    return hidden + context[index].to(hidden.dtype), out_context


def check_layout(hf_config: Any, cfg: Any, path: str) -> None:
    """The deepstack layers sit in the first pipeline chunk, beside the vision tower."""
    needed = deepstack_layers(hf_config)
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    if pp * vpp == 1 or not needed:
        return
    held = cfg.pipeline_rank_layers(hf_config.text_config.num_hidden_layers)[0][0]
    if held < needed:
        key = (
            "pipeline_model_parallel_layout"
            if cfg.pipeline_model_parallel_layout
            else "pipeline_model_parallel_size"
        )
        raise ConfigError(
            f"{path}.{key}",
            f"PP {pp} (VPP {vpp}) puts {held} decoder layers in the first pipeline chunk; Qwen3-VL adds its "
            f"vision tower's deepstack features after the first {needed}, which must sit there beside the "
            "tower (fewer stages, a larger num_layers_in_first_pipeline_stage, or a layout with more t in "
            "its first stage)",
        )


MODEL_CLASS = Qwen3VLGPTModel  # families.VISION_MODULES' entry point
