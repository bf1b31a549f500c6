"""CPU unit tests of the megatron backend's own pieces (no TransformerEngine, no GPU).

Vocab-parallel log-probs over 2 gloo ranks, SDPA core attention against the plain formula, the
sequence-parallel norm, the plain-torch layer spec's parameter names against megatron-core's
local spec, grouped experts against the per-expert loop, the router without TE, TE-only options
as ConfigErrors, the sampling processors against transformers' warpers, and the shifted layout.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))
pytest.importorskip("megatron.core")

from gloo_ranks import process_group, spawn_ranks  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.megatron import layer_spec  # noqa: E402
from roll.models.megatron.forward import pack_micro_batches  # noqa: E402
from roll.models.megatron.kv_generate import attention_mask  # noqa: E402
from roll.models.megatron.sampling import process_logits  # noqa: E402
from roll.models.megatron.vocab_parallel import vocab_parallel_logprobs_entropy  # noqa: E402
from roll.utils.ports import free_port  # noqa: E402


# --------------------------------------------------------------------------- vocab parallel
def _plain(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab: int):
    logp = torch.log_softmax(logits[..., :vocab].double() / temperature, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _vocab_worker(rank: int, world_size: int, port: int, out: str) -> None:
    with process_group(rank, world_size, port):
        gen = torch.Generator().manual_seed(0)
        full = torch.randn(3, 5, 16, generator=gen) * 3  # 16 padded columns, 13 real
        targets = torch.randint(0, 13, (3, 5), generator=gen)
        weights = torch.randn(2, 3, 5, generator=gen)
        local = full[..., rank * 8 : (rank + 1) * 8].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs_entropy(local, targets, dist.group.WORLD, 0.7, vocab_size=13)
        (logp * weights[0] + ent * weights[1]).sum().backward()
        grads = [torch.empty_like(local.grad) for _ in range(2)]
        dist.all_gather(grads, local.grad)
        if rank == 0:
            torch.save({"logp": logp, "ent": ent, "grad": torch.cat(grads, -1)}, out)


def test_vocab_parallel_matches_plain_softmax(tmp_path: Path) -> None:
    out = str(tmp_path / "vp.pt")
    spawn_ranks(_vocab_worker, 2, out)
    got = torch.load(out)
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 5, 16, generator=gen) * 3).double().requires_grad_(True)
    targets = torch.randint(0, 13, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen).double()
    logp, ent = _plain(full, targets, 0.7, 13)
    (logp * weights[0] + ent * weights[1]).sum().backward()
    torch.testing.assert_close(got["logp"].double(), logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["ent"].double(), ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["grad"].double(), full.grad, atol=1e-5, rtol=1e-5)
    assert got["grad"][..., 13:].abs().max() == 0  # vocab padding gets no gradient


def test_vocab_parallel_single_rank_rejects_bad_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), None, 0.0)


# ------------------------------------------------------------------------- megatron in-process
@pytest.fixture(scope="module")
def megatron_world():
    """A one-rank gloo world with megatron's parallel groups (TP=PP=EP=1)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        activation_func=F.silu,
        params_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return TransformerConfig(**{**base, **kwargs})


def _moe_kwargs() -> dict:
    return dict(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="allgather"
    )


def test_sdpa_attention_matches_formula(megatron_world) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    attn = layer_spec.SDPAttention(_config(), 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, n, 8, generator=gen) for n in (4, 2, 2))  # [s, b, heads/groups, d]

    def reference(mask):  # mask [b, 1, sq, sk], True = masked
        kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        scores = torch.einsum("qbhd,kbhd->bhqk", q, kk) / math.sqrt(8)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        return torch.einsum("bhqk,kbhd->qbhd", probs, vv).reshape(6, 2, 32)

    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1).expand(2, 1, 6, 6)
    torch.testing.assert_close(attn(q, k, v, None), reference(causal))
    padded = causal.clone()
    padded[0, :, 2:, :2] = True  # row 0: its first two keys are left padding
    torch.testing.assert_close(attn(q, k, v, padded), reference(padded))


def test_torch_norm_matches_rmsnorm_and_marks_sequence_parallel(megatron_world) -> None:
    norm = layer_spec.TorchNorm(_config(sequence_parallel=True, tensor_model_parallel_size=2), 32, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    x = torch.randn(5, 2, 32)
    with torch.no_grad():
        norm.weight.normal_()
    torch.testing.assert_close(norm(x), F.rms_norm(x, (32,), norm.weight, 1e-6))
    plain = layer_spec.TorchNorm(_config(), 32)
    assert plain.weight.sequence_parallel is False


@pytest.mark.parametrize("moe", [False, True])
def test_plain_torch_spec_keeps_local_spec_names(megatron_world, moe: bool) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(**(_moe_kwargs() if moe else {}))
    experts = 4 if moe else None
    ours = layer_spec.build_layer_spec(config, MegatronConfig(moe_grouped_gemm=moe), experts)
    local = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    shapes = []
    for spec in (ours, local):
        torch.manual_seed(0)
        model = GPTModel(config, spec, vocab_size=64, max_sequence_length=32)
        shapes.append({n: tuple(p.shape) for n, p in model.named_parameters()})
    assert shapes[0] == shapes[1]
    layer = ours.submodules
    assert layer.input_layernorm is layer_spec.TorchNorm
    assert layer.self_attention.submodules.core_attention.module is layer_spec.SDPAttention
    if moe:
        assert layer.mlp.submodules.router.__name__ == "TorchTopKRouter"
        assert layer.mlp.submodules.experts.module.__name__ == "TorchGroupedMLP"


def test_grouped_experts_match_the_loop_and_router_needs_no_te(megatron_world) -> None:
    from megatron.core.models.gpt import GPTModel

    config = _config(**_moe_kwargs())
    models = []
    for grouped in (True, False):
        torch.manual_seed(0)
        spec = layer_spec.build_layer_spec(config, MegatronConfig(moe_grouped_gemm=grouped), 4)
        models.append(GPTModel(config, spec, vocab_size=64, max_sequence_length=32).decoder.layers[0].mlp)
    models[1].load_state_dict(models[0].state_dict())
    experts = [m.experts for m in models]
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 32, generator=gen, requires_grad=True)
    tokens = torch.tensor([3, 0, 5, 2])
    probs = torch.rand(10, generator=gen)
    outs = [e(hidden, tokens, probs)[0] for e in experts]
    torch.testing.assert_close(outs[0], outs[1])
    grads = [
        torch.autograd.grad(o.pow(2).sum(), e.local_experts[2].linear_fc1.weight)[0]
        for o, e in zip(outs, experts)
    ]
    torch.testing.assert_close(grads[0], grads[1])
    logits = models[0].router.gating(torch.randn(3, 2, 32))  # would hit te_general_gemm in 0.16.1
    assert logits.shape == (3, 2, 4) and logits.dtype == torch.float32


