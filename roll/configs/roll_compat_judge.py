"""ROLL's LLM judge served by a separate inference cluster (``judge_model_type: cluster``).

In ROLL the judge model runs in its own role, declared at the top level (``reward_model`` in ROLL's
example files, ``reward_infer`` in its newer pipeline): an engine with its own ``strategy_args`` and
``device_mapping``. The ``llm_judge`` reward workers are CPU clients of it, as many as its
``world_size``. In roll a judge reward role runs its engine itself, on the role's devices, so the
cluster becomes that role's engine:

>>> raw = {"rewards": {"judge": {"judge_model_type": "cluster", "world_size": 32}},
...        "reward_model": {"strategy_args": {"strategy_name": "vllm"}, "device_mapping": "[6, 7]"}}
>>> notes = []
>>> map_judge_cluster(raw, Problems(), notes)
>>> raw["rewards"]["judge"]["device_mapping"], "reward_model" in raw
('[6, 7]', False)
"""

from __future__ import annotations

from typing import Any

from roll.configs.roll_compat_options import Problems

# ROLL's names for the top-level role that serves a cluster-mode judge.
JUDGE_SERVICE_ROLES = ("reward_model", "reward_infer")
# Keys of the service role that become the judge reward role's (the service's win: they are what
# ROLL's cluster-mode judge generates with); the rest of the service role describes ROLL's worker.
SERVED = ("model_args", "generating_args", "strategy_args", "device_mapping", "infer_batch_size")
# Keys of the service role with no meaning in roll's judge role.
SERVICE_DROPPED = {
    "name": "ROLL's name of the cluster",
    "worker_cls": "ROLL's inference worker class; roll's reward worker runs the engine",
    "data_args": "the judge prompts are built by the llm_judge reward (judge_prompt, its template)",
}


def map_judge_cluster(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """Give every ``judge_model_type: cluster`` reward role the service role's engine, devices and
    generation options, and drop the service role and the client count."""
    judges = [
        name
        for name, reward in (raw.get("rewards") or {}).items()
        if isinstance(reward, dict) and reward.get("judge_model_type") == "cluster"
    ]
    if not judges:
        return
    services = [key for key in JUDGE_SERVICE_ROLES if isinstance(raw.get(key), dict)]
    if len(services) != 1:
        found = f"found {', '.join(services)}" if services else "found none"
        for name in judges:
            problems.add(
                f"rewards.{name}.judge_model_type=cluster",
                f"ROLL's judge service is one top-level role named {' or '.join(JUDGE_SERVICE_ROLES)} "
                f"({found}); or write inference and give the reward role its own strategy_args",
            )
        return
    if len(judges) > 1:
        problems.add(
            f"rewards.{judges[1]}.judge_model_type=cluster",
            f"roll runs one judge engine per reward role, and {judges[0]} already takes "
            f"{services[0]}'s devices; give this role its own strategy_args and device_mapping",
        )
        return
    service_key, name = services[0], judges[0]
    service, reward = raw.pop(service_key), raw["rewards"][name]
    path = f"rewards.{name}"
    del reward["judge_model_type"]
    for key in SERVED:
        if key in service:
            reward[key] = _merged(reward.get(key), service.pop(key))
    for key, why in SERVICE_DROPPED.items():
        if key in service:
            notes.append(f"{service_key}.{key}: {service.pop(key)!r} dropped; {why}")
    for key in service:
        problems.add(f"{service_key}.{key}", "a key of ROLL's judge service role that roll does not map")
    clients = reward.pop("world_size", None)
    notes.append(
        f"{path}.judge_model_type: cluster -> the judge's engine is {path}'s own, on {service_key}'s "
        f"devices {reward.get('device_mapping')!r} with its strategy_args, model_args and generating_args"
        + (f"; world_size {clients} (ROLL's client workers) dropped" if clients is not None else "")
    )


def _merged(own: Any, served: Any) -> Any:
    """The service's value over the reward role's own; for two dicts (``*_args``) key by key, so the
    reward's keys the service lacks are kept."""
    if isinstance(own, dict) and isinstance(served, dict):
        return {**own, **served}
    return served
