"""Rollout dump and replay (``rollout_dump``): one run writes every step's scored rollouts, a later
run trains on them instead of generating, so two training setups can be compared step by step on
identical data (alibaba/ROLL's ``rollout_mock``).

    dump = RolloutDump.open(config, tokenizer)   # checks dir against the config (and the tokenizer)
    dump.write(step, batch, metrics)            # mode dump: after collect_rollouts
    batch, metrics = dump.read(step)            # mode replay: instead of collect_rollouts

A dump directory holds, per step k, ``step_<k>.safetensors`` (every tensor of the batch) and
``step_<k>.json`` (the per-row non-tensor fields, the batch's meta and the step's sampling metrics),
and ``manifest.json``: the roll version, the config values replay must share (``MATCHED``, with the
tokenizer's vocabulary size and hash), and each step's files with their sha256. Files are written
through a temporary file, fsync and rename; the manifest last, so a step is in the dump only once
its files are whole. Nothing is pickled.

The batch is the one ``collect_rollouts`` returns: prompts, responses, masks, the engine's
log-probs, and the scores and flags of the reward roles (after DAPO dynamic sampling and overlong
shaping). Replay takes the scores as dumped rather than scoring again: an LLM judge or a sandboxed
program is neither cheap nor certain to give the same score twice, and dynamic sampling chose the
rows by those scores.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

import roll
from roll.configs.device_mapping import format_device_ids
from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.run_config import resume_requested
from roll.core.batch import Batch
from roll.core.errors import RolloutDumpError
from roll.utils.atomic_io import disk_full_as, write_file_durably

logger = logging.getLogger("roll")

MANIFEST = "manifest.json"
FORMAT = 1
# Config values a replay must share with the dump (key path -> how to read it from the config).
MATCHED = {
    "rollout_batch_size": lambda c: c.rollout_batch_size,
    "num_return_sequences_in_group": lambda c: c.num_return_sequences_in_group,
    "prompt_length": lambda c: c.prompt_length,
    "response_length": lambda c: c.response_length,
    "actor_train.model_args.model_name_or_path": lambda c: c.actor_train.model_args.model_name_or_path,
}
KEY = "rollout_dump.dir"


def step_files(step: int) -> tuple[str, str]:
    return f"step_{step}.safetensors", f"step_{step}.json"


def config_values(config: RLVRConfig) -> dict[str, Any]:
    return {key: read(config) for key, read in MATCHED.items()}


def tokenizer_values(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's vocabulary size and the sha256 of its token -> id table."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"tokenizer.vocab_size": len(vocab), "tokenizer.vocab_sha256": digest}


def check_dump_dir(config: RLVRConfig) -> dict[str, Any] | None:
    """The pre-launch check of ``rollout_dump`` (also run when a dump opens); returns the manifest
    of an existing dump, None for a fresh one. One ConfigError naming the key (see the two checks
    below); a ``dir`` that is a file is refused in both modes."""
    mode, root = config.rollout_dump.mode, Path(config.rollout_dump.dir or "")
    if mode == "none":
        return None
    if root.exists() and not root.is_dir():
        raise ConfigError(KEY, f"{root} is a file, not a directory")
    return _check_dump_target(config, root) if mode == "dump" else _check_replay_source(config, root)


def _check_dump_target(config: RLVRConfig, root: Path) -> dict[str, Any] | None:
    """A dump goes into a new or empty directory, or, when the run resumes, continues the dump
    there (made with the same values); anything else is refused before a file is touched."""
    if not root.is_dir() or not any(root.iterdir()):
        return None
    if not resume_requested(config.resume_from_checkpoint):
        raise ConfigError(
            KEY,
            f"{root} already holds files ({_describe(root)}); point rollout_dump.dir at a new "
            "directory, or resume the run that wrote it (resume_from_checkpoint)",
        )
    manifest = read_manifest(root)
    check_matches(manifest, config_values(config), root)
    return manifest


def _check_replay_source(config: RLVRConfig, root: Path) -> dict[str, Any]:
    """A replay needs the directory, a readable manifest made with this run's values, and the
    files of steps 1 to ``max_steps``."""
    if not root.is_dir():
        raise ConfigError(KEY, f"{root}: no such directory; dump into it first (rollout_dump.mode: dump)")
    manifest = read_manifest(root)
    check_matches(manifest, config_values(config), root)
    steps = sorted(int(k) for k in manifest["steps"])
    missing = [k for k in range(1, config.max_steps + 1) if str(k) not in manifest["steps"]]
    if missing:
        held = f"steps {format_device_ids(steps)}" if steps else "no steps"
        raise ConfigError(
            "max_steps",
            f"{config.max_steps}, but {root} holds {held} (step {missing[0]} is missing); set max_steps "
            f"to at most {_contiguous(steps)}, or dump more steps",
        )
    for k in range(1, config.max_steps + 1):
        for name in manifest["steps"][str(k)]["files"]:
            if not (root / name).is_file():
                raise ConfigError(KEY, f"{root / name}: no such file (listed in {MANIFEST} for step {k})")
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise ConfigError(
            KEY, f"{path}: no such file ({root} is not a rollout dump, or its first step never finished)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(KEY, f"{path}: not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(KEY, f"{path}: not a rollout dump manifest of format {FORMAT}")
    if not isinstance(manifest.get("values"), dict) or not isinstance(manifest.get("steps"), dict):
        raise ConfigError(KEY, f"{path}: lacks 'values' or 'steps'")
    for step, entry in manifest["steps"].items():
        if not step.isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            raise ConfigError(KEY, f"{path}: steps.{step} is not a step entry")
    return manifest


def check_matches(manifest: dict[str, Any], now: dict[str, Any], root: Path) -> None:
    """Every value of ``now`` equals the dump's (a value the dump does not record is not checked)."""
    dumped = manifest["values"]
    for key, value in now.items():
        if key in dumped and dumped[key] != value:
            raise ConfigError(
                KEY,
                f"{root / MANIFEST}: {key} differs: dumped with {dumped[key]!r}, this run has {value!r}; "
                "replay needs the value the dump was made with",
            )


