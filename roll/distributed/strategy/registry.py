"""Strategy registry: exact ``strategy_name`` -> strategy class, imported only when used.

>>> spec = get_strategy_spec("hf_infer")
>>> strategy_cls = load_strategy_class("hf_infer")   # imports transformers only now

The config dataclasses are light, so validation and ``--dry_run`` work without megatron-core,
vLLM or SGLang installed; importing a strategy whose engine is missing raises a ConfigError that
names the extra to install.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from roll.configs.errors import ConfigError, did_you_mean
from roll.configs.strategy_configs import STRATEGY_CONFIGS


@dataclass(frozen=True)
class StrategySpec:
    name: str
    # "module:ClassName", imported lazily.
    target: str
    side: Literal["train", "infer"]
    # pip extra that provides the engine, named in the error when the import fails.
    extra: str | None = None
    # Python modules the strategy needs; a missing one becomes a ConfigError naming ``extra``.
    requires: tuple[str, ...] = ()
    # Whether the role's workers join one torch.distributed default group. Engines that build their
    # own in the worker process (vLLM's in-process executor) must find none there.
    role_process_group: bool = True
    # Releases of the engine package this strategy ran on, as (lowest, first refused) versions;
    # another installed version is a ConfigError before launch (see ``check_engine_version``).
    engine_versions: tuple[str, str] | None = None

    @property
    def config_cls(self) -> type:
        """The options class of ``strategy_config``, which the loader parses (STRATEGY_CONFIGS)."""
        return STRATEGY_CONFIGS[self.name]


_S = "roll.distributed.strategy"
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec("hf_infer", f"{_S}.hf_strategy:HFInferStrategy", "infer"),
        StrategySpec("fsdp2_train", f"{_S}.fsdp2_strategy:FSDP2TrainStrategy", "train"),
        StrategySpec(
            "megatron_train",
            f"{_S}.megatron_strategy:MegatronTrainStrategy",
            "train",
            extra="megatron",
            requires=("megatron.core",),
        ),
        StrategySpec(
            "megatron_infer",
            f"{_S}.megatron_infer_strategy:MegatronInferStrategy",
            "infer",
            extra="megatron",
            requires=("megatron.core",),
        ),
        StrategySpec(
            "vllm",
            f"{_S}.vllm_strategy:VLLMStrategy",
            "infer",
            extra="vllm",
            requires=("vllm",),
            role_process_group=False,
            engine_versions=("0.24", "0.25"),
        ),
        StrategySpec(
            "sglang",
            f"{_S}.sglang_strategy:SGLangStrategy",
            "infer",
            extra="sglang",
            requires=("sglang",),
            role_process_group=False,
            engine_versions=("0.5.16", "0.6"),
        ),
    )
}


def get_strategy_spec(name: str, path: str = "strategy_args.strategy_name") -> StrategySpec:
    spec = STRATEGIES.get(name)
    if spec is None:
        raise ConfigError(
            path,
            f"unknown strategy {name!r}{did_you_mean(name, STRATEGIES)}; valid names: {', '.join(sorted(STRATEGIES))}",
        )
    return spec


def load_strategy_class(name: str, path: str = "strategy_args.strategy_name") -> type:
    """Import and return the strategy class registered under ``name``."""
    spec = get_strategy_spec(name, path)
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                path,
                f"strategy {name!r} needs the '{module}' package, which is not installed ({exc}); "
                f"install it with: pip install -e .[{spec.extra}]",
            ) from exc
    module_name, class_name = spec.target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def check_engine_version(spec: StrategySpec, path: str) -> None:
    """Refuse an installed engine outside ``spec.engine_versions`` (one ConfigError naming ``path``).

    Checked where the run is launched; an engine that is not installed there is not an error here
    (workers on other nodes may have it; the worker's import names the extra if they do not).
    """
    from importlib.metadata import PackageNotFoundError, version

    if spec.engine_versions is None or not spec.requires:
        return
    package = spec.requires[0].split(".")[0]
    try:
        installed = version(package)
    except PackageNotFoundError:
        return
    low, high = spec.engine_versions
    if not _version_key(low) <= _version_key(installed) < _version_key(high):
        raise ConfigError(
            path,
            f"strategy {spec.name!r} runs on {package} >={low},<{high} but {installed} is installed; "
            f"install a tested release with: pip install -e .[{spec.extra}]",
        )


def _version_key(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
