"""Prompt rows that used to pass or kill the run: empty prompts and message content, null / NaN /
inf ground truths, lone surrogates, deeply nested JSON; over-long prompts located by file:line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_data import load, write_jsonl  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402

GOOD = '{"prompt": "1+1?", "ground_truth": "2"}'


def test_bad_rows_are_rejected_with_file_and_line(tmp_path, caplog):
    rows = [
        GOOD,
        '{"prompt": "", "ground_truth": "1"}',
        '{"prompt": "  \\n\\t", "ground_truth": "1"}',
        '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}], "ground_truth": "1"}',
        '{"prompt": "x", "ground_truth": NaN}',
        '{"prompt": "x", "ground_truth": Infinity}',
        '{"prompt": "x", "ground_truth": null}',
        '{"prompt": "x\\ud800y", "ground_truth": "1"}',
        '{"messages": [{"role": "user", "content": "\\udfff"}], "ground_truth": "1"}',
        "[" * 100_000 + "]" * 100_000,
        '{"prompt": "x", "ground_truth": "1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}",
        GOOD,
    ]
    write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = load(tmp_path, ["d.jsonl"])
    assert len(ds) == 2 and [r.source.rsplit(":", 1)[1] for r in ds.rows] == ["1", "12"]
    reasons = {b.line: b.reason for b in ds.bad_rows}
    assert sorted(reasons) == list(range(2, 12))
    assert reasons[2] == reasons[3] == "empty prompt: field 'prompt' has no text"
    assert reasons[4] == "empty content: messages[1] (user) has no text"
    assert reasons[5] == "missing value: field 'ground_truth' is nan (not a finite number)"
    assert reasons[6] == "missing value: field 'ground_truth' is inf (not a finite number)"
    assert reasons[7] == "missing value: field 'ground_truth' is null"
    assert reasons[8] == "invalid text: field 'prompt' holds a lone surrogate '\\ud800' at character 1"
    assert reasons[9].startswith("invalid text: field 'messages[0].content' holds a lone surrogate")
    assert reasons[10] == reasons[11] == "invalid JSON: nested too deeply"
    assert f"{tmp_path / 'd.jsonl'}:8: invalid text" in caplog.text
    assert len(ds.bad_rows) == 10


def test_a_file_of_only_bad_rows_is_one_config_error(tmp_path):
    write_jsonl(
        tmp_path / "d.jsonl", ['{"prompt": " ", "ground_truth": "1"}', '{"prompt": "x", "ground_truth": NaN}']
    )
    with pytest.raises(ConfigError, match=r"^actor_train\.data_args\.file_name: no usable prompt rows"):
        load(tmp_path, ["d.jsonl"])


def test_dropped_long_prompts_are_located(tmp_path, caplog):
    write_jsonl(
        tmp_path / "a.jsonl", [{"prompt": "x" * n, "ground_truth": "1"} for n in (1, 90, 2) + (80,) * 6]
    )
    overhead = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    with caplog.at_level(logging.WARNING):
        ds = load(tmp_path, ["a.jsonl"], prompt_length=overhead + 10)
    path = tmp_path / "a.jsonl"
    assert ds.num_too_long == 7 and ds.too_long[0] == f"{path}:2 ({overhead + 90} tokens)"
    assert f"dropped 7 prompts longer than prompt_length={overhead + 10} tokens: {path}:2 (" in caplog.text
    assert (
        f"{path}:7 (" in caplog.text and f"{path}:8 (" not in caplog.text and "(first 5 shown)" in caplog.text
    )


def test_a_row_whose_tag_no_reward_role_claims_is_named_by_file_and_line():
    """The run's own check (load_data, before any worker starts) for configs that skipped the
    launcher's: the first unclaimed row by file:line, not only the tag."""
    from types import SimpleNamespace

    from roll.configs.role import RewardConfig
    from roll.pipeline.rlvr.data.dataset import PromptRow
    from roll.pipeline.rlvr.data.routing import check_rows_routed

    config = SimpleNamespace(
        rewards={"math": RewardConfig(reward_fn="math_rule", tag_included=["arith"])}, default_reward=None
    )
    rows = [
        PromptRow([1], "1+1?", "2", tag, tag, f"data/train.jsonl:{i}")
        for i, tag in enumerate(["arith", "poem", "poem"], 1)
    ]
    with pytest.raises(ConfigError) as err:
        check_rows_routed(config, rows)
    assert str(err.value).startswith(
        "rewards: no reward role claims tag 'poem' of the prompt row data/train.jsonl:2;"
    )
    check_rows_routed(config, rows[:1])
    catch_all = SimpleNamespace(rewards={"any": RewardConfig(reward_fn="math_rule")}, default_reward=None)
    check_rows_routed(catch_all, rows)
