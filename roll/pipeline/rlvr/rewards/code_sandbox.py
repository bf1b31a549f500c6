"""Code reward: run the response's program against the row's test cases in the sandbox.

    code_sandbox_reward("```python\\nprint(int(input()) * 2)\\n```",
                        '[{"input": "3", "output": "6"}, {"input": "5", "output": "10"}]')   # 1.0

The program is the last fenced code block of the response (```python or ```), else the whole
response. ``ground_truth`` is JSON, either a list of ``{"input": ..., "output": ...}`` stdin/stdout
cases (outputs compared after stripping trailing whitespace per line) or ``{"test_code": "..."}``,
assertions appended to the program (a case passes when the program exits 0).

``reward_type``: "soft" scores the fraction of cases passed, "hard" 1.0 only when all pass. Each
case runs under ``time_limit_s`` and ``memory_mb`` (see ``roll.pipeline.rlvr.rewards.sandbox``);
give the reward role a ``timeout_s`` above cases x time_limit_s.
"""

from __future__ import annotations

import json
import re

from roll.pipeline.rlvr.rewards.sandbox import run_sandboxed

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _same_output(got: str, want: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(want)


def _case_results(code: str, truth: object, time_limit_s: float, memory_mb: int) -> list[bool]:
    if isinstance(truth, dict) and "test_code" in truth:
        program = f"{code}\n\n{truth['test_code']}\n"
        return [run_sandboxed(program, "", time_limit_s, memory_mb).ok]
    if not isinstance(truth, list) or not truth:
        raise ValueError("ground_truth must be a JSON list of {input, output} cases or {test_code}")
    results = []
    for case in truth:
        run = run_sandboxed(code, str(case.get("input", "")), time_limit_s, memory_mb)
        results.append(run.ok and _same_output(run.stdout, str(case["output"])))
    return results


def code_sandbox_reward(
    response: str,
    ground_truth: str,
    *,
    reward_type: str = "soft",
    time_limit_s: float = 2.0,
    memory_mb: int = 512,
) -> float:
    if reward_type not in ("soft", "hard"):
        raise ValueError(f"reward_type: expected 'soft' or 'hard', got {reward_type!r}")
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    results = _case_results(extract_code(response), truth, time_limit_s, memory_mb)
    if reward_type == "hard":
        return float(all(results))
    return sum(results) / len(results)
