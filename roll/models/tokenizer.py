"""``load_tokenizer``: a model directory's tokenizer, padded on the left.

Its own module because the driver needs the tokenizer and nothing of the modelling code:
``roll.models.loading`` imports transformers' ``modeling_utils``, which brings in scipy and
torch._dynamo (about 3 CPU seconds), while ``AutoTokenizer`` alone does not.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from roll.configs.errors import ConfigError


def load_tokenizer(path: str | None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``path``, left-padding (prompts are left-padded), with a pad token
    (the EOS token when the tokenizer has none)."""
    if not path or not Path(path).is_dir():
        raise ConfigError("model_args.model_name_or_path", f"tokenizer directory {path!r} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            "model_args.model_name_or_path", f"cannot load a tokenizer from {path!r}: {exc}"
        ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(
                "model_args.model_name_or_path",
                f"the tokenizer in {path!r} has neither a pad nor an EOS token",
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer
