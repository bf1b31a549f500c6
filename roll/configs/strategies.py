"""Every strategy in one table: one row per ``strategy_name`` that every reader uses::

    spec = get_strategy_spec("vllm")
    spec.options        # VLLMConfig: the class ``strategy_args.strategy_config`` is built as
    spec.target         # "roll.distributed.strategy.vllm_strategy:VLLMStrategy", imported when used

A row says what a strategy is for each part of roll, so no part keeps a table of strategy names
of its own:

- the loader types ``strategy_config`` as ``options`` (``StrategyArgs``);
- alibaba/ROLL files go through ``roll_compat`` (``roll.configs.roll_compat_options``);
- the worker imports ``target`` and checks it against the Protocols named in ``protocols``
  (``roll.distributed.strategy.registry.load_strategy_class``);
- the scheduler, the launch checks and the pipeline read the capability flags;
- the memory planner predicts the role with its ``memory_model`` (``roll.planner.roles``).

The options classes import nothing heavy, so configs load (and ``--dry_run`` plans) without
megatron-core, vLLM or SGLang installed. docs/strategies.md says how to add a row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from roll.configs.build import build_dataclass
from roll.configs.errors import ConfigError, table_entry
from roll.configs.roll_compat_options import map_fsdp2, map_megatron
from roll.configs.strategy_configs import FSDP2Config, HFInferConfig, MegatronConfig, SGLangConfig, VLLMConfig


@dataclass(frozen=True)
class StrategySpec:
    name: str
    # The options class of ``strategy_config`` (roll.configs.strategy_configs).
    options: type
    # "module:ClassName" of the strategy class, imported lazily.
    target: str
    side: Literal["train", "infer"]
    # Which formula of the memory planner predicts this strategy's device memory
    # (``roll.planner.roles.MEMORY_MODELS``).
    memory_model: str
    # Maps the alibaba/ROLL keys of a role of this strategy onto ``options`` (called with the role's
    # plain data before the strict build; ``roll.configs.roll_compat_roles.map_strategy``).
    roll_compat: Callable[..., None] | None = None
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
    # Names of the optional Protocols of ``roll.distributed.strategy.base`` the class implements,
    # checked against the class when it is loaded (``registry.check_strategy_class``).
    protocols: tuple[str, ...] = ()
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
    # Whether the strategy sizes its device memory from what is free when it starts (vLLM profiles
    # ``gpu_memory_utilization``, SGLang ``mem_fraction_static``): on a device shared with other
    # roles it must initialize alone (``roll.pipeline.rlvr.start.init_waves``).
    sizes_from_free_memory: bool = False
    # Modules a GPU worker of this strategy imports on a background thread as soon as it starts, so
    # the import (~12 s for vLLM; megatron-core with Transformer Engine) overlaps the other roles'
    # start-up instead of adding to the role's ``initialize``.
    preload: tuple[str, ...] = ()
    # Whether the strategy trains LoRA adapters when ``model_args.lora_rank`` is set (roll.models.lora)
    # and exports merged weights; any other strategy refuses the lora_* keys before launch.
    trains_lora: bool = False
    # Whether the strategy runs a vision-language model on prompts with images (roll.models.vision:
    # pixel inputs in the forward, or images sent to the engine); roll.launch.files refuses the
    # others before launch for such a model.
    runs_vision: bool = False
    # The vision-language model types (config.json's ``model_type``) a ``runs_vision`` strategy has
    # been checked with, where that is fewer than roll.models.vision.VISION_MODEL_TYPES; None: all
    # of them. roll.launch.files refuses the others before launch; one entry adds a type.
    vision_model_types: tuple[str, ...] | None = None
    # Environment every GPU worker of a run that has a role of this strategy gets (under the run's
    # and the role's ``system_envs``, which win). SGLang's ``Engine`` sets NCCL_CUMEM_ENABLE=0 in
    # its worker's process unless it is set, and NCCL's peer-to-peer transport between a process
    # with cuMem buffers and one without fails ("Cuda failure 'invalid argument'", transport/p2p.cc;
    # seen on 2 x H200 in the trainer -> SGLang model update), so every process of the run must agree.
    run_env: tuple[tuple[str, str], ...] = ()

    def build_options(self, data: Any) -> Any:
        """``data`` (a mapping, None or an ``options`` object) as an ``options`` object, built
        strictly; a ConfigError names the key under ``strategy_config``."""
        if data is None or isinstance(data, Mapping):
            return build_dataclass(self.options, data or {}, "strategy_config")
        if not isinstance(data, self.options):
            raise ConfigError(
                "strategy_config",
                f"strategy {self.name!r} takes {self.options.__name__} options, got {type(data).__name__}",
            )
        return data


_S = "roll.distributed.strategy"
# megatron-core's model code (with Transformer Engine where installed: seconds to import on a GPU
# host), imported while the other roles' workers start rather than inside ``initialize``.
MEGATRON_PRELOAD = ("megatron.core.models.gpt",)
# The vision-language model types fsdp2_train and hf_infer load (transformers' Auto classes): every
# one of roll.models.vision.VISION_MODEL_TYPES but Qwen3-Omni (``qwen3_omni_moe``), whose checkpoint
# transformers builds whole (thinker, talker, code2wav) and whose thinker the Megatron strategies
# build; the pre-launch check refuses it there, naming strategy_name and the strategies that run it.
HF_VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(
            "hf_infer",
            HFInferConfig,
            f"{_S}.hf_strategy:HFInferStrategy",
            "infer",
            memory_model="hf_inference",
            protocols=("ValueModelStrategy", "HFWeightSource"),
            shares_process_on_cpu=True,
            uses_default_group=False,
            runs_vision=True,
            vision_model_types=HF_VISION_MODEL_TYPES,
        ),
        StrategySpec(
            "fsdp2_train",
            FSDP2Config,
            f"{_S}.fsdp2_strategy:FSDP2TrainStrategy",
            "train",
            memory_model="fsdp2_train",
            roll_compat=map_fsdp2,
            protocols=("ValueModelStrategy",),
            records_train_log_probs=True,
            shares_process_on_cpu=True,
            trains_lora=True,
            runs_vision=True,
            vision_model_types=HF_VISION_MODEL_TYPES,
        ),
        StrategySpec(
            "megatron_train",
            MegatronConfig,
            f"{_S}.megatron_strategy:MegatronTrainStrategy",
            "train",
            memory_model="megatron_train",
            roll_compat=map_megatron,
            extra="megatron",
            requires=("megatron.core",),
            protocols=("FinishesModelUpdate",),
            records_train_log_probs=True,
            offloads_on_cpu=True,
            trains_lora=True,
            preload=MEGATRON_PRELOAD + ("megatron.core.optimizer", "megatron.core.distributed"),
            runs_vision=True,  # Qwen2.5-VL (roll.models.megatron.qwen2_5_vl)
        ),
        StrategySpec(
            "megatron_infer",
            MegatronConfig,
            f"{_S}.megatron_infer_strategy:MegatronInferStrategy",
            "infer",
            memory_model="megatron_inference",
            roll_compat=map_megatron,
            extra="megatron",
            requires=("megatron.core",),
            protocols=("HFWeightSource", "FinishesModelUpdate"),
            preload=MEGATRON_PRELOAD,
            runs_vision=True,  # scores image rows; generation with images: vllm
        ),
        StrategySpec(
            "vllm",
            VLLMConfig,
            f"{_S}.vllm_strategy:VLLMStrategy",
            "infer",
            memory_model="vllm_engine",
            extra="vllm",
            requires=("vllm",),
            role_process_group=False,
            engine_versions=("0.24", "0.25"),
            protocols=("FinishesModelUpdate", "SharedBucketEngine", "BroadcastBucketEngine"),
            sizes_from_free_memory=True,
            preload=("vllm.entrypoints.llm",),
            runs_vision=True,  # generation only; it scores text rows (engine_vision)
        ),
        StrategySpec(
            "sglang",
            SGLangConfig,
            f"{_S}.sglang_strategy:SGLangStrategy",
            "infer",
            memory_model="sglang_engine",
            extra="sglang",
            requires=("sglang",),
            role_process_group=False,
            engine_versions=("0.5.16", "0.6"),
            protocols=("FinishesModelUpdate", "SharedBucketEngine", "DistributedBucketEngine"),
            sizes_from_free_memory=True,
            preload=("sglang",),
            run_env=(("NCCL_CUMEM_ENABLE", "0"),),
            runs_vision=True,  # images and videos as processor output (sglang_vision)
            vision_model_types=("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"),
        ),
    )
}


def strategies_run_env(roles: Iterable[Any]) -> dict[str, str]:
    """The ``run_env`` of every strategy among ``roles`` (RoleConfigs), merged."""
    env: dict[str, str] = {}
    for role in roles:
        args = getattr(role, "strategy_args", None)
        if args is not None and args.strategy_name in STRATEGIES:
            env.update(STRATEGIES[args.strategy_name].run_env)
    return env


def get_strategy_spec(name: str, path: str = "strategy_args.strategy_name") -> StrategySpec:
    """The row of ``name``; an unknown name is a ConfigError on ``path`` listing the valid ones."""
    return table_entry(STRATEGIES, name, path, "strategy")


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
