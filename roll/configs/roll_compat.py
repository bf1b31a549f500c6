"""Read alibaba/ROLL RLVR files: map the keys roll has under another name, accept the ROLL keys whose
value asks for nothing roll lacks, and refuse the rest in ONE error that lists every such key.

>>> raw = translate_roll_keys({"rewards": {"math": {"worker_cls": "x.MathRuleRewardWorker"}}})
>>> raw["rewards"]["math"]["reward_fn"]
'math_rule'

Runs on the interpolated plain data, before the strict dataclass build, so that ``${pg_variant}``
style references still resolve and the strict loader only ever sees roll's own keys. The tables
below are the reference that docs/migrating_from_roll.md describes key by key.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from dataclasses import dataclass
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.rl_options import PolicyLossConfig
from roll.configs.roll_compat_judge import map_judge_cluster
from roll.configs.roll_compat_lora import map_lora
from roll.configs.roll_compat_options import Problems, map_expert_keys, map_fsdp_size
from roll.configs.roll_compat_roles import class_name, drop_offload_nccl, map_engine, map_role, map_strategy
from roll.configs.roll_compat_rollout import map_rollout_mock
from roll.configs.timeouts import WorkerTimeoutsConfig

ROLES = ("actor_train", "actor_infer", "reference", "critic")


@dataclass(frozen=True)
class Unsupported:
    """A ROLL key roll does not implement. Values in ``accepted`` ask for ROLL's default behaviour,
    which is also roll's, so the key is dropped; any other value is refused with ``advice``."""

    advice: str
    accepted: tuple[Any, ...] = (None, False)


_OFF0 = (None, False, 0, 0.0)
# Key path patterns ('*' is one role or reward name) -> what a user must do to run without them.
UNSUPPORTED: dict[str, Unsupported] = {
    "difficulty_loss_weight": Unsupported(
        "remove it; roll's data rows carry no per-sample difficulty (length_loss_weight is supported)"
    ),
    "reward_norm": Unsupported("remove it; use norm_mean_type/norm_std_type or whiten_rewards"),
    "reward_scale": Unsupported("remove it; use norm_std_type or whiten_rewards"),
    "reward_shift": Unsupported("remove it; use norm_mean_type or whiten_rewards"),
    "*.pg_variant": Unsupported("remove it; only actor_train trains a policy", (None,)),
    "rewards.*.response_length_penalty_coef": Unsupported("remove it; no length penalty on rewards", _OFF0),
    "rewards.*.judge_model_type": Unsupported(
        "ROLL: api asks a remote judge API; roll's llm_judge scores with the role's own engine "
        "(write inference, or cluster with ROLL's top-level reward_model role)",
        (None, "inference"),
    ),
    "rewards.*.reward_type": Unsupported(
        "remove it; only code_sandbox, ifeval, multiple_choice take one", ()
    ),
    "rewards.*.use_local": Unsupported(
        "remove it or write true; for a remote service set reward_kwargs.sandbox: "
        "{backend: sandbox_fusion, url: ...} (SandboxFusion's API; ROLL's service API is not supported)",
        (None, True),
    ),
    "is_num_return_sequences_expand": Unsupported(
        "remove it",
        (None, False, True),  # both spellings sample the group's n responses per prompt
    ),
    "*.strategy_args.strategy_config.use_batched_model_update": Unsupported(
        "remove it; roll sends weights in model_update_buffer_size_mb buckets"
    ),
    "*.data_args.interleave_probs": Unsupported(
        "remove it; roll reads every prompt file with the same weight (weight tags with "
        "actor_train.data_args.domain_interleave_probs)",
        (None, 1, 1.0, "1", "1.0"),
    ),
    "checkpoint_config.type": Unsupported(
        "remove it; roll checkpoints to a file system path (checkpoint_config.output_dir)",
        (None, "file_system"),
    ),
}

