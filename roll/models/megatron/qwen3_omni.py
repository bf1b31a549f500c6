"""Qwen3-Omni-MoE's thinker on megatron-core: Qwen3-VL-MoE's language model with an audio tower too.

A Qwen3-Omni checkpoint (config.json ``model_type: qwen3_omni_moe``) holds the *thinker* (the
multimodal language model that writes text) and, for the Instruct edition, a *talker* and
*code2wav* that turn its text into speech. RLVR trains the thinker only (ROLL's
``freeze_module_prefix`` names the towers, talker and code2wav), so roll builds the thinker:

- the language model is Qwen3-MoE (q/k norms, softmax-top-k routing renormalised as
  ``norm_topk_prob`` says, every layer routed) with Qwen3-VL's **interleaved multimodal RoPE**
  (``thinker_config.text_config.rope_parameters.mrope_section``; transformers'
  ``Qwen3OmniMoeThinkerTextRotaryEmbedding.recomposition_frequencies`` is the T H W T H W ...
  layout of ``interleaved_mrope``) and Qwen3-VL's **deepstack** (the vision tower's inner features
  added after the first decoder layers; ``qwen3_vl``);
- the vision tower (``Qwen3OmniMoeVisionEncoder``, deepstack mergers included) and the audio tower
  (``Qwen3OmniMoeAudioEncoder``) are transformers' own modules, held whole on every rank of the first
  pipeline stage as ``visual`` and ``audio_tower``; audio features replace the ``<|audio_pad|>``
  tokens' embeddings (no deepstack for audio, as in transformers);
- rope positions are transformers' own ``get_rope_index`` of the thinker: an image's tokens take
  its grid coordinates (temporal ``t * position_id_per_seconds``), audio tokens count up like text
  (so their positions need each audio's length, ``feature_attention_mask``), text after a
  multimodal span starts after its largest position.

The checkpoint names everything under ``thinker.`` (``thinker.model.layers.*``,
``thinker.visual.*``, ``thinker.audio_tower.*``, ``thinker.lm_head.weight``) and stores each
expert's tensors apart (as Qwen3-MoE); roll's wire, its HF saves and vLLM's thinker loader
(``hf_to_vllm_mapper``: ``thinker.model.`` -> ``language_model.model.``, ``thinker.`` -> '') take
those names (``HF_PREFIXES``). ``talker.*`` and ``code2wav.*`` are not built: skipped on load (a
logged line) and absent from a saved checkpoint (the Thinking edition has none).

>>> model = Qwen3OmniGPTModel(config, block_spec, hf_config=omni, vocab_size=..., ...)
>>> logits = model(ids, None, None, pixel_values=pv, image_grid_thw=grid,
...                input_features=feats, feature_attention_mask=feat_mask)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.models.megatron.interleaved_mrope import InterleavedMRoPE
from roll.models.megatron.packed_vision import with_vision_features
from roll.models.megatron.qwen2_5_vl import build_vision_tower, vision_parts
from roll.models.megatron.qwen3_vl import Qwen3VLGPTModel, _add_deepstack
from roll.models.megatron.qwen3_vl import check_layout as _qwen3_vl_check_layout

MODEL_TYPES = ("qwen3_omni_moe",)
# Audio inputs of a forward, as transformers' thinker takes them: ``input_features`` [audios, mel,
# frames] (padded to the longest) and ``feature_attention_mask`` [audios, frames].
AUDIO_INPUT_KEYS = ("input_features", "feature_attention_mask")
# (prefix in roll's tables / megatron model, prefix in the checkpoint and on the wire)
HF_PREFIXES = (
    ("visual.", "thinker.visual."),
    ("audio_tower.", "thinker.audio_tower."),
    ("model.", "thinker.model."),
    ("lm_head.", "thinker.lm_head."),
)
# Checkpoint modules roll does not build (the speech output): skipped on load.
SKIPPED_PREFIXES = ("talker.", "code2wav.")


def thinker(hf_config: Any) -> Any:
    """The thinker's config (``thinker_config``: text, vision and audio configs, token ids)."""
    return hf_config.thinker_config


def _modeling() -> Any:
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    return m


def vision_tensor_names(hf_config: Any) -> tuple[str, ...]:
    """The towers' parameter names as roll's model holds them (``visual.*``, ``audio_tower.*``)."""
    m, cfg = _modeling(), thinker(hf_config)
    with torch.device("meta"):
        towers = (
            ("visual", m.Qwen3OmniMoeVisionEncoder._from_config(cfg.vision_config)),
            ("audio_tower", m.Qwen3OmniMoeAudioEncoder._from_config(cfg.audio_config)),
        )
    return tuple(f"{prefix}.{name}" for prefix, tower in towers for name, _ in tower.named_parameters())


