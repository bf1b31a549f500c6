"""Vision-language prompt rows on CPU: reading ROLL's layout (JSONL and parquet) and its errors, the
Batch carrying each row's own vision inputs through the generation layout, splits, joins and
pickling (Ray), hf_infer generating and scoring with them, and the prompts vLLM is sent."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_vl import build_tiny_vl_dir, detection_rows, math_rows  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.role import DataArgs, ModelArgs, RoleConfig, StrategyArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.distributed.strategy.engine_vision import vision_tokens, vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch, prompt_token_lists  # noqa: E402
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor, forward_kwargs  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 48


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_batch")
    model = build_tiny_vl_dir(root / "model", seed=0, std=0.1)
    return root, model, VisionProcessor.load(str(model))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path: Path, processor, **args):
    data_args = DataArgs(file_name=[str(path)], messages="prompt", **args)
    return load_prompt_files(
        data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor
    )


def prompts(setup, n_det: int = 3, n_math: int = 2) -> Batch:
    root, _, processor = setup
    rows = detection_rows(root / "images", n_det) + math_rows(root / "images", n_math)
    dataset = load(write_jsonl(root / "rows.jsonl", rows), processor)
    return to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def test_rows_read_in_rolls_layout(setup):
    batch = prompts(setup)
    assert list(batch["tag"]) == ["v3det_train"] * 3 + ["mm_math"] * 2  # data_source
    assert batch["ground_truth"][3] == "\\boxed{1}"  # reward_model.ground_truth
    pad = setup[2].image_token_id
    for i, mm in enumerate(batch[MULTI_MODAL_INPUTS]):
        tokens = int((batch["prompts"][i] == pad).sum())
        assert tokens == int(mm["image_grid_thw"].prod()) // 4  # one token per 2 x 2 merged patches
        assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod())
    context = batch["reward_context"][0]
    assert context["verifier_parm"]["det_verifier_normalized"] is True
    assert context["image_sizes"] == [[56, 56]]  # the 56 x 56 image as the model saw it
    assert len(batch["multi_modal_data"][1]["image"]) == 1


def test_batch_keeps_each_rows_vision_inputs_through_splits_joins_and_pickling(setup):
    batch = prompts(setup, n_det=3, n_math=1)
    n = 2
    responses = [[5, 6]] * (len(batch) * n)
    out = build_generation_batch(batch, responses, None, n, pad_token_id=0, response_length=4)
    parts = [pickle.loads(pickle.dumps(p)) for p in out.chunk(2)]  # what Ray does per DP rank
    again = Batch.concat(parts).index([7, 0, 3])
    rows = list(again[MULTI_MODAL_INPUTS])
    for got, src in zip(rows, [3, 0, 1]):  # generated row i * n + j belongs to prompt i
        assert torch.equal(got["pixel_values"], batch[MULTI_MODAL_INPUTS][src]["pixel_values"])
    kwargs = forward_kwargs(again, "cpu")
    sizes = [int(r["image_grid_thw"].prod()) for r in rows]
    assert kwargs["pixel_values"].shape[0] == sum(sizes)  # concatenated in row order
    assert torch.equal(kwargs["pixel_values"][: sizes[0]], rows[0]["pixel_values"])
    assert torch.equal(kwargs["image_grid_thw"], torch.cat([r["image_grid_thw"] for r in rows]))


def _hf_infer(model, role: str, infer_batch_size: int):
    """An initialised fp32 hf_infer strategy on CPU for the tiny VL model, as ``role`` rank 0 of 1."""
    from roll.distributed.strategy.hf_strategy import HFInferStrategy

    config = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(model), dtype="fp32"),
        strategy_args=StrategyArgs("hf_infer", {}),
        infer_batch_size=infer_batch_size,
    )
    ctx = WorkerContext(role=role, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), seed=1)
    strategy = HFInferStrategy(config, ctx)
    strategy.initialize()
    return strategy


def test_hf_infer_generates_and_scores_with_images(setup):
    _, model, _ = setup
    strategy = _hf_infer(model, "actor_infer", 2)
    batch = prompts(setup, n_det=2, n_math=1)
    out = strategy.generate(
        batch, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=0, logprobs=True)
    )
    assert out["responses"].shape == (6, 6)
    scored = strategy.compute_log_probs(out)["log_probs"]
    mask = out["response_mask"].bool()
    # generate's per-step log-probs (the cache, rope deltas of left-padded rows) equal one forward's
    assert torch.allclose(scored[mask], out["infer_logprobs"][mask], atol=1e-4)


def test_vllm_prompts_collapse_image_tokens_and_carry_the_images(setup):
    _, model, processor = setup
    batch = prompts(setup, n_det=2, n_math=0)
    token = vision_tokens(str(model)).image
    assert token == processor.image_token_id
    ids = prompt_token_lists(batch)
    sent = vllm_prompts(batch, ids, token)
    for row, request in zip(ids, sent):
        assert request["prompt_token_ids"].count(token) == 1  # vLLM expands it itself
        assert len(request["prompt_token_ids"]) == len(row) - row.count(token) + 1
        assert len(request["multi_modal_data"]["image"]) == 1
    text = batch.select(["prompts", "prompt_mask"])
    assert vllm_prompts(text, ids, token) is None  # a text batch keeps the text path
    batch.non_tensors["multi_modal_data"][1] = None  # a text row among image rows: its ids
    assert vllm_prompts(batch, ids, token)[1] == ids[1]
    with pytest.raises(ValueError, match="no image token"):
        vllm_prompts(prompts(setup, 1, 0), ids[:1], None)


def test_a_bad_image_names_the_file_row_and_image(setup):
    root, _, processor = setup
    rows = detection_rows(root / "images", 2, as_paths=True)
    rows[1]["images"] = [{"bytes": None, "path": "images/missing.png"}]
    path = write_jsonl(root / "missing.jsonl", rows)
    with pytest.raises(
        ConfigError, match=r"missing\.jsonl:2: image 0 \('images/missing\.png'\) cannot be read"
    ):
        load(path, processor)
    rows[1]["images"] = ["images/det0.png", "images/det1.png"]  # one <image> for two images
    dataset = load(write_jsonl(root / "marks.jsonl", rows), processor)
    assert len(dataset) == 1 and "1 <image> marks for 2 images" in str(dataset.bad_rows[0])
    rows[1]["images"] = [17]
    dataset = load(write_jsonl(root / "type.jsonl", rows), processor)
    assert "type.jsonl:2: wrong type: images[0]" in str(dataset.bad_rows[0])


def test_images_need_a_vision_language_model(setup, tmp_path):
    root, _, processor = setup
    path = write_jsonl(tmp_path / "rows.jsonl", detection_rows(root / "images", 1))
    args = DataArgs(file_name=[str(path)], messages="prompt")
    with pytest.raises(ConfigError, match=r"rows\.jsonl:1: the row has images but the model is not a vision"):
        load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", None)


def test_parquet_rows_with_image_bytes(setup, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _, _, processor = setup
    rows = detection_rows(None, 3, as_paths=False)
    rows[1]["images"][0]["bytes"] = b"not an image"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "det.parquet")
    with pytest.raises(ConfigError, match=r"det\.parquet:2: image 0 \(12 bytes\) cannot be read"):
        load(tmp_path / "det.parquet", processor)
    rows[1]["prompt"] = [{"role": "user", "content": " "}]  # a bad row: skipped, reported by row number
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "det.parquet")
    dataset = load(tmp_path / "det.parquet", processor)
    assert len(dataset) == 2 and str(dataset.bad_rows[0]).startswith(
        f"{tmp_path / 'det.parquet'}:2: empty content"
    )
    batch = to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    assert [r["image_grid_thw"].tolist() for r in batch[MULTI_MODAL_INPUTS]] == [[[1, 4, 4]], [[1, 4, 8]]]


def test_freeze_module_prefix_freezes_the_vision_tower_or_names_the_modules(setup):
    from transformers import AutoModelForImageTextToText

    from roll.models.vision import freeze_prefixes

    model = AutoModelForImageTextToText.from_pretrained(setup[1])
    frozen = freeze_prefixes(model, ["model.visual"], "actor_train.model_args.freeze_module_prefix")
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == len(names) and names == {
        n for n, _ in model.named_parameters() if n.startswith("model.visual.")
    }
    with pytest.raises(
        ConfigError, match="'visual' matches no parameter; the model's modules: .*model.visual"
    ):
        freeze_prefixes(model, ["visual"], "actor_train.model_args.freeze_module_prefix")


def test_image_pixel_bounds_resize_for_the_model_and_for_vllm(setup):
    root, model, processor = setup
    rows = detection_rows(root / "images", 3)  # the third image: 112 x 56, 8 merged patches
    path = write_jsonl(root / "pixels.jsonl", rows)
    dataset = load(path, processor, image_max_pixels=28 * 28 * 4)  # ROLL's data_args key
    batch = to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    grid = batch[MULTI_MODAL_INPUTS][2]["image_grid_thw"]
    assert (
        int(grid.prod()) // 4 <= 4
        and int((batch["prompts"][2] == processor.image_token_id).sum()) == int(grid.prod()) // 4
    )
    sent = vllm_prompts(batch, prompt_token_lists(batch), vision_tokens(str(model)).image)
    assert sent[2]["mm_processor_kwargs"] == {"max_pixels": 28 * 28 * 4}  # vLLM resizes alike
    plain = to_batch(load(path, processor).rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    assert int(plain[MULTI_MODAL_INPUTS][2]["image_grid_thw"].prod()) // 4 == 8
    assert (
        "mm_processor_kwargs"
        not in vllm_prompts(plain, prompt_token_lists(plain), vision_tokens(str(model)).image)[2]
    )


def test_responses_never_hold_vision_tokens_so_the_forward_reads_them_as_generated(setup):
    """A random model samples its vision tokens too; a generated <|image_pad|> made the reference's
    forward look for a 13th image patch group (``Image features and image tokens do not match``).
    Every strategy gives them zero probability in responses, hf_infer's sampling and the forward's
    log-probs alike."""
    from roll.distributed.strategy.engine_vision import vision_tokens
    from roll.models.vision import response_excluded_tokens

    _, model, processor = setup
    strategy = _hf_infer(model, "reference", 4)
    excluded = response_excluded_tokens(strategy.model.config)
    assert processor.image_token_id in excluded and len(excluded) == 3
    assert set(vision_tokens(str(model)).bias) == set(excluded)  # vLLM's logit_bias, the same ids
    batch = prompts(setup, n_det=2, n_math=2)
    out = strategy.generate(
        batch, SamplingParams(n=8, max_new_tokens=12, temperature=1.5, seed=0, logprobs=True)
    )
    assert not torch.isin(out["responses"][out["response_mask"].bool()], torch.tensor(excluded)).any()
    scored = strategy.compute_log_probs(out)["log_probs"]  # no error: no image token in a response
    mask = out["response_mask"].bool()
    assert torch.allclose(scored[mask], out["infer_logprobs"][mask], atol=1e-4)


def test_validation_rows_decode_their_images_per_chunk(setup):
    """Validation keeps its rows' image bytes only; each chunk's images are decoded when it runs
    (a ROLL file validates on thousands of image rows)."""
    from roll.pipeline.rlvr.data.vision import VISION_ROWS, with_vision_fields

    root, _, processor = setup
    rows = load(write_jsonl(root / "val.jsonl", detection_rows(root / "images", 3)), processor).rows
    eager = to_batch(rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    lazy = to_batch(rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor, lazy=True)
    assert VISION_ROWS in lazy and MULTI_MODAL_INPUTS not in lazy
    chunk = with_vision_fields(lazy.split(2)[1], processor)
    assert VISION_ROWS not in chunk and VISION_ROWS in lazy  # the whole batch keeps its rows
    assert torch.equal(
        chunk[MULTI_MODAL_INPUTS][0]["pixel_values"], eager[MULTI_MODAL_INPUTS][2]["pixel_values"]
    )
    assert chunk["reward_context"][0] == eager["reward_context"][2]


def test_model_update_names_are_the_module_names_vllm_maps(setup):
    """transformers renames a Qwen2.5-VL checkpoint's start (``^visual``); roll's wire keeps the
    module names, which vLLM's Qwen2.5-VL loader maps (``model.language_model.``, ``model.visual.``)."""
    from transformers import AutoModelForImageTextToText

    from roll.models.checkpoint_names import CheckpointNames

    model = AutoModelForImageTextToText.from_pretrained(setup[1])
    names = [n for n, _ in CheckpointNames.of(model).to_checkpoint(model.state_dict().items())]
    assert names == list(model.state_dict())
    assert {n.split(".")[0] + "." + n.split(".")[1] for n in names if n.startswith("model.")} == {
        "model.visual",
        "model.language_model",
    }
