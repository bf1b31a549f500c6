"""A prompt row's audio files read into what the model and vLLM take (``roll.pipeline.rlvr.data.audio``
describes the rows): once when the file is loaded, for the prompt's audio tokens, and per batch.

    waves = read_row_audios(["0.wav"], "rows.jsonl:1", "data/audios", processor.audio)
    mm, engine = audio_fields(row, processor.audio)   # forward inputs, vLLM's {"audio": [...]}
"""

from __future__ import annotations

from typing import Any

from roll.configs.errors import ConfigError
from roll.pipeline.rlvr.data.video import video_path


def read_row_audios(refs: list[str], source: str, folder: str | None, audio: Any) -> list[Any]:
    """The waveforms of a row's audios (``audio``: the model's ``AudioProcessor``); one ConfigError
    naming the row and the file when one cannot be read."""
    waves = []
    for i, ref in enumerate(refs):
        path = video_path(ref, source, folder)
        try:
            waves.append(audio.read(path))
        except Exception as exc:  # noqa: BLE001 - OSError, wave.Error, ValueError: one message naming the file
            raise ConfigError(
                "data_args.file_name", f"{source}: audio {i} ({str(path)!r}) cannot be read: {exc}"
            ) from None
    return waves


def audio_fields(row: Any, audio: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model inputs, engine data) of a row's audios: ``input_features`` and ``feature_attention_mask``
    for the forward, and for vLLM the waveforms themselves (``{"audio": [float32 arrays at the
    feature extractor's rate]}``: vLLM's Qwen3-Omni thinker runs the same feature extractor)."""
    waves = read_row_audios(row.audios, row.source, row.audio_folder, audio)
    return audio.audio_inputs(waves), {"audio": waves}
