"""Strategy registry: exact ``strategy_name`` -> strategy class, imported only when used.

>>> spec = get_strategy_spec("hf_infer")
>>> strategy_cls = load_strategy_class("hf_infer")   # imports transformers only now, checks the Protocols

Each row names the Protocols of ``base.py`` its class implements: its side's (``TrainStrategy`` or
``InferenceStrategy``) plus ``protocols``. ``check_strategy_class`` checks them against the class's
methods (no instance is made, so vLLM/SGLang classes are checked without the engines) when the
class is loaded, and ``tests/test_strategy_protocols.py`` runs it over every row.

The config dataclasses are light, so validation and ``--dry_run`` work without megatron-core,
vLLM or SGLang installed; importing a strategy whose engine is missing raises a ConfigError that
names the extra to install.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Literal

from roll.configs.errors import ConfigError, did_you_mean
from roll.configs.strategy_configs import STRATEGY_CONFIGS
from roll.distributed.strategy.base import (
    OPTIONAL_PROTOCOLS,
    BroadcastBucketEngine,
    FinishesModelUpdate,
    HFWeightSource,
    InferenceStrategy,
    SharedBucketEngine,
    TrainStrategy,
    ValueModelStrategy,
    check_protocol,
)


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
    # Optional Protocols of ``base.py`` the class implements (see ``check_strategy_class``).
    protocols: tuple[type, ...] = ()
    # Whether ``offload_states``/``reload_states`` do anything on CPU slots. Most strategies only
    # free device memory, which a CPU slot does not have, so the pipeline skips their calls there
    # (two Ray round trips per stage saved); megatron's offloader frees and restores storage on
    # any device, which the CPU pipeline tests exercise, so its calls stay.
    offloads_on_cpu: bool = False
    # Training side: whether every row's ``log_probs`` reach ``loss_fn`` on the DP group's output
    # rank, so the worker can return them from ``train_step`` (``record_log_probs``) and a
    # one-update step needs no separate old-log-probs pass (``recompute_old_log_probs: auto``).
    records_train_log_probs: bool = False
    # Whether, on CPU slots, a worker of this strategy may live in one process with the workers of
    # the other roles on its slot (``roll/distributed/scheduler/hosting.py``): every process imports
    # torch and transformers, which is most of a CPU run's start-up. Only strategies that keep no
    # process-wide state besides torch.distributed's default group qualify; megatron keeps its global
    # parallel state and offloader, vLLM and SGLang start engine processes and groups of their own.
    shares_process_on_cpu: bool = False
    # Whether the strategy's collectives run on torch.distributed's default group. One process has
    # one such group, so a shared process holds at most one role that uses it.
    uses_default_group: bool = True

    @property
    def required_protocols(self) -> tuple[type, ...]:
        return (TrainStrategy if self.side == "train" else InferenceStrategy, *self.protocols)

    @property
    def config_cls(self) -> type:
        """The options class of ``strategy_config``, which the loader parses (STRATEGY_CONFIGS)."""
        return STRATEGY_CONFIGS[self.name]

    def implements(self, protocol: type) -> bool:
        """Whether the row declares ``protocol`` (or a Protocol that extends it), e.g.
        ``implements(ValueModelStrategy)`` for a critic; true of the class once it is loaded."""
        return any(protocol in required.__mro__ for required in self.required_protocols)


_S = "roll.distributed.strategy"
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(
            "hf_infer",
            f"{_S}.hf_strategy:HFInferStrategy",
            "infer",
            protocols=(ValueModelStrategy, HFWeightSource),
            shares_process_on_cpu=True,
            uses_default_group=False,
        ),
        StrategySpec(
            "fsdp2_train",
            f"{_S}.fsdp2_strategy:FSDP2TrainStrategy",
            "train",
            protocols=(ValueModelStrategy,),
            records_train_log_probs=True,
            shares_process_on_cpu=True,
        ),
        StrategySpec(
            "megatron_train",
            f"{_S}.megatron_strategy:MegatronTrainStrategy",
            "train",
            extra="megatron",
            requires=("megatron.core",),
            protocols=(FinishesModelUpdate,),
            offloads_on_cpu=True,
        ),
        StrategySpec(
            "megatron_infer",
            f"{_S}.megatron_infer_strategy:MegatronInferStrategy",
            "infer",
            extra="megatron",
            requires=("megatron.core",),
            protocols=(HFWeightSource, FinishesModelUpdate),
        ),
        StrategySpec(
            "vllm",
            f"{_S}.vllm_strategy:VLLMStrategy",
            "infer",
            extra="vllm",
            requires=("vllm",),
            role_process_group=False,
            engine_versions=("0.24", "0.25"),
            protocols=(FinishesModelUpdate, SharedBucketEngine, BroadcastBucketEngine),
        ),
        StrategySpec(
            "sglang",
            f"{_S}.sglang_strategy:SGLangStrategy",
            "infer",
            extra="sglang",
            requires=("sglang",),
            role_process_group=False,
            engine_versions=("0.5.16", "0.6"),
            protocols=(FinishesModelUpdate, SharedBucketEngine),
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
    """Import and return the strategy class registered under ``name``, checked against its row's
    Protocols (``check_strategy_class``)."""
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
    return check_strategy_class(name)


@functools.cache
def check_strategy_class(name: str) -> type:
    """Import the class of row ``name`` (not its engine) and check that it implements the row's
    Protocols, and declares every optional Protocol it has all the methods of; a TypeError lists
    what differs. Returns the class."""
    spec = STRATEGIES[name]
    module_name, class_name = spec.target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    problems = [
        f"{protocol.__name__}.{problem}"
        for protocol in spec.required_protocols
        for problem in check_protocol(cls, protocol)
    ]
    undeclared = [
        p.__name__ for p in OPTIONAL_PROTOCOLS if not spec.implements(p) and not check_protocol(cls, p)
    ]
    if undeclared:
        problems.append(f"implements {undeclared} without declaring them in its row's protocols")
    if problems:
        raise TypeError(f"strategy {name!r} ({spec.target}): " + "; ".join(problems))
    return cls


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
