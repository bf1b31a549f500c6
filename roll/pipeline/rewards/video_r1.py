"""Video-R1 reward: an answer scored by its question type, plus a format score.

    video_r1_reward("<think>...</think><answer>B</answer>", "<answer>B</answer>",
                    context={"problem_type": "multiple choice"})                       # 2.0

The scoring follows alibaba/ROLL's ``VideoR1RewardWorker`` (itself after tulerfeng/Video-R1's
``grpo.py``); roll's own code. The answers compared are the text inside the first
``<answer>...</answer>`` of the response and of the ground truth (the whole text when there is none):

| question type | accuracy |
|---|---|
| ``multiple choice`` | 1.0 when the first characters agree (inside the last ``\\boxed{...}`` if any; outer spaces and dots stripped) |
| ``numerical`` | 1.0 when both or neither hold a ``.`` or ``,`` and the numbers (commas dropped) agree to 2 decimals |
| ``OCR`` | ``1 - WER`` (word edit distance / reference words), clipped to [0, 1] |
| ``free-form`` | the mean of ROUGE-1, ROUGE-2 and ROUGE-L F-measures, clipped to [0, 1] |
| ``regression`` | ``1 - min(1, |out - gt| / |gt|)`` (1e-9 added to both) |
| anything else | 0.0 |

Format: 1.0 when the whole response is ``<think>...</think>`` then ``<answer>...</answer>`` (spaces
between allowed). The reward is accuracy + format (0 to 2), as ROLL's ``overall``.

The question type is the row's ``problem_type`` (``context``, put there by the data loader from a
Video-R1 row), else the ``question_type`` option. Differences from ROLL: ROUGE tokenizes as
``rouge_score`` does (lower case, runs of letters and digits) but without its Porter stemmer (roll
adds no dependency for it), so inflected words that ROLL would match count as different here; a
regression answer that is not a number scores 0 (ROLL raises).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

QUESTION_TYPES = ("multiple choice", "numerical", "OCR", "free-form", "regression")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed{(.*?)}")
_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_WORD = re.compile(r"[a-z0-9]+")


def answer_text(text: str) -> str:
    """The stripped text of the first ``<answer>`` block; the text itself when it has none."""
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else text


def boxed_text(text: str) -> str:
    """The content of the last ``\\boxed{...}``; the text itself when it has none."""
    boxes = _BOXED.findall(text)
    return boxes[-1] if boxes else text


def to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance (substitutions, insertions, deletions) over the reference's words."""
    ref, hyp = reference.split(), hypothesis.split()
    previous = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, 1):
        current = [i]
        for j, hyp_word in enumerate(hyp, 1):
            cost = (
                previous[j - 1]
                if ref_word == hyp_word
                else 1 + min(previous[j], current[j - 1], previous[j - 1])
            )
            current.append(cost)
        previous = current
    return previous[-1] / max(1, len(ref))


def _f_measure(overlap: int, reference: int, hypothesis: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / hypothesis, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _lcs(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, 1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_f(reference: str, hypothesis: str) -> float:
    """Mean of the ROUGE-1, ROUGE-2 and ROUGE-L F-measures (tokens: lower-cased letter/digit runs)."""
    ref, hyp = _WORD.findall(reference.lower()), _WORD.findall(hypothesis.lower())
    scores = []
    for n in (1, 2):
        r, h = _ngrams(ref, n), _ngrams(hyp, n)
        scores.append(_f_measure(sum((r & h).values()), sum(r.values()), sum(h.values())))
    scores.append(_f_measure(_lcs(ref, hyp), len(ref), len(hyp)))
    return sum(scores) / 3


def _numerical(gt: str, out: str) -> float:
    if any(c in gt for c in ".,") != any(c in out for c in ".,"):
        return 0.0
    gt_number, out_number = to_number(gt), to_number(out)
    if gt_number is None or out_number is None:
        return 0.0
    return 1.0 if round(gt_number, 2) == round(out_number, 2) else 0.0


def _regression(gt: str, out: str) -> float:
    gt_number, out_number = to_number(gt), to_number(out)
    if gt_number is None or out_number is None:
        return 0.0
    relative = (abs(out_number - gt_number) + 1e-9) / (abs(gt_number) + 1e-9)
    return 1.0 - min(1.0, max(0.0, relative))


def accuracy(response: str, ground_truth: str, question_type: str) -> float:
    """The accuracy score of ``response`` for a question of ``question_type`` (table above)."""
    out, gt = answer_text(response), answer_text(ground_truth)
    if question_type == "multiple choice":
        out, gt = boxed_text(out), boxed_text(gt)
        return 1.0 if out.strip().strip(".")[:1] == gt.strip().strip(".")[:1] else 0.0
    if question_type == "numerical":
        return _numerical(gt, out)
    if question_type == "OCR":
        return max(0.0, min(1.0, 1.0 - word_error_rate(gt, out)))
    if question_type == "free-form":
        return max(0.0, min(1.0, rouge_f(gt, out)))
    if question_type == "regression":
        return _regression(gt, out)
    return 0.0


def format_score(response: str) -> float:
    """1.0 when the whole response is ``<think>...</think>`` then ``<answer>...</answer>``."""
    return 1.0 if _FORMAT.fullmatch(response) else 0.0


def video_r1_reward(
    response: str,
    ground_truth: str,
    *,
    question_type: str | None = None,
    context: dict[str, Any] | None = None,
) -> float:
    """Accuracy by question type plus format (see the module docstring); ``context``: the row's
    ``reward_context`` (its ``problem_type`` wins over ``question_type``)."""
    kind = (context or {}).get("problem_type") or question_type
    if kind is None:
        raise ValueError(
            "video_r1 needs a question type: a row's problem_type or reward_kwargs.question_type "
            f"(one of {', '.join(QUESTION_TYPES)})"
        )
    return accuracy(response, ground_truth, kind) + format_score(response)
