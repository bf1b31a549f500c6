"""Everything knowable before launch stops a run there: one ``ConfigError: <key>: ...`` line, exit 2,
for ``--dry_run`` and a real launch alike (issue 22). Classes of mistake: value ranges (steps,
lengths, learning rates incl. nan/inf, clips, world sizes), named values taken from the tables that
implement them (``kl_loss_type: full``), model/tokenizer directories, prompt files, tag routing,
reward-function options."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from launch_files import launch_overrides, make_launch_files, point_at_files

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.ranges import CHOICES_KEY, RANGE_KEY
from roll.launch.checks import check_before_launch
from roll.launch.range_table import config_sections, markdown, walk
from roll.launch.rlvr import main

REPO = Path(__file__).resolve().parents[1]
MINIMAL = REPO / "tests" / "configs" / "good" / "minimal.yaml"
EXAMPLES = REPO / "examples" / "config"


@pytest.fixture
def files(tmp_path):
    return make_launch_files(tmp_path, ("arithmetic",))


def checked(overrides: list[str]):
    """The minimal config loaded and checked as the launcher checks it, without its files."""
    config = load_config(MINIMAL, overrides)
    check_before_launch(config, files=False)
    return config


def dry_run(
    overrides: list[str], capsys, config: str = "rlvr_config", dry: bool = True
) -> tuple[int, list[str]]:
    argv = [
        "--config_name",
        config,
        "--config_path",
        str(EXAMPLES),
        *(["--dry_run"] if dry else []),
        *overrides,
    ]
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------ ranges (checked by the loader)

RANGE_CASES = [
    ("max_steps=0", "max_steps", ">= 1"),
    ("max_steps=-3", "max_steps", ">= 1"),
    ("save_steps=-1", "save_steps", ">= 0"),
    ("eval_steps=-5", "eval_steps", ">= 0"),
    ("response_length=0", "response_length", ">= 1"),
    ("response_length=-16", "response_length", ">= 1"),
    ("prompt_length=0", "prompt_length", ">= 1"),
    ("actor_train.training_args.learning_rate=.nan", "actor_train.training_args.learning_rate", "finite"),
    ("actor_train.training_args.learning_rate=nan", "actor_train.training_args.learning_rate", "finite"),
    ("actor_train.training_args.learning_rate=.inf", "actor_train.training_args.learning_rate", "finite"),
    ("actor_train.training_args.learning_rate=-1e-5", "actor_train.training_args.learning_rate", ">= 0"),
    ("pg_clip=-0.2", "pg_clip", ">= 0"),
    ("model_update_probe_tolerance=-0.01", "model_update_probe_tolerance", "> 0"),
    ("rewards.math.world_size=0", "rewards.math.world_size", ">= 1"),
    ("rewards.math.world_size=-2", "rewards.math.world_size", ">= 1"),
    ("actor_infer.generating_args.top_p=0", "actor_infer.generating_args.top_p", "in (0, 1]"),
    (
        "actor_train.data_args.domain_interleave_probs.a=-1",
        "actor_train.data_args.domain_interleave_probs.a",
        ">= 0",
    ),
    ("rewards.math.timeout_s=0", "rewards.math.timeout_s", "> 0"),
    ("seed=-1", "seed", "in [0, 4294967295]"),
    ("max_steps=true", "max_steps", "expected a number (>= 1), got true"),
    (
        "actor_train.training_args.learning_rate=false",
        "actor_train.training_args.learning_rate",
        "expected a number",
    ),
    ("off_policy_correction.cap=0", "off_policy_correction.cap", "> 0"),
]


@pytest.mark.parametrize("override, key, words", RANGE_CASES)
def test_out_of_range_value_is_one_config_error(override, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(MINIMAL, [override])
    assert info.value.path == key and words in info.value.message, str(info.value)


def test_top_level_value_is_named_before_sections_that_interpolate_it():
    # max_new_tokens: ${response_length} in minimal.yaml; the cause is response_length
    with pytest.raises(ConfigError, match="^response_length: must be >= 1, got 0"):
        load_config(MINIMAL, ["response_length=0"])


def test_strategy_config_ranges_are_checked():
    with pytest.raises(ConfigError, match="strategy_config.sharding: expected one of"):
        checked(["actor_train.strategy_args.strategy_config={sharding: full}"])
    with pytest.raises(ConfigError, match="strategy_config.gpu_memory_utilization: must be in \\(0, 1\\]"):
        load_config(
            MINIMAL,
            [
                "actor_infer.strategy_args={strategy_name: vllm, strategy_config: {gpu_memory_utilization: 1.5}}"
            ],
        )


def test_every_numeric_config_field_declares_a_range():
    missing = []
    for _, prefix, cls, skip in config_sections():
        for key, f, tp in walk(cls, prefix, skip):
            kinds = (
                set(typing.get_args(tp)) | {tp} | {a for t in typing.get_args(tp) for a in typing.get_args(t)}
            )
            numeric = bool(kinds & {int, float})
            if numeric and RANGE_KEY not in f.metadata and CHOICES_KEY not in f.metadata:
                missing.append(key)
    assert not missing, missing


# ------------------------------------------------------------------ named values from their tables


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("kl_loss_type=full", "kl_loss_type", "'full' needs the full vocabulary distributions"),
        ("kl_penalty=full", "kl_penalty", "'full' needs the full vocabulary"),
        ("kl_loss_type=k4", "kl_loss_type", "expected one of ['kl', 'k1'"),
        ("adv_estimator=grp", "adv_estimator", "did you mean 'grpo'"),
        ("loss_agg_mode=seq-sum", "loss_agg_mode", "expected one of ['token-mean'"),
        (
            "actor_train.training_args.lr_scheduler_type=cosin",
            "actor_train.training_args.lr_scheduler_type",
            "did you mean 'cosine'",
        ),
        (
            "actor_train.model_args.dtype=bfloat16",
            "actor_train.model_args.dtype",
            "expected one of ['fp32', 'bf16'",
        ),
        ("norm_mean_type=running", "norm_mean_type", "is not supported"),
        ("off_policy_correction.mode=cis", "off_policy_correction.mode", "did you mean 'tis'"),
        ("track_with=mlflow", "track_with", "expected one of ['tensorboard', 'wandb', 'none']"),
        ("device=tpu", "device", "expected one of ['auto', 'cuda', 'cpu']"),
        ("memory_check=fail", "memory_check", "expected one of ['warn', 'error', 'off']"),
        ("actor_train.model_args.model_type=reward", "actor_train.model_args.model_type", "['value', 'trl']"),
        (
            "actor_train.strategy_args.strategy_config={sharding: hybrid}",
            "actor_train.strategy_args.strategy_config.sharding",
            "expected one of ['full_shard', 'no_shard']",
        ),
    ],
)
def test_named_value_outside_its_table_is_refused(override, key, words):
    with pytest.raises(ConfigError) as info:
        checked([override])
    assert info.value.path == key and words in info.value.message, str(info.value)


def test_allowed_names_are_read_from_the_implementing_table(monkeypatch):
    from roll.pipeline.rlvr.algorithms import advantages, kl

    monkeypatch.setitem(kl.KL_ESTIMATORS, "k9", kl.kl_k1)  # a new estimator is allowed at once
    assert checked(["kl_loss_type=k9"]).kl_loss_type == "k9"
    fewer = {k: v for k, v in advantages.ADV_ESTIMATORS.items() if k != "reinforce"}
    monkeypatch.setattr(advantages, "ADV_ESTIMATORS", fewer)  # and a removed one refused
    with pytest.raises(ConfigError, match="adv_estimator: expected one of"):
        checked(["adv_estimator=reinforce"])


def test_the_loader_leaves_table_backed_names_to_the_pre_launch_step():
    # configs/ imports no table above it: it parses the name; the check before launch refuses it
    assert load_config(MINIMAL, ["adv_estimator=grp"]).adv_estimator == "grp"
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        checked(["adv_estimator=grp"])


def _every_choice_field():
    for _, prefix, cls, skip in config_sections():
        for key, f, _ in walk(cls, prefix, skip):
            if CHOICES_KEY in f.metadata:
                yield key, f.metadata[CHOICES_KEY]


def test_every_allowed_name_has_an_implementation():
    """Each table a field names resolves, and each name it allows is implemented there: a dict
    maps it to its implementation, a refused name is not also allowed."""
    from roll.launch.named_values import allowed_values, load_table, refused_reasons

    for key, choices in _every_choice_field():
        if choices.table is None:
            continue
        table = load_table(choices.table)
        assert isinstance(table, (dict, tuple)) and table, (key, choices.table)
        if isinstance(table, dict):
            assert all(impl is not None or name == "none" for name, impl in table.items()), key
        assert not set(allowed_values(choices)) & set(refused_reasons(choices)), key


def test_refused_kl_full_is_not_an_estimator():
    from roll.pipeline.rlvr.algorithms import kl

    assert "full" in kl.KL_REFUSED and "full" not in kl.KL_ESTIMATORS
    with pytest.raises(ValueError, match="'full' needs the full vocabulary"):
        kl.get_kl_estimator("full")


# ------------------------------------------------------------------ files, tags, reward options


def test_good_files_pass(files, capsys):
    code, err = dry_run(launch_overrides(files), capsys)
    assert code == 0, err


@pytest.mark.parametrize(
    "make_bad, key, words",
    [
        (
            lambda f: ["pretrain=/no/such/model"],
            "actor_train.model_args.model_name_or_path",
            "does not exist",
        ),
        (
            lambda f: ["pretrain=Qwen/No-Such-Model"],
            "actor_train.model_args.model_name_or_path",
            "huggingface-cli download Qwen/No-Such-Model",
        ),
        (
            lambda f: (f["model"] / "config.json").unlink() or [],
            "actor_train.model_args.model_name_or_path",
            "no config.json",
        ),
        (
            lambda f: (f["model"] / "tokenizer.json").unlink() or [],
            "actor_train.model_args.model_name_or_path",
            "holds no tokenizer",
        ),
        (
            lambda f: ["actor_train.data_args.file_name=[/no/such.jsonl]"],
            "actor_train.data_args.file_name",
            "no such file",
        ),
        (lambda f: f["val"].unlink() or [], "validation.data_args.file_name", "no such file"),
        (
            lambda f: f["train"].write_text("not json\n{}\n") and [],
            "actor_train.data_args.file_name",
            "no usable prompt rows",
        ),
        (
            lambda f: [f"actor_train.data_args={{dataset_dir: {f['model']}, file_name: [train.jsonl]}}"],
            "actor_train.data_args.file_name",
            "no such file",
        ),
    ],
)
def test_missing_model_tokenizer_or_data_is_caught_before_launch(files, capsys, make_bad, key, words):
    extra = make_bad(files)
    code, err = dry_run(launch_overrides(files) + extra, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"ConfigError: {key}: ") and words in err[0], err[0]


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("rewards.math.tag_included=[arithmetc]", "rewards.math.tag_included[0]", "matches no row"),
        (
            "rewards.more={reward_fn: format, tag_included: [code], world_size: 1}",
            "rewards.more.tag_included[0]",
            "matches no row",
        ),
        (
            "actor_train.data_args.domain_interleave_probs={algebra: 1.0}",
            "actor_train.data_args.domain_interleave_probs.algebra",
            "no prompt rows have the tag",
        ),
    ],
)
def test_tag_routing_that_matches_no_row_is_caught(files, capsys, override, key, words):
    code, err = dry_run(launch_overrides(files) + [override], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"ConfigError: {key}: ") and words in err[0], err[0]


def test_a_tag_without_rows_beside_one_with_rows_is_a_warning(files, capsys):
    """alibaba/ROLL's files list tags their data lacks (``[deepmath_103k, aime]``): the role still
    scores its other tags, so the run goes ahead with one warning naming the tag."""
    code, err = dry_run(launch_overrides(files) + ["rewards.math.tag_included=[arithmetic,geometry]"], capsys)
    assert code == 0, err
    assert err == [
        "WARNING: rewards.math.tag_included: ['geometry'] match no row of the prompt files (their tags: "
        "['arithmetic']); the role scores the rows of its other tags, as in ROLL"
    ]


def test_tag_no_reward_role_claims_is_caught(tmp_path, capsys):
    files = make_launch_files(tmp_path, ("arithmetic", "poetry"))
    code, err = dry_run(launch_overrides(files), capsys)
    assert (
        code == 2
        and err == [err[0]]
        and err[0].startswith(
            f"ConfigError: rewards: no reward role claims tag 'poetry' (2 prompt rows, the first at {files['train']}:2)"
        )
    )


@pytest.mark.parametrize(
    "override, key",
    [
        ("rewards.math.reward_kwargs={fallback: true}", "rewards.math.reward_kwargs.fallback"),
        (
            "rewards.math.reward_kwargs={rel_tol: 0.1, use_sympi: true}",
            "rewards.math.reward_kwargs.use_sympi",
        ),
        (
            "rewards.math={reward_fn: multiple_choice, reward_kwargs: {kind: hard}, tag_included: [arithmetic]}",
            "rewards.math.reward_kwargs.kind",
        ),
    ],
)
def test_reward_kwargs_the_function_does_not_take_is_caught(files, capsys, override, key):
    code, err = dry_run(launch_overrides(files) + [override], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"ConfigError: {key}: ") and "takes no such option" in err[0], err[0]


def test_rule_reward_model_args_go_unchecked_a_judge_model_is_checked(files, capsys):
    unused = "rewards.math.model_args={model_name_or_path: /not/loaded}"  # math_rule loads no model
    assert dry_run(launch_overrides(files) + [unused], capsys)[0] == 0
    judge = (
        "rewards.judge={reward_fn: llm_judge, tag_included: [x], device_mapping: [0], "
        "strategy_args: {strategy_name: hf_infer}, model_args: {model_name_or_path: /no/judge}}"
    )
    code, err = dry_run(launch_overrides(files) + [judge], capsys)
    assert code == 2 and err == [err[0]], err
    assert err[0].startswith("ConfigError: rewards.judge.model_args.model_name_or_path: model directory")


def test_model_reward_options_come_from_its_table():
    from roll.pipeline.rewards.scoring import check_reward_kwargs

    check_reward_kwargs("llm_judge", {"score_scale": 5.0}, "rewards.judge.reward_kwargs")
    with pytest.raises(
        ConfigError, match=r"rewards\.judge\.reward_kwargs\.scale: .*did you mean 'score_scale'"
    ):
        check_reward_kwargs("llm_judge", {"scale": 5.0}, "rewards.judge.reward_kwargs")


def test_real_launch_runs_the_same_checks(files, capsys, monkeypatch):
    from roll.pipeline.rlvr import pipeline

    monkeypatch.setattr(pipeline, "run_pipeline", lambda config: pytest.fail("launched"))
    code, err = dry_run(launch_overrides(files) + ["rewards.math.tag_included=[nope]"], capsys, dry=False)
    assert code == 2 and len(err) == 1 and err[0].startswith("ConfigError: rewards.math.tag_included[0]:")


def test_resume_without_a_checkpoint_is_caught(files, tmp_path):
    config = load_config(
        EXAMPLES / "rlvr_config.yaml",
        launch_overrides(files) + [f"output_dir={tmp_path}/run", "resume_from_checkpoint=true"],
    )
    with pytest.raises(ConfigError, match="^resume_from_checkpoint: no checkpoint found"):
        check_before_launch(config)


# ------------------------------------------------------------------ the real script


@pytest.mark.parametrize(
    "override, key",
    [
        ("max_steps=0", "max_steps"),
        ("actor_train.training_args.learning_rate=nan", "actor_train.training_args.learning_rate"),
        ("kl_loss_type=full", "kl_loss_type"),
        ("rewards.math.tag_included=[algebra]", "rewards.math.tag_included[0]"),
        ("rewards.math.reward_kwargs.fallback=true", "rewards.math.reward_kwargs.fallback"),
        ("pretrain=/no/such/model", "actor_train.model_args.model_name_or_path"),
    ],
)
def test_script_dry_run_exits_2_with_one_config_error_line(files, override, key):
    argv = [
        sys.executable,
        str(REPO / "examples/start_rlvr_pipeline.py"),
        "--config_name",
        "rlvr_config",
        "--dry_run",
    ]
    proc = subprocess.run(
        argv + launch_overrides(files) + [override], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"ConfigError: {key}: "), proc.stderr


# ------------------------------------------------------------------ shipped configs and docs


# Shipped configs, and the drafts of examples/config/pending_gpu (not yet run on their GPUs).
SHIPPED = sorted(p.relative_to(EXAMPLES).with_suffix("").as_posix() for p in EXAMPLES.glob("*.yaml"))
PENDING = sorted(
    p.relative_to(EXAMPLES).with_suffix("").as_posix() for p in EXAMPLES.glob("pending_gpu/*.yaml")
)


@pytest.mark.parametrize("path", SHIPPED + PENDING)
def test_shipped_config_passes_dry_run_with_its_files_present(path, tmp_path, capsys):
    from roll.launch import sft
    from roll.launch.roles import engines_missing_here

    name = Path(path).name
    raw = yaml.safe_load((EXAMPLES / f"{path}.yaml").read_text())
    is_sft = "data" in raw  # an SFT file (its --dry_run does not look for files)
    raw = raw if is_sft else point_at_files(raw, tmp_path)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    launcher = sft.main if is_sft else main
    code = launcher(["--config_name", name, "--config_path", str(tmp_path), "--dry_run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Placement plan" in out
    if not is_sft:  # an engine missing here is a note in the plan, not an error (a launch stops on it)
        from roll.configs.loader import load_config

        missing = engines_missing_here(load_config(tmp_path / f"{name}.yaml"))
        assert [line for line in out.splitlines() if line.startswith("missing engine: ")] == [
            f"missing engine: {e} (a one-node launch from here stops on this)" for e in missing
        ]


def test_pending_gpu_drafts_say_they_have_not_run_and_how_to_run_them():
    assert PENDING  # the drafts that have not run (they move up to examples/config once they have)
    for path in PENDING:
        text = (EXAMPLES / f"{path}.yaml").read_text()
        assert text.startswith("# NOT RUN ON GPUs YET."), path
        name = Path(path).name
        assert f"--config_path examples/config/pending_gpu --config_name {name}" in text, path
    readme = (REPO / "README.md").read_text()
    assert "pending_gpu" not in readme and not any(Path(p).name in readme for p in PENDING)


def test_docs_ranges_table_is_the_generated_one():
    text = (REPO / "docs" / "config_checks.md").read_text()
    from roll.launch.range_table import BEGIN, END

    assert BEGIN in text and END in text
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert documented == markdown().strip(), (
        "regenerate: python -m roll.launch.range_table --update docs/config_checks.md"
    )


def test_range_table_covers_the_config_fields():
    table = markdown()
    for key in (
        "`max_steps`",
        "`<role>.training_args.learning_rate`",
        "`<role>.world_size`",
        "`kl_loss_type`",
    ):
        assert key in table
    assert dataclasses.is_dataclass(config_sections()[0][2])


def test_update_doc_rewrites_only_between_the_markers(tmp_path):
    from roll.launch.range_table import BEGIN, END, update_doc

    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{BEGIN}\nstale table\n{END}\nafter\n")
    update_doc(doc)
    text = doc.read_text()
    assert text.startswith(f"intro\n{BEGIN}\n\n#### Top level") and text.endswith(f"{END}\nafter\n")
    assert "stale table" not in text and "| `max_steps` | >= 1 | `100` |" in text
