"""Qwen3-Next (``qwen3_next``) on megatron-core, against transformers' Qwen3NextForCausalLM on a
tiny random config, on CPU over gloo (fp32, the test-only shims in ``compat`` / ``cuda_on_cpu``).

One two-rank spawn runs, in order:

- parity and weight mapping (the checks of ``test_conversion``) at TP1 (two data-parallel
  replicas, + ``save_hf_checkpoint`` that transformers reloads), TP2 and EP2: each rank reads
  exactly its own slices of the safetensors (the fused Gated DeltaNet in_proj and conv split by
  key heads), the export gives every tensor back bit for bit, the logits equal transformers'
  (atol 1e-4), also on 150 tokens (three chunks of the delta rule);
- the offline converter: HF (with ``mtp.*`` tensors, dropped) -> mcore dist checkpoint at TP2
  -> HF, bit-exact (megatron's own sharded-state-dict split of in_proj / conv1d);
- megatron_train at TP2 + SP (padded rows) and EP2 (packed rows): log-probs equal transformers',
  one training step has a finite loss and transformers' gradient norm (the Gated DeltaNet output
  norm's gradient is summed over TP), and both layouts take the same step.

Fast tests beside it: the plain-torch gated delta rule and causal conv against transformers'
token-by-token versions (packed rows too), ``mtp.*`` tensors skipped with a log line, bad layouts
and config.json values as one ConfigError naming the key, generation refused, LoRA layouts leaving
the linear-attention layers out, and the planner's parameter count (80B total, ~3B active at the
published shape).

The tiny config keeps every Qwen3-Next feature: linear and full attention layers, two value heads
per key head, an output-gated q_proj with partial RoPE, zero-centred norms, 4 experts (top 2) with
a gated shared expert, one dense MLP layer (``mlp_only_layers``).
"""

from __future__ import annotations

import datetime
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

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
from tiny_models import (  # noqa: E402
    build_tiny_tokenizer,
    safetensors_dir,
    tensor_differences,
    tiny_qwen3_next_config,
)
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

MTP = {
    "mtp.fc.weight": (64, 128),
    "mtp.norm.weight": (64,),
    "mtp.layers.0.self_attn.q_proj.weight": (128, 64),
}


def save_qwen3_next(path: Path, seed: int = 0, mtp: bool = False) -> Path:
    """Random weights N(mean, 0.1): zero-centred norms around 0, the gated norm around 1, A_log and
    dt_bias around 1, the rest around 0; a tokenizer; with ``mtp`` also ``mtp.*`` tensors (as the
    published checkpoints carry a multi-token-prediction module)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_next_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            around_one = name.endswith(("linear_attn.norm.weight", "A_log", "dt_bias"))
            param.normal_(1.0 if around_one else 0.0, 0.1)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    if mtp:
        tensors = load_file(path / "model.safetensors")
        tensors |= {name: torch.randn(shape) for name, shape in MTP.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


# ------------------------------------------------------------------------- parity + mapping
CASES = [
    conv.Case("qwen3_next", roll_spec=True, save=True),  # two data-parallel replicas
    conv.Case("qwen3_next", tp=2, roll_spec=True),
    conv.Case("qwen3_next", ep=2, roll_spec=True),
]


def _check_long_forward(chunks, ckpt: str, length: int = 150) -> None:
    """Logits on ``length`` tokens (several delta-rule chunks) equal transformers' (TP gathered)."""
    from megatron.core import parallel_state as ps

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 272, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
        logits = chunks[0](ids, torch.arange(length).unsqueeze(0), attention_mask=None)
    tp_group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, logits.contiguous(), group=tp_group)
    diff = float((torch.cat(shards, dim=-1)[..., :272] - expected).abs().max())
    assert diff < 1e-4, f"{length} tokens: max |logits - HF logits| = {diff:.2e}"


def _run_case(case: conv.Case, ckpt: str, scratch: Path) -> None:
    from megatron.core import parallel_state as ps

    from roll.models.megatron.model_builder import build_model_chunks

    ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep)
    compat.seed(1234)
    cfg = MegatronConfig(tensor_model_parallel_size=case.tp, expert_model_parallel_size=case.ep)
    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    chunks = build_model_chunks(hf_config, cfg, torch.float32)
    conv._load_and_check_reads(chunks, ckpt)
    conv._check_export(chunks, ckpt, scratch / "export", case)
    conv._check_forward(chunks, ckpt)
    _check_long_forward(chunks, ckpt)
    if case.save:
        conv._check_save(chunks, hf_config, ckpt, scratch / "saved")


