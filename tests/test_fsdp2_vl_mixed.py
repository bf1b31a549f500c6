"""fsdp2_train with a vision-language model when ranks differ in what their rows hold: one rank's
micro-batch has images and another's is text-only (RLVR data mixes them). FSDP2 shards each vision
block as its own unit, so a rank that skipped the tower would skip its all-gathers and
reduce-scatters while the other ran them (gloo aborts, NCCL hangs). Two gloo ranks on CPU (fp32),
the tiny Qwen2.5-VL of tests/tiny_vl.py.

What is checked, against transformers' model run alone in this process on each rank's rows:
- the log-probs of each rank are bit for bit those of its rows alone (the image rank's as if every
  rank had images, the text rank's as a text-only run), with and without ``reshard_after_forward``;
- the train step's gradient is bit for bit the mean of the two ranks' gradients computed alone,
  so the text rank's vision-tower gradient is exactly zero;
- micro-batches re-formed by ``max_tokens_per_microbatch`` (rows of both kinds dealt to both ranks)
  and a rank whose micro-batch has images and videos (two tower calls) against one with images only;
- a frozen tower (``freeze_module_prefix: model.visual``) runs too.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import process_group, spawn_ranks
from tiny_vl import build_tiny_vl_dir, detection_rows, math_rows
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.core.batch import Batch, object_array
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.generation import build_generation_batch
from roll.distributed.strategy.registry import load_strategy_class
from roll.models.loading import load_model
from roll.models.logprobs import response_log_probs
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor, freeze_prefixes

sys.path.insert(0, str(Path(__file__).parent / "megatron"))
from vl_cases import PROMPT_LENGTH, RESPONSE_LENGTH, rows_prompts  # noqa: E402

torch.set_num_threads(1)
TEXT_PROMPTS = ["What color is red?", "How many boxes are there? 0123", "blue red", "The answer is 2."]


def rows_batch(model: Path, scratch: Path) -> Batch:
    """Rows 0-3 with one image each (sizes differ), rows 4-7 text-only; random responses."""
    processor = VisionProcessor.load(str(model))
    rows = detection_rows(scratch / "images", 2) + math_rows(scratch / "images", 2)
    rows += [
        {"data_source": "text", "prompt": [{"role": "user", "content": t}], "ground_truth": "2"}
        for t in TEXT_PROMPTS
    ]
    prompts = rows_prompts(processor, scratch, rows)
    gen = torch.Generator().manual_seed(0)
    responses = [
        torch.randint(3, 300, (RESPONSE_LENGTH - i % 3,), generator=gen).tolist() for i in range(len(prompts))
    ]
    out = build_generation_batch(
        prompts, responses, None, 1, processor.tokenizer.pad_token_id, RESPONSE_LENGTH
    )
    assert [bool(r) for r in out[MULTI_MODAL_INPUTS]] == [True] * 4 + [False] * 4
    return out


def as_video_row(batch: Batch, row: int, config) -> Batch:
    """An image row turned into a one-temporal-patch video row: its image tokens become video tokens
    and its ``pixel_values``/``image_grid_thw`` the video's (the tower runs on them alike)."""
    out = batch.index([row])
    ids = out["input_ids"].clone()
    ids[ids == config.image_token_id] = config.video_token_id
    out.tensors["input_ids"] = ids
    inputs = out[MULTI_MODAL_INPUTS][0]
    video = {
        "pixel_values_videos": inputs["pixel_values"],
        "video_grid_thw": inputs["image_grid_thw"],
        "second_per_grid_ts": torch.ones(len(inputs["image_grid_thw"])),
    }
    out.non_tensors[MULTI_MODAL_INPUTS] = object_array([video])
    return out


def video_case(batch: Batch, config) -> list[Batch]:
    """Rank 0: an image row and a video row (two tower calls); rank 1: an image row and a text row."""
    return [Batch.concat([batch.index([2]), as_video_row(batch, 3, config)]), batch.index([0, 7])]


