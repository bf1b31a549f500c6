"""alibaba/ROLL's role-level keys onto roll's: devices per worker, each strategy's options (its
row's mapper in ``roll.configs.strategies``; vLLM/SGLang engine arguments), sequence packing and
dynamic batching. Part of ``roll.configs.roll_compat``'s translation, which calls ``map_role`` for
every role and ``map_strategy`` for reward roles:

>>> problems, notes = Problems(), []
>>> role = {"num_gpus_per_worker": 2, "strategy_args": {"strategy_name": "vllm", "strategy_config": {}}}
>>> map_role(role, "actor_infer", problems, notes)
>>> role["strategy_args"]["strategy_config"]["tensor_parallel_size"]
2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from roll.configs.roll_compat_options import Problems, remove_padding_to_packing
from roll.configs.strategies import STRATEGIES
from roll.configs.strategy_configs import PackingOptions

# ActorPGWorker is ROLL's worker for pg_variant; roll's one actor worker computes every variant.
ACTOR_WORKERS = ("ActorWorker", "ActorPGWorker")


def class_name(dotted: Any) -> str:
    """``x.y.MathRuleRewardWorker`` -> ``MathRuleRewardWorker``."""
    return str(dotted).rsplit(".", 1)[-1]


def _strategies_with(option: str) -> tuple[str, ...]:
    """The strategy names whose options class has the field ``option``."""
    return tuple(
        name
        for name, spec in STRATEGIES.items()
        if option in {f.name for f in dataclasses.fields(spec.options)}
    )


# Strategies whose worker spans ``tensor_parallel_size`` devices, and those that take engine arguments.
TP_STRATEGIES = _strategies_with("tensor_parallel_size")
# Strategies that split sequences the Ulysses way (ROLL's model_args.ulysses_size).
ULYSSES_STRATEGIES = _strategies_with("ulysses_size")
ENGINE_STRATEGIES = _strategies_with("engine_kwargs")
# Strategies that pack rows (their options are PackingOptions).
PACKING_STRATEGIES = tuple(
    name for name, spec in STRATEGIES.items() if issubclass(spec.options, PackingOptions)
)


def drop_offload_nccl(node: dict[str, Any], path: str, notes: list[str]) -> None:
    """ROLL's ``offload_nccl`` (top level or per role) frees NCCL buffers while a role sleeps."""
    if node.pop("offload_nccl", None):
        notes.append(
            f"WARNING: {path}: true dropped; ROLL frees the NCCL buffers while a role sleeps, roll keeps "
            "its communicators on the device (plan a little more device memory)"
        )


