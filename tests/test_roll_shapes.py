"""alibaba/ROLL's RLVR layouts (7B to 235B-A22B; Megatron, FSDP2, SGLang) dry-run in roll: prompts
that do not split evenly over actor_infer's DP ranks, and domain_interleave_probs keyed by reward role."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from launch_files import make_launch_files

from roll.core.batch import Batch
from roll.launch.rlvr import main
from roll.pipeline.rlvr.stages import dp_call

SHAPES = Path(__file__).parent / "configs" / "roll_format" / "uneven"


@pytest.mark.parametrize("name", sorted(p.stem for p in SHAPES.glob("*.yaml")))
def test_roll_layout_dry_runs(name, capsys, tmp_path):
    raw = yaml.safe_load((SHAPES / f"{name}.yaml").read_text())
    tags = tuple(t for r in raw["rewards"].values() for t in r["tag_included"])
    files = make_launch_files(tmp_path, tags)
    paths = [
        f"pretrain={files['model']}",
        f"reward_pretrain={files['model']}",
        f"actor_train.data_args.file_name=[{files['train']}]",
    ]
    code = main(["--config_name", name, "--config_path", str(SHAPES), "--dry_run", *paths])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "actor_infer" in out.out


class _FakeCluster:
    """Records the rows each call got; answers ``n`` rows per input row, in order."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.seen: list[int] = []

    def generate(self, batch: Batch, n: int) -> Batch:
        assert len(batch) % self.dp_size == 0  # what the dispatcher needs
        self.seen = batch["x"].tolist()
        return Batch.from_dict({"x": batch["x"].repeat_interleave(n)}, {})


def test_uneven_prompts_are_padded_and_the_padding_dropped():
    cluster = _FakeCluster(dp_size=12)
    prompts = Batch.from_dict({"x": torch.arange(64)}, {})
    out = dp_call(cluster.dp_size, lambda b: cluster.generate(b, 8), prompts, rows_per_input=8)
    assert len(cluster.seen) == 72 and cluster.seen[64:] == [63] * 8
    assert out["x"].tolist() == torch.arange(64).repeat_interleave(8).tolist()