_PREPROCESS = "roll reads and tokenizes the prompt files once, on the driver"
_EPOCHS = "an RLVR run lasts max_steps steps (ppo_epochs passes over each step's samples)"
# ROLL keys for things roll does its own way whatever the value: dropped, each with a note saying how.
DROPPED: dict[str, str] = {
    "logging_dir": "roll writes run.log and metrics.jsonl under output_dir (TensorBoard: tracker_kwargs.log_dir)",
    "*.data_args.preprocessing_num_workers": _PREPROCESS,
    "rewards.*.data_args.preprocessing_num_workers": _PREPROCESS,
    "model_download_type": "roll loads local checkpoint directories (ROLL: the hub to download from)",
    "*.training_args.num_train_epochs": _EPOCHS,
    "*.data_args.video_resize_chunk_frames": "roll resizes the sampled frames of one video at a time",
    "rewards.*.training_args.num_train_epochs": _EPOCHS,
    "profiler_output_dir": "roll writes per-stage timings to metrics.jsonl (ROLL: its profiler's trace directory)",
    "*.strategy_args.strategy_config.distrib_optim_fully_reshardable": "roll's distributed-optimizer "
    "checkpoints are sharded by global parameter and load into any layout (ROLL: whether its optimizer "
    "checkpoint may be resharded)",
}

# ROLL reward worker class name -> roll reward_fn. Classes not listed are refused.
REWARD_WORKERS = {
    "MathRuleRewardWorker": "math_rule",
    "LLMJudgeRewardWorker": "llm_judge",
    "CodeSandboxRewardWorker": "code_sandbox",
    "GeneralRuleRewardWorker": "ifeval",
    "CrossThinkQARuleRewardWorker": "multiple_choice",
    "DetectionRewardWorker": "detection",
    "VideoR1RewardWorker": "video_r1",
}
# ROLL's data_args.custom_data_kwargs_func (the function that reads its rows) -> roll's row_layout.
DATA_KWARGS_FUNCS = {"video_r1_get_data_kwargs": "video_r1", "audio_test_get_data_kwargs": "audio_test"}
# ROLL row readers roll knows but does not offer yet -> what they read (the refusal says so).
UNOFFERED_DATA_KWARGS_FUNCS: dict[str, str] = {}
# ROLL's track_with values that roll writes with one of its own trackers.
TRACKERS = {"ml_tracker": "tensorboard"}  # ROLL's internal experiment tracker
# ROLL role keys that become reward_kwargs of the mapped reward function.
REWARD_KWARGS = {"reward_type": ("code_sandbox", "ifeval", "multiple_choice")}


def translate_roll_keys(raw: dict[str, Any], source: str = "") -> dict[str, Any]:
    """Return ``raw`` with ROLL keys mapped or dropped; raise one ConfigError naming every refused key."""
    problems = Problems()
    notes: list[str] = []
    map_judge_cluster(raw, problems, notes)  # first: the judge role takes the service's engine keys
    sections = _sections(raw)
    roll_file = any("worker_cls" in section for section in sections.values())
    if roll_file:  # ROLL's behaviours that would hide a mistake in roll's own files
        _default_reward(raw, notes)
        _complete_interleave_probs(raw, notes)
        for path, section in sections.items():
            map_engine(section, f"{path}.strategy_args", problems, notes)
            map_fsdp_size(section, path, notes)
            map_expert_keys(section, path, notes)
    _apply_global_template(raw, notes)
    _fill_model_paths(raw, notes)
    _map_policy_loss(raw, problems, notes)
    for name, reward in (raw.get("rewards") or {}).items():
        if isinstance(reward, dict):
            _map_reward_worker(reward, f"rewards.{name}", problems, notes)
            if isinstance(reward.get("strategy_args"), dict):
                map_strategy(reward, f"rewards.{name}.strategy_args", problems, notes)
    _map_tracker(raw, notes)
    _map_rpc_timeout(raw, problems, notes)
    _map_reward_system_config(raw, problems, notes)
    for path, section in sections.items():
        _map_data_kwargs_func(section, path, problems, notes)
    map_rollout_mock(raw, problems, notes)
    drop_offload_nccl(raw, "offload_nccl", notes)
    _walk(raw, "", problems, notes)
    for role in ROLES:
        if isinstance(raw.get(role), dict):
            map_role(raw[role], role, problems, notes)
    map_lora(raw, roll_file, problems, notes)
    if problems.items:
        where = f"{source}: " if source else ""
        raise ConfigError(
            "",
            f"{where}alibaba/ROLL keys roll does not support: {'; '.join(problems.items)}"
            " (see docs/migrating_from_roll.md)",
        )
    for note in notes:
        print(note if note.startswith("WARNING: ") else f"roll: {note}", file=sys.stderr)
    return raw


