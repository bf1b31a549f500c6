"""alibaba/ROLL's ``rollout_mock`` onto roll's ``rollout_dump`` (roll/configs/rollout_dump.py).

>>> raw = {"rollout_mock": {"enable": True, "mode": "dump", "dump_dir": "./dumps/v1"}}
>>> map_rollout_mock(raw, Problems(), [])
>>> raw
{'rollout_dump': {'mode': 'dump', 'dir': './dumps/v1'}}

ROLL's modes are ``dump`` and ``mock`` (train on the dumped batches): roll's ``dump`` and ``replay``.
roll writes its own files (safetensors + JSON, never pickles), so a dump ROLL wrote (``.pkl``) is
not read: dump again with roll.
"""

from __future__ import annotations

from typing import Any

from roll.configs.roll_compat_options import Problems

# ROLL's rollout_mock.mode -> roll's rollout_dump.mode.
MODES = {"dump": "dump", "mock": "replay"}
KEYS = ("enable", "mode", "dump_dir")


def map_rollout_mock(raw: dict[str, Any], problems: Problems, notes: list[str]) -> None:
    """Replace ``rollout_mock`` in ``raw`` by ``rollout_dump``; refusals go to ``problems``."""
    if "rollout_mock" not in raw:
        return
    mock = raw.pop("rollout_mock")
    if mock is None:
        return
    if not isinstance(mock, dict):
        problems.add(f"rollout_mock={mock!r}", "must be a mapping {enable, mode, dump_dir}")
        return
    unknown = [k for k in mock if k not in KEYS]
    if unknown:
        problems.add(
            f"rollout_mock.{unknown[0]}", f"not a ROLL rollout_mock key; its keys: {', '.join(KEYS)}"
        )
        return
    if mock.get("enable") is not True:
        if mock.get("enable") not in (None, False):
            problems.add(f"rollout_mock.enable={mock['enable']!r}", "write true or false")
        else:
            notes.append("rollout_mock: enable is false; key dropped")
        return
    mode = MODES.get(mock.get("mode"))
    if mode is None:
        problems.add(f"rollout_mock.mode={mock.get('mode')!r}", f"ROLL's modes are {' and '.join(MODES)}")
        return
    if not mock.get("dump_dir"):
        problems.add("rollout_mock.dump_dir", "is required: the directory to dump into or replay from")
        return
    if "rollout_dump" in raw:
        problems.add("rollout_mock", "give rollout_mock or roll's rollout_dump, not both")
        return
    raw["rollout_dump"] = {"mode": mode, "dir": mock["dump_dir"]}
    notes.append(f"rollout_mock -> rollout_dump: {{mode: {mode}, dir: {mock['dump_dir']}}}")
