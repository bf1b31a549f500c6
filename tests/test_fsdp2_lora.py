"""fsdp2_train with LoRA (``model_args.lora_rank``) on CPU: only the adapters train, the exported
weights are the merged ones under the HF names, 2 gloo ranks agree with 1, a checkpoint holds the
adapters and optimizer state and resumes bit-identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gloo_ranks import process_group, spawn_ranks
from test_fsdp2_strategy import global_batch, local_micro_batches, train, value_loss
from tiny_models import build_tiny_model_dir
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.core.errors import CheckpointError
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.registry import load_strategy_class

torch.set_num_threads(1)
TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK, ALPHA = 4, 16.0  # scale 4


def make_lora_strategy(
    model_dir: str, rank: int, world_size: int, strategy_config: dict | None = None, **model_args
):
    role = RoleConfig(
        model_args=ModelArgs(
            model_name_or_path=model_dir,
            dtype="fp32",
            lora_target=TARGETS,
            lora_rank=RANK,
            lora_alpha=ALPHA,
            **model_args,
        ),
        training_args=TrainingArgs(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0),
        strategy_args=StrategyArgs("fsdp2_train", dict(strategy_config or {})),
        infer_batch_size=2,
    )
    ctx = WorkerContext("actor_train", rank, world_size, rank, torch.device("cpu"), seed=42)
    strategy = load_strategy_class("fsdp2_train")(role, ctx)
    strategy.initialize()
    return strategy


def wrapped_state(strategy) -> dict[str, torch.Tensor]:
    """The wrapped model's full state_dict (base weights and adapters), on every rank."""
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in strategy.model.state_dict().items()
    }


def exported(strategy) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in strategy.iter_hf_weights()}


def _lora_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):
        micro = local_micro_batches(rank, world_size)
        first = make_lora_strategy(model_dir, rank, world_size)
        trainable = [n for n, p in first.model.named_parameters() if p.requires_grad]
        optimized = sum(p.numel() for group in first.optimizer.param_groups for p in group["params"])
        before = wrapped_state(first)
        losses = train(first, 1, micro)
        first.save_checkpoint(f"{out}/ckpt")
        losses += train(first, 2, micro)
        after = wrapped_state(first)
        weights = exported(first)
        logps = first.compute_log_probs(global_batch().chunk(world_size)[rank])["log_probs"]
        first.save_hf_checkpoint(f"{out}/hf")

        resumed = make_lora_strategy(model_dir, rank, world_size)
        resumed.load_checkpoint(f"{out}/ckpt")
        resumed_losses = train(resumed, 2, micro)
        resumed_after = wrapped_state(resumed)
        result = {
            "losses": losses,
            "resumed_losses": resumed_losses,
            "before": before,
            "after": after,
            "resumed_after": resumed_after,
            "exported": weights,
            "trainable": trainable,
            "optimized": optimized,
            "logps": logps,
        }
        torch.save(result, f"{out}/rank{rank}.pt")


def _run(model_dir, tmp_path_factory, world_size: int) -> dict:
    out = tmp_path_factory.mktemp(f"lora_{world_size}")
    spawn_ranks(_lora_worker, world_size, str(model_dir), str(out))
    result = torch.load(out / "rank0.pt", weights_only=True)
    result["out"] = out
    if world_size > 1:
        result["rank1"] = torch.load(out / "rank1.pt", weights_only=True)
    return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_lora"), seed=0)


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    return _run(model_dir, tmp_path_factory, 1)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    return _run(model_dir, tmp_path_factory, 2)


def test_only_adapters_train_and_the_base_stays_bit_identical(one_rank):
    assert one_rank["trainable"] == [
        f"model.layers.{i}.{m}.{ab}"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in ("lora_A", "lora_B")
    ]
    # 2 layers x rank 4 x ((32 + 32) + (32 + 16) + (64 + 32)) adapter parameters, nothing else.
    assert one_rank["optimized"] == 2 * RANK * (64 + 48 + 96)
    before, after = one_rank["before"], one_rank["after"]
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == set(one_rank["trainable"])
    assert one_rank["losses"][-1] < one_rank["losses"][0]


