"""Memory planner (roll/planner): size formulas against transformers, state bytes, colocation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from launch_files import point_at_files

from roll.configs.errors import ConfigError
from roll.launch.rlvr import main
from roll.models.random_checkpoint import preset_config
from roll.planner.memory import (
    GIB,
    Split,
    activations,
    fsdp2_train,
    kv_cache_bytes,
    layer_activation_bytes,
    logit_bytes,
    megatron_train,
    rank_params,
    training_state,
)
from roll.planner.model_shape import FAMILY_TRAITS, shape_from_config
from roll.planner.report import DeviceGroup, overflow_warning
from roll.planner.roles import RoleMemory

REPO = Path(__file__).resolve().parents[1]

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=128,
)
CASES = {
    "Qwen2Config": dict(TINY, tie_word_embeddings=False),
    "LlamaConfig": dict(TINY, tie_word_embeddings=True),
    "Qwen3Config": dict(TINY, head_dim=24, tie_word_embeddings=False),
    "Qwen3MoeConfig": dict(
        TINY,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "MixtralConfig": dict(TINY, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}


@pytest.mark.parametrize("class_name", sorted(CASES))
def test_param_count_matches_transformers(class_name: str) -> None:
    config = getattr(transformers, class_name)(**CASES[class_name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    assert shape_from_config(config.to_dict()).total_params() == expected


def test_families_match_megatron_families() -> None:
    from roll.models.megatron.families import FAMILIES

    assert set(FAMILY_TRAITS) == set(FAMILIES)


def test_unknown_family_names_the_key() -> None:
    with pytest.raises(ConfigError, match="actor_train.model_args.model_name_or_path: model_type 'gpt2'"):
        shape_from_config({"model_type": "gpt2"}, "actor_train.model_args.model_name_or_path")


# ------------------------------------------------------------------------------ byte formulas
def test_adam_state_bytes() -> None:
    assert training_state(1000, 2) == {"params": 2000, "grads": 4000, "optimizer": 12000}
    assert training_state(1000, 2, optimizer_shards=4)["optimizer"] == 3000
    assert training_state(1000, 4) == {"params": 4000, "grads": 4000, "optimizer": 8000}


def test_kv_cache_bytes_by_hand() -> None:
    shape = shape_from_config(dict(CASES["Qwen2Config"], model_type="qwen2"))
    # K and V x 3 layers x 2 kv heads x head dim 16 x 2 bytes, for 5 rows of 10 positions.
    assert kv_cache_bytes(shape, rows=5, seq_len=10) == 2 * 3 * 2 * 16 * 2 * 5 * 10
    assert kv_cache_bytes(shape, rows=5, seq_len=10, tp=2) == 2 * 3 * 1 * 16 * 2 * 5 * 10


def test_megatron_state_of_7b_16_layers_is_the_documented_80_8_gib() -> None:
    """docs/benchmarks.md: 4.82 B params x 18 B (bf16 param, fp32 grad, fp32 main + 2 moments)."""
    shape = shape_from_config(preset_config("qwen2.5-7b", 16).to_dict())
    parts = megatron_train(shape, Split(vocab_multiple=128), 1, 2, 4096, False, False)
    state = parts["params"] + parts["grads"] + parts["optimizer"]
    assert state / GIB == pytest.approx(80.8, abs=0.1)
    dist = megatron_train(shape, Split(vocab_multiple=128), 2, 2, 4096, False, True)
    assert dist["optimizer"] == parts["optimizer"] // 2  # the distributed optimizer halves Adam at DP=2


def test_tensor_parallel_splits_weights_and_vocab() -> None:
    shape = shape_from_config(preset_config("qwen2.5-1.5b").to_dict())
    dense1, _ = rank_params(shape, Split(vocab_multiple=128))
    dense2, _ = rank_params(shape, Split(tp=2, vocab_multiple=128))
    assert dense1 == shape.total_params()  # 151936 is already a multiple of 128
    # At TP=2 the vocabulary is padded to a multiple of 256: 151936 -> 152064 rows (tied).
    assert dense2 == (dense1 - shape.hidden + 128 * shape.hidden) // 2 + shape.hidden
    assert logit_bytes(shape, 100, Split(tp=2)) < logit_bytes(shape, 100)


def test_expert_parallel_splits_only_the_experts() -> None:
    shape = shape_from_config(preset_config("qwen3-30b-a3b", 4).to_dict())
    dense, expert = rank_params(shape, Split(ep=2))
    assert expert == shape.expert_params() // 2
    assert dense + expert * 2 == shape.total_params()


def test_an_uneven_pipeline_split_counts_the_rank_with_the_most_layers() -> None:
    """pipeline_model_parallel_layout "Et|tttL" on a 4-layer model: PP rank 1 holds 3 of 4 layers."""
    from roll.configs.strategy_configs import MegatronConfig

    shape = shape_from_config(preset_config("qwen3-30b-a3b", 4).to_dict())
    cfg = MegatronConfig(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttL")
    stage_layers = tuple(sum(rank) for rank in cfg.pipeline_rank_layers(shape.layers))
    assert stage_layers == (1, 3)
    even_dense, even_expert = rank_params(shape, Split(pp=2))
    dense, expert = rank_params(shape, Split(pp=2, stage_layers=stage_layers))
    assert expert == shape.expert_params() * 3 // 4 and even_expert == shape.expert_params() // 2
    assert dense - even_dense == shape.layer_dense_params() * 3 // 4 - shape.layer_dense_params() // 2
    assert rank_params(shape, Split(pp=2, stage_layers=(2, 2))) == (even_dense, even_expert)


def test_full_recompute_keeps_only_layer_inputs() -> None:
    shape = shape_from_config(preset_config("qwen2.5-1.5b").to_dict())
    full = activations(shape, 4096)
    assert full == shape.layers * layer_activation_bytes(shape, 4096)
    assert (
        activations(shape, 4096, recompute=True)
        == 2 * shape.hidden * 4096 * shape.layers + full // shape.layers
    )


# ---------------------------------------------------------------------------------- colocation
def _role(name: str, peak_gib: float, idle_gib: float) -> RoleMemory:
    return RoleMemory(name, "x", {"params": int(peak_gib * GIB)}, int(idle_gib * GIB), context=0)


def test_colocated_peak_is_max_over_stages_not_sum() -> None:
    group = DeviceGroup(
        (0, 1), (_role("actor_train", 50, 4), _role("actor_infer", 60, 0), _role("reference", 10, 1))
    )
    stages = {k: v / GIB for k, v in group.stage_peaks().items()}
    assert stages == {"actor_train": 51, "actor_infer": 65, "reference": 14}
    assert group.peak() == ("actor_infer", 65 * GIB)


def test_overflow_warning_names_devices_role_and_knob() -> None:
    train = RoleMemory(
        "actor_train",
        "megatron_train",
        {"optimizer": 70 * GIB, "params": 10 * GIB},
        0,
        0,
        {"optimizer": "strategy_args.strategy_config.use_distributed_optimizer"},
    )
    group = DeviceGroup((0, 1, 2), (train, _role("actor_infer", 5, 0)))
    assert overflow_warning(group, 100 * GIB, "gpu H100") is None
    line = overflow_warning(group, 79 * GIB, "gpu H100")
    assert line.startswith("devices 0-2: predicted peak 80.0 GiB while actor_train runs")
    assert (
        "exceeds 79.0 GiB (gpu H100) by 1.0 GiB; largest: actor_train optimizer 70.0 GiB (88% of the peak)"
        in line
    )
    assert line.endswith("-> turn actor_train.strategy_args.strategy_config.use_distributed_optimizer")


# ------------------------------------------------------------------------------------ dry run
def _shipped_with_model(name: str, tmp_path: Path, preset: str, layers: int | None = None) -> str:
    raw = point_at_files(yaml.safe_load((REPO / "examples/config" / f"{name}.yaml").read_text()), tmp_path)
    (tmp_path / "model" / "config.json").write_text(preset_config(preset, layers).to_json_string())
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path)


ONE_GPU = [f"{role}.device_mapping=[0]" for role in ("actor_train", "actor_infer", "reference")] + [
    "actor_train.strategy_args.strategy_config.tensor_model_parallel_size=1",
    "actor_train.strategy_args.strategy_config.sequence_parallel=false",
]


def test_dry_run_warns_for_7b_on_one_h100(tmp_path, capsys) -> None:
    path = _shipped_with_model("rlvr_megatron_vllm_2gpus", tmp_path, "qwen2.5-7b")
    argv = ["--config_name", "rlvr_megatron_vllm_2gpus", "--config_path", path, "--dry_run", "gpu=H100"]
    assert main(argv + ONE_GPU) == 1  # refused: it would not fit
    captured = capsys.readouterr()
    out = captured.out
    assert "Memory plan (GiB per device, one rank of each role; device memory: gpu H100)" in out
    warning = [line for line in out.splitlines() if line.startswith("WARNING: ")]
    assert len(warning) == 1 and warning[0].startswith("WARNING: devices 0: predicted peak ")
    assert "while actor_train runs" in warning[0] and "exceeds 79.2 GiB (gpu H100) by " in warning[0]
    # The role, the term, its size and share, and the key to change; the last line says it is refused.
    assert re.search(
        r"largest: actor_train optimizer [\d.]+ GiB \(\d+% of the peak\) -> turn actor_train\.strategy_args\."
        r"strategy_config\.tensor_model_parallel_size",
        warning[0],
    ), warning[0]
    assert captured.err.splitlines()[-1] == "roll: --dry_run: does not fit: " + warning[0][len("WARNING: ") :]
    # As shipped (TP=2 over two GPUs, 7B) it fits an H200 and nothing is flagged.
    assert main(argv[:-1] + ["gpu=H200"]) == 0
    out = capsys.readouterr().out
    assert "device peak" in out and "WARNING" not in out


def test_memory_check_error_refuses_with_one_line(tmp_path, capsys) -> None:
    path = _shipped_with_model("rlvr_megatron_vllm_2gpus", tmp_path, "qwen2.5-7b")
    argv = ["--config_name", "rlvr_megatron_vllm_2gpus", "--config_path", path, "--dry_run"]
    assert main(argv + ONE_GPU + ["device_memory_gib=80", "memory_check=error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ConfigError: memory_check: devices 0: predicted peak")
    assert re.search(
        r"exceeds 80\.0 GiB \(device_memory_gib 80\) by [\d.]+ GiB; largest: actor_train ", err[0]
    )
    assert err[0].endswith("(memory_check: warn only warns)")


def test_launch_prints_the_warning_before_starting(tmp_path, capsys, monkeypatch) -> None:
    import roll.pipeline.rlvr.pipeline as pipeline

    started = []
    monkeypatch.setattr(pipeline, "run_pipeline", started.append)
    # as on a machine with vLLM (a launch without it stops before the plan's warnings matter)
    monkeypatch.setattr("roll.launch.roles.check_engines_installed", lambda config, plan: None)
    path = _shipped_with_model("rlvr_megatron_vllm_2gpus", tmp_path, "qwen2.5-7b")
    assert (
        main(["--config_name", "rlvr_megatron_vllm_2gpus", "--config_path", path, "gpu=H100"] + ONE_GPU) == 0
    )
    assert started and "WARNING: devices 0: predicted peak" in capsys.readouterr().err


def test_cpu_device_skips_the_plan(tmp_path, capsys) -> None:
    path = _shipped_with_model("rlvr_megatron_vllm_2gpus", tmp_path, "qwen2.5-7b")
    argv = ["--config_name", "rlvr_megatron_vllm_2gpus", "--config_path", path, "--dry_run", "device=cpu"]
    assert main(argv) == 0
    assert "note: no memory plan: device: cpu" in capsys.readouterr().out


RLVR_CONFIGS = sorted(
    p.stem for p in (REPO / "examples/config").glob("*.yaml") if "data" not in yaml.safe_load(p.read_text())
)  # SFT files (a data: section) have no memory plan in their --dry_run


@pytest.mark.parametrize("name", RLVR_CONFIGS)
def test_every_shipped_config_gets_a_plan(name: str, tmp_path, capsys) -> None:
    """Every strategy a shipped config uses has a formula (no role is left out with a note)."""
    # A model its layout fits (the check before launch compares them): MoE files get an MoE model.
    # Files made for a cut of the model ("pretrain: ...-4l") get that many layers.
    pretrain = str(yaml.safe_load((REPO / "examples/config" / f"{name}.yaml").read_text()).get("pretrain"))
    layers = int(pretrain.rsplit("-", 1)[1][:-1]) if re.search(r"-\d+l$", pretrain) else None
    path = _shipped_with_model(name, tmp_path, "qwen3-30b-a3b" if "A3B" in name else "qwen2.5-1.5b", layers)
    code = main(["--config_name", name, "--config_path", path, "--dry_run", "gpu=H200", "device=cuda"])
    out = capsys.readouterr().out
    assert "device peak" in out and "note:" not in out, out
    assert code == (1 if "WARNING: " in out else 0)  # a --dry_run that would not fit is refused


def test_fsdp2_shards_fp32_state_over_the_world() -> None:
    shape = shape_from_config(preset_config("qwen2.5-1.5b").to_dict())
    params = shape.total_params()
    one = fsdp2_train(shape, 1, 2, 1024, True, sharded=False, mixed=True)
    four = fsdp2_train(shape, 4, 2, 1024, True, sharded=True, mixed=True)
    assert one["params"] + one["grads"] + one["optimizer"] == 16 * params  # fp32 param, grad, 2 moments
    assert four["grads"] + four["optimizer"] == 12 * params // 4


def test_vllm_with_its_kv_cache_in_bytes_is_weights_cache_and_extra(tmp_path, capsys) -> None:
    path = _shipped_with_model("rlvr_megatron_vllm_2gpus", tmp_path, "qwen2.5-7b")
    argv = ["--config_name", "rlvr_megatron_vllm_2gpus", "--config_path", path, "--dry_run", "gpu=H200"]
    main(argv + ["actor_infer.strategy_args.strategy_config.kv_cache_memory_gb=8"])
    plan = capsys.readouterr().out.split("Memory plan", 1)[1]
    row = next(line for line in plan.splitlines() if line.strip().startswith("actor_infer"))
    # 7B bf16 weights 14.2 GiB (TP=1) + the 8 GiB cache + 2 GiB of graphs, profile run and sampler,
    # not gpu_memory_utilization's share of the device
    assert row.split()[-2:] == ["24.2", "-"]  # peak; asleep (sleep_level 1) it holds nothing


def test_token_budgets_size_the_micro_batches(tmp_path, capsys) -> None:
    """With ``max_tokens_per_microbatch`` / ``infer_max_tokens_per_microbatch`` a micro-batch holds up
    to the budget's tokens, not ``per_device_train_batch_size`` rows: the prediction follows them."""
    path = _shipped_with_model("rlvr_megatron_2gpus", tmp_path, "qwen2.5-1.5b")
    argv = ["--config_name", "rlvr_megatron_2gpus", "--config_path", path, "--dry_run", "gpu=H200"]
    key = "actor_train.strategy_args.strategy_config."

    def train_row(*overrides: str) -> list[float]:
        assert main(argv + list(overrides)) in (0, 1)
        plan = capsys.readouterr().out.split("Memory plan", 1)[1]
        cells = next(row.split() for row in plan.splitlines() if " actor_train " in f" {row} ")
        return [float(cell) for cell in cells[6:8]]  # devices role strategy params grads optim activ logits

    rows = 16 * (64 + 32)  # per_device_train_batch_size x (prompt + response)
    base = train_row(f"{key}recompute_granularity=null", f"{key}recompute_method=null")
    budget = train_row(
        f"{key}recompute_granularity=null",
        f"{key}recompute_method=null",
        f"{key}max_tokens_per_microbatch={8 * rows}",
        f"{key}infer_max_tokens_per_microbatch={8 * rows}",
    )
    # 8x the train tokens; the logits were sized by the 6,144-token log-prob forward before, 2x now.
    assert budget[0] > 6 * base[0] and budget[1] > 2 * base[1], (base, budget)
