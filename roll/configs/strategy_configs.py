"""The options classes of ``strategy_config``, one per strategy (its row in ``roll.configs.strategies``
names it), loaded strictly like the rest of the config.

These classes import nothing heavy, so configs load (and ``--dry_run`` plans) on machines
where megatron-core, vLLM or SGLang are not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.pipeline_layout import PipelineLayout
from roll.configs.ranges import bounded, one_of


@dataclass(frozen=True)
class ParallelSizes:
    """Model-parallel layout of one role. ``dp`` is derived from the role's world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    dp: int = 1
    # Ulysses sequence parallelism (fsdp2_train): ranks that split each sequence, dp = world / sp.
    sp: int = 1
    # HSDP (fsdp2_train's fsdp_size): ranks per parameter-shard group, None when one group holds all.
    fsdp: int | None = None

    def describe(self) -> str:
        return (
            f"TP={self.tp} PP={self.pp} CP={self.cp} EP={self.ep} DP={self.dp}"
            + (f" VPP={self.vpp}" if self.vpp > 1 else "")
            + (f" SP={self.sp} (Ulysses)" if self.sp > 1 else "")
            + (f" FSDP={self.fsdp} (HSDP)" if self.fsdp is not None else "")
        )


class _DataParallelOnly:
    """Mixin for strategies where every worker is one data-parallel replica."""

    devices_per_worker = 1

    def parallel_sizes(self, world_size: int) -> ParallelSizes:
        return ParallelSizes(dp=world_size)

    def validate(self, num_devices: int, path: str) -> None:
        return None


@dataclass
class HFInferConfig(_DataParallelOnly):
    """transformers' generate() and forward; one full model replica per worker."""

    # Offload moves the weights to CPU memory between uses (for colocated layouts).
    offload_to_cpu: bool = True


@dataclass
class PackingOptions:
    """Sequence packing and token-budget micro-batches of a training strategy (docs/packing.md).

    ``sequence_packing``: several sequences per row, attention confined to each; None turns it on
    wherever the strategy's attention path is exact with it. ``max_tokens_per_microbatch``: train
    micro-batches formed by real-token count (None: the rows the worker gives,
    ``per_device_train_batch_size`` each); ``infer_max_tokens_per_microbatch`` likewise for
    log-prob passes (None: ``infer_batch_size`` rows). Budgets need packing.
    """

    sequence_packing: bool | None = None
    max_tokens_per_microbatch: int | None = bounded(None, ge=1)
    infer_max_tokens_per_microbatch: int | None = bounded(None, ge=1)

    def __post_init__(self) -> None:
        for key in ("max_tokens_per_microbatch", "infer_max_tokens_per_microbatch"):
            value = getattr(self, key)
            if value is not None and self.sequence_packing is False:
                raise ValueError(f"{key}: a token budget needs sequence_packing (set it true or null)")


