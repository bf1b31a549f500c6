"""The multi-domain example: its generated code rows score with code_sandbox, and its config
dry-runs with math and code rows routed to their reward roles by tag."""

from __future__ import annotations

import json
from pathlib import Path

from launch_files import make_launch_files

from examples.tasks.python_programs import OPERATIONS, write_task
from roll.pipeline.rlvr.launcher import main
from roll.pipeline.rlvr.rewards.code_sandbox import code_sandbox_reward


def test_generated_programs_score_with_the_sandbox(tmp_path):
    paths = write_task(tmp_path, seed=0, n_sft=40, n_train=10, n_val=20)
    rows = [json.loads(line) for line in paths["val"].read_text().splitlines()]
    assert {r["operation"] for r in rows} == set(OPERATIONS) and {r["tag"] for r in rows} == {"code"}
    for row in rows:
        assert code_sandbox_reward(row["solution"], row["ground_truth"], reward_type="hard") == 1.0
        assert code_sandbox_reward("print(0)", row["ground_truth"], reward_type="hard") == 0.0
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    wrong = sum(r["target"] != r["solution"] for r in sft)
    assert 0 < wrong < len(sft)  # half the warm-start targets are another operation's program
    again = write_task(tmp_path / "again", seed=0, n_sft=40, n_train=10, n_val=20)
    assert again["sft"].read_text() == paths["sft"].read_text()


def test_multi_domain_config_dry_runs(capsys, tmp_path):
    files = make_launch_files(tmp_path, ("arithmetic", "code"))
    data = f"[{files['train']}]"
    args = [f"pretrain={files['model']}", f"actor_train.data_args.file_name={data}"]
    args.append(f"validation.data_args.file_name=[{files['val']}]")
    config_dir = Path(__file__).parents[1] / "examples" / "config"
    code = main(["--config_name", "rlvr_multi_domain", "--config_path", str(config_dir), "--dry_run", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "rewards.code_sandbox" in out.out and "rewards.math_rule" in out.out