def _map_tracker(raw: dict[str, Any], notes: list[str]) -> None:
    """``track_with: ml_tracker`` (ROLL's internal tracker, not public) -> ``tensorboard``."""
    value = raw.get("track_with")
    if isinstance(value, str) and value in TRACKERS:
        raw["track_with"] = TRACKERS[value]
        notes.append(
            f"track_with: {value!r} (ROLL's internal tracker) -> {TRACKERS[value]!r} "
            "(TensorBoard reads tracker_kwargs.log_dir only)"
        )


def _sections(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The role and reward sections of ``raw`` by key path. A file whose sections carry ROLL's
    ``worker_cls`` is a ROLL file."""
    out = {role: raw[role] for role in ROLES if isinstance(raw.get(role), dict)}
    rewards = raw.get("rewards")
    if isinstance(rewards, dict):
        out.update({f"rewards.{n}": r for n, r in rewards.items() if isinstance(r, dict)})
    return out


def _walk(node: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    for key in list(node):
        at = f"{path}.{key}" if path else str(key)
        note = _match(at, DROPPED)
        if note is not None:
            notes.append(f"{at}: {node.pop(key)!r} dropped; {note}")
            continue
        rule = _match(at, UNSUPPORTED)
        if rule is not None:
            value = node.pop(key)
            if _accepted(value, rule.accepted):
                if value is not None:
                    notes.append(f"{at}: {value!r} asks for what roll does anyway; key dropped")
            else:
                problems.add(f"{at}={value!r}", rule.advice)
        elif isinstance(node[key], dict):
            _walk(node[key], at, problems, notes)


def _accepted(value: Any, accepted: tuple[Any, ...]) -> bool:
    """``value in accepted`` where booleans only equal booleans (``True == 1`` in Python)."""
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)


def _match(path: str, table: dict[str, Any]) -> Any:
    for pattern, rule in table.items():
        if path == pattern or ("*" in pattern and fnmatch.fnmatchcase(path, pattern)):
            if pattern.count(".") == path.count("."):
                return rule
    return None


def _map_reward_worker(reward: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    if "worker_cls" not in reward:
        return
    cls = class_name(reward.pop("worker_cls"))
    name = REWARD_WORKERS.get(cls)
    if name is None:
        problems.add(
            f"{path}.worker_cls={cls}", f"unknown ROLL reward worker; known: {', '.join(REWARD_WORKERS)}"
        )
        return
    if reward.setdefault("reward_fn", name) != name:
        problems.add(
            f"{path}.worker_cls={cls}", f"maps to reward_fn {name} but reward_fn is {reward['reward_fn']}"
        )
    notes.append(f"{path}.worker_cls {cls} -> reward_fn: {name}")
    if name == "llm_judge":
        _drop_judge_value_head(reward, path, notes)
    for key, rewards in REWARD_KWARGS.items():
        if key in reward and name in rewards:
            reward.setdefault("reward_kwargs", {})[key] = reward.pop(key)


def _map_rpc_timeout(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """ROLL waits ``rpc_timeout`` seconds for any worker call; roll's waits are per stage
    (``worker_timeouts``): each stage not given there gets the same limit."""
    if "rpc_timeout" not in raw:
        return
    seconds = raw.pop("rpc_timeout")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        problems.add(f"rpc_timeout={seconds!r}", "ROLL's seconds per worker call: give a positive number")
        return
    timeouts = raw.setdefault("worker_timeouts", {}) or {}
    raw["worker_timeouts"] = timeouts
    for f in dataclasses.fields(WorkerTimeoutsConfig):
        timeouts.setdefault(f.name, seconds)
    notes.append(f"rpc_timeout: {seconds} -> worker_timeouts of every stage not set there")


def _map_reward_system_config(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """ROLL's ``reward_system_config: {skip_special_tokens: true}``: roll's rewards always read the
    responses decoded without special tokens, so only that value is accepted."""
    if "reward_system_config" not in raw:
        return
    section = raw.pop("reward_system_config")
    for key, value in (section or {}).items() if isinstance(section, dict) else [(None, section)]:
        if key == "skip_special_tokens" and value is True:
            notes.append(
                "reward_system_config.skip_special_tokens: true dropped; roll's rewards read responses so"
            )
        else:
            at = f"reward_system_config.{key}={value!r}" if key else f"reward_system_config={section!r}"
            problems.add(at, "roll's rewards read responses decoded without special tokens; remove it")


def _map_data_kwargs_func(section: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    data_args = section.get("data_args")
    if not isinstance(data_args, dict) or "custom_data_kwargs_func" not in data_args:
        return
    func = data_args.pop("custom_data_kwargs_func")
    layout = DATA_KWARGS_FUNCS.get(class_name(str(func)))
    at = f"{path}.data_args.custom_data_kwargs_func={func}"
    if layout is None and class_name(str(func)) in UNOFFERED_DATA_KWARGS_FUNCS:
        problems.add(
            at, f"{UNOFFERED_DATA_KWARGS_FUNCS[class_name(str(func))]}; known: {', '.join(DATA_KWARGS_FUNCS)}"
        )
        return
    if layout is None:
        problems.add(at, f"unknown ROLL row reader; known: {', '.join(DATA_KWARGS_FUNCS)}")
        return
    data_args.setdefault("row_layout", layout)
    notes.append(f"{path}.data_args.custom_data_kwargs_func {class_name(str(func))} -> row_layout: {layout}")


def _complete_interleave_probs(raw: dict[str, Any], notes: list[str]) -> None:
    """ROLL splits each step's prompts by ``domain_interleave_probs`` with ``int(p * batch)`` for
    every domain but the last, which takes the rest: probabilities that do not sum to 1 (a line left
    commented out) give the last domain the remainder. roll's sampler needs them to sum to 1."""
    data_args = (raw.get("actor_train") or {}).get("data_args") or {}
    probs = data_args.get("domain_interleave_probs")
    if not isinstance(probs, dict) or not probs:
        return
    values = list(probs.values())
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values):
        return  # roll's loader names the bad value
    last, rest = list(probs)[-1], sum(values[:-1])
    if abs(sum(values) - 1.0) < 1e-6 or not 0 <= rest < 1:
        return
    probs[last] = round(1.0 - rest, 6)
    notes.append(
        f"WARNING: actor_train.data_args.domain_interleave_probs sum to {sum(values):g}; {last}: "
        f"{values[-1]} -> {probs[last]:g}, the remainder ROLL gives its last domain"
    )