@dataclass
class FSDP2Config(PackingOptions, _DataParallelOnly):
    """torch FSDP2 (fully_shard) on GPU; on CPU the same API over gloo."""

    reshard_after_forward: bool = True
    # "full_shard" shards across all ranks (or fsdp_size groups); "no_shard" keeps replicas (DDP-like).
    sharding: str = one_of("full_shard", table="roll.distributed.strategy.fsdp2_strategy:SHARDINGS")
    mixed_precision: bool = True
    # With mixed_precision: the dtype gradients are reduced (reduce-scattered) in across ranks
    # (FSDP2 MixedPrecisionPolicy.reduce_dtype). bf16 halves the gradient traffic at the cost of
    # summing in 8 mantissa bits; the sharded gradients and the optimizer stay in the parameter dtype.
    reduce_dtype: str = one_of("fp32", "fp32", "bf16")
    cpu_offload: bool = False
    # Ulysses sequence parallelism (roll.models.ulysses): each group of this many ranks splits every
    # sequence of its micro-batches; attention exchanges sequence shards for head shards (all-to-all).
    # Must divide the role's ranks (data-parallel size = ranks / ulysses_size) and the model's
    # attention heads; KV heads are replicated when fewer than ulysses_size (checked at model load).
    ulysses_size: int = bounded(1, ge=1)
    # HSDP: each group of this many consecutive ranks shards the parameters, gradients and optimizer
    # state among them and the world / fsdp_size groups are replicas (gradients all-reduced between
    # them). null shards over every rank; 1 replicates everything (like sharding: no_shard). Must
    # divide the role's ranks; independent of ulysses_size. ROLL's fsdp_size maps onto it.
    fsdp_size: int | None = bounded(None, ge=1)
    # Expert parallelism (roll.models.expert_parallel, MoE models only): each group of this many
    # consecutive ranks splits the experts of every MoE layer (tokens exchanged by all-to-all). Must
    # divide the role's ranks and the model's number of experts (checked at model load).
    ep_size: int = bounded(1, ge=1)
    # Ranks that FSDP-shard one expert slice (ranks r, r + ep_size, ...); null: ranks / ep_size, the
    # only value roll runs (ROLL's eddp expert replicas are refused). ROLL's key of the same name.
    efsdp_size: int | None = bounded(None, ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reduce_dtype != "fp32" and not self.mixed_precision:
            raise ValueError(f"reduce_dtype: {self.reduce_dtype} needs mixed_precision: true")
        if self.ep_size > 1:
            self._check_expert_parallel()
        if self.sharding == "no_shard" and self.fsdp_size not in (None, 1):
            raise ValueError(
                f"fsdp_size: {self.fsdp_size} shards over groups of ranks but sharding is no_shard "
                "(full replicas); drop one of them"
            )

    def _check_expert_parallel(self) -> None:
        """ep_size > 1 runs with full sharding of the dense parameters over all ranks only (then every
        gradient element lives on one rank, which the global-norm clipping counts on)."""
        others = {
            "fsdp_size": self.fsdp_size is not None,
            "sharding": self.sharding != "full_shard",
            "cpu_offload": self.cpu_offload,
        }
        clash = [key for key, on in others.items() if on]
        if clash:
            raise ValueError(
                f"ep_size: {self.ep_size} runs only with sharding: full_shard, fsdp_size: null and "
                f"cpu_offload: false; change {', '.join(clash)} or set ep_size: 1"
            )

    def expert_fsdp_size(self, world_size: int) -> int:
        """Ranks that FSDP-shard one expert slice: ``efsdp_size``, or world / ep_size."""
        return self.efsdp_size if self.efsdp_size is not None else max(world_size // self.ep_size, 1)

    def shard_size(self, world_size: int) -> int:
        """Ranks that share one copy of the parameters (1 = full replicas, world_size = one copy)."""
        if self.sharding == "no_shard":
            return 1
        return world_size if self.fsdp_size is None else self.fsdp_size

    def parallel_sizes(self, world_size: int) -> ParallelSizes:
        hsdp = self.fsdp_size if self.fsdp_size is not None and self.fsdp_size < world_size else None
        return ParallelSizes(
            dp=max(world_size // self.ulysses_size, 1), sp=self.ulysses_size, fsdp=hsdp, ep=self.ep_size
        )

    def validate(self, num_devices: int, path: str) -> None:
        if num_devices % self.ulysses_size:
            raise ConfigError(
                f"{path}.ulysses_size",
                f"{self.ulysses_size} does not divide the role's {num_devices} devices; change it or "
                "the device_mapping",
            )
        if self.fsdp_size is not None and num_devices % self.fsdp_size:
            raise ConfigError(
                f"{path}.fsdp_size",
                f"{self.fsdp_size} does not divide the role's {num_devices} devices into shard groups; "
                "change it (null shards over all of them) or the device_mapping",
            )
        if self.ep_size > 1 and num_devices % self.ep_size:
            raise ConfigError(
                f"{path}.ep_size",
                f"{self.ep_size} does not divide the role's {num_devices} devices into expert-parallel "
                "groups; change it or the device_mapping",
            )
        efsdp = self.expert_fsdp_size(num_devices)
        if self.ep_size > 1 and efsdp * self.ep_size != num_devices:
            raise ConfigError(
                f"{path}.efsdp_size",
                f"{efsdp} x ep_size {self.ep_size} must equal the role's {num_devices} devices (expert "
                "replicas, ROLL's eddp, are not supported); set it to null",
            )
        if self.ep_size == 1 and self.efsdp_size not in (None, num_devices):
            raise ConfigError(f"{path}.efsdp_size", f"{self.efsdp_size} needs ep_size > 1; set it to null")


RECOMPUTE_GRANULARITIES = (None, "full", "selective")
# The keys of megatron's other uneven pipeline split, which a pipeline_model_parallel_layout replaces.
_UNEVEN_SPLIT_KEYS = (
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)
RECOMPUTE_METHODS = (None, "uniform", "block")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")


@dataclass
class MegatronConfig(PackingOptions):
    """megatron-core options (names as in Megatron-LM's arguments)."""

    tensor_model_parallel_size: int = bounded(1, ge=1)
    pipeline_model_parallel_size: int = bounded(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = bounded(None, ge=1)
    context_parallel_size: int = bounded(1, ge=1)
    expert_model_parallel_size: int = bounded(1, ge=1)
    expert_tensor_parallel_size: int | None = bounded(None, ge=1)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # The optimizer step leaves other DP ranks' shards to the next forward's all-gather; weight
    # exports and checkpoints (megatron_train) finish that all-gather first.
    overlap_param_gather: bool = False
    recompute_granularity: str | None = one_of(None, *RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = one_of(None, *RECOMPUTE_METHODS)
    recompute_num_layers: int | None = bounded(None, ge=1)
    moe_token_dispatcher_type: str = one_of("allgather", *TOKEN_DISPATCHERS)
    moe_grouped_gemm: bool = False
    moe_layer_recompute: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = bounded(0.0, ge=0)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Uneven pipeline split: the first / last stage holds this many decoder layers, the other
    # stages share the rest evenly (megatron-core's TransformerConfig options of the same names).
    num_layers_in_first_pipeline_stage: int | None = bounded(None, ge=1)
    num_layers_in_last_pipeline_stage: int | None = bounded(None, ge=1)
    # Megatron's layout string: the layers of every pipeline stage (roll.configs.pipeline_layout,
    # e.g. "E|(tt|)*30,L": the embedding alone, 30 stages of 2 decoder layers, the loss alone). Its
    # stage count / PP is the virtual pipeline size, set here when virtual_pipeline_model_parallel_size
    # is null. Exclusive with the four uneven-split keys above.
    pipeline_model_parallel_layout: str | None = None
    # MoE: the routers' weights (and expert bias) get no gradient and no optimizer state.
    freeze_moe_router: bool = False
    # A directory written by `python -m roll.models.megatron.convert hf-to-mcore` for this model
    # and TP size: the weights load from its dist checkpoint (no HF safetensors are read; the
    # directory holds config.json and the tokenizer, so model_name_or_path may point at it too).
    mcore_checkpoint: str | None = None
    # The embedding/output vocab is padded to a multiple of this x TP (as Megatron-LM does); the
    # padding is dropped again on export to HF.
    make_vocab_size_divisible_by: int = bounded(128, ge=1)
    # Offload for colocated layouts (moved to CPU between training steps).
    offload_params: bool = False
    offload_grads: bool = True
    offload_optimizer: bool = True
    # Attention kernel for the plain-torch layer spec: "sdpa" or "local" (megatron-core's unfused one).
    attention_backend: str = one_of("sdpa", "sdpa", "local")
    # Attention over packed rows (roll.models.packed_attention): "auto" (varlen FlashAttention on CUDA,
    # else per-sequence SDPA), "varlen", "flex" or "sdpa".
    packing_attention: str = one_of("auto", table="roll.models.packed_attention:PACKED_ATTENTION_KINDS")
    # Passed through to megatron-core's TransformerConfig untouched (advanced use).
    transformer_config_kwargs: dict[str, Any] = field(default_factory=dict)

    devices_per_worker = 1

    def parallel_sizes(self, world_size: int) -> ParallelSizes:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        return ParallelSizes(
            tp=tp,
            pp=pp,
            cp=cp,
            ep=self.expert_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size or 1,
            dp=max(world_size // (tp * pp * cp), 1),
        )

    def validate(self, num_devices: int, path: str) -> None:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        model_parallel = tp * pp * cp
        if num_devices % model_parallel:
            raise ConfigError(
                f"{path}.tensor_model_parallel_size",
                f"TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel} does not divide the role's "
                f"{num_devices} devices; change the sizes or the device_mapping",
            )
        dp = num_devices // model_parallel
        etp = self.expert_tensor_parallel_size or tp
        ep = self.expert_model_parallel_size
        if (tp * cp * dp) % (etp * ep):
            raise ConfigError(
                f"{path}.expert_model_parallel_size",
                f"EP x expert-TP = {ep} x {etp} must divide TP x CP x DP = {tp} x {cp} x {dp} "
                f"(the devices of one pipeline stage)",
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1 and pp == 1:
            raise ConfigError(
                f"{path}.virtual_pipeline_model_parallel_size",
                "needs pipeline_model_parallel_size > 1",
            )
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if getattr(self, key) is not None and pp == 1:
                raise ConfigError(f"{path}.{key}", "needs pipeline_model_parallel_size > 1")
        if self.sequence_parallel and tp == 1:
            raise ConfigError(f"{path}.sequence_parallel", "needs tensor_model_parallel_size > 1")
        self._validate_recompute(path)
        if cp > 1 and (self.sequence_packing is False or self.attention_backend != "sdpa"):
            raise ConfigError(
                f"{path}.context_parallel_size",
                "context parallelism runs on packed rows: needs sequence_packing (true or null) and "
                "attention_backend: sdpa",
            )
        if self.sequence_packing and self.attention_backend != "sdpa":
            raise ConfigError(
                f"{path}.sequence_packing",
                "packed rows need attention_backend: sdpa (megatron's local attention cannot confine "
                "attention to each sequence)",
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(f"{path}.overlap_param_gather", "needs use_distributed_optimizer: true")

    def __post_init__(self) -> None:
        super().__post_init__()
        full = self.recompute_granularity == "full"
        if full and self.recompute_method is None and self.recompute_num_layers is None:
            # megatron-core asserts without both; ROLL (mcore_adapter) defaults to recomputing
            # every layer, i.e. uniform chunks of one layer. Parsed here, so every reader sees it.
            self.recompute_method, self.recompute_num_layers = "uniform", 1
        if self.pipeline_model_parallel_layout is not None:
            self._apply_pipeline_layout()

    def _apply_pipeline_layout(self) -> None:
        """Check the layout against the other pipeline keys and derive the virtual pipeline size
        from it, so every reader of virtual_pipeline_model_parallel_size (the schedules, the model
        chunks, the optimizer, checkpoints, the converter) sees the layout's."""
        key = "pipeline_model_parallel_layout"
        clash = [k for k in _UNEVEN_SPLIT_KEYS if getattr(self, k) not in (None, False)]
        if clash:
            raise ValueError(f"{key}: places every layer itself; remove {', '.join(clash)}")
        pp = self.pipeline_model_parallel_size
        if pp == 1:
            raise ValueError(f"{key}: needs pipeline_model_parallel_size > 1")
        try:
            layout = PipelineLayout.parse(self.pipeline_model_parallel_layout)
            vpp = layout.virtual_size(pp)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        if layout.mtp_layers:
            raise ValueError(
                f"{key}: roll builds no multi-token-prediction layers (it drops a checkpoint's mtp "
                "weights); remove the m stages"
            )
        given = self.virtual_pipeline_model_parallel_size
        if given is not None and given != vpp:
            raise ValueError(
                f"{key}: its {len(layout.stages)} stages over PP {pp} make virtual pipeline size {vpp}, "
                f"but virtual_pipeline_model_parallel_size is {given}; remove that key or make them agree"
            )
        self.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else given

    def pipeline_layout(self) -> PipelineLayout | None:
        """The parsed ``pipeline_model_parallel_layout`` (checked at load), or None."""
        text = self.pipeline_model_parallel_layout
        return None if text is None else PipelineLayout.parse(text)

    def pipeline_rank_layers(self, num_layers: int) -> list[list[int]]:
        """Decoder layers of each PP rank's virtual stages, ``[pp_rank][vp_stage]``, as megatron
        places them: by the layout, by the first/last stage sizes, or evenly (the embedding and the
        loss counted as layers where account_for_* says so). Assumes the split checks passed."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size or 1
        layout = self.pipeline_layout()
        if layout is not None:
            return layout.rank_layers(pp)
        first, last = self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage
        if pp > 1 and (first is not None or last is not None):
            middle = pp - (first is not None) - (last is not None)
            rest = num_layers - (first or 0) - (last or 0)
            per_rank = [rest // middle if middle else 0] * pp
            per_rank[0] = first if first is not None else per_rank[0]
            per_rank[-1] = last if last is not None else per_rank[-1]
            return [[n // vpp] * vpp for n in per_rank]
        embedding = int(self.account_for_embedding_in_pipeline_split)
        loss = int(self.account_for_loss_in_pipeline_split)
        chunk = (num_layers + embedding + loss) // (pp * vpp)
        layers = [[chunk] * vpp for _ in range(pp)]
        layers[0][0] -= embedding
        layers[-1][-1] -= loss
        return layers

    def _validate_recompute(self, path: str) -> None:
        """Full recompute needs a method and a layer count (megatron-core asserts at model build,
        on every rank); selective recompute takes neither."""
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                raise ConfigError(
                    f"{path}.recompute_method",
                    "recompute_granularity: full needs recompute_method: uniform (recompute every "
                    "recompute_num_layers-layer chunk) or block (recompute the first "
                    "recompute_num_layers layers of each stage)",
                )
            if self.recompute_num_layers is None:
                raise ConfigError(
                    f"{path}.recompute_num_layers",
                    "recompute_granularity: full needs recompute_num_layers (>= 1 layers per chunk)",
                )
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            key = "recompute_method" if self.recompute_method is not None else "recompute_num_layers"
            raise ConfigError(f"{path}.{key}", "only applies with recompute_granularity: full")


class _EngineTensorParallel:
    """Mixin for engines whose worker owns ``tensor_parallel_size`` devices."""

    tensor_parallel_size: int

    @property
    def devices_per_worker(self) -> int:
        return self.tensor_parallel_size

    def parallel_sizes(self, world_size: int) -> ParallelSizes:
        return ParallelSizes(tp=self.tensor_parallel_size, dp=max(world_size // self.tensor_parallel_size, 1))


# How a seeded vLLM ``generate`` seeds sampling (VLLMConfig.seed_mode).
VLLM_SEED_MODES = ("step", "request")
# Where a vLLM engine's GPU workers run (VLLMConfig.distributed_executor_backend).
VLLM_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class VLLMConfig(_EngineTensorParallel):
    """vLLM V1 engine options; a worker owns ``tensor_parallel_size`` devices."""

    gpu_memory_utilization: float = bounded(0.8, gt=0, le=1)
    block_size: int = bounded(16, ge=1)
    max_model_len: int | None = bounded(None, ge=1)
    tensor_parallel_size: int = bounded(1, ge=1)
    enable_prefix_caching: bool = True
    # 0: never sleep; 1: offload weights, drop KV cache; 2: drop both (weights come back by model update).
    sleep_level: int = bounded(1, ge=0, le=2)
    load_format: str = one_of("auto", "auto", "dummy", "safetensors", "pt")
    max_num_seqs: int | None = bounded(None, ge=1)
    max_num_batched_tokens: int | None = bounded(None, ge=1)
    enforce_eager: bool = False
    enable_chunked_prefill: bool | None = None
    # Start-up against decode speed (docs/strategies.md "Start-up"). ``torch_compile: false`` skips
    # vLLM's torch.compile/inductor pass and captures decode steps as full CUDA graphs instead
    # (prefill runs eager); true is vLLM's own default (compiled pieces, piecewise + full graphs).
    torch_compile: bool = False
    # Decode batch sizes captured as CUDA graphs (a batch runs in the next larger one); None: the
    # powers of two up to 512. vLLM's own default captures about 50 sizes, most of its graph time.
    cuda_graph_sizes: list[int] | None = bounded(None, ge=1)
    # The KV cache's size in GiB per engine (vLLM's ``kv_cache_memory_bytes``) instead of what
    # ``gpu_memory_utilization`` leaves after profiling: the engine then sizes nothing from free
    # memory and initializes beside the roles that share its devices (roll.pipeline.rlvr.start),
    # and a smaller cache is less to drop and map again at every sleep and wake.
    kv_cache_memory_gb: float | None = bounded(None, gt=0)
    # How a seeded ``generate`` seeds vLLM's sampling. ``step``: the call's seed goes into every TP
    # worker's torch generator and the requests carry none, so vLLM samples the whole batch in one
    # pass. ``request``: each request carries its own seed (reproducible per sample whatever the
    # batch), and vLLM samples seeded requests one at a time (docs/strategies.md "Sampling seeds").
    seed_mode: str = one_of("step", *VLLM_SEED_MODES)
    # Where the engine's GPU workers run. ``mp``: processes vLLM spawns beside the worker, on the
    # worker's node (in-process for TP 1). ``ray``: vLLM's Ray executor, one Ray actor per device in
    # the engine's placement group, so an engine may span nodes (devices filling whole nodes);
    # the worker holds the engine core and no GPU of its own (docs/strategies.md "Engines across nodes").
    distributed_executor_backend: str = one_of("mp", *VLLM_EXECUTOR_BACKENDS)
    # Any further vLLM EngineArgs, checked against the installed vLLM when the engine starts.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def workers_on_ray(self) -> bool:
        """Whether the engine's GPU workers are Ray actors in the worker's placement group, which
        lets one engine span nodes (roll.distributed.scheduler.placement)."""
        return self.distributed_executor_backend == "ray"

    def drops_weights_on_offload(self) -> bool:
        """Whether actor_infer's weights are gone after ``offload_states`` (the next model update
        refills them): sleep level 2 discards them, level 1 keeps a CPU copy."""
        return self.sleep_level == 2

    def sizes_from_free_memory(self) -> bool:
        """Whether the engine sizes its KV cache from the memory free when it starts (vLLM's
        profile of ``gpu_memory_utilization``), so it must start alone on shared devices; not when
        ``kv_cache_memory_gb`` gives the size."""
        return self.kv_cache_memory_gb is None

    def validate(self, num_devices: int, path: str) -> None:
        _check_engine_tp(self.tensor_parallel_size, num_devices, f"{path}.tensor_parallel_size")
        if self.cuda_graph_sizes == []:
            raise ConfigError(
                f"{path}.cuda_graph_sizes", "is empty: list batch sizes, or null for the default"
            )


SGLANG_UPDATE_TRANSPORTS = ("auto", "tensor", "distributed")


@dataclass
class SGLangConfig(_EngineTensorParallel):
    """SGLang Engine options; a worker owns ``tensor_parallel_size`` devices."""

    mem_fraction_static: float = bounded(0.8, gt=0, le=1)
    tensor_parallel_size: int = bounded(1, ge=1)
    context_length: int | None = bounded(None, ge=1)
    enable_memory_saver: bool = True
    load_format: str = "auto"
    max_running_requests: int | None = bounded(None, ge=1)
    disable_radix_cache: bool = False
    # Kernels: triton attention and the pytorch sampler run from a plain SGLang wheel; "fa3" and
    # "flashinfer" need SGLang's FlashAttention-3 build / FlashInfer installed (docs/strategies.md).
    attention_backend: str = "triton"
    sampling_backend: str = "pytorch"
    disable_cuda_graph: bool = False
    # SGLang honours a request's sampling seed only with deterministic inference (batch-invariant
    # kernels, slower); without it the engine seed (seed + worker rank) alone sets the samples.
    enable_deterministic_inference: bool = False
    # How a model update reaches this engine from a trainer rank on another device: "distributed"
    # (SGLang's schedulers receive each bucket on their own NCCL group), "tensor" (this worker
    # receives it, then Engine.update_weights_from_tensor by CUDA IPC). "auto": distributed, except
    # from a trainer rank on the engine's own device, which always takes "tensor" (CUDA IPC);
    # "distributed" next to actor_train is refused before launch (docs/strategies.md).
    model_update_transport: str = one_of("auto", *SGLANG_UPDATE_TRANSPORTS)
    # Any further SGLang ServerArgs, checked against the installed SGLang when the engine starts.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def drops_weights_on_offload(self) -> bool:
        """Whether actor_infer's weights are gone after ``offload_states``: with the memory saver
        actor_infer releases them, and SGLang keeps no copy (the next model update refills them)."""
        return self.enable_memory_saver

    def sizes_from_free_memory(self) -> bool:
        """SGLang always sizes its memory from what is free at start (``mem_fraction_static``)."""
        return True

    def validate(self, num_devices: int, path: str) -> None:
        _check_engine_tp(self.tensor_parallel_size, num_devices, f"{path}.tensor_parallel_size")


def _check_engine_tp(tp: int, num_devices: int, path: str) -> None:
    if num_devices % tp:
        raise ConfigError(path, f"{tp} does not divide the role's {num_devices} devices")