def policy_loss(outputs: dict[str, torch.Tensor], micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token mean of -log p; says no ``loss_agg_mode``, so each rank's micro-batches weigh alike."""
    mask = micro["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _token_loss(outputs: dict, micro: Batch, loss_agg_mode: str) -> tuple[torch.Tensor, dict[str, float]]:
    return policy_loss(outputs, micro)


# The same loss, weighted by its tokens' share over all micro-batches and ranks (roll.models.microbatch).
token_mean_loss = functools.partial(_token_loss, loss_agg_mode="token-mean")


def role_config(model: str, freeze: bool = False, **config) -> RoleConfig:
    return RoleConfig(
        model_args=ModelArgs(
            model_name_or_path=model, dtype="fp32", freeze_module_prefix=["model.visual"] if freeze else None
        ),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=0.0),
        strategy_args=StrategyArgs("fsdp2_train", strategy_config=config),
        infer_batch_size=2,
    )


def make_strategy(model: str, rank: int, world_size: int, device: str, freeze: bool = False, **config):
    ctx = WorkerContext("actor_train", rank, world_size, rank, torch.device(device), seed=42)
    strategy = load_strategy_class("fsdp2_train")(role_config(model, freeze, **config), ctx)
    strategy.initialize()
    return strategy


def step_grads(strategy, micro_batches: list[Batch], loss_fn=policy_loss) -> dict[str, torch.Tensor]:
    """The full gradients of one train step (taken at clipping; the update is skipped)."""
    box: dict = {}

    def clip() -> float:
        box["grads"] = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu()
            for n, p in strategy.model.named_parameters()
            if p.grad is not None
        }
        return float("nan")

    strategy._clip_gradients = clip
    strategy.train_step(micro_batches, loss_fn)
    return box["grads"]


def _worker(rank: int, world_size: int, port: int, model: str, scratch: str, device: str) -> None:
    """Every case on this rank (``device`` "cpu", or "cuda": this rank's GPU over NCCL)."""
    device = f"cuda:{rank}" if device == "cuda" else device
    if device.startswith("cuda"):  # fp32 as on CPU: cuDNN runs the tower's Conv3d in TF32 by default
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    batch = torch.load(Path(scratch, "batch.pt"), weights_only=False)
    mine = batch.index([0, 1] if rank == 0 else [4, 5])  # rank 0: image rows, rank 1: text rows
    out: dict = {}
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        strategy = make_strategy(model, rank, world_size, device)
        out["log_probs"] = strategy.compute_log_probs(mine)["log_probs"]
        out["grads"] = step_grads(strategy, [mine])
        kept = make_strategy(model, rank, world_size, device, reshard_after_forward=False)
        out["log_probs_kept"] = kept.compute_log_probs(mine)["log_probs"]
        out["grads_kept"] = step_grads(kept, [mine])
        # Every rank holds both kinds of rows; micro-batches by tokens deal them out afresh.
        both = batch.index([0, 4, 5, 6] if rank == 0 else [1, 2, 7, 3])
        strategy.config.max_tokens_per_microbatch = 2 * (PROMPT_LENGTH + RESPONSE_LENGTH)
        strategy.config.infer_max_tokens_per_microbatch = PROMPT_LENGTH + RESPONSE_LENGTH
        out["log_probs_budget"] = strategy.compute_log_probs(both)["log_probs"]
        out["grads_budget"] = step_grads(strategy, [both], token_mean_loss)
        strategy.config.max_tokens_per_microbatch = strategy.config.infer_max_tokens_per_microbatch = None
        # Rank 0: an image row and a video row (two tower calls); rank 1: an image row and a text row.
        mixed = video_case(batch, strategy.model.config)[rank]
        out["log_probs_video"] = strategy.compute_log_probs(mixed)["log_probs"]
        out["grads_video"] = step_grads(strategy, [mixed])
        frozen = make_strategy(model, rank, world_size, device, freeze=True)
        out["log_probs_frozen"] = frozen.compute_log_probs(mine)["log_probs"]
        out["grads_frozen"] = step_grads(frozen, [mine])
    torch.save(out, Path(scratch, f"rank{rank}.pt"))


