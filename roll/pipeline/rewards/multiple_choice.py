"""Multiple-choice reward (CrossThinkQA style): the chosen letter against the ground-truth letter.

    multiple_choice_reward("... so the answer is \\\\boxed{B}", "B")                 # 1.0
    multiple_choice_reward("The answer is B", "B", reward_type="soft")             # 0.5 (not boxed)

The chosen option is the first capital letter in the last ``\\boxed{...}``; without a box, the first
capital letter after the last "answer is" (case-insensitive), else none. ``reward_type`` follows
alibaba/ROLL's table of (correct, boxed) -> reward:

    correct, boxed      1.0   1.0   1.0
    correct, not boxed  1.0   0.5  -1.0
    wrong,   boxed     -1.0  -0.5  -1.0
    wrong,   not boxed -1.0  -1.0  -1.0
                       loose soft  strict
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\boxed\{([^{}]*)\}")
REWARDS = {
    "loose": {(True, True): 1.0, (True, False): 1.0, (False, True): -1.0, (False, False): -1.0},
    "soft": {(True, True): 1.0, (True, False): 0.5, (False, True): -0.5, (False, False): -1.0},
    "strict": {(True, True): 1.0, (True, False): -1.0, (False, True): -1.0, (False, False): -1.0},
}


def chosen_option(response: str) -> tuple[str | None, bool]:
    """(the chosen letter or None, whether it came from a box)."""
    boxes = _BOX.findall(response)
    if boxes:
        text, boxed = boxes[-1], True
    else:
        at = response.lower().rfind("answer is")
        text, boxed = ("" if at < 0 else response[at + len("answer is") :]), False
    letter = next((c for c in text if c.isupper()), None)
    return letter, boxed


def multiple_choice_reward(response: str, ground_truth: str, *, reward_type: str = "soft") -> float:
    if reward_type not in REWARDS:
        raise ValueError(f"reward_type: expected one of {list(REWARDS)}, got {reward_type!r}")
    letter, boxed = chosen_option(response)
    correct = letter is not None and letter == ground_truth.strip()[:1]
    return REWARDS[reward_type][(correct, boxed)]
