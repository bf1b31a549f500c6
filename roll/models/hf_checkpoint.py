"""Write a Hugging Face checkpoint from a stream of full, HF-named tensors.

Tensors arrive one by one (gathered from shards by a train strategy), so at most one shard of
``max_shard_bytes`` is held in memory. The result is what ``save_pretrained`` writes:
``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``),
``config.json``, ``generation_config.json`` and the tokenizer files, so
``AutoModelForCausalLM.from_pretrained(path)`` loads it as is.

>>> write_hf_checkpoint(out_dir, trainer_named_tensors(), model.config, model.generation_config,
...                     tokenizer_dir=role.model_args.model_name_or_path)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from roll.configs.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 1024**3


class _ShardWriter:
    """Fills shards up to ``max_bytes`` and names them once the count is known."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        temp = f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.path / temp), metadata={"format": "pt"})
        self.files.append((temp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.files) == 1:
            os.replace(self.path / self.files[0][0], self.path / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (temp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.replace(self.path / temp, self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def write_hf_checkpoint(
    path: str | Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config,
    generation_config=None,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    skip: Collection[str] = (),
) -> None:
    """Write the tensors, ``config`` (a PretrainedConfig), the generation config and the tokenizer
    of ``tokenizer_dir`` (skipped with a warning when it has none) under ``path``.

    ``skip`` names tensors to leave out: the second name of a tied weight (see
    ``roll.models.weights.tied_duplicate_names``), as ``save_pretrained`` does; transformers re-ties
    it on load.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(path, max_shard_bytes)
    for name, tensor in named_tensors:
        if name not in skip:
            writer.add(name, tensor)
    writer.finish()
    config.save_pretrained(path)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer_dir:
        _copy_tokenizer(tokenizer_dir, path)


def _copy_tokenizer(source: str, target: Path) -> None:
    from roll.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(source)
    except ConfigError as exc:
        logger.warning("no tokenizer written to %s: %s", target, exc)
        return
    tokenizer.save_pretrained(target)
