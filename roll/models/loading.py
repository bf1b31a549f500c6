"""Load Hugging Face models and tokenizers from a role's ``ModelArgs``.

>>> model = load_model(role.model_args, training=True)          # AutoModelForCausalLM or ValueModel
>>> tokenizer = load_tokenizer(role.model_args.model_name_or_path)

``model_name_or_path`` is a local Hugging Face directory (config.json + safetensors). Every
strategy that runs HF modules (``hf_infer``, ``fsdp2_train``) loads through here, so dtype names,
attention kernels and activation checkpointing mean the same thing everywhere.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from roll.configs.errors import ConfigError
from roll.configs.role import ModelArgs
from roll.models.model_dir import check_model_dir
from roll.models.model_options import ATTN_IMPLEMENTATIONS, DTYPES
from roll.models.value_model import ValueModel
from roll.models.vision import is_vision_model_dir


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (names as in ``ModelArgs.dtype``)."""
    if name not in DTYPES:
        raise ConfigError("model_args.dtype", f"expected one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_attn_implementation(model_args: ModelArgs) -> str:
    """``attn_implementation`` if set, else ROLL's ``flash_attn`` ("fa2" -> flash_attention_2), else sdpa."""
    for key in ("attn_implementation", "flash_attn"):
        value = getattr(model_args, key)
        if value is None:
            continue
        if value not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"model_args.{key}", f"expected one of {sorted(ATTN_IMPLEMENTATIONS)}, got {value!r}"
            )
        return ATTN_IMPLEMENTATIONS[value]
    return "sdpa"


def model_path(model_args: ModelArgs) -> str:
    """The checked ``model_name_or_path``: a directory with a config.json."""
    return check_model_dir(model_args.model_name_or_path)


def load_model(
    model_args: ModelArgs, dtype: torch.dtype | None = None, training: bool = False, seed: int = 42
) -> nn.Module:
    """A causal LM (``AutoModelForCausalLM``; a vision-language model's directory:
    ``AutoModelForImageTextToText``) or, for ``model_type`` "value"/"trl", a ``ValueModel``.

    ``dtype`` overrides ``model_args.dtype`` (FSDP2 keeps fp32 master weights under mixed
    precision). With ``training`` the model gets activation checkpointing unless
    ``disable_gradient_checkpointing``; ``seed`` initialises a new value head. The model is on CPU.
    """
    path = model_path(model_args)
    kwargs = {
        "dtype": dtype or torch_dtype(model_args.dtype),
        "attn_implementation": resolve_attn_implementation(model_args),
        "trust_remote_code": model_args.trust_remote_code,
    }
    try:
        if model_args.is_value_model:
            model: nn.Module = ValueModel.from_pretrained(path, seed=seed, **kwargs)
        elif is_vision_model_dir(path):  # Qwen2.5-VL: roll.models.vision
            from transformers import AutoModelForImageTextToText

            from roll.models.qwen_rope_rule import use_qwen_rope_rule

            use_qwen_rope_rule()  # Qwen2.5-VL's positions as its checkpoints and the engines lay them
            model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "model_args.model_name_or_path", f"cannot load a model from {path!r}: {exc}"
        ) from exc
    if training and not model_args.disable_gradient_checkpointing:
        enable_activation_checkpointing(model.model if isinstance(model, ValueModel) else model)
    return model


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (works under FSDP2).

    transformers 5.23 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``;
    5.17 (the GPU machine) only has the old name.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def decoder_layer_classes(model: nn.Module) -> set[str]:
    """Class names of the repeated decoder layers, as the HF models declare them (``_no_split_modules``)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder-layer modules of ``model`` in order (the units FSDP2 shards one by one)."""
    classes = decoder_layer_classes(model)
    return [m for m in model.modules() if type(m).__name__ in classes]