def _parity_checks(ckpt: str, scratch: Path) -> list[str]:
    from megatron.core import parallel_state as ps

    bad = []
    for i, case in enumerate(CASES):
        try:
            _run_case(case, ckpt, scratch / f"case{i}")
        except AssertionError as err:
            bad.append(f"{case}: {err}")
        finally:
            ps.destroy_model_parallel()
    return bad


# ------------------------------------------------------------------------------ converter
def _converter_checks(with_mtp: Path, scratch: Path) -> list[str]:
    """HF -> mcore at TP2 -> HF (read back at TP1): bit-exact, the ``mtp.*`` tensors dropped."""
    mcore, back = scratch / "mcore", scratch / "back"
    convert.write_mcore(with_mtp, mcore, convert.layout_config(2, 1, 1))
    convert.read_mcore(mcore, back)
    if dist.get_rank() != 0:
        return []
    original = {n: t for n, t in safetensors_dir(with_mtp).items() if not n.startswith("mtp.")}
    return tensor_differences("TP2 converter", original, safetensors_dir(back))


# ------------------------------------------------------------------------------- training
LAYOUTS = {
    "TP2+SP": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "EP2 packed": {"expert_model_parallel_size": 2, "sequence_packing": True},
}


def _training_checks(path: str) -> list[str]:
    bad, after = [], {}
    batch = pg_batch(0)
    reference, hf_norm = hf_log_probs_and_grad_norm(path, batch)
    mask = batch["response_mask"].bool()
    for name, layout in LAYOUTS.items():
        strategy = train_strategy(path, layout)
        diff = float((strategy.compute_log_probs(batch)["log_probs"] - reference).abs()[mask].max())
        if diff > 1e-4:
            bad.append(f"{name}: log-probs differ from transformers' by {diff:.2e}")
        dp_rank, dp_size, _ = strategy.dp_layout()
        metrics = strategy.train_step(batch.chunk(dp_size)[dp_rank].split(1), pg_loss)
        if not torch.isfinite(torch.tensor(metrics["loss"])):
            bad.append(f"{name}: loss {metrics['loss']}")
        if abs(metrics["grad_norm"] - hf_norm) > 1e-5 * hf_norm:
            bad.append(f"{name}: grad norm {metrics['grad_norm']:.7f}, transformers' {hf_norm:.7f}")
        after[name] = full_hf_weights(strategy)
    first, second = after.values()
    # lr 1e-2: Adam's first step moves every weight by ~1e-2 x sign(grad); rounding in a near-zero
    # gradient shows as up to ~1e-3, a wrong gradient as 2e-2.
    far = sorted((float((first[n] - second[n]).abs().max()), n) for n in first)
    if far[-1][0] > 2e-3:
        bad.append(f"one step at {' and '.join(LAYOUTS)} gives weights apart: {far[-4:]}")
    return bad


def _worker(rank: int, world_size: int, port: int, ckpt: str, with_mtp: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=300)) as bad:
        bad += _parity_checks(ckpt, Path(scratch, "parity"))
        bad += _converter_checks(Path(with_mtp), Path(scratch, "convert"))
        bad += _training_checks(ckpt)


