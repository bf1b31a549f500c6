"""Checks of what a loaded config points at, run by the launcher before anything starts, for
``--dry_run`` and a real launch alike: model and tokenizer directories, prompt files, tag routing
to reward roles, reward-function options, and the checkpoint to resume from.

    config = load_config(path, overrides)   # values, ranges, placement (roll.configs.validate)
    check_before_launch(config)             # the files and functions those values name

Each failure is one ``ConfigError`` naming the key path. Field ranges are checked earlier, by the
loader (roll.configs.ranges).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import DataArgs, RewardConfig, RoleConfig

# Files one of which a directory needs for ``AutoTokenizer.from_pretrained`` to find a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Roles that load no tokenizer of their own (a critic only scores token ids).
NO_TOKENIZER_ROLES = ("critic",)


def check_before_launch(config: RLVRConfig) -> None:
    """Raise one ConfigError for the first thing the config names that is missing or cannot work."""
    for name, role in config.roles().items():
        if not loads_model(role):
            continue
        key = f"{name}.model_args.model_name_or_path"
        check_model_dir(role.model_args.model_name_or_path, key)
        if name not in NO_TOKENIZER_ROLES:
            check_tokenizer_dir(role.model_args.model_name_or_path, key)
    train = prompt_tags(config.actor_train.data_args, "actor_train.data_args")
    tags = train.copy()
    if config.validation is not None and config.validation.data_args.file_name:
        tags.update(prompt_tags(config.validation.data_args, "validation.data_args"))
    check_tag_routes(config, tags)
    probs = config.actor_train.data_args.domain_interleave_probs
    if probs:
        from roll.pipeline.rlvr.data.sampler import check_domain_probs

        role_tags = {name: reward.tag_included for name, reward in config.rewards.items()}
        check_domain_probs(probs, sorted(train), "actor_train.data_args.domain_interleave_probs", role_tags)
    check_reward_options(config)
    if config.resume_from_checkpoint not in (False, None, ""):
        from roll.pipeline.rlvr.checkpoint import resolve_resume

        resolve_resume(config)


def loads_model(role: RoleConfig) -> bool:
    """Every role but a rule reward (scored by a Python function; its model_args go unused)."""
    if not isinstance(role, RewardConfig):
        return True
    from roll.pipeline.rlvr.rewards.registry import get_reward_spec

    return get_reward_spec(role.reward_fn).kind == "model"


def check_model_dir(path: str | None, key: str = "model_args.model_name_or_path") -> str:
    """``path`` is a Hugging Face model directory (it holds a config.json); returns it."""
    if not path:
        raise ConfigError(key, "is not set; point it at a Hugging Face model directory")
    if not Path(path).is_dir():
        hint = f"relative paths start at {Path.cwd()}"
        if _looks_like_hub_name(path):
            hint = (
                "roll loads local directories; download it first, e.g. huggingface-cli download "
                f"{path} --local-dir models/{path.split('/')[-1]}, and point {key} there"
            )
        raise ConfigError(key, f"model directory {path!r} does not exist ({hint})")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(key, f"{path!r} is not a Hugging Face model directory (no config.json there)")
    return path


def check_tokenizer_dir(path: str, key: str) -> None:
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            key,
            f"{path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer there",
        )


def prompt_tags(data_args: DataArgs, prefix: str) -> Counter[str]:
    """Rows per tag over the good rows of every prompt file (bad rows are reported at load)."""
    from roll.pipeline.rlvr.data.dataset import read_rows, resolve_files

    tags: Counter[str] = Counter()
    for path in resolve_files(data_args, prefix):
        tags.update(tag for _, _, tag, _ in read_rows(path, data_args, []))
    if not tags:
        raise ConfigError(
            f"{prefix}.file_name",
            f"no usable prompt rows in {data_args.file_name} (every row is empty or bad)",
        )
    return tags


def check_tag_routes(config: RLVRConfig, tags: Counter[str]) -> None:
    """Every reward role's tags occur in the data, and every tag of the data has a reward role."""
    from roll.pipeline.rlvr.run import build_tag_routes

    routes, catch_all = build_tag_routes(config)
    for name, reward in config.rewards.items():
        for i, tag in enumerate(reward.tag_included):
            if tag not in tags:
                raise ConfigError(
                    f"rewards.{name}.tag_included[{i}]",
                    f"tag {tag!r} matches no row of the prompt files (their tags: {sorted(tags)}); "
                    "fix the tag, or the rows' tag field (a row without one takes its file's stem)",
                )
    if catch_all is None:
        for tag, count in sorted(tags.items()):
            if tag not in routes:
                raise ConfigError(
                    "rewards",
                    f"no reward role claims tag {tag!r} ({count} prompt rows); add it to a role's "
                    "tag_included, or leave one role's tag_included empty to score every other tag",
                )


def check_reward_options(config: RLVRConfig) -> None:
    """Every ``reward_kwargs`` key is an option of the reward function it is passed to."""
    from roll.pipeline.rlvr.rewards.scoring import check_reward_kwargs

    for name, reward in config.rewards.items():
        check_reward_kwargs(reward.reward_fn, reward.reward_kwargs, f"rewards.{name}.reward_kwargs")


def _looks_like_hub_name(path: str) -> bool:
    """``org/name`` as on the Hugging Face hub (not ``./x``, ``/x`` or ``a/b/c``)."""
    return not path.startswith((".", "/", "~")) and path.count("/") == 1
