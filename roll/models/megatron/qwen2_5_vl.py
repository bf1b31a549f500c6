"""Qwen2.5-VL on megatron-core: transformers' vision tower in front of a GPTModel language model.

The language model is megatron-core's GPTModel as for Qwen2 (TP / PP / SP as usual) with
multimodal RoPE (``position_embedding_type="mrope"``, the HF config's ``mrope_section``). The vision
tower and merger are transformers' own module, built from ``vision_config`` and held whole on every
rank of the first pipeline stage (as ``visual``, the HF checkpoint's name). Its image embeddings
replace the word embeddings at the image-token positions and enter the decoder as ``decoder_input``.

Every stage computes the 3-D rope positions of its rows from ``input_ids`` and ``image_grid_thw``
(``mrope_positions``, transformers' own ``get_rope_index``): rows start at column 0 (roll's shifted
layout, ``forward.py``), so trailing padding never moves a real token's position. Packed rows (thd)
are not supported: the strategies run vision-language models on padded rows.

>>> model = Qwen2_5_VLGPTModel(config, block_spec, hf_config=hf, vocab_size=..., ...)
>>> logits = model(input_ids, position_ids, None, pixel_values=pv, image_grid_thw=grid)
"""

from __future__ import annotations

import re
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.models.vision import token_types


def _vision_class() -> Any:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def vision_tensor_names(hf_config: Any) -> tuple[str, ...]:
    """The vision tower's parameter names as the HF checkpoint stores them (``visual.*``)."""
    with torch.device("meta"):
        tower = _vision_class()._from_config(hf_config.vision_config)
    return tuple(f"visual.{name}" for name, _ in tower.named_parameters())


def mrope_positions(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, hf_config: Any
) -> torch.Tensor:
    """[3, B, S] Qwen2.5-VL rope positions (temporal, height, width) of rows whose tokens start at
    column 0: text tokens count up on all three axes, an image's tokens take its grid coordinates.
    ``image_grid_thw`` holds the rows' images in row order (None: text rows)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    if image_grid_thw is None or not len(image_grid_thw):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
    host = SimpleNamespace(config=hf_config)  # get_rope_index reads only the config and this method
    host.get_vision_position_ids = partial(Qwen2_5_VLModel.get_vision_position_ids, host)
    types = token_types(input_ids, hf_config)
    positions, _ = Qwen2_5_VLModel.get_rope_index(host, input_ids, types, image_grid_thw=image_grid_thw)
    return positions


class Qwen2_5_VLGPTModel(GPTModel):
    """GPTModel with Qwen2.5-VL's vision tower on the first pipeline stage (see the module docstring).

    ``forward`` takes GPTModel's arguments plus ``pixel_values`` [patches, D] and ``image_grid_thw``
    [images, 3] of the rows' images in row order; 2-D ``position_ids`` are replaced by the 3-D ones.
    """

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = hf_config
        if self.pre_process:
            tower = _vision_class()._from_config(hf_config.vision_config)
            self.visual = tower.to(
                device=self.embedding.word_embeddings.weight.device, dtype=config.params_dtype
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("packed_seq_params") is not None:
            raise ValueError("Qwen2.5-VL runs on padded rows; packed (thd) rows are not supported")
        position_ids = mrope_positions(input_ids, image_grid_thw, self.roll_vl_config)
        if self.pre_process and decoder_input is None and pixel_values is not None:
            decoder_input = self._embed_with_images(input_ids, pixel_values, image_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    def _embed_with_images(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """[s, b, h] (this rank's sequence share under SP) word embeddings with the image tokens'
        replaced by the vision tower's output."""
        from megatron.core import tensor_parallel

        words = self.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp), b, h]
        features = self.visual(
            pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw
        ).pooler_output
        image = input_ids == self.roll_vl_config.image_token_id  # [b, s]: features in row order
        if int(image.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(image.sum())} image tokens in the rows for {features.shape[0]} image features"
            )
        full = words.new_zeros(image.shape + (words.shape[-1],))
        full = full.masked_scatter(image.unsqueeze(-1), features.to(words.dtype)).transpose(0, 1).contiguous()
        image = image.transpose(0, 1).contiguous()  # [s, b, h] / [s, b], as the decoder takes them
        if self.config.sequence_parallel:  # this rank's share, as the embedding scattered the words
            full = tensor_parallel.scatter_to_sequence_parallel_region(full)
            image = tensor_parallel.scatter_to_sequence_parallel_region(image.float()).bool()
        return torch.where(image.unsqueeze(-1), full, words).contiguous()  # pipeline sends need contiguous


MODEL_CLASS = Qwen2_5_VLGPTModel  # families.VISION_MODULES' entry point


def freeze_vision_tower(chunks: list[torch.nn.Module], prefixes: list[str] | None, path: str) -> int:
    """``model_args.freeze_module_prefix`` on megatron_train: ROLL's / transformers' module names
    (``model.visual``, ``model.visual.merger``, or ``visual...``) freeze that part of the tower on
    the ranks that hold it (the first pipeline stage); other prefixes are a ConfigError. Returns how
    many tensors this rank froze; call before DDP and the optimizer are built."""
    from roll.configs.errors import ConfigError
    from roll.models.vision import freeze_prefixes

    if not prefixes:
        return 0
    # ROLL's mcore_adapter names Qwen3.5's / Qwen3-VL's tower "vision_model"; roll's is "visual".
    names = [re.sub(r"^vision_model(\.|$)", r"visual\1", p.removeprefix("model.")) for p in prefixes]
    for prefix, name in zip(prefixes, names):
        if name != "visual" and not name.startswith("visual."):
            raise ConfigError(
                path,
                f"{prefix!r}: megatron_train freezes parts of the vision tower (model.visual... or ROLL's "
                "vision_model...) only",
            )
    return sum(freeze_prefixes(c, names, path) for c in chunks if getattr(c, "pre_process", False))
