"""DeepSeek-V3 (``deepseek_v3``) on megatron-core, against transformers' DeepseekV3ForCausalLM on
shrunken random configs, on CPU over gloo (fp32, the test-only shims in ``compat``):

- parity and weight mapping (one spawn per world size, the checks of ``test_conversion``): each rank
  reads exactly its own slices of the safetensors, the export gives every tensor back bit for bit,
  and the logits equal transformers' (atol 1e-4) at TP1 (YaRN RoPE + q LoRA; default RoPE without
  q LoRA) and TP2, EP2, PP2 (+ ``save_hf_checkpoint`` that transformers reloads);
- the offline converter: HF -> mcore dist checkpoint -> HF bit-exact at TP2 and EP2, and a
  checkpoint carrying a multi-token-prediction layer converts with that layer dropped;
- megatron_train: log-probs equal transformers' at EP2 and TP2, one training step gives the same
  weights (expert bias included) at both layouts, and ``freeze_moe_router`` keeps the router
  weight and its expert bias;
- bad input: options roll does not reproduce are one ConfigError naming the config.json key.

The shrunken config keeps every DeepSeek-V3 feature: q LoRA, kv LoRA, separate nope/rope/v head
dims, 8 routed experts in 4 groups (top-2 groups, top-4 experts), a non-zero score-correction bias,
routed_scaling_factor 2.5, one shared expert, the first layer dense.
"""

from __future__ import annotations

import datetime
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

import compat  # noqa: E402
import test_conversion as conv  # noqa: E402
from cuda_on_cpu import cuda_hidden  # noqa: E402
from gloo_ranks import spawn_ranks  # noqa: E402
from tiny_models import build_tiny_tokenizer, safetensors_dir, tensor_differences  # noqa: E402
from two_rank_training import (  # noqa: E402
    full_hf_weights,
    hf_log_probs_and_grad_norm,
    megatron_rank,
    pg_batch,
    pg_loss,
    run_two_ranks,
    train_strategy,
)

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.models.megatron import convert, families, model_fit  # noqa: E402

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
SHAPE = dict(
    vocab_size=272,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=1,
)


def deepseek_config(**overrides) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**{**SHAPE, "rope_parameters": YARN, **overrides})


VARIANTS = {
    "deepseek_v3": {},
    # No q LoRA (a plain q_proj, as DeepSeek-V2-Lite) and default RoPE.
    "deepseek_v3_noq": {"q_lora_rank": None, "rope_parameters": None},
}


def save_deepseek(path: Path, seed: int = 0, **overrides) -> Path:
    """Random weights N(0, 0.1) (norms around 1), a non-zero score-correction bias, a tokenizer."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(deepseek_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------------------- parity + mapping
CASES = {
    1: [conv.Case("deepseek_v3", roll_spec=True), conv.Case("deepseek_v3_noq", roll_spec=True)],
    2: [
        conv.Case("deepseek_v3", tp=2, roll_spec=True, sliced_export=True),
        conv.Case("deepseek_v3", ep=2, roll_spec=True),
        conv.Case("deepseek_v3", pp=2, roll_spec=True, save=True),
        conv.Case("deepseek_v3_noq", tp=2, roll_spec=True),
    ],
}


def _owned_elements(chunks) -> int:
    """Elements of this rank's parameters and HF buffers (expert bias), vocab padding excluded."""
    from megatron.core import parallel_state as ps

    from roll.models.megatron import weight_mapping as wm
    from roll.models.megatron.hf_io import model_tensors, unwrap

    total = 0
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        model = unwrap(chunk)
        for name, tensor in model_tensors(model).items():
            total += tensor.numel()
            if name in (wm.EMBEDDING.mcore, wm.OUTPUT.mcore):
                rows = model.roll_hf_info.padded_vocab_size // tp
                total -= (
                    rows - min(max(model.roll_hf_info.vocab_size - tp_rank * rows, 0), rows)
                ) * tensor.shape[1]
    return total


def _run_case(case: conv.Case, ckpt: str, scratch: Path) -> None:
    from megatron.core import parallel_state as ps

    from roll.models.megatron.model_builder import build_model_chunks

    ps.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep,
    )
    compat.seed(1234)
    cfg = MegatronConfig(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep,
        # PP2: the dense layer and one MoE layer on stage 0, the other MoE layer on stage 1.
        num_layers_in_first_pipeline_stage=2 if case.pp == 2 else None,
    )
    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    chunks = build_model_chunks(hf_config, cfg, torch.float32)
    conv._owned_elements = _owned_elements  # the expert bias buffers are read too
    conv._load_and_check_reads(chunks, ckpt)
    conv._check_export(chunks, ckpt, scratch / "export", case)
    conv._check_forward(chunks, ckpt)
    if case.save:
        conv._check_save(chunks, hf_config, ckpt, scratch / "saved")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: str(save_deepseek(root / name, i, **kw)) for i, (name, kw) in enumerate(VARIANTS.items())}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_logits_match_transformers_and_weights_round_trip(world_size, checkpoints, tmp_path) -> None:
    with cuda_hidden():
        spawn_ranks(conv._worker, world_size, checkpoints, CASES[world_size], str(tmp_path), _run_case)


