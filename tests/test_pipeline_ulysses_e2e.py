"""End to end on CPU with Ulysses: actor_train and the reference on fsdp2_train over 2 gloo ranks
with ``ulysses_size: 2`` (one data-parallel rank) train like the same run with each on 1 rank
without it: the workers' dispatch (both ranks of the group get the rows, one returns them), the
old and reference log-probs and the train step, through Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import config_dict, load, pipeline_dir  # noqa: E402

from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow
COMPARED = ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/ref_kl")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from pipeline_dir(tmp_path_factory, "e2e_ulysses")


def run(tmp: Path, model: Path, name: str, devices: str, ulysses: int) -> list[dict]:
    cfg = config_dict(tmp, model, tmp / name, max_steps=2, save_steps=0, eval_steps=0)
    options = {"ulysses_size": ulysses}
    cfg["actor_train"]["device_mapping"] = devices
    cfg["actor_train"]["strategy_args"]["strategy_config"] = dict(options)
    cfg["reference"]["strategy_args"] = {"strategy_name": "fsdp2_train", "strategy_config": dict(options)}
    cfg["reference"]["device_mapping"] = devices
    cfg["reference"].pop("infer_batch_size")
    return read_metrics(run_pipeline(load(tmp, name, cfg)) / "metrics.jsonl")


def test_ulysses_run_trains_like_the_unsplit_run(setup):
    tmp, model = setup
    unsplit = run(tmp, model, "unsplit", "0", 1)
    split = run(tmp, model, "ulysses", "0-1", 2)
    assert [r["step"] for r in split] == [r["step"] for r in unsplit]
    for a, b in zip(unsplit, split):
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert all(key in unsplit[-1] for key in COMPARED)
    for row in split:  # the split trainer's old log-probs score like the hf_infer engine's
        assert row["rollout/logprob_mismatch"] < 1e-4 and row["model_update/probe_logprob_diff"] < 1e-4
