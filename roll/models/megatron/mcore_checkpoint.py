"""A dist checkpoint written by ``convert hf-to-mcore``: its manifest, and loading it into chunks.

``DIR/roll_mcore.json`` (the manifest: model type, layout, padded vocab, dtype) sits next to the
megatron-core dist checkpoint under ``DIR/mcore``. The converter writes both; ``megatron_train``
and ``megatron_infer`` start from one through ``MegatronConfig.mcore_checkpoint``
(``runtime.build_chunks``). Both sides import this file, so neither imports the other.

>>> check_compatible(mcore_dir, hf_config, megatron_cfg, "strategy_args.strategy_config.mcore_checkpoint")
>>> load_mcore_weights(chunks, mcore_dir)                    # collective
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig

MANIFEST = "roll_mcore.json"
SUBDIR = "mcore"


@contextlib.contextmanager
def cpu_safe_sync() -> Iterator[None]:
    """megatron-core's dist-checkpointing calls ``torch.cuda.synchronize()`` and puts a status flag
    on ``torch.cuda.current_device()`` unconditionally; on a machine without CUDA there is nothing
    to wait for and the flag goes to the CPU (for the save/load only)."""
    if torch.cuda.is_available():
        yield
        return
    with (
        mock.patch.object(torch.cuda, "synchronize", lambda *args, **kwargs: None),
        mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")),
    ):
        yield


def read_manifest(mcore_dir: str | Path) -> dict[str, Any]:
    """The manifest of the converted checkpoint in ``mcore_dir`` (ConfigError when there is none)."""
    path = Path(mcore_dir) / MANIFEST
    if not path.is_file():
        raise ConfigError(str(path), "no such file: not a checkpoint written by `convert hf-to-mcore`")
    return json.loads(path.read_text())


def check_compatible(mcore_dir: str | Path, hf_config: Any, cfg: MegatronConfig, key: str) -> None:
    """The checkpoint in ``mcore_dir`` must be of this model family and TP size (the padded vocab
    depends on it); else one ConfigError naming ``key`` and the manifest."""
    manifest = read_manifest(mcore_dir)
    where = f"{Path(mcore_dir) / MANIFEST}"
    if manifest["model_type"] != hf_config.model_type:
        raise ConfigError(
            key, f"{where} holds a {manifest['model_type']!r} model, not {hf_config.model_type!r}"
        )
    from roll.models.megatron.families import padded_vocab_size

    if manifest["padded_vocab_size"] != padded_vocab_size(hf_config.vocab_size, cfg):
        raise ConfigError(
            key,
            f"{where} was written for TP={manifest['layout']['tp']} (vocab padded to "
            f"{manifest['padded_vocab_size']}); this layout pads to {padded_vocab_size(hf_config.vocab_size, cfg)}",
        )


def load_mcore_weights(chunks: list[Any], mcore_dir: str | Path) -> None:
    """Fill this rank's chunks from the dist checkpoint under ``mcore_dir`` (collective; any PP / EP /
    VPP layout of the same TP)."""
    from megatron.core import dist_checkpointing

    from roll.models.megatron.stream_save import sharded_state_dict

    with cpu_safe_sync():
        state = dist_checkpointing.load(sharded_state_dict(chunks), str(Path(mcore_dir) / SUBDIR))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{i}"], strict=True)