def _expert_tp_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """Expert-TP = TP = 2: the grouped experts take the grouped path on each rank's shards and
    match the per-expert loop (outputs and a weight's gradient)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    sys.path.insert(0, str(Path(__file__).parent))
    import compat

    with process_group(rank, world_size, port):
        ps.initialize_model_parallel(2, 1)
        compat.apply()
        config = _config(tensor_model_parallel_size=2, **_moe_kwargs())
        experts = []
        for grouped in (True, False):
            torch.manual_seed(0)
            spec = layer_spec.build_layer_spec(config, MegatronConfig(moe_grouped_gemm=grouped), 4)
            model = GPTModel(config, spec, vocab_size=64, max_sequence_length=32)
            experts.append(model.decoder.layers[0].mlp.experts)
        experts[1].load_state_dict(experts[0].state_dict())
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(10, 32, generator=gen)
        tokens, probs = torch.tensor([3, 0, 5, 2]), torch.rand(10, generator=gen)
        grouped = experts[0]._can_group(hidden)
        outs = [e(hidden, tokens, probs)[0] for e in experts]
        grads = [
            torch.autograd.grad(o.pow(2).sum(), e.local_experts[2].linear_fc1.weight)[0]
            for o, e in zip(outs, experts)
        ]
        ps.destroy_model_parallel()
        if rank == 0:
            torch.save({"grouped": grouped, "outs": outs, "grads": grads}, out)


def test_grouped_experts_serve_expert_tensor_parallel(tmp_path: Path) -> None:
    out = str(tmp_path / "etp.pt")
    spawn_ranks(_expert_tp_worker, 2, out)
    got = torch.load(out)
    assert got["grouped"], "expert-TP experts fell back to the per-expert loop"
    torch.testing.assert_close(got["outs"][0], got["outs"][1])
    torch.testing.assert_close(got["grads"][0], got["grads"][1])


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (MegatronConfig(transformer_config_kwargs={"fp8": "hybrid"}), "transformer_config_kwargs.fp8"),
        (MegatronConfig(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
    ],
)
def test_te_only_options_are_config_errors(cfg: MegatronConfig, key: str) -> None:
    if layer_spec.HAVE_TE:
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ConfigError) as err:
        layer_spec.check_te_requirements(cfg)
    assert err.value.path.endswith(key)


# ------------------------------------------------------------------------------- sampling
def test_processors_match_transformers_warpers() -> None:
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = torch.randint(0, 50, (3, 7), generator=gen)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3, min_new_tokens=2)
    ours = process_logits(logits, params, history, torch.ones_like(history, dtype=torch.bool), 0, [1])
    expected = logits.clone()
    for proc in (
        RepetitionPenaltyLogitsProcessor(1.3),
        MinNewTokensLengthLogitsProcessor(7, 2, 1),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.8),
    ):
        expected = proc(history, expected)
    torch.testing.assert_close(ours, expected)


def test_attention_mask_hides_left_padding_but_never_a_whole_row() -> None:
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    mask = attention_mask(valid, 0)[:, 0]  # True = masked
    assert mask[0, 3].tolist() == [True, True, False, False]
    assert mask[0, 0].tolist() == [False, True, True, True]  # a padding query sees itself only
    assert mask[1].tolist() == torch.triu(torch.ones(4, 4, dtype=torch.bool), 1).tolist()
    assert attention_mask(valid, 3).shape == (2, 1, 1, 4)


def test_packing_shifts_rows_and_points_at_the_responses() -> None:
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    batch = build_generation_batch(
        Batch.from_dict({"prompts": prompts, "prompt_mask": (prompts > 0).long()}),
        [[11, 12], [13]],
        None,
        1,
        0,
        3,
    )
    (packed,) = pack_micro_batches([batch], seq_multiple=4, device=torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 6, 11, 12, 0, 0, 0, 0], [7, 8, 9, 10, 13, 0, 0, 0]]
    # logits column window[i, t] predicts responses[i, t]: the token right after it in the row
    for row in range(2):
        for t in range(int(batch["response_mask"][row].sum())):
            col = int(packed.window[row, t])
            assert packed.input_ids[row, col + 1] == batch["responses"][row, t]
    assert packed.response_mask.tolist() == [[True, True, False], [True, False, False]]
