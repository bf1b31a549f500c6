"""HF -> Megatron -> HF conversion on tiny models of every family, over real process groups.

One spawn per world size (1, 2, 4) runs many cases (family x layout) in the same processes; each
case re-creates megatron's parallel groups. Per case:

- load the HF checkpoint into Megatron chunks while recording every safetensors slice read: each
  rank must read exactly the elements of its own parameters (no whole tensors where a slice does);
- export back to HF names; the union over ranks must equal the checkpoint bit for bit, each tensor
  yielded by exactly one rank (with ``gather=False``: each rank's slice, checked against the file);
- where marked, compare Megatron's fp32 logits (TP gathered, pipeline stages chained by hand) with
  transformers' logits (atol 1e-4), and save with ``save_hf_checkpoint`` and reload in transformers.

On CPU the forward runs through ``compat`` (test-only patches). On CUDA the same code runs on NCCL,
one GPU per rank (world sizes above the GPU count are skipped).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import compat  # noqa: E402  (tests/megatron/compat.py)
from gloo_ranks import process_group, spawn_ranks  # noqa: E402

pytest.importorskip("megatron.core")

TINY = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, intermediate_size=128, vocab_size=200),
    # Tied embeddings; vocab padded to 384 (TP=1) / 512 (TP=2).
    "qwen2": lambda: transformers.Qwen2Config(
        **TINY, intermediate_size=128, vocab_size=272, tie_word_embeddings=True
    ),
    # head_dim != hidden / heads; vocab needs no padding.
    "qwen3": lambda: transformers.Qwen3Config(**TINY, intermediate_size=128, vocab_size=256, head_dim=32),
    # Layer 1 is a dense MLP layer (mlp_only_layers), the others MoE.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        vocab_size=130,
        head_dim=16,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=300
    ),
}


@dataclass(frozen=True)
class Case:
    family: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    forward: bool = True
    save: bool = False
    sliced_export: bool = False
    # Build with roll's layer spec (layer_spec.build_layer_spec) instead of megatron-core's local one.
    roll_spec: bool = False
    # Count the embedding and the loss as pipeline layers (account_for_*_in_pipeline_split).
    pp_split_extras: bool = False

    def __str__(self) -> str:
        vpp = f"VPP{self.vpp}" if self.vpp else ""
        spec = " roll-spec" if self.roll_spec else ""
        extras = " +emb+loss" if self.pp_split_extras else ""
        return (
            f"{self.family} TP{self.tp} PP{self.pp}{vpp} EP{self.ep} ETP{self.etp or self.tp}{spec}{extras}"
        )


DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen3_moe", "mixtral")
CASES = {
    1: [Case(f) for f in DENSE + MOE] + [Case("qwen2", save=True)],
    2: [Case(f, tp=2) for f in DENSE + MOE]
    + [Case(f, pp=2) for f in ("llama", "qwen2", "qwen3_moe")]
    + [Case(f, pp=2, vpp=2) for f in ("qwen2", "qwen3")]
    # 4 layers + embedding + loss = 6 pipeline "layers", 3 per stage. With VPP 3 the six chunks hold
    # [embedding], [L0], [L1], [L2], [L3], [loss] (first/last without any transformer layer).
    + [Case("llama", pp=2, pp_split_extras=True), Case("qwen2", pp=2, vpp=3, pp_split_extras=True)]
    + [Case(f, ep=2) for f in MOE]
    + [Case("qwen3", tp=2, sliced_export=True), Case("mixtral", ep=2, sliced_export=True)]
    + [Case(f, tp=2, roll_spec=True) for f in ("qwen2", "qwen3_moe")]
    + [Case("qwen3", pp=2, roll_spec=True)],
    4: [Case(f, tp=2, pp=2) for f in ("llama", "qwen2", "qwen3_moe")]
    + [
        Case("qwen3", tp=2),  # DP=2: the second replica yields nothing
        Case("mixtral", tp=2, ep=2),  # expert-TP 2 x EP 2
        Case("qwen3_moe", ep=2, etp=1, tp=2),  # expert-TP 1 under TP 2
        Case("qwen3_moe", pp=2, ep=2, save=True),
        Case("llama", tp=2, pp=2, save=True),
        Case("qwen2", pp=4, save=True),
    ],
}


# ------------------------------------------------------------------------------- main process
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Each family saved with save_pretrained (random weights, norms not 1, safetensors)."""
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for i, (family, make_config) in enumerate(HF_CONFIGS.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
        paths[family] = str(root / family)
        model.save_pretrained(paths[family])
        _tokenizer().save_pretrained(paths[family])
    return paths


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer, so save_hf_checkpoint has one to copy."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "a": 1, "b": 2}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    )


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_round_trip_and_forward(world_size: int, checkpoints: dict[str, str], tmp_path: Path) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs (one per rank) on a CUDA machine")
    spawn_ranks(_worker, world_size, checkpoints, CASES[world_size], str(tmp_path))


def test_transformer_engine_names() -> None:
    """TE fuses the norms into linear_qkv / linear_fc1 and names grouped experts weight{i}; the
    tables bind those names when the built model has them (MoE layers keep pre_mlp_layernorm)."""
    from roll.configs.strategy_configs import MegatronConfig
    from roll.models.megatron import families
    from roll.models.megatron import weight_mapping as wm

    te_names = [
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight0",
    ]
    naming = wm.MegatronNaming.detect(te_names)
    assert naming == wm.MegatronNaming(fused_norms=True, grouped_experts=True)
    info = families.conversion_info(HF_CONFIGS["qwen3_moe"](), MegatronConfig())
    dense = {w.mcore: w.hf for w in wm.layer_weights(info, naming, layer=1, local=0, experts=[])}
    assert dense["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] == (
        "model.layers.1.input_layernorm.weight",
    )
    assert dense["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == (
        "model.layers.1.post_attention_layernorm.weight",
    )
    moe = {w.mcore: w.hf for w in wm.layer_weights(info, naming, layer=2, local=1, experts=[2, 3])}
    assert moe["decoder.layers.1.pre_mlp_layernorm.weight"] == (
        "model.layers.2.post_attention_layernorm.weight",
    )
    assert moe["decoder.layers.1.mlp.experts.linear_fc1.weight1"] == (
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    )
    assert moe["decoder.layers.1.mlp.experts.linear_fc2.weight0"] == (
        "model.layers.2.mlp.experts.2.down_proj.weight",
    )
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        wm.MegatronNaming.detect(["decoder.layers.0.mlp.experts.weight1"])


# ------------------------------------------------------------------------------------ workers
def _worker(
    rank: int, world: int, port: int, ckpts: dict[str, str], cases: list[Case], scratch: str, run_case=None
) -> None:
    """Run ``cases`` on this rank with ``run_case`` (default: this module's ``_run_case``; the
    DeepSeek-V3 test passes its own)."""
    run_case = run_case or _run_case
    warnings.filterwarnings("ignore")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    with process_group(rank, world, port, backend="nccl" if cuda else "gloo"):
        compat.apply()
        from megatron.core import parallel_state as ps

        for i, case in enumerate(cases):
            try:
                run_case(case, ckpts[case.family], Path(scratch) / f"case{i}")
            except Exception as err:
                raise AssertionError(f"rank {rank}, case {case}: {err}") from err
            finally:
                ps.destroy_model_parallel()


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _run_case(case: Case, ckpt: str, scratch: Path) -> None:
    from megatron.core import parallel_state as ps

    from roll.configs.strategy_configs import MegatronConfig
    from roll.models.megatron.model_builder import build_model_chunks, default_layer_spec_fn, local_layer_spec
    from roll.models.megatron.runtime import move_params

    ps.initialize_model_parallel(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp,
    )
    compat.seed(1234)
    cfg = MegatronConfig(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp,
        account_for_embedding_in_pipeline_split=case.pp_split_extras,
        account_for_loss_in_pipeline_split=case.pp_split_extras,
    )
    cfg.validate(dist.get_world_size(), "strategy_config")
    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    spec_fn = default_layer_spec_fn() if case.roll_spec else local_layer_spec
    chunks = build_model_chunks(hf_config, cfg, torch.float32, spec_fn)
    _load_and_check_reads(chunks, ckpt)
    # As the strategies' runtime does after loading: megatron builds some modules on CPU whatever
    # the device (torch norms of the local spec, the MoE router), so a CUDA forward needs them moved.
    move_params(chunks, _device())
    _check_export(chunks, ckpt, scratch / "export", case)
    if case.forward:
        _check_forward(chunks, ckpt)
    if case.save:
        _check_save(chunks, hf_config, ckpt, scratch / "saved")


# ------------------------------------------------------------------------------- load + reads
class _RecordingSlice:
    def __init__(self, inner, name: str, log: list):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        tensor = self.inner[index]
        self.log.append((self.name, tensor.numel()))
        return tensor


class _RecordingOpen:
    """safe_open that logs (tensor name, elements) for every slice read."""

    log: list = []

    def __init__(self, path, framework: str, device: str):
        self.inner = safe_open(path, framework=framework, device=device)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name: str):
        return _RecordingSlice(self.inner.get_slice(name), name, self.log)


