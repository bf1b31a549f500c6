"""Engine-neutral sampling parameters; each inference strategy maps them to its engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: bool = True
    seed: int | None = None
    # Generate past EOS (benchmarks that need every response at full length); stop ids still apply.
    ignore_eos: bool = False