def audio_lengths(feature_attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[audios] each audio's feature frames (None without audio)."""
    return None if feature_attention_mask is None else feature_attention_mask.sum(-1).long()


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    hf_config: Any,
    audio_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, S] rope positions of rows starting at column 0 (the thinker's ``get_rope_index``; the
    audios' feature lengths in row order)."""
    cfg = thinker(hf_config)
    mask = torch.ones_like(input_ids)
    if image_grid_thw is None or not len(image_grid_thw):  # text and audio count up (as transformers)
        return (
            torch.arange(input_ids.shape[1], device=input_ids.device)
            .view(1, 1, -1)
            .expand(3, *input_ids.shape)
        )
    host_class = _modeling().Qwen3OmniMoePreTrainedModelForConditionalGeneration
    host = SimpleNamespace(config=cfg, spatial_merge_size=cfg.vision_config.spatial_merge_size)
    host.get_llm_pos_ids_for_vision = partial(host_class.get_llm_pos_ids_for_vision, host)
    lengths = None if audio_seqlens is None else audio_seqlens.cpu()
    positions, _ = host_class.get_rope_index(host, input_ids, image_grid_thw, None, mask, False, lengths)
    return positions.long()


class Qwen3OmniGPTModel(Qwen3VLGPTModel):
    """GPTModel with Qwen3-Omni's vision and audio towers on the first pipeline stage, interleaved
    mrope and deepstack (see the module docstring). ``forward`` is Qwen2.5-VL's (padded or packed
    rows) plus the audio inputs (``AUDIO_INPUT_KEYS``); images only (no videos)."""

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        GPTModel.__init__(self, config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = cfg = thinker(hf_config)
        self.roll_omni_config = hf_config
        self._audio: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.pre_process:
            m = _modeling()
            self.visual = build_vision_tower(m.Qwen3OmniMoeVisionEncoder, cfg, self, config.params_dtype)
            self.audio_tower = _build_audio_tower(m.Qwen3OmniMoeAudioEncoder, cfg, self, config.params_dtype)
        self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)
        self.roll_deepstack_layers = len(cfg.vision_config.deepstack_visual_indexes or ())
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
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("pixel_values_videos") is not None:
            raise ValueError("roll's Qwen3-Omni thinker takes images and audio, not videos")
        self._audio = None if input_features is None else (input_features, feature_attention_mask)
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
        finally:
            self._audio = None

    def _vision_parts(self, *inputs: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The images' tower call (``vision_parts``) and, with audio, a part for the audio tower."""
        parts = vision_parts(self.roll_vl_config, *inputs)
        if self._audio is not None:
            parts.append((self.roll_vl_config.audio_token_id, *self._audio))
        return parts

    def _row_positions(
        self, image_grid_thw: torch.Tensor | None, video_grid_thw: Any, second_per_grid_ts: Any
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        lengths = audio_lengths(self._audio[1]) if self._audio is not None else None
        return partial(
            mrope_positions,
            image_grid_thw=image_grid_thw,
            hf_config=self.roll_omni_config,
            audio_seqlens=lengths,
        )

    def _embed_with_vision(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        local: torch.Tensor | None,
        parts: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Qwen3-VL's embedding of the image parts (deepstack context included), then the audio
        tower's features at the audio tokens."""
        audio_token = self.roll_vl_config.audio_token_id
        images = [p for p in parts if p[0] != audio_token]
        audio = [p for p in parts if p[0] == audio_token]
        if images:
            decoder_input, extra = super()._embed_with_vision(input_ids, rows, local, images)
        else:
            decoder_input, extra = self.embedding(input_ids=input_ids, position_ids=None), {}
        for token, features, mask in audio:
            embeds = self._audio_embeddings(features, mask)
            decoder_input = with_vision_features(
                decoder_input, rows, [(token, embeds)], local, self.config.sequence_parallel
            )
        return decoder_input, extra

    def _audio_embeddings(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[audio tokens, h] the audio tower's output (transformers' ``get_audio_features``: the
        audios' valid frames concatenated, [mel, frames])."""
        lengths = audio_lengths(mask)
        flat = features.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        out = self.audio_tower(flat.to(self.config.params_dtype), feature_lens=lengths, return_dict=True)
        return out.last_hidden_state


def _build_audio_tower(tower_class: Any, cfg: Any, model: GPTModel, params_dtype: torch.dtype) -> Any:
    tower = tower_class._from_config(cfg.audio_config)
    return tower.to(device=model.embedding.word_embeddings.weight.device, dtype=params_dtype)


def check_layout(hf_config: Any, cfg: Any, path: str) -> None:
    """Qwen3-VL's rule: the deepstack layers sit in the first pipeline chunk, beside the towers."""
    _qwen3_vl_check_layout(thinker(hf_config), cfg, path)


MODEL_CLASS = Qwen3OmniGPTModel  # families.VISION_MODULES' entry point
