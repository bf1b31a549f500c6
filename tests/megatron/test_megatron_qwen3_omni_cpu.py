"""Qwen3-Omni-MoE's thinker on megatron-core against transformers' Qwen3OmniMoeThinkerForConditionalGeneration,
on the tiny random model of tests/tiny_qwen3_omni.py (a ``thinker.*`` checkpoint as Qwen releases it),
two gloo ranks on CPU, fp32:

- TP 2 + SP and EP 2: each rank reads its slices of the ``thinker.*`` tensors (experts stored apart);
  the logits of a text row, an image row (interleaved mrope, deepstack) and an audio row (the audio
  tower's features at the ``<|audio_pad|>`` tokens) equal transformers' (atol 1e-4);
- the export (the model update's wire, what vLLM's thinker loader maps) names and holds every tensor
  of the checkpoint bit for bit, and ``save_hf_checkpoint`` writes a checkpoint transformers loads
  with the same weights;
- a training loss (mean cross-entropy of the image row) and its gradients at the final norm, a
  router and the vision tower's merger equal transformers' (EP 2: each rank's non-expert gradients
  are the whole model's);
- through roll's data path and strategy: rows with audio files (two lengths, one row with an image
  too), an image row and a text row, left-padded with random responses, scored by megatron_train
  (TP 2 + SP, padded rows) and by megatron_infer at CP 2 (packed rows, as ROLL's audio_test_80G's
  reference) equal transformers' thinker's response log-probs (1e-4).

All of it runs in one spawned pair of gloo ranks (most of the test's time is their imports).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

import compat  # noqa: E402
from omni_cases import audio_batch, hf_thinker, thinker_log_probs  # noqa: E402
from tiny_qwen3_omni import MEL_BINS, build_tiny_qwen3_omni_dir  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_checks import check_log_probs  # noqa: E402

AUDIO_FRAMES = 150  # 20 audio tokens (transformers' _get_feat_extract_output_lengths)
AUDIO_TOKENS = 20
# (roll's megatron name, transformers' thinker module name) of the gradients compared
GRADS = (
    ("decoder.final_layernorm.weight", "model.language_model.norm.weight"),
    ("decoder.layers.1.mlp.router.weight", "model.language_model.layers.1.mlp.gate.weight"),
    ("visual.merger.mlp.2.weight", "model.visual.merger.mlp.2.weight"),
)


def _rows(path: Path) -> list[dict]:
    """A text row, an image row (a 64 x 64 image: 4 image tokens) and an audio row, each the
    forward's keyword arguments (batch of one)."""
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).thinker_config
    gen = torch.Generator().manual_seed(0)

    def ids(*parts: object) -> torch.Tensor:
        out: list[int] = []
        for part in parts:
            out += tok(part, add_special_tokens=False)["input_ids"] if isinstance(part, str) else list(part)
        return torch.tensor([out + out[-1:] * (len(out) % 2)])  # even: SP splits it over two ranks

    image = Image.fromarray((torch.rand(64, 64, 3, generator=gen) * 255).byte().numpy())
    pixels = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    n_image = int(grid.prod()) // 4
    audio_start = cfg.audio_start_token_id
    return [
        {"input_ids": ids("How many boxes are there? The answer is 2.")},
        {
            "input_ids": ids(
                "Find", [cfg.vision_start_token_id], [cfg.image_token_id] * n_image, "every box."
            ),
            "pixel_values": pixels["pixel_values"],
            "image_grid_thw": grid,
        },
        {
            "input_ids": ids(
                "blue", [audio_start], [cfg.audio_token_id] * AUDIO_TOKENS, [audio_start + 2], "red"
            ),
            "input_features": torch.randn(1, MEL_BINS, AUDIO_FRAMES, generator=gen),
            "feature_attention_mask": torch.ones(1, AUDIO_FRAMES, dtype=torch.long),
        },
    ]


def _hf_reference(path: Path, scratch: Path) -> None:
    """transformers' logits of each row and the image row's loss gradients, saved for the ranks."""
    thinker, rows = hf_thinker(path), _rows(path)
    with torch.no_grad():
        logits = [thinker(attention_mask=torch.ones_like(r["input_ids"]), **r).logits for r in rows]
    image = rows[1]
    out = thinker(attention_mask=torch.ones_like(image["input_ids"]), **image).logits
    _loss(out, image["input_ids"]).backward()
    grads = {theirs: dict(thinker.named_parameters())[theirs].grad.clone() for _, theirs in GRADS}
    loss = float(_loss(out, image["input_ids"]))
    torch.save({"rows": rows, "logits": logits, "grads": grads, "loss": loss}, scratch / "reference.pt")


def _audio_case(path: Path, scratch: Path) -> None:
    """``scratch / "batch.pt"``: ``omni_cases.audio_batch``; ``scratch / "want.pt"``: transformers'
    thinker's log-probs of it."""
    batch = audio_batch(path, scratch)
    torch.save(batch, scratch / "batch.pt")
    torch.save(thinker_log_probs(path, batch), scratch / "want.pt")


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])


