"""alibaba/ROLL's own RLVR example files (tests/configs/roll_examples/, copied at one commit with only
paths changed) dry-run in roll, or stop at one line that names what roll lacks.

Each file runs from a directory where the hub names it gives (``Qwen/Qwen2.5-7B``) are local model
directories holding the published ``config.json`` (random_checkpoint's presets, so the Megatron
layout and memory checks see the real shapes) and a tokenizer file, and where ``data/`` holds
stand-ins of ROLL's prompt files in ROLL's row format (``messages`` as a JSON string) with the tags
ROLL's files carry. docs/migrating_from_roll.md has the table of these files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.launch.rlvr import main
from roll.models.random_checkpoint import preset_config

EXAMPLES = Path(__file__).parent / "configs" / "roll_examples"

MODELS = {
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "virtuoussy/Qwen2.5-7B-Instruct-RLVR": "qwen2.5-7b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-8B-Base": "qwen3-8b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
}
# ROLL's data files and the tags their rows carry (math_benchmarks: validation rows whose tags no
# reward role lists, which ROLL scores with math_rule).
DATA = {
    "code_KodCode_data.jsonl": ["KodCode"],
    "llm_judge_Multi-subject-RLVR_deal_new.jsonl": ["RLVR"],
    "math_deepmath_deal.jsonl": ["deepmath_103k"],
    "general_ifeval_train_deal.jsonl": ["ifeval"],
    "general_CrossThink-QA_deal.jsonl": ["crossthinkqa"],
    "math_benchmarks.jsonl": ["MATH-500", "aime2024", "aime2025"],
    "aime24_25_deal.jsonl": ["aime2025"],
}

# File -> the words of its one-line refusal (what roll lacks); every other file dry-runs.
REFUSED = {
    "qwen2_5-vl-3B-rlvr_fsdp2__rlvr_fsdp2_offload.yaml": "DetectionRewardWorker (ROLL scores object-detection",
}


@pytest.fixture(scope="module")
def roll_workdir(tmp_path_factory) -> Path:
    """Model directories at ROLL's hub names and ROLL-format stand-in prompt files under data/."""
    root = tmp_path_factory.mktemp("roll_examples")
    for name, preset in MODELS.items():
        model = root / name
        model.mkdir(parents=True)
        preset_config(preset).to_json_file(model / "config.json")
        (model / "tokenizer.json").write_text("{}")
    (root / "data").mkdir()
    for file_name, tags in DATA.items():
        rows = [
            {
                "id": str(i),
                "messages": json.dumps([{"role": "user", "content": f"What is {i} + 1?"}]),
                "ground_truth": str(i + 1),
                "tag": tag,
                **({"domain": "math_rule"} if file_name == "math_benchmarks.jsonl" else {}),
            }
            for i, tag in enumerate(tags * 2)
        ]
        (root / "data" / file_name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_every_copied_file_is_listed():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert len(names) == 34 and set(REFUSED) <= names


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_roll_example_dry_runs_or_names_what_roll_lacks(name, roll_workdir, monkeypatch, capsys):
    monkeypatch.chdir(roll_workdir)
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run"])
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("ConfigError")]
    if name in REFUSED:
        assert code == 2 and len(errors) == 1, out.err
        assert REFUSED[name] in errors[0], errors[0]
    else:
        assert code == 0, out.err
        assert "actor_infer" in out.out and not errors
    if name == "qwen3-30BA3B-rlvr_fsdp2__rlvr_config_ep.yaml":  # ROLL's fsdp2 expert parallelism
        assert "EP=8 DP=8 SP=4 (Ulysses)" in out.out and "EP=8 DP=16 SP=2 (Ulysses)" in out.out, out.out


def test_megatron_infer_rollouts_of_qwen3_next_are_refused_before_launch(roll_workdir, monkeypatch, capsys):
    """kv_generate's cache has no place for Gated DeltaNet's recurrent state: the dry run says so."""
    monkeypatch.chdir(roll_workdir)
    name = "qwen3-next-80BA3B-rlvr_megatron__rlvr_config.yaml"
    infer = "actor_infer.strategy_args"
    overrides = [f"{infer}.strategy_name=megatron_infer", f"{infer}.strategy_config={{}}"]
    code = main(["--config_path", str(EXAMPLES), "--config_name", name, "--dry_run", *overrides])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1].startswith(
        "ConfigError: actor_infer.strategy_args.strategy_name: megatron_infer cannot generate with "
        "model_type 'qwen3_next'"
    ), err[-5:]