@dataclass
class RolloutDump:
    """An open dump directory in mode ``dump`` or ``replay`` (see the module doc)."""

    root: Path
    mode: str
    manifest: dict[str, Any]

    @classmethod
    def open(cls, config: RLVRConfig, tokenizer: Any) -> RolloutDump | None:
        """None when ``rollout_dump.mode`` is none. A replay checks the dump's values and the
        tokenizer; a dump writes its manifest (or continues the one of the run it resumes)."""
        if not config.rollout_dump.enabled:
            return None
        root = Path(config.rollout_dump.dir)
        existing = check_dump_dir(config)  # the config's values checked there already
        tokens = tokenizer_values(tokenizer)
        if existing is not None:
            check_matches(existing, tokens, root)
        dump = cls(root, config.rollout_dump.mode, existing or _new_manifest(config_values(config) | tokens))
        if dump.mode == "dump" and existing is None:
            with disk_full_as(RolloutDumpError, root / MANIFEST):
                root.mkdir(parents=True, exist_ok=True)
                dump._write_manifest()
        logger.info("rollout_dump: %s %s", "replaying" if dump.mode == "replay" else "dumping into", root)
        return dump

    def write(self, step: int, batch: Batch, metrics: dict[str, float]) -> None:
        """Write step ``step``'s rollouts and sampling metrics, then record them in the manifest."""
        tensor_name, fields_name = step_files(step)
        tensors = save_tensors({k: v.detach().cpu().contiguous().clone() for k, v in batch.tensors.items()})
        fields = json.dumps(
            {
                "non_tensors": {k: _encode_field(k, v) for k, v in batch.non_tensors.items()},
                "meta": _jsonable(batch.meta, "meta"),
                "metrics": metrics,
            },
            ensure_ascii=False,
        ).encode()
        with disk_full_as(RolloutDumpError, self.root):
            write_file_durably(self.root / tensor_name, tensors)
            write_file_durably(self.root / fields_name, fields)
            self.manifest["steps"][str(step)] = {
                "rows": len(batch),
                "files": {tensor_name: _sha256(tensors), fields_name: _sha256(fields)},
            }
            self._write_manifest()

    def read(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s rollouts and sampling metrics, each file checked against its sha256."""
        entry = self.manifest["steps"].get(str(step))
        if entry is None:
            raise RolloutDumpError(f"{self.root / MANIFEST}: step {step} was not dumped")
        data = {name: self._read_checked(name, entry["files"].get(name), step) for name in step_files(step)}
        tensor_name, fields_name = step_files(step)
        fields = json.loads(data[fields_name])
        non_tensors = {k: _decode_field(v) for k, v in fields["non_tensors"].items()}
        batch = Batch(load_tensors(data[tensor_name]), non_tensors, fields["meta"])
        return batch, fields["metrics"]

    def _read_checked(self, name: str, digest: str | None, step: int) -> bytes:
        path = self.root / name
        if digest is None:
            raise RolloutDumpError(f"{self.root / MANIFEST}: step {step} does not list {name}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise RolloutDumpError(f"{path}: {exc.strerror or exc} (listed in {MANIFEST})") from None
        if _sha256(data) != digest:
            raise RolloutDumpError(f"{path}: sha256 differs from {MANIFEST} (the file is corrupted)")
        return data

    def _write_manifest(self) -> None:
        write_file_durably(self.root / MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True))


def _new_manifest(values: dict[str, Any]) -> dict[str, Any]:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "format": FORMAT,
        "roll_version": roll.__version__,
        "created": created,
        "values": values,
        "steps": {},
    }


def _encode_field(name: str, values: np.ndarray) -> dict[str, Any]:
    return {
        "dtype": values.dtype.str if values.dtype != object else "object",
        "values": _jsonable(values.tolist(), name),
    }


def _decode_field(field: dict[str, Any]) -> np.ndarray:
    if field["dtype"] != "object":
        return np.array(field["values"], dtype=field["dtype"])
    out = np.empty(len(field["values"]), dtype=object)
    for i, v in enumerate(field["values"]):
        out[i] = v
    return out


def _jsonable(value: Any, name: str) -> Any:
    """``value`` if JSON keeps it as it is (str, int, float, bool, None, and lists and str-keyed
    dicts of those); a RolloutDumpError naming the field otherwise."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, list):
        return [_jsonable(v, name) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v, name) for k, v in value.items()}
    raise RolloutDumpError(
        f"rollout_dump: field {name!r} holds a {type(value).__name__}, which a dump cannot keep as JSON"
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _describe(root: Path) -> str:
    names = sorted(p.name for p in root.iterdir())
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _contiguous(steps: list[int]) -> int:
    last = 0
    while last + 1 in steps:
        last += 1
    return last
