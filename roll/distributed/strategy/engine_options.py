"""Starting an engine-backed strategy (``vllm``, ``sglang``) without needing the engine here.

* the engine's constructor arguments from ``strategy_config`` + ``model_args``, each remembering
  the config key it came from, checked against the option names of the installed engine
  (``dataclasses.fields(vllm.EngineArgs)`` / SGLang's ``ServerArgs``): an unknown option is a
  ConfigError naming ``<role>.strategy_args.strategy_config.<key>`` with a did-you-mean. The
  pre-launch step builds and checks the same options where the driver imports the engine
  (roll.launch.roles); the worker checks again because only its process is sure to have the
  engine that runs;
* importing the engine with a ConfigError that names the pip extra when it is missing;
* checks that the model splits evenly over an engine's TP/EP ranks.

Constructing the engine with these options is ``engine_startup.start_engine``.

    options = vllm_engine_options(cfg, role_config, "actor_infer", seed=42, extension_cls=EXT)
    options.check(dataclass_field_names(vllm.EngineArgs), "vLLM", "vllm")
    llm = vllm.LLM(**options.kwargs)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from roll.configs.errors import ConfigError, did_you_mean
from roll.models.model_dir import config_json
from roll.models.vision import is_vision_config

if TYPE_CHECKING:
    from roll.configs.role import RoleConfig
    from roll.configs.strategy_configs import SGLangConfig, VLLMConfig

ENGINE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# --------------------------------------------------------------------------- strategy setup


def import_engine(module: str, role: str, strategy_name: str) -> ModuleType:
    """Import the engine package or raise a ConfigError naming the pip extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{role}.strategy_args.strategy_name",
            f"strategy {strategy_name!r} needs the '{module}' package, which is not installed ({exc}); "
            f"install it with: pip install -e .[{strategy_name}]",
        ) from exc


