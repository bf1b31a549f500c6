"""What the GPU tests of the engine strategies (``vllm``, ``sglang``) on vision-language models share:
the tiny Qwen2.5-VL pair and its image rows, roll's prompt Batches of them, transformers' sampled
log-probs, and the generate / load_weights checks against transformers (bf16 tolerance,
tests/engine_gpu.py).

>>> root, a, b = save_vl_models(tmp_path)                  # two tiny Qwen2.5-VLs, prompts.jsonl of image rows
>>> check_generate(engine, vl_prompts(root, a), a, "generate with images")
>>> check_load_weights(engine, vl_prompts(root, a), b)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from engine_gpu import assert_close
from tiny_vl import VIDEO_ARGS, build_tiny_vl_dir, detection_rows, math_rows, video_r1_rows

from roll.configs.role import DataArgs
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.models.logprobs import response_log_probs
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor
from roll.pipeline.rlvr.data.dataset import load_prompt_files
from roll.pipeline.rlvr.data.sampler import to_batch

PROMPT_LENGTH = 64
VIDEO_PROMPT_LENGTH = 600  # the tiny tokenizer spends ~530 tokens on Video-R1's template


def save_image_rows(root: Path) -> None:
    """``root / "prompts.jsonl"``: four detection rows and two counting rows (images under ``root``)."""
    rows = detection_rows(root / "images", 4) + math_rows(root / "images", 2)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def save_vl_models(root: Path) -> tuple[Path, Path, Path]:
    """(root, a, b): two tiny Qwen2.5-VLs of other weights (``a`` the engine's, ``b`` the update's)
    and ``save_image_rows``' prompts."""
    a = build_tiny_vl_dir(root / "a", seed=0, full_processor=True, std=0.1)
    b = build_tiny_vl_dir(root / "b", seed=1, full_processor=True, std=0.1)
    save_image_rows(root)
    return root, a, b


