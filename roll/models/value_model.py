"""``ValueModel``: a causal-LM body with a scalar value head, the critic of PPO/GAE.

The body is the transformer without its LM head (``AutoModel``), so a critic can start from any
causal-LM checkpoint. The state dict keeps the checkpoint's own key names (``model.*``) next to
``value_head.weight`` / ``value_head.bias``, so the same files reload with ``from_pretrained``.

>>> critic = ValueModel.from_pretrained("/models/qwen2.5-0.5b", dtype=torch.float32, seed=42)
>>> values = critic(input_ids, attention_mask=mask, position_ids=pos)   # [B, T], fp32
>>> window = response_values(critic, batch)                                # [B, R]
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, PreTrainedModel

from roll.core.batch import Batch
from roll.models.packing import pack_rows

HEAD_PREFIX = "value_head."


class ValueModel(nn.Module):
    """Transformer body + ``nn.Linear(hidden, 1)``; ``forward`` returns values [B, T] in fp32.

    The head is initialised from ``seed`` alone (normal, std 1/sqrt(hidden + 1); bias zero), so
    every rank of a data-parallel critic starts from the same head.
    """

    def __init__(self, backbone: PreTrainedModel, seed: int = 42) -> None:
        super().__init__()
        self.model = backbone
        self.config = backbone.config
        hidden = backbone.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=backbone.dtype, device=backbone.device)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(1, hidden, generator=generator) / math.sqrt(hidden + 1)
            self.value_head.weight.copy_(weight)
            self.value_head.bias.zero_()
        # FSDP wraps the decoder layers that the body declares unsplittable.
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or [])

    @classmethod
    def from_pretrained(cls, path: str, seed: int = 42, **kwargs: Any) -> ValueModel:
        """Body from ``path`` (any causal-LM or saved critic); head from its safetensors when present."""
        model = cls(AutoModel.from_pretrained(path, **kwargs), seed=seed)
        head = _read_head_tensors(Path(path))
        if head:
            with torch.no_grad():
                for name, tensor in head.items():
                    getattr(model.value_head, name).copy_(tensor)
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        kwargs.pop("logits_to_keep", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
        # A fresh tensor, not a view: FSDP2's backward hook on a view is lost by in-place ops.
        return self.value_head(out.last_hidden_state).squeeze(-1).to(torch.float32, copy=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.value_head.weight.dtype


def check_output_kind(role: str, is_value_model: bool, values: bool) -> None:
    """A strategy asked for values (``values``) or log-probs must hold that kind of model; the
    error names the call that fits."""
    if values and not is_value_model:
        raise ValueError(f"{role}: compute_values needs a value model (model_args.model_type: value)")
    if not values and is_value_model:
        raise ValueError(f"{role}: a value model has values, not log-probs (compute_values)")


def response_values(model: nn.Module, batch: Batch, packed: bool = False) -> torch.Tensor:
    """Values [B, R] for the response window: position t is the value of the state before
    ``responses[:, t]`` (column P + t - 1), 0 on response padding. ``packed``: the rows packed
    into one (``roll.models.packing``), same values."""
    if packed:
        row = pack_rows(batch).to(batch["input_ids"].device)
        values = model(input_ids=row.input_ids, position_ids=row.position_ids)
        return torch.where(batch["response_mask"].bool(), values[0][row.window], 0.0)
    width = batch["responses"].shape[1]
    values = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    )
    window = values[:, -width - 1 : -1]
    return torch.where(batch["response_mask"].bool(), window, 0.0)


def _read_head_tensors(path: Path) -> dict[str, torch.Tensor]:
    """``{"weight": ..., "bias": ...}`` of a saved value head, or {} when the checkpoint has none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {weight_map[k] for k in weight_map if k.startswith(HEAD_PREFIX)}
    else:
        files = {"model.safetensors"} if (path / "model.safetensors").is_file() else set()
    head: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(HEAD_PREFIX):
                    head[key[len(HEAD_PREFIX) :]] = f.get_tensor(key)
    return head