def test_two_ranks_match_transformers_round_trip_and_train(tmp_path: Path) -> None:
    ckpt = save_qwen3_next(tmp_path / "hf")
    with_mtp = save_qwen3_next(tmp_path / "hf_mtp", mtp=True)
    bad = run_two_ranks(_worker, (str(ckpt), str(with_mtp), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- the torch math
def test_gated_delta_rule_and_conv_equal_transformers_recurrence() -> None:
    """The chunked delta rule (three chunks; packed rows restart per sequence) and the causal conv
    equal transformers' token-by-token recurrence and its conv, in float64 inputs."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from roll.models.megatron.gated_delta_rule import causal_conv, gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, s, heads, dk, dv = 2, 150, 4, 8, 12
    q, k = (torch.randn(b, s, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, heads, dv, generator=gen, dtype=torch.float64)
    g, beta = (torch.rand(b, s, heads, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -g
    expected, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert (gated_delta_rule(q, k, v, g, beta, use_fla=False) - expected).abs().max() < 1e-5
    cu = torch.tensor([0, 50, 130])  # two sequences, then 20 tokens of padding
    packed = gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=cu, use_fla=False)
    x, weight = torch.randn(1, 6, s, generator=gen), torch.randn(6, 1, 4, generator=gen)
    conv_out = causal_conv(x, weight, cu)
    for start, stop in ((0, 50), (50, 130), (130, 150)):
        part = slice(start, stop)
        alone, _ = hf.torch_recurrent_gated_delta_rule(
            q[:1, part], k[:1, part], v[:1, part], g[:1, part], beta[:1, part], use_qk_l2norm_in_kernel=True
        )
        assert (packed[:, part] - alone).abs().max() < 1e-5, (start, stop)
        expected_conv = hf.causal_conv1d_fn(x[..., part], weight.squeeze(1), activation="silu")
        assert torch.allclose(conv_out[..., part], expected_conv, atol=1e-6), (start, stop)


# ----------------------------------------------------------------------------------- mtp
def test_mtp_tensors_are_skipped_with_a_log_line(tmp_path: Path, caplog) -> None:
    from contextlib import ExitStack

    from roll.models.megatron import hf_io

    path = save_qwen3_next(tmp_path / "m", mtp=True)
    info = families.conversion_info(transformers.AutoConfig.from_pretrained(path), MegatronConfig())
    assert all(info.skipped(n) for n in MTP) and not info.skipped("model.layers.0.linear_attn.A_log")
    with caplog.at_level(logging.INFO, logger="roll.models.megatron.hf_io"), ExitStack() as stack:
        hf_io._check_checkpoint_names(hf_io._Checkpoint(path, stack), info)
    assert "skipping 3 tensors of modules roll does not build (mtp.*)" in caplog.text


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "layout, key, words",
    [
        ({"context_parallel_size": 4}, "context_parallel_size", r"TP x CP = 1 x 4 does not divide"),
        ({"tensor_model_parallel_size": 4}, "tensor_model_parallel_size", "4 does not divide"),
        ({"pipeline_model_parallel_size": 3}, "pipeline_model_parallel_size", "do not split evenly"),
        ({"expert_model_parallel_size": 3}, "expert_model_parallel_size", "number of experts"),
    ],
)
def test_bad_layouts_name_the_key(layout, key, words) -> None:
    with pytest.raises(ConfigError, match=rf"^strategy_args.strategy_config.{key}: .*{words}"):
        model_fit.check_model_fits(tiny_qwen3_next_config(), MegatronConfig(**layout))


def test_context_parallelism_splits_the_linear_key_heads() -> None:
    """CP runs the Gated DeltaNet layers on 1 / (TP x CP) of the key heads (2 here)."""
    model_fit.check_model_fits(tiny_qwen3_next_config(), MegatronConfig(context_parallel_size=2))
    with pytest.raises(ConfigError, match=r"context_parallel_size: 2: TP x CP = 2 x 2 does not divide"):
        model_fit.check_model_fits(
            tiny_qwen3_next_config(), MegatronConfig(tensor_model_parallel_size=2, context_parallel_size=2)
        )


def test_tp_must_divide_the_linear_key_heads() -> None:
    config = tiny_qwen3_next_config(linear_num_key_heads=1, linear_num_value_heads=4)
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size: 2 does not divide .* linear_num_key_heads"
    ):
        model_fit.check_model_fits(config, MegatronConfig(tensor_model_parallel_size=2))
    model_fit.check_model_fits(config, MegatronConfig())


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"num_experts": 0}, "num_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_options_name_the_key(overrides, key) -> None:
    config = tiny_qwen3_next_config()
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ConfigError, match=rf"^model_args.model_name_or_path: config.json {key}=.*qwen3_next"):
        model_fit.check_model_fits(config, MegatronConfig())


def test_megatron_generation_is_refused() -> None:
    from roll.core.sampling import SamplingParams
    from roll.models.megatron.kv_generate import generate_tokens

    config = SimpleNamespace(sequence_parallel=False, experimental_attention_variant="gated_delta_net")
    with pytest.raises(ConfigError, match=r"^strategy_args.strategy_name: megatron_infer cannot generate"):
        generate_tokens([SimpleNamespace(config=config)], [[3, 4]], SamplingParams(), [1], 272, 0)


@pytest.mark.parametrize("name", ["actor_infer", "rewards.judge", "reference"])
def test_megatron_infer_is_refused_at_launch_where_it_would_generate(name, tmp_path) -> None:
    """actor_infer and a judge (a model reward) generate with megatron_infer; the reference only
    scores, which Qwen3-Next supports."""
    from roll.configs.role import ModelArgs, RewardConfig, RoleConfig, StrategyArgs
    from roll.launch.files import check_megatron_layout

    tiny_qwen3_next_config().save_pretrained(tmp_path)
    kind = RewardConfig if name.startswith("rewards.") else RoleConfig
    extra = {"reward_fn": "llm_judge"} if kind is RewardConfig else {}
    role = kind(
        model_args=ModelArgs(model_name_or_path=str(tmp_path)),
        strategy_args=StrategyArgs("megatron_infer", strategy_config={}),
        device_mapping=[0],
        **extra,
    )
    if name == "reference":
        check_megatron_layout(name, role)
        return
    with pytest.raises(
        ConfigError, match=rf"^{name}.strategy_args.strategy_name: megatron_infer cannot generate"
    ):
        check_megatron_layout(name, role)


def test_lora_adapts_the_full_attention_layers_only() -> None:
    from roll.models.megatron import lora

    config = SimpleNamespace(
        num_layers=4,
        num_moe_experts=4,
        moe_layer_freq=[1, 1, 0, 1],
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1, 0, 1, 0],
    )
    layout = lora.layout(config, ["all-linear"], 8, "model_args.lora_target")
    assert layout["modules"] == [
        "decoder.layers.1.self_attention.linear_qkv",
        "decoder.layers.1.self_attention.linear_proj",
        "decoder.layers.2.mlp.linear_fc1",
        "decoder.layers.2.mlp.linear_fc2",
        "decoder.layers.3.self_attention.linear_qkv",
        "decoder.layers.3.self_attention.linear_proj",
    ]


# ------------------------------------------------------------------------------- planner
@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [1], "full_attention_interval": 2}])
def test_planner_counts_qwen3_next_parameters_exactly(overrides) -> None:
    """roll.planner's size formula equals transformers' parameter count (meta device); at the
    published shape (random_checkpoint's preset) it is 80B with ~3B active (plus the embeddings)."""
    from roll.models.random_checkpoint import preset_config
    from roll.planner.model_shape import shape_from_config

    config = transformers.Qwen3NextConfig(num_hidden_layers=4, **overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape_from_config(config.to_dict()).total_params() == sum(p.numel() for p in model.parameters())
    interval = {**config.to_dict(), "layer_types": None, "full_attention_interval": 2}
    assert shape_from_config(interval).linear_layers == 2  # a config.json without layer_types
    shape = shape_from_config(preset_config("qwen3-next-80b-a3b").to_dict())
    active = shape.total_params() - shape.expert_params() * (1 - shape.top_k / shape.experts)
    assert round(shape.total_params() / 1e9) == 80 and 3.0e9 < active - shape.embedding_params() < 3.5e9


def test_random_weights_start_zero_centred_norms_at_one() -> None:
    """The benchmarks' random weights: a zero-centred norm's stored weight is 0 (it scales by 1 + w),
    a plain norm's is 1."""
    from roll.models.megatron.layer_spec import TorchNorm
    from roll.models.megatron.runtime import init_random_weights

    config = SimpleNamespace(
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        sequence_parallel=False,
    )
    chunk = torch.nn.ModuleDict(
        {"centred": TorchNorm(config, 4, zero_centered_gamma=True), "plain": TorchNorm(config, 4)}
    )
    x = torch.randn(3, 4)
    init_random_weights([chunk])
    assert chunk["centred"].weight.eq(0).all() and chunk["plain"].weight.eq(1).all()
    torch.testing.assert_close(chunk["centred"](x), chunk["plain"](x))


@pytest.mark.parametrize(
    ("capability", "version", "refused"),
    [
        ((9, 0), "3.6.0", True),
        ((9, 0), "3.7.1", False),
        ((8, 0), "3.6.0", False),
        ((9, 0), "3.3.1+git", False),
    ],
)
def test_fla_is_refused_where_it_refuses_its_own_backward(monkeypatch, capability, version, refused):
    """fla 0.6 raises inside its first backward on Hopper with Triton >= 3.4.0 and < 3.7.1 (the GPU
    machines' image); roll says so before the forward (``fla_unusable``)."""
    import sys
    from types import SimpleNamespace

    from roll.models.megatron import gated_delta_rule as gdr

    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__=version))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = gdr.fla_unusable(torch.device("cpu"))
    assert (reason is not None) == refused
    if refused:
        assert "Triton 3.6.0" in reason and "#640" in reason
