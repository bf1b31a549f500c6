"""alibaba/ROLL's LoRA keys (``lora_target``, ``lora_rank``, ``lora_alpha``, ``lora_dropout``) onto roll's.

ROLL writes them at the top level and references them from each role's ``model_args``
(``lora_rank: ${lora_rank}``), on the trainer and the inference engine alike. In roll:

- on a role whose strategy trains LoRA (``fsdp2_train``, ``megatron_train``): kept, the same names
  (on megatron_train the HF target names adapt the fused megatron layers, docs/megatron.md "LoRA";
  a note says that MoE expert MLPs get no adapters there, which ROLL's ``all-linear`` adapts);
- on an inference role of a ROLL file (vLLM, SGLang, hf_infer, megatron_infer): dropped with a
  note; the engine receives the trainer's merged weights, the reference is the frozen base model
  (in roll's own files they are a ConfigError before launch, ``roll.launch.roles``);
- on another training strategy in a ROLL file: refused (none today: both train LoRA);
- at the top level: dropped once a role's ``model_args`` carries them (the file's ``${}``
  references are resolved by then), else refused with where to write them.

>>> problems, notes = Problems(), []
>>> raw = {"lora_rank": 8, "actor_train": {"model_args": {"lora_rank": 8},
...        "strategy_args": {"strategy_name": "fsdp2_train"}}}
>>> map_lora(raw, True, problems, notes); "lora_rank" in raw, raw["actor_train"]["model_args"]
(False, {'lora_rank': 8})
"""

from __future__ import annotations

from typing import Any

from roll.configs.role import LORA_KEYS
from roll.configs.roll_compat_options import Problems
from roll.configs.strategies import STRATEGIES

ROLES = ("actor_train", "actor_infer", "reference", "critic")
NO_LORA_TRAINER = (
    "this strategy trains every parameter; roll trains LoRA on fsdp2_train and megatron_train "
    "(model_args.lora_*), or remove the lora_* keys"
)

# ROLL's megatron LoRA also adapts MoE experts' grouped linears; roll's adapts attention and dense MLPs.
MEGATRON_EXPERTS = (
    "{role}.model_args.lora_target: on megatron_train roll adapts the attention and dense-MLP layers; "
    "MoE expert MLPs keep no adapters (ROLL's all-linear adapts them too)"
)


def map_lora(raw: dict[str, Any], roll_file: bool, problems: Problems, notes: list[str]) -> None:
    """Map or drop the LoRA keys of ``raw`` in place (see the module docstring); ``roll_file``:
    the file is alibaba/ROLL's (its inference roles' copies are dropped, not refused)."""
    used = False
    for role in ROLES:
        section = raw.get(role)
        if isinstance(section, dict) and isinstance(section.get("model_args"), dict):
            used |= _map_role(section, role, roll_file, problems, notes)
    for key in [k for k in LORA_KEYS if k in raw]:
        value = raw.pop(key)
        if used or value is None:
            notes.append(f"{key}: {value!r} dropped; roll reads each role's model_args.{key}")
        else:
            problems.add(
                f"{key}={value!r}",
                "ROLL's top-level LoRA keys only feed ${} references; write actor_train.model_args."
                f"{key} (strategy fsdp2_train or megatron_train)",
            )


def _map_role(
    section: dict[str, Any], role: str, roll_file: bool, problems: Problems, notes: list[str]
) -> bool:
    """The lora_* keys of one role; True when the role keeps or drops any set key."""
    model_args = section["model_args"]
    for key in [k for k in LORA_KEYS if k in model_args and model_args[k] is None]:
        del model_args[key]  # ROLL's "not set"
    keys = [k for k in LORA_KEYS if k in model_args]
    if not keys:
        return False
    args = section.get("strategy_args")
    spec = STRATEGIES.get(str(args.get("strategy_name"))) if isinstance(args, dict) else None
    if spec is not None and spec.name == "megatron_train" and roll_file and "lora_target" in keys:
        notes.append(MEGATRON_EXPERTS.format(role=role))
    if spec is None or spec.trains_lora or not roll_file:
        return True  # roll's own file: the pre-launch check names a misplaced key (roll.launch.roles)
    if spec.side == "train":
        for key in keys:
            problems.add(f"{role}.model_args.{key}={model_args[key]!r}", NO_LORA_TRAINER)
        return True
    for key in keys:
        del model_args[key]
    what = "is the frozen base model" if role == "reference" else "receives the trainer's merged weights"
    notes.append(f"{role}.model_args: {', '.join(keys)} dropped; {role} ({spec.name}) {what}")
    return True