def test_yarn_and_the_expert_bias_matter(tmp_path) -> None:
    """The parity above is not vacuous: YaRN and the score-correction bias change transformers'
    logits at this shape."""
    ids = torch.randint(3, 272, (2, 12), generator=torch.Generator().manual_seed(0))
    path = save_deepseek(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ).eval()
    with torch.no_grad():
        logits = model(ids).logits
        assert (logits - plain(ids).logits).abs().max() > 1e-2
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert (logits - model(ids).logits).abs().max() > 1e-2


# -------------------------------------------------------------------- converter + training
_tensors = safetensors_dir


def add_mtp_layer(path: Path) -> list[str]:
    """Append tensors of a multi-token-prediction layer (``model.layers.{num_hidden_layers}``) to the
    checkpoint, as DeepSeek-V3's files carry them; returns their names."""
    tensors = load_file(path / "model.safetensors")
    layer = SHAPE["num_hidden_layers"]
    extra = {f"model.layers.{layer}.{n}": torch.randn(4, 64) for n in ("enorm.weight", "eh_proj.weight")}
    extra[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = torch.randn(4, 4)
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    return sorted(extra)


LAYOUTS = [(2, 1, 1), (1, 1, 2)]  # (tp, pp, ep) on two ranks


def _converter_checks(scratch: str) -> list[str]:
    bad = []
    src = Path(scratch, "hf")
    original = {n: t for n, t in _tensors(src).items() if not n.startswith("model.layers.3.")}
    for tp, pp, ep in LAYOUTS:
        tag = f"tp{tp}-pp{pp}-ep{ep}"
        mcore, back = Path(scratch, tag, "mcore"), Path(scratch, tag, "hf")
        convert.write_mcore(src, mcore, convert.layout_config(tp, pp, ep))
        convert.read_mcore(mcore, back)
        if dist.get_rank() == 0:
            bad += tensor_differences(tag, original, _tensors(back))
    return bad


def _training_checks(scratch: str) -> list[str]:
    bad, path = [], str(Path(scratch, "hf"))
    batch = pg_batch(0)
    reference, hf_norm = hf_log_probs_and_grad_norm(path, batch)
    mask = batch["response_mask"].bool()
    after, stepped, metrics = {}, {}, {}
    for name, layout in (
        ("EP2", {"expert_model_parallel_size": 2}),
        ("TP2+SP", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ):
        strategy = train_strategy(path, layout)
        log_probs = strategy.compute_log_probs(batch)["log_probs"]
        diff = float((log_probs - reference).abs()[mask].max())
        if diff > 1e-4:
            bad.append(f"{name}: log-probs differ from transformers' by {diff:.2e}")
        before = full_hf_weights(strategy)
        dp_rank, dp_size, _ = strategy.dp_layout()
        metrics[name] = strategy.train_step(batch.chunk(dp_size)[dp_rank].split(1), pg_loss)
        after[name] = full_hf_weights(strategy)
        stepped[name] = strategy.compute_log_probs(batch)["log_probs"]
        moved = {n for n in before if not torch.equal(before[n], after[name][n])}
        if not any("e_score_correction_bias" in n for n in moved) or not any("self_attn" in n for n in moved):
            bad.append(f"{name}: the step left attention or the expert bias unchanged: {sorted(moved)[:4]}")
    for name, values in metrics.items():
        if abs(values["grad_norm"] - hf_norm) > 1e-5 * hf_norm:
            bad.append(f"{name}: grad norm {values['grad_norm']:.7f}, transformers' {hf_norm:.7f}")
    gaps = {n: float((after["EP2"][n] - after["TP2+SP"][n]).abs().max()) for n in after["EP2"]}
    # lr 1e-2: Adam's first step moves every weight by about 1e-2 x sign(grad), so rounding in a
    # near-zero gradient shows up as up to ~1e-4; a wrong gradient sign as 2e-2.
    far = sorted((g, n) for n, g in gaps.items() if g > 1e-3)
    if far:
        bad.append(f"one step at EP2 and at TP2+SP give weights apart: {far[-4:]} ({len(far)} tensors)")
    gap = float((stepped["EP2"] - stepped["TP2+SP"]).abs()[mask].max())
    if gap > 1e-4:
        bad.append(f"log-probs after the step differ by {gap:.2e} between EP2 and TP2+SP")
    frozen = train_strategy(path, {"expert_model_parallel_size": 2, "freeze_moe_router": True})
    before = full_hf_weights(frozen)
    dp_rank, dp_size, _ = frozen.dp_layout()
    frozen.train_step(batch.chunk(dp_size)[dp_rank].split(1), pg_loss)
    now = full_hf_weights(frozen)
    router = [n for n in before if ".mlp.gate." in n]
    bad += [f"freeze_moe_router: {n} moved" for n in router if not torch.equal(before[n], now[n])]
    return bad


def _worker(rank: int, world_size: int, port: int, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=300)) as bad:
        bad += _converter_checks(scratch) + _training_checks(scratch)


@pytest.mark.slow
def test_converter_round_trip_and_training(tmp_path: Path) -> None:
    save_deepseek(tmp_path / "hf")
    add_mtp_layer(tmp_path / "hf")
    bad = run_two_ranks(_worker, (str(tmp_path),), tmp_path)
    assert not bad, "\n".join(bad)


def test_mtp_layers_are_skipped_with_a_log_line(tmp_path: Path, caplog) -> None:
    from contextlib import ExitStack

    from roll.models.megatron import hf_io

    path = save_deepseek(tmp_path / "m")
    names = add_mtp_layer(path)
    info = families.conversion_info(transformers.AutoConfig.from_pretrained(path), MegatronConfig())
    assert info.extra_layers == 1 and all(info.skipped(n) for n in names)
    assert not info.skipped("model.layers.2.input_layernorm.weight")
    with caplog.at_level(logging.INFO, logger="roll.models.megatron.hf_io"), ExitStack() as stack:
        hf_io._check_checkpoint_names(hf_io._Checkpoint(path, stack), info)
    assert "skipping 3 tensors of the 1 multi-token-prediction layer(s) after layer 2" in caplog.text


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"rope_interleave": False}, "rope_interleave"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope_scaling.rope_type",
        ),
        ({"rope_parameters": {**YARN, "attention_factor": 1.5}}, "rope_scaling.attention_factor"),
        ({"rope_parameters": {**YARN, "mscale": None}}, "rope_scaling.mscale"),
        ({"topk_group": 1}, "topk_group"),  # groups scored by top-4, transformers by top-2
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"n_group": 3}, "n_group"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_options_name_the_key(overrides, key) -> None:
    config = deepseek_config()
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ConfigError, match=rf"^model_args.model_name_or_path: config.json {key}=") as err:
        model_fit.check_model_fits(config, MegatronConfig())
    assert "deepseek_v3" in str(err.value)