def _default_reward(raw: dict[str, Any], notes: list[str]) -> None:
    """alibaba/ROLL scores a row whose tag no reward role lists in the ``math_rule`` domain
    (``update_dataset_domain``); roll's spelling is ``default_reward: math_rule``."""
    rewards = raw.get("rewards")
    if not isinstance(rewards, dict) or "default_reward" in raw:
        return
    if not isinstance(rewards.get("math_rule"), dict) or "worker_cls" not in rewards["math_rule"]:
        return  # ROLL's fallback domain is the role named math_rule of ROLL's own file
    if any(isinstance(r, dict) and not r.get("tag_included") for r in rewards.values()):
        return  # roll's catch-all role (empty tag_included) already takes them
    raw["default_reward"] = "math_rule"
    notes.append("rows whose tag no reward role lists are scored by rewards.math_rule, as in ROLL")


def _drop_judge_value_head(reward: dict[str, Any], path: str, notes: list[str]) -> None:
    """ROLL's judge files carry ``model_type: trl`` (a value head) for a generative judge, where it
    means nothing: the judge generates its verdict."""
    model_args = reward.get("model_args")
    if isinstance(model_args, dict) and model_args.get("model_type") == "trl":
        del model_args["model_type"]
        notes.append(f"{path}.model_args.model_type: 'trl' dropped; a generative LLM judge has no value head")


