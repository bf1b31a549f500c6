"""Audio inputs of Qwen3-Omni's thinker: wav files read into the feature extractor's waveforms, their
log-mel features, and how many ``<|audio_pad|>`` tokens each audio becomes.

    audio = AudioProcessor.load("models/qwen3-omni", tokenizer)     # None: the model takes no audio
    wave = audio.read("data/audios/0.wav", "rows.jsonl:1", 0)      # float32, 16 kHz, hop-padded
    audio.audio_tokens([wave])                                     # [13]: <|audio_pad|> per audio
    audio.audio_inputs([wave])  # {"input_features": [1, mel, frames], "feature_attention_mask": [1, frames]}

A row's audio inputs ride in the Batch beside its images, in the row's ``multi_modal_inputs``
(``roll.models.vision``); rows of different lengths are padded to the longest only when a forward
concatenates them (``concat_audio_inputs``), and ``feature_attention_mask`` says which frames are real.

What the model directory holds: the feature extractor (``WhisperFeatureExtractor``) in
``preprocessor_config.json`` beside the image processor's keys, as Qwen's releases ship it; the
audio tower's window (``thinker_config.audio_config.n_window``) gives the token count (the tower's
three stride-2 convolutions per window of ``2 * n_window`` frames, 13 tokens per whole window: the
formula of transformers' Qwen3-Omni processor and of vLLM's thinker).

Waveforms: wav files read with the standard library (``wave``: 8-, 16-, 24- or 32-bit PCM), channels
averaged to mono, resampled to the feature extractor's rate (16 kHz) by linear interpolation only
when the file's rate differs (ROLL reads with librosa's band-limited resampler, so such files give
slightly different features there), then zero-padded to a whole number of hops (160 samples): vLLM
pads each audio so before its feature extractor, and roll sends it the padded waveform, so both
compute the same frames.
"""

from __future__ import annotations

import wave
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

AUDIO_PLACEHOLDER = "<audio>"  # one audio of a prompt (ROLL's {"type": "audio"} part)
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
# The forward's audio inputs, as transformers' thinker takes them (``input_features`` [audios, mel,
# frames], ``feature_attention_mask`` [audios, frames]).
AUDIO_INPUT_KEYS = ("input_features", "feature_attention_mask")
_PCM = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}


def read_wav(path: str | Path, rate: int) -> np.ndarray:
    """[samples] float32 in [-1, 1]: the wav file's channels averaged, at ``rate`` samples per second
    (linear interpolation when the file's rate differs). ValueError naming what is wrong."""
    with wave.open(str(path), "rb") as f:
        width, channels, file_rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
        raw = f.readframes(f.getnframes())
    if width == 3:  # 24-bit: widen each sample to 32 bits
        raw = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        raw = np.concatenate([np.zeros((len(raw), 1), np.uint8), raw], axis=1).tobytes()
        width = 4
    if width not in _PCM:
        raise ValueError(f"{width * 8}-bit samples (roll reads 8-, 16-, 24- and 32-bit PCM)")
    dtype, offset, scale = _PCM[width]
    samples = (np.frombuffer(raw, dtype).astype(np.float32) - offset) / scale
    samples = samples.reshape(-1, channels).mean(axis=1)
    if not len(samples):
        raise ValueError("no samples")
    if file_rate != rate:
        times = np.arange(round(len(samples) * rate / file_rate)) * (file_rate / rate)
        samples = np.interp(times, np.arange(len(samples)), samples).astype(np.float32)
    return samples


def pad_to_hop(samples: np.ndarray, hop: int) -> np.ndarray:
    """``samples`` zero-padded to a multiple of ``hop`` (as vLLM pads before its feature extractor)."""
    extra = -len(samples) % hop
    return np.pad(samples, (0, extra)) if extra else samples


def audio_token_count(frames: int, n_window: int) -> int:
    """How many audio tokens ``frames`` feature frames become in Qwen3-Omni's audio tower: per window
    of ``2 * n_window`` frames three stride-2 convolutions (13 tokens for a whole 100-frame window),
    the rest likewise."""
    window = 2 * n_window
    rest = frames % window
    length = (rest - 1) // 2 + 1
    return ((length - 1) // 2 + 1 - 1) // 2 + 1 + (frames // window) * 13


@dataclass
class AudioProcessor:
    """The model's feature extractor and how one waveform becomes audio tokens."""

    feature_extractor: Any = field(repr=False)
    audio_token_id: int
    n_window: int

    @classmethod
    def load(cls, path: str, tokenizer: Any, config: dict[str, Any]) -> AudioProcessor | None:
        """The audio side of a model directory whose ``config`` (config.json's dict) has an audio
        tower (``thinker_config.audio_config``); None for any other model. ValueError when the
        directory has no feature extractor or the tokenizer no ``<|audio_pad|>``."""
        thinker = config.get("thinker_config") or {}
        audio = thinker.get("audio_config") if isinstance(thinker, dict) else None
        if not isinstance(audio, dict):
            return None
        from transformers import AutoFeatureExtractor

        try:
            extractor = AutoFeatureExtractor.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the audio feature extractor of {path!r}: {exc}") from None
        token_id = tokenizer.convert_tokens_to_ids(AUDIO_PAD)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer of {path!r} has no {AUDIO_PAD} token")
        return cls(extractor, int(token_id), int(audio.get("n_window", 50)))

    @property
    def sampling_rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    def read(self, path: str | Path) -> np.ndarray:
        """The waveform of a wav file as the feature extractor takes it (``read_wav`` at its rate,
        ``pad_to_hop``)."""
        return pad_to_hop(read_wav(path, self.sampling_rate), int(self.feature_extractor.hop_length))

    def frames(self, samples: np.ndarray) -> int:
        """Feature frames of a hop-padded waveform (the feature extractor's valid frames)."""
        return len(samples) // int(self.feature_extractor.hop_length)

    def audio_tokens(self, waves: Sequence[np.ndarray]) -> list[int]:
        """How many ``<|audio_pad|>`` tokens each waveform becomes."""
        return [audio_token_count(self.frames(w), self.n_window) for w in waves]

    def audio_inputs(self, waves: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """``input_features`` [audios, mel, frames] and ``feature_attention_mask`` [audios, frames]
        of ``waves``: each audio through the feature extractor alone (its features do not depend on
        the others), then zero-padded to the longest."""
        feats = [
            self.feature_extractor(
                w, sampling_rate=self.sampling_rate, padding="longest", truncation=False, return_tensors="pt"
            )["input_features"][0, :, : self.frames(w)]
            for w in waves
        ]
        return concat_audio_inputs(
            [
                {
                    "input_features": f[None],
                    "feature_attention_mask": torch.ones(1, f.shape[-1], dtype=torch.long),
                }
                for f in feats
            ]
        )


def concat_audio_inputs(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The audio inputs of several rows (``AUDIO_INPUT_KEYS`` each) as one: frames zero-padded to the
    longest (the mask 0 there), audios in order."""
    width = max(p["feature_attention_mask"].shape[-1] for p in parts)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    return {
        "input_features": torch.cat([padded(p["input_features"]) for p in parts]),
        "feature_attention_mask": torch.cat([padded(p["feature_attention_mask"]) for p in parts]),
    }
