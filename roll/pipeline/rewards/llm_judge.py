"""``llm_judge``: a model reward that asks a judge model whether a response is right.

A reward role with ``reward_fn: llm_judge`` runs its own inference strategy (``hf_infer``,
``vllm`` or ``sglang``) on its own devices; ``RewardWorker.compute_rewards`` calls
``llm_judge_reward(strategy, batch, role_config)`` with the rows routed to it (fields
``prompt_text``, ``response_text``, ``ground_truth``). For each row the judge prompt is built from
the role's ``judge_prompt`` template (``{question}``, ``{response}``, ``{reference}``; the
default below when unset), wrapped in the judge tokenizer's chat template when it has one,
generated greedily, and the verdict parsed into a score in [0, 1]:

* ``[[yes]]`` / ``[[no]]`` (also correct/incorrect, true/false) -> 1 / 0;
* ``[[7]]`` -> 7 / ``score_scale`` (10 by default), clipped to [0, 1];
* without brackets, a last ``7/10`` fraction, or a leading yes/no word;
* anything else -> ``unparsed_score`` (0 by default).

``reward_kwargs`` may set ``score_scale``, ``unparsed_score``, ``max_prompt_tokens`` (4096; the
response is cut to fit) and ``use_chat_template`` (true). The judge's ``generating_args`` give
``max_new_tokens`` and ``stop_strings``; sampling is always greedy.

    rewards:
      judge:
        reward_fn: llm_judge
        judge_prompt: "Question: {question}\\nAnswer: {response}\\nReference: {reference}\\nCorrect? [[yes]] or [[no]]"
        model_args: {model_name_or_path: /models/judge}
        strategy_args: {strategy_name: vllm, strategy_config: {gpu_memory_utilization: 0.5}}
        device_mapping: "6-7"
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams

DEFAULT_JUDGE_PROMPT = (
    "You are grading an answer against a reference answer.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\n"
    "Is the answer to grade correct, i.e. does it agree with the reference answer? "
    "Reply with [[yes]] or [[no]]."
)
PLACEHOLDERS = ("question", "response", "reference")
JUDGE_KWARGS = {
    "score_scale": 10.0,
    "unparsed_score": 0.0,
    "max_prompt_tokens": 4096,
    "use_chat_template": True,
}

_BRACKETED = re.compile(r"\[\[\s*([^\[\]]+?)\s*\]\]")
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)")
_WORDS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "no": 0.0, "incorrect": 0.0, "false": 0.0, "wrong": 0.0}


@dataclass(frozen=True)
class Verdict:
    """One judged row: the judge's text, the score used, and whether the text could be parsed."""

    text: str
    score: float
    parsed: bool


def check_judge_prompt(template: str, path: str = "judge_prompt") -> None:
    """Every ``{field}`` of the template must be question, response or reference."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ConfigError(
            path, f"is not a valid template ({exc}); write literal braces as {{{{ and }}}}"
        ) from exc
    unknown = [f for f in fields if f not in PLACEHOLDERS]
    if unknown:
        raise ConfigError(
            path, f"unknown placeholder {{{unknown[0]}}}; use {{question}}, {{response}} and {{reference}}"
        )


def build_judge_prompt(template: str, question: str, response: str, reference: str) -> str:
    return template.format(question=question, response=response, reference=reference)


def parse_judge_score(text: str, score_scale: float = 10.0) -> float | None:
    """The verdict in ``text`` as a score in [0, 1], or None when there is none (see module doc)."""
    bracketed = _BRACKETED.findall(text)
    if bracketed:
        return _score_token(bracketed[-1], score_scale)
    fractions = _FRACTION.findall(text)
    if fractions:
        num, den = (float(x) for x in fractions[-1])
        return _clip(num / den) if den > 0 else None
    words = re.findall(r"[a-z]+", text.lower())
    return _WORDS.get(words[0]) if words else None


def _score_token(token: str, score_scale: float) -> float | None:
    token = token.strip().lower()
    if token in _WORDS:
        return _WORDS[token]
    fraction = _FRACTION.fullmatch(token)
    if fraction:
        num, den = float(fraction.group(1)), float(fraction.group(2))
        return _clip(num / den) if den > 0 else None
    try:
        return _clip(float(token) / score_scale)
    except ValueError:
        return None


def _clip(value: float) -> float:
    return min(1.0, max(0.0, value))


def judge_options(reward_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``reward_kwargs`` over the defaults; unknown keys are errors."""
    for key in reward_kwargs:
        if key not in JUDGE_KWARGS:
            raise ConfigError(f"reward_kwargs.{key}", f"llm_judge takes {sorted(JUDGE_KWARGS)}")
    return {**JUDGE_KWARGS, **reward_kwargs}


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(path: str, trust_remote_code: bool):
    from roll.models.tokenizer import load_tokenizer

    return load_tokenizer(path, trust_remote_code)