def _fill_model_paths(raw: dict[str, Any], notes: list[str]) -> None:
    """ROLL's default: roles without model_name_or_path use ``pretrain`` (the critic
    ``reward_pretrain``)."""
    for role in ROLES:
        source = "reward_pretrain" if role == "critic" else "pretrain"
        section = raw.get(role)
        if not isinstance(section, dict) or raw.get(source) is None:
            continue
        model_args = section.setdefault("model_args", {}) or {}
        section["model_args"] = model_args
        if model_args.get("model_name_or_path") is None:
            model_args["model_name_or_path"] = raw[source]
            notes.append(f"{role}.model_args.model_name_or_path <- {source}")


def _apply_global_template(raw: dict[str, Any], notes: list[str]) -> None:
    """ROLL's ``global_template`` is every role's (and validation's) default chat template."""
    template = raw.pop("global_template", None)
    if template is None:
        return
    for section in (*ROLES, "validation", *(f"rewards.{n}" for n in raw.get("rewards") or {})):
        node = raw
        for key in section.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            data_args = node.setdefault("data_args", {}) or {}
            node["data_args"] = data_args
            data_args.setdefault("template", template)
    notes.append(f"global_template: {template!r} -> data_args.template of every role without one")


# ROLL's options of the pg_variant losses (top level or actor_train) -> roll's policy_loss section.
POLICY_LOSS_KEYS = tuple(f.name for f in dataclasses.fields(PolicyLossConfig))


def _map_policy_loss(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """ROLL reads ``pg_variant`` and its options from actor_train; roll's keys are top-level
    ``pg_variant`` and ``policy_loss.<option>``. A value given in both places must agree."""
    role = raw.get("actor_train") if isinstance(raw.get("actor_train"), dict) else {}
    for key in ("pg_variant", *POLICY_LOSS_KEYS):
        if key not in raw and key not in role:
            continue
        target = raw if key == "pg_variant" else raw.setdefault("policy_loss", {})
        if not isinstance(target, dict):
            problems.add(f"policy_loss={target!r}", "must be a mapping of the pg_variant options")
            return
        for source, where in ((raw, key), (role, f"actor_train.{key}")):
            if key not in source or source is target:
                continue
            value = source.pop(key)
            if target.setdefault(key, value) != value:
                problems.add(f"{where}={value!r}", f"conflicts with {key}={target[key]!r}; give one value")
            elif where != key or target is not raw:
                notes.append(f"{where} -> {'policy_loss.' if target is not raw else ''}{key}: {value!r}")
    _map_ratio_type(raw, problems, notes)
    _map_pg_clip_range(raw, notes)


def _map_ratio_type(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """ROLL's ``ratio_type: segment`` (one ratio per response) on the PPO loss is GSPO's ratio."""
    ratio_type = raw.pop("ratio_type", None)
    if ratio_type in (None, "token"):
        return
    if ratio_type == "segment" and raw.get("pg_variant", "ppo") in ("ppo", "gspo"):
        raw["pg_variant"] = "gspo"
        notes.append("ratio_type: 'segment' -> pg_variant: gspo (sequence-level ratio, PPO clip)")
        return
    problems.add(
        f"ratio_type={ratio_type!r}",
        f"a sequence-level ratio is pg_variant: gspo (PPO clip only), not pg_variant {raw.get('pg_variant')!r}",
    )


def _map_pg_clip_range(raw: dict[str, Any], notes: list[str]) -> None:
    """ROLL uses ``pg_clip_low``/``pg_clip_high`` only with ``use_pg_clip_range: true``; roll uses
    them whenever they are set, so without the switch they are dropped."""
    if "use_pg_clip_range" not in raw:
        return
    if raw.pop("use_pg_clip_range"):
        return
    for key in ("pg_clip_low", "pg_clip_high"):
        if raw.pop(key, None) is not None:
            notes.append(f"{key} dropped: use_pg_clip_range is false, so ROLL clips at pg_clip")