def _build(path: str, tp: int, ep: int) -> list:
    import transformers
    from megatron.core import parallel_state as ps

    from roll.configs.strategy_configs import MegatronConfig
    from roll.models.megatron import hf_io
    from roll.models.megatron.model_builder import build_model_chunks, default_layer_spec_fn

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    compat.seed(1234)
    cfg = MegatronConfig(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1
    )
    cfg.validate(dist.get_world_size(), "strategy_config")
    hf_config = transformers.AutoConfig.from_pretrained(path)
    chunks = build_model_chunks(hf_config, cfg, torch.float32, default_layer_spec_fn())
    hf_io.load_hf_weights(chunks, path)
    return chunks


def _logits(model, row: dict) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    kwargs = {k: v for k, v in row.items() if k != "input_ids"}
    out = model(row["input_ids"], None, None, **kwargs)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        shards = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(shards, dim=-1)
    return out


def _check_logits(model, ref: dict, name: str) -> list[str]:
    bad = []
    model.eval()
    with torch.no_grad():
        for i, (row, want) in enumerate(zip(ref["rows"], ref["logits"])):
            got = _logits(model, row)[..., : want.shape[-1]]
            diff = float((got - want).abs().max())
            if diff > 1e-4:
                bad.append(f"{name}: row {i} logits differ from transformers' by {diff:.2e}")
    return bad


def _check_export_and_save(chunks, path: str, scratch: Path) -> list[str]:
    from safetensors.torch import load_file

    from roll.models.megatron.hf_io import export_hf_weights, save_hf_checkpoint

    stored = load_file(Path(path) / "model.safetensors")
    exported = {n: t.clone() for n, t in export_hf_weights(chunks)}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, exported)
    merged = {n: t for part in gathered for n, t in part.items()}
    bad = (
        [f"export: names differ: {sorted(set(merged) ^ set(stored))[:4]}"]
        if set(merged) != set(stored)
        else []
    )
    bad += [
        f"export: {n} differs" for n in stored.keys() & merged.keys() if not torch.equal(stored[n], merged[n])
    ]
    out = scratch / "saved"
    save_hf_checkpoint(chunks, _top_config(path), out, tokenizer_dir=path)
    dist.barrier()
    if dist.get_rank() == 0:
        original, saved = hf_thinker(Path(path)).state_dict(), hf_thinker(out).state_dict()
        bad += [
            f"saved: {n} differs in transformers" for n, t in original.items() if not torch.equal(saved[n], t)
        ]
    return bad


def _top_config(path: str):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)


def _check_train_grads(model, ref: dict) -> list[str]:
    model.train()
    model.zero_grad()
    row = ref["rows"][1]
    vocab = ref["logits"][1].shape[-1]  # the padded vocab's extra columns are not the model's
    loss = _loss(_logits(model, row)[..., :vocab], row["input_ids"])
    loss.backward()
    params = dict(model.named_parameters())
    bad = (
        []
        if abs(float(loss) - ref["loss"]) < 1e-5
        else [f"train: loss {float(loss)} != transformers' {ref['loss']}"]
    )
    for ours, theirs in GRADS:
        diff = float((params[ours].grad - ref["grads"][theirs]).abs().max())
        if diff > 1e-5:
            bad.append(f"train: {ours} gradient differs from transformers' by {diff:.2e}")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    from megatron.core import parallel_state as ps

    from roll.models.megatron.hf_io import unwrap

    ref = torch.load(Path(scratch) / "reference.pt", weights_only=False)
    with megatron_rank(rank, world_size, port, scratch) as bad:
        chunks = _build(path, tp=2, ep=1)
        bad += _check_logits(unwrap(chunks[0]), ref, "tp2_sp")
        bad += _check_export_and_save(chunks, path, Path(scratch))
        ps.destroy_model_parallel()
        chunks = _build(path, tp=1, ep=2)
        bad += _check_logits(unwrap(chunks[0]), ref, "ep2")
        bad += _check_train_grads(unwrap(chunks[0]), ref)
        ps.destroy_model_parallel()
        layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
        bad += check_log_probs(path, Path(scratch), "audio rows", "megatron_train", layout)
        # ROLL's audio_test_80G reference: megatron_infer at CP 2 (each rank's zig-zag share of the
        # packed row, audio features placed by the whole row)
        cp2 = {"context_parallel_size": 2}
        bad += check_log_probs(path, Path(scratch), "audio rows, infer cp2", "megatron_infer", cp2)


def test_qwen3_omni_thinker_matches_transformers(tmp_path: Path) -> None:
    model = build_tiny_qwen3_omni_dir(tmp_path / "model")
    _hf_reference(model, tmp_path)
    _audio_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


def test_rolls_omni_freeze_prefixes() -> None:
    """ROLL's qwen3-omni files freeze "vision_model,audio_model,talker,code2wav": both towers are
    frozen, the talker and code2wav (not built) are skipped; another module is one ConfigError."""
    from roll.configs.errors import ConfigError
    from roll.models.megatron.qwen2_5_vl import freeze_vision_tower

    chunk = torch.nn.Module()
    chunk.pre_process = True
    chunk.visual, chunk.audio_tower, chunk.decoder = (torch.nn.Linear(2, 2) for _ in range(3))
    key = "actor_train.model_args.freeze_module_prefix"
    assert freeze_vision_tower([chunk], ["vision_model", "audio_model", "talker", "code2wav"], key) == 4
    assert chunk.decoder.weight.requires_grad and not chunk.audio_tower.weight.requires_grad
    with pytest.raises(ConfigError, match="audio_model"):
        freeze_vision_tower([chunk], ["decoder"], key)