def test_exported_weights_are_merged_under_the_hf_names(one_rank, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights, state = one_rank["exported"], one_rank["after"]
    assert list(weights) == list(hf.state_dict())
    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")
        if module.endswith(tuple(TARGETS)) and leaf == "weight":
            a, b = state[f"{module}.lora_A"], state[f"{module}.lora_B"]
            merged = state[f"{module}.base.weight"] + (ALPHA / RANK) * b @ a
            assert torch.allclose(tensor, merged, atol=1e-6), name
            assert not torch.equal(tensor, hf.state_dict()[name]), name
        else:
            assert torch.equal(tensor, hf.state_dict()[name]), name


def test_the_hf_export_is_the_merged_model(one_rank):
    exported_model = AutoModelForCausalLM.from_pretrained(one_rank["out"] / "hf", dtype=torch.float32)
    for name, tensor in exported_model.state_dict().items():
        assert torch.equal(tensor, one_rank["exported"][name]), name


def test_checkpoint_holds_adapters_and_resume_continues_identically(one_rank):
    metadata = dcp.FileSystemReader(str(one_rank["out"] / "ckpt")).read_metadata()
    model_keys = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert model_keys == set(one_rank["trainable"])  # no frozen base weights
    assert one_rank["resumed_losses"] == one_rank["losses"][1:]
    for name, tensor in one_rank["after"].items():
        assert torch.equal(one_rank["resumed_after"][name], tensor), name


def test_two_ranks_train_like_one_rank(one_rank, two_ranks):
    two = [(a + b) / 2 for a, b in zip(two_ranks["losses"], two_ranks["rank1"]["losses"])]
    assert two == pytest.approx(one_rank["losses"], abs=1e-5)
    assert two_ranks["rank1"]["exported"] == {}  # only rank 0 yields
    for name, tensor in one_rank["exported"].items():
        assert torch.allclose(two_ranks["exported"][name], tensor, atol=1e-5), name
    resumed = [(a + b) / 2 for a, b in zip(two_ranks["resumed_losses"], two_ranks["rank1"]["resumed_losses"])]
    assert resumed == two[1:]


def test_log_probs_after_training_are_the_merged_model_s(one_rank):
    from roll.models.logprobs import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(one_rank["out"] / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        merged = response_log_probs(model, global_batch(), temperature=0.9)["log_probs"]
    assert torch.allclose(one_rank["logps"], merged, atol=1e-5)


def _critic_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):
        critic = make_lora_strategy(model_dir, rank, world_size, model_type="value")
        trainable = [n for n, p in critic.model.named_parameters() if p.requires_grad]
        before = wrapped_state(critic)
        critic.train_step(local_micro_batches(rank, world_size), value_loss)
        after = wrapped_state(critic)
        changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
        # HF names load into the frozen base weights; the adapters keep their values.
        weight = "model.layers.0.self_attn.q_proj.weight"
        critic.load_weights(
            iter([(weight, torch.zeros_like(after[weight.replace(".weight", ".base.weight")]))])
        )
        loaded = wrapped_state(critic)
        torch.save(
            {
                "trainable": trainable,
                "changed": changed,
                "base_zeroed": bool(
                    torch.count_nonzero(loaded["model.layers.0.self_attn.q_proj.base.weight"]) == 0
                ),
                "adapter_kept": torch.equal(
                    loaded["model.layers.0.self_attn.q_proj.lora_B"],
                    after["model.layers.0.self_attn.q_proj.lora_B"],
                ),
            },
            f"{out}/critic.pt",
        )


def test_a_lora_critic_trains_its_adapters_and_its_new_value_head(model_dir, tmp_path):
    spawn_ranks(_critic_worker, 1, str(model_dir), str(tmp_path))
    result = torch.load(tmp_path / "critic.pt", weights_only=True)
    adapters = [n for n in result["trainable"] if n.endswith(("lora_A", "lora_B"))]
    assert len(adapters) == 12 and set(result["trainable"]) - set(adapters) == {
        "value_head.weight",
        "value_head.bias",
    }
    assert set(result["changed"]) <= set(result["trainable"]) and "value_head.weight" in result["changed"]
    assert result["base_zeroed"] and result["adapter_kept"]


def _mismatch_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):
        make_lora_strategy(model_dir, rank, world_size).save_checkpoint(f"{out}/ckpt")
        full = RoleConfig(
            model_args=ModelArgs(model_name_or_path=model_dir, dtype="fp32"),
            training_args=TrainingArgs(learning_rate=1e-2),
            strategy_args=StrategyArgs("fsdp2_train", {}),
        )
        ctx = WorkerContext("actor_train", rank, world_size, rank, torch.device("cpu"), seed=42)
        candidates = {"full": load_strategy_class("fsdp2_train")(full, ctx)}
        candidates["full"].initialize()
        wider = RoleConfig(
            model_args=ModelArgs(
                model_name_or_path=model_dir, dtype="fp32", lora_target=TARGETS, lora_rank=8
            ),
            training_args=TrainingArgs(learning_rate=1e-2),
            strategy_args=StrategyArgs("fsdp2_train", {}),
        )
        candidates["rank 8"] = load_strategy_class("fsdp2_train")(wider, ctx)
        candidates["rank 8"].initialize()
        errors = {}
        for name, strategy in candidates.items():
            try:
                strategy.load_checkpoint(f"{out}/ckpt")
            except CheckpointError as exc:
                errors[name] = str(exc)
        (Path(out) / "errors.json").write_text(json.dumps(errors))


def test_a_checkpoint_saved_with_other_lora_keys_is_refused_in_one_line(model_dir, tmp_path):
    spawn_ranks(_mismatch_worker, 1, str(model_dir), str(tmp_path))
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert set(errors) == {"full", "rank 8"}
    for error in errors.values():
        assert "\n" not in error and error.startswith(
            f"{tmp_path}/ckpt/trainer_state.json: saved with LoRA rank 4"
        )
    assert "asks for off (every weight trained)" in errors["full"]
    assert "asks for rank 8 on 6 modules" in errors["rank 8"]
