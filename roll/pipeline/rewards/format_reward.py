"""Format reward: 1.0 when a response is shaped the way the task asks, whatever its answer.

    format_reward("37 + 48 = 85. \\\\boxed{85}", "85")                         # 1.0
    format_reward("\\\\boxed{85} and more text", "85")                           # 0.0
    format_reward("<think>..</think> 42", "", pattern=r"<think>.*</think>.+")   # 1.0

By default a response passes when it holds exactly one ``\\boxed{...}`` (balanced braces) and
nothing follows it except whitespace and end-of-sequence markers. With ``pattern``, it passes when
the whole response (end markers and surrounding whitespace removed) matches the regular expression
(``re.fullmatch`` with DOTALL).
"""

from __future__ import annotations

import re

from roll.pipeline.rewards.math_rule import last_boxed

END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def strip_end_markers(response: str) -> str:
    """The response without surrounding whitespace and trailing end-of-sequence markers."""
    text = response.strip()
    while text.endswith(END_MARKERS):
        marker = next(m for m in END_MARKERS if text.endswith(m))
        text = text[: -len(marker)].rstrip()
    return text


def format_reward(response: str, ground_truth: str, *, pattern: str | None = None) -> float:
    """1.0 when ``response`` has the expected format (see the module docstring), else 0.0."""
    text = strip_end_markers(response)
    if pattern is not None:
        return 1.0 if re.fullmatch(pattern, text, re.DOTALL) else 0.0
    if text.count("\\boxed{") != 1:
        return 0.0
    content = last_boxed(text)
    if content is None:
        return 0.0
    end = text.rindex("\\boxed{") + len("\\boxed{") + len(content) + 1
    return 1.0 if not text[end:].strip() and content.strip() else 0.0