def dataclass_field_names(cls: type) -> set[str]:
    """Option names of an engine's argument dataclass (``vllm.EngineArgs``, SGLang ``ServerArgs``)."""
    return {f.name for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------- engine options


@dataclass
class EngineOptions:
    """Keyword arguments for the engine constructor, and for each key the config key it came from
    (so an error about an engine option names the key the user wrote)."""

    kwargs: dict[str, Any]
    sources: dict[str, str]

    def check(self, accepted: Collection[str], engine: str, extra: str) -> None:
        """Raise a ConfigError for the first option the installed engine does not accept."""
        for key in self.kwargs:
            if key not in accepted:
                raise ConfigError(
                    self.sources[key],
                    f"the installed {engine} has no engine option {key!r}{did_you_mean(key, accepted)}; "
                    f"check the option against your {engine} version (pip install -e .[{extra}])",
                )


def _build_options(
    derived: dict[str, tuple[Any, str]], engine_kwargs: Mapping[str, Any], path: str
) -> EngineOptions:
    kwargs = {k: v for k, (v, _) in derived.items() if v is not None}
    sources = {k: src for k, (v, src) in derived.items() if v is not None}
    for key, value in engine_kwargs.items():
        if key in derived:
            raise ConfigError(
                f"{path}.engine_kwargs.{key}",
                f"is set by roll from {derived[key][1]}; set it there instead of in engine_kwargs",
            )
        kwargs[key] = value
        sources[key] = f"{path}.engine_kwargs.{key}"
    return EngineOptions(kwargs, sources)


def _model_options(
    role_config: RoleConfig, role: str, model_key: str, seed_key: str, seed: int
) -> dict[str, tuple[Any, str]]:
    """What every engine is told about the model and the seed (under its own names for the model
    path and the seed), each with the config key it came from."""
    margs = role_config.model_args
    return {
        model_key: (margs.model_name_or_path, f"{role}.model_args.model_name_or_path"),
        "dtype": (ENGINE_DTYPES[margs.dtype], f"{role}.model_args.dtype"),
        "trust_remote_code": (margs.trust_remote_code, f"{role}.model_args.trust_remote_code"),
        seed_key: (seed, "seed"),
    }


VLLM_OVERRIDABLE = {
    "worker_extension_cls",
    "logprobs_mode",
    "compilation_config",
    "gdn_prefill_backend",
    "disable_custom_all_reduce",
}
# ``cuda_graph_sizes: null``: decode batches are padded up to the next power of two.
DEFAULT_CUDA_GRAPH_SIZES = [1 << i for i in range(10)]  # 1 ... 512


def vllm_compilation_config(cfg: VLLMConfig) -> dict[str, Any] | None:
    """vLLM's ``compilation_config`` for ``torch_compile`` / ``cuda_graph_sizes`` (None when
    ``enforce_eager``: vLLM then compiles and captures nothing). Without torch.compile vLLM can
    only capture whole decode steps (``FULL_DECODE_ONLY``; piecewise graphs need the compiled
    pieces); with it, vLLM's default mode (full graphs for decode, piecewise for mixed batches)."""
    if cfg.enforce_eager:
        return None
    sizes = sorted(set(cfg.cuda_graph_sizes or DEFAULT_CUDA_GRAPH_SIZES))
    if cfg.torch_compile:
        return {"mode": "VLLM_COMPILE", "cudagraph_capture_sizes": sizes}
    return {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes}


def vllm_engine_options(
    cfg: VLLMConfig,
    role_config: RoleConfig,
    role: str,
    seed: int,
    extension_cls: str,
    spans_nodes: bool = False,
) -> EngineOptions:
    """Arguments of ``vllm.LLM``. ``distributed_executor_backend: mp``: TP runs beside the worker,
    "uni" (in-process) for TP=1, "mp" (vLLM's own worker processes on the worker's visible GPUs) for
    TP>1. ``ray``: vLLM's Ray executor, its GPU workers in the worker's placement group (vLLM would
    pick "ray" by itself inside a Ray actor, so roll always names the backend).

    ``spans_nodes`` (the engine's devices lie on more than one node): vLLM's custom all-reduce is
    turned off, as vLLM does itself for its own multi-node launch. Its Ray executor gives each GPU
    worker the GPU ids of its own Ray node only, but the custom all-reduce decides "one node" by
    whether the TP workers share /dev/shm: Ray nodes on one machine (or in containers sharing its
    IPC namespace) pass that test, and the all-reduce's peer check then looks up the peer's local
    rank among this node's ids (vLLM 0.24: ``IndexError: device_id 1 is out of range for
    assigned_physical_gpu_ids``). Across real machines the test fails and vLLM skips it anyway."""
    path = f"{role}.strategy_args.strategy_config"
    derived = _model_options(role_config, role, "model", "seed", seed)
    derived |= {
        "worker_extension_cls": (extension_cls, f"{path}.engine_kwargs"),
        "distributed_executor_backend": (
            vllm_executor_backend(cfg),
            f"{path}.distributed_executor_backend",
        ),
        "enable_sleep_mode": (cfg.sleep_level > 0, f"{path}.sleep_level"),
    }
    if spans_nodes:
        derived["disable_custom_all_reduce"] = (True, f"{path}.distributed_executor_backend")
    for key in (
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "block_size",
        "max_model_len",
        "enable_prefix_caching",
        "load_format",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enforce_eager",
        "enable_chunked_prefill",
    ):
        derived[key] = (getattr(cfg, key), f"{path}.{key}")
    if cfg.kv_cache_memory_gb is not None:
        derived["kv_cache_memory_bytes"] = (int(cfg.kv_cache_memory_gb * 2**30), f"{path}.kv_cache_memory_gb")
    compilation = vllm_compilation_config(cfg)
    if compilation is not None:
        derived["compilation_config"] = (compilation, f"{path}.torch_compile")
    # Sampled-token log-probs of the distribution actually sampled from (after temperature/top-k/top-p),
    # like hf_infer's infer_logprobs; vLLM's own default is the raw model distribution.
    derived["logprobs_mode"] = ("processed_logprobs", f"{path}.engine_kwargs")
    derived["gdn_prefill_backend"] = (gdn_prefill_backend(role_config), f"{path}.engine_kwargs")
    # Our own choices may be overridden through engine_kwargs (e.g. the executor backend).
    engine_kwargs = dict(cfg.engine_kwargs)
    for key in VLLM_OVERRIDABLE & engine_kwargs.keys():
        derived[key] = (engine_kwargs.pop(key), f"{path}.engine_kwargs.{key}")
    return _build_options(derived, engine_kwargs, path)


def vllm_executor_backend(cfg: VLLMConfig) -> str:
    """vLLM's ``distributed_executor_backend`` for ``cfg``: "ray" as configured, else "uni" (the
    model in the worker's process) for TP 1 and "mp" (spawned TP processes) above."""
    if cfg.workers_on_ray:
        return "ray"
    return "uni" if cfg.tensor_parallel_size == 1 else "mp"


def gdn_prefill_backend(role_config: RoleConfig) -> str | None:
    """vLLM's Gated DeltaNet prefill kernel for a model with linear-attention layers (Qwen3-Next):
    "triton" (fla's kernels, inside vLLM) where FlashInfer is not installed, since vLLM's "auto"
    picks FlashInfer on Hopper and its engine then fails at start-up without it; None (vLLM's
    choice) otherwise and for every other model."""
    if importlib.util.find_spec("flashinfer") is not None:
        return None
    config = config_json(role_config.model_args.model_name_or_path)
    text = config.get("text_config") or config
    linear = text.get("model_type") in LINEAR_ATTENTION_TYPES or "linear_attention" in (
        text.get("layer_types") or []
    )
    return "triton" if linear else None


# Model types whose layers include Gated DeltaNet linear attention (a config may leave out layer_types).
LINEAR_ATTENTION_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"}


SGLANG_CONFIG_KEYS = {
    # SGLang ServerArgs name -> SGLangConfig field
    "tp_size": "tensor_parallel_size",
    "mem_fraction_static": "mem_fraction_static",
    "context_length": "context_length",
    "enable_memory_saver": "enable_memory_saver",
    "load_format": "load_format",
    "max_running_requests": "max_running_requests",
    "disable_radix_cache": "disable_radix_cache",
    "attention_backend": "attention_backend",
    "sampling_backend": "sampling_backend",
    "disable_cuda_graph": "disable_cuda_graph",
    "enable_deterministic_inference": "enable_deterministic_inference",
}


def sglang_engine_options(cfg: SGLangConfig, role_config: RoleConfig, role: str, seed: int) -> EngineOptions:
    """Arguments of ``sglang.Engine`` (the names of SGLang's ``ServerArgs``)."""
    path = f"{role}.strategy_args.strategy_config"
    derived = _model_options(role_config, role, "model_path", "random_seed", seed)
    for engine_key, cfg_key in SGLANG_CONFIG_KEYS.items():
        derived[engine_key] = (getattr(cfg, cfg_key), f"{path}.{cfg_key}")
    if "mm_attention_backend" not in cfg.engine_kwargs:
        backend = sglang_vision_attention(cfg, role_config)
        derived["mm_attention_backend"] = (backend, f"{path}.attention_backend")
    return _build_options(derived, cfg.engine_kwargs, path)


# SGLang's vision-tower kernel for each attention_backend that has one: SGLang picks "fa3" on
# Hopper by itself, which needs the FlashAttention-3 build that attention_backend "triton" avoids.
SGLANG_VISION_ATTENTION = {"triton": "triton_attn", "fa3": "fa3"}


def sglang_vision_attention(cfg: SGLangConfig, role_config: RoleConfig) -> str | None:
    """SGLang's ``mm_attention_backend`` for a vision-language model, following ``attention_backend``
    (``engine_kwargs.mm_attention_backend`` overrides it); None (SGLang's choice) otherwise."""
    if not is_vision_config(config_json(role_config.model_args.model_name_or_path)):
        return None
    return SGLANG_VISION_ATTENTION.get(cfg.attention_backend)


# --------------------------------------------------------------------------- layout vs model


def model_split_sizes(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(attention heads, KV heads, routed experts; 0 for a dense model) of a config.json's dict;
    a multimodal file's language model is its ``text_config``."""
    if "num_attention_heads" not in hf_config and isinstance(hf_config.get("text_config"), Mapping):
        hf_config = hf_config["text_config"]
    heads = int(hf_config.get("num_attention_heads") or 0)
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    # Qwen-MoE files say num_experts, Mixtral num_local_experts, DeepSeek n_routed_experts.
    experts = next(
        (hf_config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in hf_config), 0
    )
    return heads, kv_heads, int(experts or 0)


def check_engine_tp(hf_config: Mapping[str, Any], tp: int, key: str, model: str) -> None:
    """A vLLM/SGLang engine's split of ``model`` (its config.json as a dict) over ``tp``
    tensor-parallel ranks; a ConfigError naming ``key`` otherwise. Each rank takes an equal share
    of the attention heads; the KV heads are split the same way, or copied when there are fewer of
    them than ranks, so one count must divide the other."""
    heads, kv_heads, _ = model_split_sizes(hf_config)
    where = f"{model}/config.json"
    if heads and heads % tp:
        raise ConfigError(
            key,
            f"{tp} does not divide the model's {heads} attention heads (num_attention_heads in {where}); "
            f"use one of {_divisors(heads)}",
        )
    if kv_heads and kv_heads % tp and tp % kv_heads:
        fits = [d for d in _divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]
        raise ConfigError(
            key,
            f"{tp} and the model's {kv_heads} KV heads (num_key_value_heads in {where}) do not split "
            f"evenly either way (each rank gets an equal share, or a copy when ranks outnumber them); "
            f"use one of {fits}",
        )


def check_engine_ep(hf_config: Mapping[str, Any], ep: int, key: str, what: str, model: str) -> None:
    """Each of an engine's ``ep`` expert-parallel ranks (``what``: how that number is made) holds an
    equal share of ``model``'s routed experts; a ConfigError naming ``key`` otherwise. A dense
    model has nothing to split."""
    _, _, experts = model_split_sizes(hf_config)
    if experts and experts % ep:
        raise ConfigError(
            key,
            f"expert parallelism over {ep} ranks ({what}) does not divide the model's {experts} experts "
            f"({model}/config.json); use a divisor of {experts}: {_divisors(experts)}",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
