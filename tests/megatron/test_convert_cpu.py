"""``roll.models.megatron.convert`` on two CPU ranks (gloo, fp32, the CPU shims): HF -> mcore dist
checkpoint -> HF gives every original tensor bit for bit, for each family roll knows and several
layouts, each rank holding one parameter value at a time while it writes (the export in parts of
20 kB); megatron_train starts from the dist checkpoint (``mcore_checkpoint``) with the same
weights as from HF; a layout the model cannot split and a checkpoint of another family / TP are
one-line errors."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

from cuda_on_cpu import cuda_hidden  # noqa: E402
from tiny_models import safetensors_dir, save_random_model, tensor_differences  # noqa: E402
from two_rank_training import megatron_rank, raw_params, run_two_ranks, train_strategy  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.models.megatron import convert, mcore_checkpoint  # noqa: E402

SHAPE = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=272, max_position_embeddings=64
)
MODELS = {
    "qwen2": ("Qwen2Config", dict(intermediate_size=64, num_hidden_layers=4, tie_word_embeddings=False)),
    "qwen3": (
        "Qwen3Config",
        dict(intermediate_size=64, num_hidden_layers=2, head_dim=8, tie_word_embeddings=True),
    ),
    "llama": ("LlamaConfig", dict(intermediate_size=64, num_hidden_layers=2)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            head_dim=8,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    ),
}
# (model, tp, pp, ep, vpp) on two ranks
LAYOUTS = [
    ("qwen2", 2, 1, 1, None),
    ("qwen2", 1, 2, 1, 2),
    ("qwen3", 2, 1, 1, None),
    ("llama", 1, 2, 1, None),
    ("qwen3_moe", 1, 1, 2, None),
    ("mixtral", 1, 1, 2, None),
    ("mixtral", 2, 1, 1, None),
]


def save_model(path: Path, name: str) -> Path:
    cls, extra = MODELS[name]
    config = getattr(transformers, cls)(**SHAPE, **extra, pad_token_id=0, eos_token_id=1)
    return save_random_model(config, path)


_tensors = safetensors_dir


def _strategy_checks(scratch: str) -> list[str]:
    """megatron_train started from the TP2 dist checkpoint (model_name_or_path = that directory,
    which holds no safetensors) has exactly the weights of one started from HF; a TP1 layout
    refuses the TP2 checkpoint with one line naming the key."""
    mcore = str(Path(scratch, "qwen2-tp2-pp1-ep1-vppNone", "mcore"))
    from_hf = raw_params(train_strategy(str(Path(scratch, "qwen2")), {"tensor_model_parallel_size": 2}))
    layout = {"tensor_model_parallel_size": 2, "mcore_checkpoint": mcore}
    from_mcore = raw_params(train_strategy(mcore, layout))
    bad = [f"mcore start: {n} differs" for n in from_hf if not torch.equal(from_hf[n], from_mcore[n])]
    try:
        train_strategy(mcore, {"mcore_checkpoint": mcore})
        bad.append("a TP1 layout loaded the TP2 checkpoint")
    except ConfigError as exc:
        if "mcore_checkpoint" not in exc.path or "written for TP=2" not in exc.message:
            bad.append(f"TP1 load: {exc}")
    return bad


def _worker(rank: int, world_size: int, port: int, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=120)) as bad:
        for name, tp, pp, ep, vpp in LAYOUTS:
            tag = f"{name}-tp{tp}-pp{pp}-ep{ep}-vpp{vpp}"
            mcore, back = Path(scratch, tag, "mcore"), Path(scratch, tag, "hf")
            source = convert.write_mcore(Path(scratch, name), mcore, convert.layout_config(tp, pp, ep, vpp))
            largest = max(p.numel() * p.element_size() for _, p, _ in source.items.values())
            if source.peak_bytes > largest:  # one parameter value at a time
                bad.append(f"{tag}: held {source.peak_bytes} bytes at once, largest parameter {largest}")
            convert.read_mcore(mcore, back, max_shard_size=20_000)  # several parts
            if rank == 0:
                bad += tensor_differences(tag, _tensors(Path(scratch, name)), _tensors(back))
        bad += _strategy_checks(scratch)


@pytest.mark.slow
def test_round_trips_are_bit_exact(tmp_path: Path) -> None:
    for name in MODELS:
        save_model(tmp_path / name, name)
    bad = run_two_ranks(_worker, (str(tmp_path),), tmp_path)
    assert not bad, "\n".join(bad)


def test_layout_the_model_cannot_split_names_the_flag(tmp_path: Path) -> None:
    save_model(tmp_path / "m", "qwen2")
    with pytest.raises(ConfigError, match=r"^--tp: 4 does not divide the model's num_key_value_heads"):
        convert.check_layout(tmp_path / "m", convert.layout_config(4, 1, 1))
    with pytest.raises(ConfigError, match=r"^--ep: is an MoE option"):
        convert.check_layout(tmp_path / "m", convert.layout_config(1, 1, 2))
    assert (
        convert.main(["hf-to-mcore", "--hf", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--pp", "3"])
        == 2
    )


def test_checkpoint_of_another_family_or_tp_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / mcore_checkpoint.MANIFEST).write_text(
        '{"model_type": "mixtral", "layout": {"tp": 1, "pp": 1, "ep": 1, "vpp": null}, "padded_vocab_size": 384}'
    )
    qwen = transformers.Qwen2Config(**SHAPE)
    with pytest.raises(ConfigError, match=r"roll_mcore.json holds a 'mixtral' model, not 'qwen2'"):
        mcore_checkpoint.check_compatible(tmp_path / "ck", qwen, convert.layout_config(1, 1, 1), "key")
    mixtral = transformers.MixtralConfig(**SHAPE)
    with pytest.raises(ConfigError, match=r"written for TP=1"):
        mcore_checkpoint.check_compatible(tmp_path / "ck", mixtral, convert.layout_config(2, 1, 1), "key")
    with pytest.raises(ConfigError, match=r"no such file"):
        mcore_checkpoint.read_manifest(tmp_path)


@pytest.mark.slow
def test_command_line_round_trip_on_cpu(tmp_path: Path) -> None:
    """The CLI as a user runs it (its own ranks, no test shims): TP2 there and back, bit-exact."""
    save_model(tmp_path / "hf", "qwen2")
    args = ["hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"), "--tp", "2"]
    back = ["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]
    with cuda_hidden():  # the CLI's own ranks, on CPU even where CUDA exists
        assert convert.main(args) == 0
        assert convert.main(back) == 0
    original, again = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert original.keys() == again.keys()
    assert all(torch.equal(original[n], again[n]) for n in original)