def test_layout_checks_name_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size: 8 does not divide the model's num_attention_heads"
    ):
        model_fit.check_model_fits(deepseek_config(), MegatronConfig(tensor_model_parallel_size=8))
    with pytest.raises(
        ConfigError, match=r"expert_model_parallel_size: 3 does not divide the model's number of experts"
    ):
        model_fit.check_model_fits(deepseek_config(), MegatronConfig(expert_model_parallel_size=3))
    model_fit.check_model_fits(
        deepseek_config(), MegatronConfig(tensor_model_parallel_size=4, expert_model_parallel_size=8)
    )


# ------------------------------------------------------------------------ recipe and planner
RECIPE = "deepseek-v3-671B-sft_megatron_512gpus"


def test_recipe_plans_and_fits_deepseek_v3(capsys) -> None:
    """The 512-GPU recipe (TP1 x PP16 x EP32, stages of 3 / 14 x 4 / 2 layers) passes --dry_run and
    fits DeepSeek-V3's published shape (transformers' DeepseekV3Config defaults)."""
    from roll.configs.sft_config import load_sft_config
    from roll.launch.sft import main

    repo = Path(__file__).resolve().parents[2]
    assert main(["--config_name", RECIPE, "--config_path", str(repo / "examples/config"), "--dry_run"]) == 0
    assert "megatron_train" in capsys.readouterr().out
    config = load_sft_config(repo / "examples/config" / f"{RECIPE}.yaml")
    model_fit.check_model_fits(
        transformers.DeepseekV3Config(), config.actor_train.strategy_args.strategy_config
    )


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": None, "first_k_dense_replace": 2, "n_shared_experts": 2}]
)
def test_planner_counts_deepseek_v3_parameters_exactly(overrides) -> None:
    """roll.planner's size formula equals transformers' parameter count (meta device, no memory);
    at the published shape it is DeepSeek-V3's 671B (without the MTP layer)."""
    from roll.planner.model_shape import shape_from_config

    config = transformers.DeepseekV3Config(num_hidden_layers=4, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config.to_dict()).total_params() == sum(p.numel() for p in model.parameters())
    assert round(shape_from_config(transformers.DeepseekV3Config().to_dict()).total_params() / 1e9) == 671
