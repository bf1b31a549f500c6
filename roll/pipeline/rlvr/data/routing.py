"""A run's prompt data and which reward role scores each row: the tag routes, checked before any
worker starts.

    routes, default = build_tag_routes(config)   # tag -> reward role, and the role for every other tag
    sampler, val = load_data(config, tokenizer)  # ConfigError naming the first row no role claims

A reward role claims the tags in its ``tag_included``; one role with an empty list, or
``default_reward``, scores every other tag.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.core.batch import Batch


def build_tag_routes(config: RLVRConfig) -> tuple[dict[str, str], str | None]:
    """(tag -> reward role, the role scoring every other tag or None): a role with an empty
    ``tag_included``, or ``default_reward``."""
    routes = {tag: name for name, reward in config.rewards.items() for tag in reward.tag_included}
    catch_all = [name for name, reward in config.rewards.items() if not reward.tag_included]
    if len(catch_all) > 1:
        raise ConfigError(
            f"rewards.{catch_all[1]}.tag_included",
            f"only one reward role may leave tag_included empty (also rewards.{catch_all[0]})",
        )
    if catch_all and config.default_reward not in (None, catch_all[0]):
        raise ConfigError(
            "default_reward",
            f"rewards.{catch_all[0]} already scores every unlisted tag (its tag_included is empty); "
            "give one of the two",
        )
    return routes, (catch_all[0] if catch_all else config.default_reward)


def reward_role_tags(config: RLVRConfig, tags: Iterable[str]) -> dict[str, list[str]]:
    """Each reward role's tags for ``domain_interleave_probs`` keyed by role: its ``tag_included``,
    and for the role scoring unlisted tags (``build_tag_routes``) those of ``tags`` too, so that
    ``math_rule: 0.4`` mixes them in as alibaba/ROLL's math_rule domain does."""
    routes, default = build_tag_routes(config)
    out = {name: list(reward.tag_included) for name, reward in config.rewards.items()}
    if default is not None:
        out[default] += sorted({t for t in tags if t not in routes})
    return out


def load_data(config: RLVRConfig, tokenizer, processor: Any = None) -> tuple[Any, Batch | None]:
    """The training sampler and the validation batch; ``processor``: a vision-language model's
    (``roll.models.vision.VisionProcessor``), for rows with images."""
    from roll.pipeline.rlvr.data.dataset import load_prompt_files
    from roll.pipeline.rlvr.data.sampler import PromptSampler, to_batch

    train = load_prompt_files(
        config.actor_train.data_args, tokenizer, config.prompt_length, "actor_train.data_args", processor
    )
    check_rows_routed(config, train.rows)  # before any worker starts
    sampler = PromptSampler(
        train,
        config.rollout_batch_size,
        config.seed,
        config.actor_train.data_args.domain_interleave_probs,
        path="actor_train.data_args.domain_interleave_probs",
        role_tags=reward_role_tags(config, train.domains()),
    )
    val = None
    if config.validation is not None and config.validation.data_args.file_name:
        rows = load_prompt_files(
            config.validation.data_args, tokenizer, config.prompt_length, "validation.data_args", processor
        )
        check_rows_routed(config, rows.rows)
        val = to_batch(  # images: decoded per validation chunk (data.vision.with_vision_fields)
            [rows[i] for i in range(len(rows))],
            tokenizer.pad_token_id,
            config.prompt_length,
            processor,
            lazy=True,
        )
        val.non_tensors["group_id"] = np.array([f"val-{i}" for i in range(len(val))], dtype=object)
    return sampler, val


def check_rows_routed(config: RLVRConfig, rows: Iterable[Any]) -> None:
    """Every prompt row's tag has a reward role; else one ConfigError naming the first unclaimed
    row by ``file:line`` (``PromptRow.source``)."""
    routes, catch_all = build_tag_routes(config)
    if catch_all is not None:
        return
    for row in rows:
        if row.tag not in routes:
            raise ConfigError(
                "rewards",
                f"no reward role claims tag {row.tag!r} of the prompt row {row.source}; add it to a "
                "role's tag_included, or leave one role's tag_included empty to score every other tag",
            )