def vl_prompts(root: Path, model_dir: Path) -> Batch:
    processor = VisionProcessor.load(str(model_dir))
    args = DataArgs(file_name=[str(root / "prompts.jsonl")], messages="prompt")
    rows = load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "data_args", processor)
    assert len(rows) == 6 and not rows.bad_rows
    return to_batch(rows.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def video_prompts(
    root: Path, model_dir: Path, video_args: dict | None = None, prompt_length: int = VIDEO_PROMPT_LENGTH
) -> Batch:
    """Two Video-R1 rows through roll's data path (``video_args``: the model's frame options,
    Qwen2.5-VL's by default)."""
    pytest.importorskip("av")  # the frames are decoded with PyAV
    processor = VisionProcessor.load(str(model_dir))
    (root / "videos.json").write_text(json.dumps(video_r1_rows(root / "videos", 2)))
    args = DataArgs(
        file_name=[str(root / "videos.json")], row_layout="video_r1", **(video_args or VIDEO_ARGS)
    )
    rows = load_prompt_files(args, processor.tokenizer, prompt_length, "data_args", processor)
    assert len(rows) == 2 and not rows.bad_rows
    return to_batch(rows.rows, processor.tokenizer.pad_token_id, prompt_length, processor)


SGLANG_LOG_DIR = Path(os.environ.get("ROLL_SGLANG_LOG_DIR", "/tmp/roll_sglang_logs"))


def sglang_logs_to(name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``SGLANG_LOG_DIR / f"{name}.log"`` (env ROLL_SGLANG_LOG_DIR), where every SGLang process of
    the engines started after this (the schedulers too: they read
    ``SGLANG_LOGGING_CONFIG_PATH`` when they configure logging) logs to stderr and to ``path``, so a
    scheduler's traceback ("Scheduler hit an exception") survives the engine killing this process
    (a dead scheduler makes SGLang's engine SIGKILL its own process, pytest here) and stderr shows it
    with ``pytest -s``."""
    SGLANG_LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = SGLANG_LOG_DIR / f"{name}.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "[%(asctime)s %(process)d] %(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"},
            "file": {"class": "logging.FileHandler", "formatter": "plain", "filename": str(path)},
        },
        "root": {"level": "INFO", "handlers": ["stderr", "file"]},
    }
    config_file = path.with_suffix(".logging.json")
    config_file.write_text(json.dumps(config))
    monkeypatch.setenv("SGLANG_LOGGING_CONFIG_PATH", str(config_file))
    print(f"SGLang logs: {path}")
    return path


def hf_vl(path: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


@torch.no_grad()
def hf_sampled_logprobs(model, out) -> torch.Tensor:
    device = next(model.parameters()).device
    return response_log_probs(model, out.to(device), temperature=1.0)["log_probs"].cpu()


def row_modalities(batch: Batch) -> list[str]:
    """Each row's media by its ``multi_modal_inputs``: "image", "video", "image+video" or "text"."""
    rows = batch[MULTI_MODAL_INPUTS] if MULTI_MODAL_INPUTS in batch else [None] * len(batch)
    out = []
    for inputs in rows:
        inputs = inputs or {}
        kinds = [k for k, key in (("image", "image_grid_thw"), ("video", "video_grid_thw")) if key in inputs]
        out.append("+".join(kinds) or "text")
    return out


def print_row_diffs(got: torch.Tensor, want: torch.Tensor, out: Batch, what: str) -> None:
    """Each row's mean and max |log-prob difference| over its response, named by the row's media (a
    GPU run then says which rows are off before assert_close fails)."""
    mask = out["response_mask"]
    for row, label in enumerate(row_modalities(out)):
        diff = (got[row].float() - want[row].float()).abs()[mask[row].bool()]
        if diff.numel():
            print(f"{what} row {row} ({label}): mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")


def check_generate(engine, prompts: Batch, model_dir: Path, what: str) -> None:
    """Two samples of each prompt keep roll's expanded prompt ids, and their sampled-token log-probs
    equal transformers' forward on ``model_dir`` (the engine's weights); each row's difference is
    printed first."""
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert out["responses"].shape[0] == 2 * len(prompts)
    assert torch.equal(out["prompts"][::2], prompts["prompts"])  # roll's expanded ids stay in the batch
    assert out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_vl(model_dir), out)
    print_row_diffs(out["infer_logprobs"], want, out, what)
    assert_close(out["infer_logprobs"], want, out["response_mask"], what)


def check_generate_moe(engine, prompts: Batch, model_dir: Path, what: str) -> None:
    """``check_generate`` for a MoE model: ``assert_close_moe`` (each token's difference beyond what
    a one-step bf16 change of the routers moves transformers' own log-prob, ``routing_moves``)."""
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert out["responses"].shape[0] == 2 * len(prompts)
    assert torch.equal(out["prompts"][::2], prompts["prompts"])
    assert_close_moe(out["infer_logprobs"], hf_vl(model_dir), out, what)


BF16_STEP = 2.0**-7  # one bf16 step, relative


def assert_close_moe(got: torch.Tensor, model, out: Batch, what: str) -> torch.Tensor:
    """``got`` (the engine's log-probs of ``out``'s responses) against transformers' on a MoE
    ``model``, token by token beyond transformers' own noise (``assert_close_beyond``, with
    ``routing_moves``); returns the moves, for other comparisons of the same tokens."""
    want = hf_sampled_logprobs(model, out)
    print_row_diffs(got, want, out, what)
    moves = routing_moves(model, out, want)
    assert_close_beyond(got, want, moves, out["response_mask"], what)
    return moves


def assert_close_beyond(
    got: torch.Tensor, want: torch.Tensor, moves: torch.Tensor, mask: torch.Tensor, what: str
) -> None:
    """``assert_close`` on ``max(|got - want| - moves, 0)``: ``moves`` is how far one-step bf16
    changes of the routers move transformers' log-prob of each token (``routing_moves``). A token on
    a near tie between experts, which bf16 noise in any implementation may route either way, gets
    the room its tie gives, every other token almost none. ``moves`` comes from transformers alone,
    never from the numbers compared; the plain differences are printed too."""
    mask = mask.bool()
    diff = (got.float() - want.float()).abs()
    print(
        f"{what}: every token mean |diff| {diff[mask].mean():.4g}, max {diff[mask].max():.4g}; the routers' "
        f"bf16 step moves transformers by mean {moves[mask].mean():.4g}, max {moves[mask].max():.4g}"
    )
    excess = (diff - moves).clamp(min=0)
    assert_close(excess, torch.zeros_like(excess), mask, f"{what} (beyond the routers' bf16 step)")


@torch.no_grad()
def routing_moves(model, out: Batch, want: torch.Tensor, draws: int = 8) -> torch.Tensor:
    """[B, R]: the most that ``draws`` random one-step bf16 changes of every MoE router's weights
    (``mlp.gate.weight``, each scaled by 1 + N(0, 1) * BF16_STEP) move transformers' log-prob of
    the sampled token (``want``: the unchanged log-probs). The routers are restored after."""
    routers = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert routers, "no MoE router (mlp.gate.weight) in the model"
    saved = [p.detach().clone() for p in routers]
    gen = torch.Generator(device=saved[0].device).manual_seed(0)
    moves = torch.zeros_like(want, dtype=torch.float32)
    try:
        for _ in range(draws):
            for param, weight in zip(routers, saved, strict=True):
                noise = torch.randn(weight.shape, generator=gen, device=weight.device)
                param.copy_((weight.float() * (1 + BF16_STEP * noise)).to(weight.dtype))
            moves = torch.maximum(moves, (hf_sampled_logprobs(model, out) - want).abs().float())
    finally:
        for param, weight in zip(routers, saved, strict=True):
            param.copy_(weight)
    return moves


def check_load_weights(engine, prompts: Batch, new_dir: Path) -> None:
    """The engine does not sample like ``new_dir``'s weights until load_weights gets them under
    transformers 5's module names (``model.visual.*``, ``model.language_model.*``); then it does."""
    new = hf_vl(new_dir)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5)
    before = engine.generate(prompts, params)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(
            before["infer_logprobs"], hf_sampled_logprobs(new, before), before["response_mask"], "old"
        )
    names = [name for name, _ in new.state_dict().items()]
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    engine.load_weights((name, t) for name, t in new.state_dict().items())
    after = engine.generate(prompts, params)
    assert_close(
        after["infer_logprobs"], hf_sampled_logprobs(new, after), after["response_mask"], "new weights"
    )
