"""IFEval-style instruction-following reward: verifiable checks on the response's text.

    truth = '{"instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],'
            ' "kwargs": [{}, {}]}'
    ifeval_reward("all lower case and no commas", truth)        # 1.0

``ground_truth`` is JSON in IFEval's row format: ``instruction_id_list`` and one ``kwargs`` dict per
instruction. ``reward_type`` "soft" scores the fraction of instructions followed, "hard" 1.0 only
when all are. The checks follow the IFEval paper's definitions (Zhou et al., 2023); an instruction
id not in CHECKS raises, so the sample is counted as an error rather than silently passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_RELATIONS = {"less than": lambda n, k: n < k, "at least": lambda n, k: n >= k}


def _words(text: str) -> int:
    return len(re.findall(r"\b\w+\b", text))


def _count(relation: str, n: int, k: int) -> bool:
    if relation not in _RELATIONS:
        raise ValueError(f"relation: expected one of {list(_RELATIONS)}, got {relation!r}")
    return _RELATIONS[relation](n, k)


def _keywords_exist(text: str, keywords: list[str]) -> bool:
    return all(re.search(re.escape(k), text, re.IGNORECASE) for k in keywords)


def _forbidden(text: str, forbidden_words: list[str]) -> bool:
    return not any(re.search(rf"\b{re.escape(w)}\b", text, re.IGNORECASE) for w in forbidden_words)


def _bullets(text: str, num_bullets: int) -> bool:
    return len(re.findall(r"^\s*[*-]\s", text, re.MULTILINE)) == num_bullets


def _paragraphs(text: str, num_paragraphs: int) -> bool:
    parts = re.split(r"\s?\*\*\*\s?", text)
    return len(parts) == num_paragraphs and all(p.strip() for p in parts)


CHECKS: dict[str, Callable[..., bool]] = {
    "punctuation:no_comma": lambda t: "," not in t,
    "change_case:english_lowercase": lambda t: t == t.lower(),
    "change_case:english_capital": lambda t: t == t.upper(),
    "length_constraints:number_words": lambda t, relation, num_words: _count(relation, _words(t), num_words),
    "length_constraints:number_paragraphs": _paragraphs,
    "keywords:existence": _keywords_exist,
    "keywords:forbidden_words": _forbidden,
    "detectable_format:number_bullet_lists": _bullets,
    "detectable_format:title": lambda t: re.search(r"<<[^\n]+>>", t) is not None,
    "startend:end_checker": lambda t, end_phrase: t.strip().lower().endswith(end_phrase.strip().lower()),
    "startend:quotation": lambda t: len(t.strip()) > 1 and t.strip()[0] == t.strip()[-1] == '"',
    "detectable_content:postscript": lambda t, postscript_marker: postscript_marker in t,
}


def followed(response: str, instruction_ids: list[str], kwargs: list[dict]) -> list[bool]:
    out = []
    for ident, args in zip(instruction_ids, kwargs, strict=True):
        if ident not in CHECKS:
            raise ValueError(f"unknown instruction {ident!r}; known: {', '.join(sorted(CHECKS))}")
        out.append(bool(CHECKS[ident](response, **{k: v for k, v in (args or {}).items() if v is not None})))
    return out


def ifeval_reward(response: str, ground_truth: str, *, reward_type: str = "soft") -> float:
    if reward_type not in ("soft", "hard"):
        raise ValueError(f"reward_type: expected 'soft' or 'hard', got {reward_type!r}")
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    ids = truth["instruction_id_list"]
    results = followed(response, ids, truth.get("kwargs") or [{}] * len(ids))
    if reward_type == "hard":
        return float(all(results))
    return sum(results) / len(results) if results else 0.0