def map_role(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """Map the ROLL keys of one model role (``path``: actor_train, ...) in place; refusals go to
    ``problems``, what was mapped or dropped to ``notes``."""
    drop_offload_nccl(role, f"{path}.offload_nccl", notes)
    if "worker_cls" in role:
        cls = class_name(role.pop("worker_cls"))
        if cls not in ACTOR_WORKERS:
            problems.add(f"{path}.worker_cls={cls}", "remove it; roll's roles use one worker class each")
    for key, mapper in ROLE_MAPPERS.items():
        if key in role:
            mapper(role, f"{path}.{key}", problems, notes)
    if isinstance(role.get("model_args"), dict) and "ulysses_size" in role["model_args"]:
        _map_ulysses(role, f"{path}.model_args.ulysses_size", problems, notes)  # after fsdp2_infer's rename


def _map_num_gpus_per_worker(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's devices per inference worker is roll's engine ``tensor_parallel_size``."""
    value = role.pop("num_gpus_per_worker")
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in TP_STRATEGIES:
        if value not in (None, 1):
            problems.add(
                f"{path}={value!r}",
                f"only {'/'.join(TP_STRATEGIES)} workers span devices (tensor_parallel_size)",
            )
        return
    config = _options_dict(args)
    if args.get("strategy_name") == "vllm" and "tensor_parallel_size" in config:
        # ROLL sets a vLLM worker's devices to tensor_parallel_size x pipeline_parallel_size,
        # whatever num_gpus_per_worker says (its WorkerConfig); so does roll.
        if config["tensor_parallel_size"] * config.get("pipeline_parallel_size", 1) != value:
            notes.append(
                f"{path}: {value!r} dropped; ROLL and roll give a vLLM worker tensor_parallel_size x "
                f"pipeline_parallel_size devices ({config['tensor_parallel_size']})"
            )
        return
    tp = config.setdefault("tensor_parallel_size", value)
    if tp != value:
        problems.add(f"{path}={value!r}", f"must equal strategy_config.tensor_parallel_size ({tp})")
    else:
        notes.append(f"{path}: {value} -> strategy_config.tensor_parallel_size: {value}")


def _map_ulysses(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's ``model_args.ulysses_size`` is roll's ``strategy_config.ulysses_size`` (fsdp2_train);
    elsewhere 1 or null is dropped and anything else refused with what roll offers instead."""
    value = role["model_args"].pop("ulysses_size")
    args = role.get("strategy_args") or {}
    name = args.get("strategy_name")
    if name not in ULYSSES_STRATEGIES:
        if value not in (None, 1):
            problems.add(
                f"{path}={value!r}",
                f"Ulysses sequence parallelism is fsdp2_train's (strategy {name!r} here); on megatron "
                "strategies split sequences with strategy_config.context_parallel_size: N, or remove it",
            )
        return
    config = _options_dict(args)
    if config.setdefault("ulysses_size", value) != value:
        problems.add(
            f"{path}={value!r}", f"conflicts with strategy_config.ulysses_size ({config['ulysses_size']})"
        )
    elif value is not None:
        notes.append(f"{path}: {value} -> strategy_config.ulysses_size: {value}")
    else:
        config.pop("ulysses_size")


def _options_dict(args: dict[str, Any]) -> dict[str, Any]:
    """``args["strategy_config"]`` as a dict to add keys to (made empty when missing or null)."""
    args["strategy_config"] = args.get("strategy_config") or {}
    return args["strategy_config"]


def _map_remove_padding(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """The role-level spelling of ``use_remove_padding``, on the strategies that pack."""
    value = role.pop("use_remove_padding")
    role_path = path.rsplit(".", 1)[0]
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in PACKING_STRATEGIES:
        if value:
            problems.add(f"{path}={value!r}", f"roll packs rows in {', '.join(PACKING_STRATEGIES)} only")
        return
    config = _options_dict(args)
    remove_padding_to_packing(value, config, role_path, problems, notes)


def map_engine(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL hands a vllm/sglang ``strategy_config`` to the engine as it is; roll's options are
    fields, and in a ROLL file any other key goes in ``engine_kwargs`` (checked by the installed
    engine when it starts; in roll's own files an unknown key stays an error)."""
    args = role.get("strategy_args")
    if not isinstance(args, dict) or args.get("strategy_name") not in ENGINE_STRATEGIES:
        return
    if not isinstance(args.get("strategy_config"), dict):
        return
    config, at = args["strategy_config"], f"{path}.strategy_config"
    known = {f.name for f in dataclasses.fields(STRATEGIES[args["strategy_name"]].options)}
    extra = [key for key in config if key not in known]
    if not extra:
        return
    engine_kwargs = config.setdefault("engine_kwargs", {})
    for key in extra:
        if engine_kwargs.setdefault(key, config[key]) != config[key]:
            problems.add(f"{at}.{key}={config[key]!r}", f"conflicts with engine_kwargs.{key}")
        config.pop(key)
    notes.append(f"{at}: {', '.join(extra)} -> engine_kwargs (engine arguments, as ROLL passes them)")


def map_strategy(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's ``fsdp2_infer`` as roll's ``fsdp2_train``, then the ``strategy_config`` keys by the
    mapper of the strategy's row (``StrategySpec.roll_compat``)."""
    args = role["strategy_args"]
    if isinstance(args, dict) and args.get("strategy_name") == "fsdp2_infer":
        args["strategy_name"] = "fsdp2_train"  # mapped below like fsdp2_train
        notes.append(
            f"WARNING: {path}.strategy_name: fsdp2_infer -> fsdp2_train (roll has no forward-only FSDP2 "
            "strategy; the role only computes log-probs, its optimizer never steps)"
        )
    if not isinstance(args, dict) or not isinstance(args.get("strategy_config"), dict):
        return
    spec = STRATEGIES.get(str(args.get("strategy_name")))
    if spec is not None and spec.roll_compat is not None:
        spec.roll_compat(role, path, problems, notes)


# ROLL's packing / dynamic-batching role keys -> roll's strategy_config keys (docs/packing.md).
_BUDGETS = {
    "train": (
        "use_dynamic_batching_in_train",
        "max_tokens_per_microbatch_in_train",
        "max_tokens_per_microbatch",
    ),
    "infer": (
        "use_dynamic_batching_in_infer",
        "max_tokens_per_microbatch_in_infer",
        "infer_max_tokens_per_microbatch",
    ),
}
_PACKING_ARGS = {
    "max_packed_sequence_length_train": "max_tokens_per_microbatch",
    "max_packed_sequence_length_forward": "infer_max_tokens_per_microbatch",
}


def _roll_packing_keys(role: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Pop ROLL's packing keys of a role: ({roll strategy_config key: value}, [(key=value, advice)])."""
    wanted: dict[str, Any] = {}
    bad: list[tuple[str, str]] = []
    for switch, budget, key in _BUDGETS.values():
        on, tokens = role.pop(switch, None), role.pop(budget, None)
        if on and tokens is None:
            bad.append((f"{switch}={on!r}", f"set {budget} too (roll: strategy_config.{key})"))
        elif on:
            wanted[key] = tokens
    for side in ("train", "infer"):
        role.pop(f"sequence_length_round_in_{side}", None)  # roll rounds to 8 (x TP)
    args = dict(role.pop("sequence_packing_args", None) or {})
    if role.pop("use_sequence_packing", None):
        wanted["sequence_packing"] = True
        args.pop("algorithm", None)  # roll's planner is LPT bin packing
        for side in ("train", "forward"):  # roll's minimum is 1 (the budget decides the rest)
            if args.get(f"min_num_micro_batches_{side}") in (None, 1):
                args.pop(f"min_num_micro_batches_{side}", None)
        for name, key in _PACKING_ARGS.items():
            if args.get(name) is not None:
                wanted.setdefault(key, args.pop(name))
        bad += [
            (f"sequence_packing_args.{k}={v!r}", "remove it; roll has no such option")
            for k, v in args.items()
        ]
    return wanted, bad


def _map_packing(role: dict[str, Any], path: str, problems: Problems, notes: list[str]) -> None:
    """ROLL's dynamic batching and sequence packing onto roll's packing options."""
    wanted, bad = _roll_packing_keys(role)
    role_path = path.rsplit(".", 1)[0]
    for key, advice in bad:
        problems.add(f"{role_path}.{key}", advice)
    if not wanted:
        return
    args = role.get("strategy_args") or {}
    if args.get("strategy_name") not in PACKING_STRATEGIES:
        problems.add(f"{role_path} packing keys", f"roll packs in {', '.join(PACKING_STRATEGIES)} only")
        return
    config = _options_dict(args)
    for key, value in wanted.items():
        if config.setdefault(key, value) != value:
            problems.add(f"{role_path}: {key}={value!r}", f"conflicts with strategy_config.{key}")
        else:
            notes.append(f"{role_path}: ROLL packing keys -> strategy_config.{key}: {value!r}")


ROLE_MAPPERS: dict[str, Callable[..., None]] = {
    "num_gpus_per_worker": _map_num_gpus_per_worker,
    "strategy_args": map_strategy,
    "use_remove_padding": _map_remove_padding,
    **{
        key: _map_packing
        for key in (
            "use_dynamic_batching_in_train",
            "use_dynamic_batching_in_infer",
            "use_sequence_packing",
            "max_tokens_per_microbatch_in_train",
            "max_tokens_per_microbatch_in_infer",
            "sequence_length_round_in_train",
            "sequence_length_round_in_infer",
            "sequence_packing_args",
        )
    },
}