def judge_tokenizer(strategy: Any, role_config: Any):
    """The strategy's tokenizer when it has one (hf_infer), else the judge checkpoint's."""
    tokenizer = getattr(strategy, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    margs = role_config.model_args
    return _cached_tokenizer(margs.model_name_or_path, margs.trust_remote_code)


def encode_judge_prompt(
    tokenizer, template: str, question: str, response: str, reference: str, budget: int, chat: bool
) -> list[int]:
    """Token ids of one judge prompt, at most ``budget`` of them: the response is cut to fit."""

    def encode(resp: str) -> list[int]:
        text = build_judge_prompt(template, question, resp, reference)
        if chat and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            return list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = encode(response)
    if len(ids) > budget:
        keep = budget - len(encode("")) - 8  # room for the "..." marker and merges at the cut
        resp_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        ids = encode(tokenizer.decode(resp_ids[: max(keep, 0)]) + " ...")
    return ids[-budget:]


def left_padded(rows: Sequence[list[int]], pad_token_id: int) -> Batch:
    """A prompt Batch (``prompts``/``prompt_mask``) left-padded to the longest row."""
    width = max((len(r) for r in rows), default=1) or 1
    prompts = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            prompts[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask})


def judge(
    strategy: Any,
    tokenizer,
    questions: Sequence[str],
    responses: Sequence[str],
    references: Sequence[str],
    template: str | None = None,
    params: SamplingParams | None = None,
    **options: Any,
) -> list[Verdict]:
    """Judge every (question, response, reference) with one greedy ``strategy.generate`` call."""
    opts = judge_options(options)
    template = template or DEFAULT_JUDGE_PROMPT
    check_judge_prompt(template)
    if not len(questions) == len(responses) == len(references):
        raise ValueError(
            f"{len(questions)} questions, {len(responses)} responses, {len(references)} references"
        )
    if not questions:
        return []
    budget, chat = int(opts["max_prompt_tokens"]), bool(opts["use_chat_template"])
    rows = [
        encode_judge_prompt(tokenizer, template, q, r, g, budget, chat)
        for q, r, g in zip(questions, responses, references)
    ]
    params = params or SamplingParams(max_new_tokens=64)
    params = SamplingParams(**{**vars(params), "n": 1, "temperature": 0.0, "logprobs": False, "seed": None})
    out = strategy.generate(left_padded(rows, tokenizer.pad_token_id), params)
    texts = tokenizer.batch_decode(
        [row[mask.bool()].tolist() for row, mask in zip(out["responses"], out["response_mask"])],
        skip_special_tokens=True,
    )
    verdicts = []
    for text in texts:
        score = parse_judge_score(text, float(opts["score_scale"]))
        verdicts.append(
            Verdict(text, float(opts["unparsed_score"]) if score is None else score, score is not None)
        )
    return verdicts


def llm_judge_reward(strategy: Any, batch: Batch, role_config: Any) -> list[float]:
    """Scores for ``batch`` (``prompt_text``, ``response_text``, ``ground_truth``); the entry point
    ``RewardWorker`` calls for a reward role whose ``reward_fn`` is ``llm_judge``."""
    gen = role_config.generating_args
    params = SamplingParams(
        max_new_tokens=gen.max_new_tokens, stop=list(gen.stop_strings) if gen.stop_strings else None
    )
    verdicts = judge(
        strategy,
        judge_tokenizer(strategy, role_config),
        [str(q) for q in batch["prompt_text"]],
        [str(r) for r in batch["response_text"]],
        [str(g) for g in batch["ground_truth"]],
        template=role_config.judge_prompt,
        params=params,
        **role_config.reward_kwargs,
    )
    return [v.score for v in verdicts]
