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
Rope positions come from transformers' ``get_rope_index``. Padded rows and images only: a batch with
videos stops the forward with one line (Video-R1 rows are refused before launch), as do packed
rows; context parallelism is refused before launch.

>>> model = Qwen3VLGPTModel(config, block_spec, hf_config=hf, vocab_size=..., ...)
>>> logits = model(input_ids, position_ids, None, pixel_values=pv, image_grid_thw=grid)
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.configs.errors import ConfigError
from roll.models.megatron.interleaved_mrope import InterleavedMRoPE
from roll.models.vision import token_types

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
    with torch.device("meta"):
        tower = _classes(hf_config)[0]._from_config(hf_config.vision_config)
    return tuple(f"visual.{name}" for name, _ in tower.named_parameters())


def deepstack_layers(hf_config: Any) -> int:
    """How many decoder layers (the first ones) get deepstack features added to their output."""
    return len(hf_config.vision_config.deepstack_visual_indexes or ())


def mrope_positions(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, hf_config: Any
) -> torch.Tensor:
    """[3, B, S] Qwen3-VL rope positions of rows starting at column 0 (transformers' own
    ``get_rope_index``); text rows count up on all three axes."""
    if image_grid_thw is None or not len(image_grid_thw):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
    model_class = _classes(hf_config)[1]
    host = SimpleNamespace(config=hf_config)  # get_rope_index reads only the config and this method
    host.get_vision_position_ids = partial(model_class.get_vision_position_ids, host)
    types = token_types(input_ids, hf_config)
    positions, _ = model_class.get_rope_index(host, input_ids, types, image_grid_thw=image_grid_thw)
    return positions


class Qwen3VLGPTModel(GPTModel):
    """GPTModel with Qwen3-VL's vision tower on the first pipeline stage, interleaved mrope and
    deepstack (see the module docstring). ``forward`` takes GPTModel's arguments plus
    ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3] of the rows' images in row order."""

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = hf_config
        if self.pre_process:
            tower = _classes(hf_config)[0]._from_config(hf_config.vision_config)
            self.visual = tower.to(
                device=self.embedding.word_embeddings.weight.device, dtype=config.params_dtype
            )
        self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)
        self.roll_deepstack_layers = deepstack_layers(hf_config)
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < self.roll_deepstack_layers:
                layer.register_forward_hook(partial(_add_deepstack, layer.layer_number - 1), with_kwargs=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("packed_seq_params") is not None:
            raise ValueError("Qwen3-VL runs on padded rows; packed (thd) rows are not supported")
        if pixel_values_videos is not None:
            raise ValueError("roll's Megatron Qwen3-VL takes images only; video rows run on fsdp2_train")
        kwargs.pop("video_grid_thw", None), kwargs.pop("second_per_grid_ts", None)
        position_ids = mrope_positions(input_ids, image_grid_thw, self.roll_vl_config)
        if self.pre_process and decoder_input is None and pixel_values is not None:
            decoder_input, deepstack = self._embed_with_deepstack(input_ids, pixel_values, image_grid_thw)
            if deepstack is not None:
                kwargs["extra_block_kwargs"] = {
                    **(kwargs.get("extra_block_kwargs") or {}),
                    "context": deepstack,
                }
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    def _embed_with_deepstack(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder input [s, b, h] (image tokens' embeddings replaced by the tower's output) and
        the deepstack features [k, s, b, h] (zero off the image tokens; None without deepstack), both
        this rank's sequence share under SP."""
        output = self.visual(
            pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw, return_dict=True
        )
        image = input_ids == self.roll_vl_config.image_token_id  # [b, s]: features in row order
        words = self.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp), b, h]
        embeds = self._scatter_rows(image, output.pooler_output, words)
        decoder_input = torch.where(self._share(image.transpose(0, 1)).unsqueeze(-1), embeds, words)
        if not self.roll_deepstack_layers:
            return decoder_input.contiguous(), None
        deepstack = [self._scatter_rows(image, f, words) for f in output.deepstack_features]
        return decoder_input.contiguous(), torch.stack(deepstack).contiguous()

    def _scatter_rows(self, image: torch.Tensor, features: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h]: ``features`` at the image tokens of ``image`` [b, s], zero elsewhere."""
        if int(image.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(image.sum())} image tokens in the rows for {features.shape[0]} image features"
            )
        full = words.new_zeros(image.shape + (words.shape[-1],))
        full = full.masked_scatter(image.unsqueeze(-1), features.to(words.dtype))
        return self._share(full.transpose(0, 1).contiguous())

    def _share(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's sequence share of a [s, b, ...] tensor under sequence parallelism."""
        if not self.config.sequence_parallel:
            return tensor
        from megatron.core import tensor_parallel

        if tensor.dtype == torch.bool:
            return tensor_parallel.scatter_to_sequence_parallel_region(tensor.float()).bool()
        return tensor_parallel.scatter_to_sequence_parallel_region(tensor)


def _add_deepstack(index: int, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of decoder layer ``index``: add the deepstack features (the ``context``) to its
    output hidden states; a row batch without images has no context and passes unchanged."""
    context = kwargs.get("context")
    if context is None:
        return output
    hidden, out_context = output
    return hidden + context[index].to(hidden.dtype), out_context


def check_layout(hf_config: Any, cfg: Any, path: str) -> None:
    """The deepstack layers sit in the first pipeline chunk, beside the vision tower; no context
    parallelism (the rows' rope positions and image features are per padded row)."""
    if cfg.context_parallel_size > 1:
        raise ConfigError(
            f"{path}.context_parallel_size",
            f"{cfg.context_parallel_size}: roll's Megatron Qwen3-VL runs on padded rows without context "
            "parallelism; set it to 1",
        )
    needed = deepstack_layers(hf_config)
    pp, vpp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size or 1
    if pp * vpp == 1 or not needed:
        return
    first = cfg.num_layers_in_first_pipeline_stage
    layers = hf_config.text_config.num_hidden_layers
    held = (first if first is not None else layers // pp) // vpp
    if held < needed:
        raise ConfigError(
            f"{path}.pipeline_model_parallel_size",
            f"{pp} (VPP {vpp}) puts {held} decoder layers in the first pipeline chunk; Qwen3-VL adds its "
            f"vision tower's deepstack features after the first {needed}, which must sit there beside the "
            "tower (fewer stages, or a larger num_layers_in_first_pipeline_stage)",
        )


MODEL_CLASS = Qwen3VLGPTModel  # families.VISION_MODULES' entry point
