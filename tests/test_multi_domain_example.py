"""The multi-domain example's generated code task: rows score with code_sandbox, the warm-start
rows mix right and wrong programs, and the files are a pure function of the seed (the config's dry
run is tests/test_preflight.py's shipped-config test)."""

from __future__ import annotations

import json

from examples.tasks.python_programs import OPERATIONS, write_task
from roll.pipeline.rewards.code_sandbox import code_sandbox_reward


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