def _owned_elements(chunks) -> int:
    """Elements of this rank's parameters that come from the checkpoint (vocab padding excluded)."""
    from megatron.core import parallel_state as ps

    from roll.models.megatron import weight_mapping as wm
    from roll.models.megatron.hf_io import unwrap

    total = 0
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        model, info = unwrap(chunk), unwrap(chunk).roll_hf_info
        for name, param in model.named_parameters():
            total += param.numel()
            if name in (wm.EMBEDDING.mcore, wm.OUTPUT.mcore):
                rows = info.padded_vocab_size // tp
                real = min(max(info.vocab_size - tp_rank * rows, 0), rows)
                total -= (rows - real) * param.shape[1]
    return total


def _load_and_check_reads(chunks, ckpt: str) -> None:
    from roll.models.megatron import hf_io

    real_open = hf_io.safe_open
    _RecordingOpen.log = []
    hf_io.safe_open = _RecordingOpen
    try:
        hf_io.load_hf_weights(chunks, ckpt)
    finally:
        hf_io.safe_open = real_open
    read = sum(n for _, n in _RecordingOpen.log)
    assert read == _owned_elements(chunks), f"read {read} elements, owns {_owned_elements(chunks)}"


# ------------------------------------------------------------------------------------- export
def _gather_exports(chunks, scratch: Path, gather: bool) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Every rank's exported tensors, on every rank (through files), with the exporting rank's
    TP rank (expert tensors: expert-TP rank)."""
    from megatron.core import parallel_state as ps

    from roll.models.megatron.hf_io import export_hf_weights

    rank = dist.get_rank()
    scratch.mkdir(parents=True, exist_ok=True)
    mine = {name: t.detach().cpu().clone() for name, t in export_hf_weights(chunks, gather=gather)}
    if gather:
        _check_export_roles(chunks, mine)
    ranks = (ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    torch.save((ranks, mine), scratch / f"{int(gather)}_{rank}.pt")
    dist.barrier()
    return [torch.load(scratch / f"{int(gather)}_{r}.pt") for r in range(dist.get_world_size())]


def _check_export_roles(chunks, exported: dict[str, torch.Tensor]) -> None:
    """export_roles() says exactly whether this rank yields non-expert / expert tensors."""
    from roll.models.megatron.hf_io import export_roles, unwrap

    dense, experts = export_roles()
    has_experts = unwrap(chunks[0]).roll_hf_info.num_experts > 0
    assert dense == any(".experts." not in name for name in exported)
    assert (experts and has_experts) == any(".experts." in name for name in exported)


def _check_export(chunks, ckpt: str, scratch: Path, case: Case) -> None:
    reference = load_file(Path(ckpt) / "model.safetensors")
    seen: dict[str, torch.Tensor] = {}
    for _, part in _gather_exports(chunks, scratch, gather=True):
        clash = set(seen) & set(part)
        assert not clash, f"exported by two ranks: {sorted(clash)[:4]}"
        seen.update(part)
    assert set(seen) == set(reference), f"names differ: {sorted(set(seen) ^ set(reference))[:6]}"
    for name, tensor in reference.items():
        assert torch.equal(seen[name], tensor), f"{name} differs after the round trip"
    if case.sliced_export:
        _check_sliced_export(chunks, scratch, reference)


def _check_sliced_export(chunks, scratch: Path, reference: dict[str, torch.Tensor]) -> None:
    """gather=False: each rank's tensors are its TP slice of the HF tensor (vocab padding dropped)."""
    from megatron.core import parallel_state as ps

    from roll.models.megatron.hf_io import unwrap

    rows_per_rank = (
        unwrap(chunks[0]).roll_hf_info.padded_vocab_size // ps.get_tensor_model_parallel_world_size()
    )
    for (tp_rank, etp_rank), part in _gather_exports(chunks, scratch, gather=False):
        for name, piece in part.items():
            full = reference[name]
            if piece.shape == full.shape:
                assert torch.equal(piece, full), name
                continue
            (dim,) = [d for d in range(full.dim()) if piece.shape[d] != full.shape[d]]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                start = tp_rank * rows_per_rank
            else:
                start = (etp_rank if ".experts." in name else tp_rank) * piece.shape[dim]
            assert torch.equal(piece, full.narrow(dim, start, piece.shape[dim])), f"{name}: slice differs"