def _alone(model: str, rows: Batch, freeze: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(log-probs, gradient of policy_loss) of transformers' model on ``rows`` alone, as fsdp2_train
    loads it (activation checkpointing on)."""
    args = role_config(model, freeze).model_args
    hf = load_model(args, training=True)
    freeze_prefixes(hf, args.freeze_module_prefix, "model_args.freeze_module_prefix")
    logps = response_log_probs(hf, rows)["log_probs"]
    policy_loss({"log_probs": logps}, rows)[0].backward()
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    hf.eval()
    with torch.no_grad():
        return response_log_probs(hf, rows)["log_probs"], grads


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("fsdp2_vl_mixed")
    model = build_tiny_vl_dir(scratch / "model", seed=0, std=0.1)
    batch = rows_batch(model, scratch)
    torch.save(batch, scratch / "batch.pt")
    spawn_ranks(_worker, 2, str(model), str(scratch), "cpu")
    ranks = [torch.load(scratch / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return str(model), batch, ranks


def _mean(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (a.get(n, 0) + b.get(n, 0)) / 2 for n in a.keys() | b.keys()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())[:4]}"
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def test_image_and_text_ranks_score_and_train_as_each_alone(setup) -> None:
    model, batch, (image_rank, text_rank) = setup
    image_logps, image_grads = _alone(model, batch.index([0, 1]))
    text_logps, text_grads = _alone(model, batch.index([4, 5]))
    assert not any(n.startswith("model.visual.") for n in text_grads)  # the tower is off a text forward
    for key in ("log_probs", "log_probs_kept"):
        assert torch.equal(image_rank[key], image_logps), key
        assert torch.equal(text_rank[key], text_logps), key
    want = _mean(image_grads, text_grads)  # FSDP2 averages over the ranks; the text rank adds 0
    assert any(n.startswith("model.visual.") for n in want)
    for key in ("grads", "grads_kept"):
        _assert_equal(image_rank[key], want, key)
        _assert_equal(text_rank[key], want, key)


def test_micro_batches_by_tokens_deal_both_kinds_to_both_ranks(setup) -> None:
    model, batch, (rank0, rank1) = setup
    rows = batch.index([0, 4, 5, 6, 1, 2, 7, 3])
    hf = load_model(role_config(model).model_args, training=True)
    token_mean_loss(response_log_probs(hf, rows), rows)[0].backward()
    hf.eval()
    with torch.no_grad():
        logps = response_log_probs(hf, rows)["log_probs"]
    got = torch.cat([rank0["log_probs_budget"], rank1["log_probs_budget"]])
    torch.testing.assert_close(got, logps, rtol=0, atol=1e-6)
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    for rank in (rank0, rank1):  # the whole mini-batch's token mean, summed in another order
        assert rank["grads_budget"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(rank["grads_budget"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_rank_with_images_and_videos_and_one_with_images(setup) -> None:
    model, batch, ranks = setup
    cases = video_case(batch, AutoConfig.from_pretrained(model))
    alone = [_alone(model, rows) for rows in cases]
    for rank, (logps, _) in zip(ranks, alone):
        assert torch.equal(rank["log_probs_video"], logps)
    want = _mean(alone[0][1], alone[1][1])
    for rank in ranks:
        _assert_equal(rank["grads_video"], want, "videos")


def test_frozen_tower_runs_on_a_text_rank(setup) -> None:
    model, batch, (image_rank, text_rank) = setup
    image_logps, image_grads = _alone(model, batch.index([0, 1]), freeze=True)
    text_logps, text_grads = _alone(model, batch.index([4, 5]), freeze=True)
    assert torch.equal(image_rank["log_probs_frozen"], image_logps)
    assert torch.equal(text_rank["log_probs_frozen"], text_logps)
    want = _mean(image_grads, text_grads)
    assert not any(n.startswith("model.visual.") for n in want)
    _assert_equal(text_rank["grads_frozen"], want, "frozen")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_image_and_text_ranks_on_two_gpus(setup, tmp_path) -> None:
    """The same cases over NCCL (where a mismatch hangs rather than aborts), fp32 on 2 GPUs."""
    model, batch, _ = setup
    torch.save(batch, tmp_path / "batch.pt")
    spawn_ranks(_worker, 2, model, str(tmp_path), "cuda")
    image_rank, text_rank = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    image_logps, image_grads = _alone(model, batch.index([0, 1]))
    text_logps, text_grads = _alone(model, batch.index([4, 5]))
    for key in ("log_probs", "log_probs_kept"):
        torch.testing.assert_close(image_rank[key], image_logps, rtol=0, atol=1e-4)
        torch.testing.assert_close(text_rank[key], text_logps, rtol=0, atol=1e-4)
    want = _mean(image_grads, text_grads)
    for rank in (image_rank, text_rank):
        assert rank["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-3, atol=1e-5, msg=name)
        assert rank["grads_video"] and rank["grads_budget"] and rank["grads_frozen"]
