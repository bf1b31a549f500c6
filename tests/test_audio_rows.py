"""Audio rows for Qwen3-Omni's thinker (roll.models.audio, roll.pipeline.rlvr.data.audio): ROLL's
audio layout read with the tiny model's processors into prompt ids and Batch fields, wav files read
with the stdlib, and vLLM's prompts of them; no engine, no megatron."""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_qwen3_omni import build_tiny_qwen3_omni_dir, write_wav  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.role import DataArgs  # noqa: E402
from roll.distributed.strategy.engine_vision import vision_tokens, vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.models.audio import audio_token_count, read_wav  # noqa: E402
from roll.models.vision import MULTI_MODAL_DATA, MULTI_MODAL_INPUTS, VisionProcessor, forward_kwargs  # noqa: E402
from roll.pipeline.rlvr.data.audio import AUDIO_TEST_TEMPLATE  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 160
SECONDS = (1.0, 0.37)  # 100 frames (13 tokens) and 37 frames (5 tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_qwen3_omni_dir(tmp_path_factory.mktemp("omni") / "model")


def write_audio_rows(root: Path) -> Path:
    """ROLL's audio rows (as its audio_test_80G.yaml reads them): two under ``root / "audios"``."""
    (root / "audios").mkdir(exist_ok=True)
    rows = []
    for i, seconds in enumerate(SECONDS):
        write_wav(root / "audios" / f"{i}.wav", seconds, pitch=300.0 + 200 * i)
        rows.append(
            {
                "prompt": f"How many words in clip {i}?",
                "audios": [f"{i}.wav"],
                "data_source": "the-mc-speech-dataset",
                "reward_model": {"ground_truth": str(i + 2)},
            }
        )
    path = root / "speech.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def audio_prompts(model: Path, root: Path):
    processor = VisionProcessor.load(str(model))
    path = write_audio_rows(root)
    args = DataArgs(
        file_name=[str(path)], messages="prompt", row_layout="audio_test", audio_folder=str(root / "audios")
    )
    rows = load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor)
    return processor, rows


def test_audio_rows_become_prompt_ids_and_batch_fields(model: Path, tmp_path: Path) -> None:
    processor, rows = audio_prompts(model, tmp_path)
    assert len(rows) == 2 and not rows.bad_rows
    audio_id = processor.audio.audio_token_id
    for row, tokens in zip(rows, (13, 5)):
        assert row.tag == "the-mc-speech-dataset" and row.ground_truth in ("2", "3")
        assert AUDIO_TEST_TEMPLATE.split("{Question}")[1] in row.prompt_text
        assert row.prompt_ids.count(audio_id) == tokens  # the tower's count of 100 (37) frames
        assert row.prompt_text.index("<|audio_start|><|audio_pad|><|audio_end|>") < row.prompt_text.index(
            "How"
        )
    batch = to_batch(rows.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    inputs = batch[MULTI_MODAL_INPUTS]
    assert [tuple(r["input_features"].shape) for r in inputs] == [(1, 32, 100), (1, 32, 37)]
    assert [int(r["feature_attention_mask"].sum()) for r in inputs] == [100, 37]
    # the features are the feature extractor's own of the wav's samples
    wave0 = read_wav(tmp_path / "audios" / "0.wav", 16000)
    want = processor.audio.feature_extractor(
        wave0, sampling_rate=16000, return_tensors="pt", padding="longest"
    )
    assert torch.equal(inputs[0]["input_features"], want["input_features"][..., :100])
    # a forward's inputs: rows padded to the longest, the mask saying which frames are real
    kwargs = forward_kwargs(batch, "cpu")
    assert kwargs["input_features"].shape == (2, 32, 100)
    assert kwargs["feature_attention_mask"].sum(-1).tolist() == [100, 37]
    assert torch.equal(kwargs["input_features"][1, :, :37], inputs[1]["input_features"][0])
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    counts = _get_feat_extract_output_lengths(kwargs["feature_attention_mask"].sum(-1))
    assert counts.tolist() == [13, 5]  # transformers' count of the tokens roll wrote
    # vLLM: one audio token per audio, the hop-padded 16 kHz waveform
    data = batch[MULTI_MODAL_DATA]
    assert [len(d["audio"][0]) for d in data] == [16000, 5920]  # 0.37 s = 5920 samples, 37 hops
    tokens = vision_tokens(str(model))
    prompts = vllm_prompts(batch, prompt_token_lists(batch), tokens.image, tokens.video, None, tokens.audio)
    assert [p["prompt_token_ids"].count(audio_id) for p in prompts] == [1, 1]
    assert np.array_equal(prompts[0]["multi_modal_data"]["audio"][0], data[0]["audio"][0])
    assert audio_id in tokens.bias  # responses hold no audio tokens


def test_audio_token_count_is_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    frames = torch.tensor([1, 2, 37, 99, 100, 101, 150, 250, 3000])
    want = _get_feat_extract_output_lengths(frames).tolist()
    assert [audio_token_count(int(f), 50) for f in frames] == want


def test_read_wav_mixes_channels_and_resamples(tmp_path: Path) -> None:
    """Stereo 8 kHz 16-bit: channels averaged, then linear interpolation to 16 kHz (twice the
    samples); a 16 kHz file is read as it is."""
    left = (np.arange(800) % 100 * 300).astype("<i2")
    right = np.zeros(800, "<i2")
    with wave.open(str(tmp_path / "s.wav"), "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(np.stack([left, right], 1).tobytes())
    got = read_wav(tmp_path / "s.wav", 16000)
    assert len(got) == 1600
    assert np.allclose(got[::2], left / 2 / 32768.0) and np.isclose(got[1], (left[0] + left[1]) / 4 / 32768)
    tone = read_wav(write_wav(tmp_path / "t.wav", 0.1), 16000)
    assert len(tone) == 1600 and abs(float(tone.max()) - 0.5) < 1e-3


def test_bad_audio_file_is_one_error_naming_row_and_file(model: Path, tmp_path: Path) -> None:
    processor = VisionProcessor.load(str(model))
    path = write_audio_rows(tmp_path)
    (tmp_path / "audios" / "1.wav").write_bytes(b"not a wav")
    folder = str(tmp_path / "audios")
    args = DataArgs(file_name=[str(path)], messages="prompt", row_layout="audio_test", audio_folder=folder)
    with pytest.raises(ConfigError, match=r"speech.jsonl:2: audio 0 \(.*1.wav'\) cannot be read"):
        load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor)
    args = DataArgs(file_name=[str(path)], messages="prompt", row_layout="audio_test")  # not under audios/
    with pytest.raises(
        ConfigError, match=r"speech.jsonl:1: audio 0 \('0.wav'\) cannot be read: .*No such file"
    ):
        load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor)


def test_audio_rows_need_a_model_with_an_audio_tower(tmp_path: Path) -> None:
    from tiny_qwen3_vl import build_tiny_qwen3_vl_dir

    processor = VisionProcessor.load(str(build_tiny_qwen3_vl_dir(tmp_path / "vl")))
    args = DataArgs(file_name=[str(write_audio_rows(tmp_path))], messages="prompt", row_layout="audio_test")
    with pytest.raises(ConfigError, match="has audios but the model has no audio tower"):
        load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor)