# ------------------------------------------------------------------------------------ forward
def _tokens(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 12), generator=generator)
    return ids.to(_device()), torch.arange(12, device=_device()).expand(2, 12)


def _pipeline_forward(chunks, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Run the chunks stage by stage (virtual stages in order), passing hidden states by send/recv;
    returns the vocab-parallel logits on the last stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    hidden_shape = (ids.shape[1], ids.shape[0], chunks[0].config.hidden_size)
    out = None
    for chunk in chunks:  # each blocking recv waits for the previous stage (ranks wrap around)
        if not chunk.pre_process:
            hidden = torch.empty(hidden_shape, device=ids.device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(hidden)
        out = chunk(ids, positions, attention_mask=None)
        if not chunk.post_process:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out if chunks[-1].post_process else None


def _check_forward(chunks, ckpt: str) -> None:
    """Megatron logits (TP gathered, padding dropped) == transformers' logits, fp32, atol 1e-4."""
    from megatron.core import parallel_state as ps

    hf_model = (
        transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(_device()).eval()
    )
    ids, positions = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits
        for chunk in chunks:
            chunk.eval()
        logits = _pipeline_forward(chunks, ids, positions)
    if logits is None:
        return
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    logits = logits[..., : hf_model.config.vocab_size]
    diff = (logits - expected).abs().max().item()
    assert diff < 1e-4, f"max |logits - HF logits| = {diff:.2e} (logits scale {expected.abs().max():.2f})"


# --------------------------------------------------------------------------------------- save
def _check_save(chunks, hf_config, ckpt: str, out: Path) -> None:
    """save_hf_checkpoint from all ranks: transformers loads the result (and its tokenizer) with the
    original weights, and load_hf_weights reads it back (several files + index when PP/EP > 1)."""
    from roll.models.megatron.hf_io import load_hf_weights, save_hf_checkpoint

    save_hf_checkpoint(chunks, hf_config, out, tokenizer_dir=ckpt)
    if dist.get_rank() == 0:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        original = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        reloaded_state, original_state = reloaded.state_dict(), original.state_dict()
        assert set(reloaded_state) == set(original_state)
        for name, tensor in original_state.items():
            assert torch.equal(reloaded_state[name], tensor), f"{name} differs after save_hf_checkpoint"
        tokenizers = [transformers.AutoTokenizer.from_pretrained(path) for path in (out, ckpt)]
        assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    for chunk in chunks:
        for param in chunk.parameters():
            param.data.zero_()
    load_hf_weights(chunks, out)
    _check_export(chunks, ckpt, out.parent / "export_after_save", Case(hf_config.model_type))
