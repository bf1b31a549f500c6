"""megatron_infer's KV-cached generation (roll/models/megatron/kv_generate.py) on a tiny Qwen3-MoE
(grouped experts, the all-to-all dispatcher) over gloo ranks: the tokens a fixed seed draws stay the
tokens it drew before the decode loop was trimmed (issue 27), at TP=1 and at TP=2 (experts
tensor-parallel too), with rows that stop early on EOS; the grouped experts serve expert-TP.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
pytest.importorskip("megatron.core")

from gloo_ranks import spawn_ranks  # noqa: E402
from tiny_models import tiny_qwen3_moe_config  # noqa: E402
from two_rank_training import megatron_rank  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.models.megatron.kv_generate import attention_mask  # noqa: E402

EOS_IDS = list(range(3, 43))  # 40 of 272 ids: some rows stop early
PROMPTS = [
    [50, 51, 52],
    [60, 61, 62, 63, 64, 65],
    [70],
    [80, 81, 82, 83],
    [90, 91],
    [100, 101, 102, 103, 104],
]
# Drawn by the loop as of 2227c4c (before issue 27's trims), torch 2.13 CPU, megatron-core 0.16.1.
GOLDEN = {
    "tp1": [
        [98, 74, 193, 261, 52, 187, 66, 0],
        [249, 183, 163, 212, 3],
        [221, 44, 59, 9],
        [177, 83, 160, 240, 55, 121, 246, 232],
        [205, 259, 225, 251, 52, 139, 174, 90],
        [195, 154, 77, 13],
    ],
    "tp2": [
        [210, 74, 193, 261, 52, 182, 66, 0],
        [249, 183, 163, 212, 3],
        [221, 44, 59, 9],
        [177, 221, 160, 240, 55, 121, 246, 259],
        [205, 259, 225, 251, 248, 139, 174, 90],
        [212, 154, 77, 13],
    ],
}


def build_moe(rank: int, world: int, tp: int):
    from roll.models.megatron.runtime import build_chunks

    cfg = MegatronConfig(
        tensor_model_parallel_size=tp, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True
    )
    role = RoleConfig(model_args=ModelArgs(dtype="fp32"))
    ctx = WorkerContext("actor_infer", rank, world, rank, torch.device("cpu"), seed=7)
    hf_config, chunks = build_chunks(role, ctx, cfg, tiny_qwen3_moe_config())
    for chunk in chunks:
        chunk.eval()
    return hf_config, chunks


def _generate_rank(rank: int, world: int, port: int, scratch: str) -> None:
    from roll.models.megatron.kv_generate import generate_tokens

    with megatron_rank(rank, world, port, scratch):
        hf_config, chunks = build_moe(rank, world, world)
        torch.manual_seed(11)
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        tokens, logps = generate_tokens(chunks, PROMPTS, params, EOS_IDS, hf_config.vocab_size, 0)
        if rank == 0:
            Path(scratch, "out.json").write_text(json.dumps({"tokens": tokens, "logps": logps}))


@pytest.mark.parametrize("tp", [1, 2])
def test_fixed_seed_draws_the_same_tokens(tp: int, tmp_path: Path) -> None:
    spawn_ranks(_generate_rank, tp, str(tmp_path))
    out = json.loads((tmp_path / "out.json").read_text())
    lengths = [len(t) for t in out["tokens"]]
    assert min(lengths) < 8 == max(lengths), lengths  # some rows stopped on EOS, some ran to the end
    assert all(t[-1] in EOS_IDS for t in out["tokens"] if len(t) < 8)
    assert [len(p) for p in out["logps"]] == lengths
    assert out["tokens"] == GOLDEN[f"tp{tp}"], out["tokens"]


def test_decode_mask_is_the_blocked_keys_with_the_query_itself_open() -> None:
    """The identity the loop's kept-up-to-date decode mask relies on: for a query at column q,
    attention_mask's row is "not a real token", except q itself."""
    valid = torch.tensor([[False, True, True, False, True], [True, True, True, True, True]])
    for q in range(5):
        blocked = ~valid[:, : q + 1]
        blocked[:, q] = False
        assert torch.equal(blocked[:, None, None, :], attention_mask(valid[:, : q + 1], q))


if __name__ == "__main__":  # print the goldens of this checkout
    import tempfile

    for tp in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            spawn_ranks(_generate_rank, tp, tmp)
            print(f"tp{tp}", json.loads(Path(tmp, "out.json").read_text())["tokens"])
