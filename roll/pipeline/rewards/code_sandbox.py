"""Code reward: run the response's program against the row's test cases in the sandbox.

    code_sandbox_reward("```python\\nprint(int(input()) * 2)\\n```",
                        '[{"input": "3", "output": "6"}, {"input": "5", "output": "10"}]')   # 1.0

The program is the last fenced code block of the response (```python or ```), else the whole
response. ``ground_truth`` is JSON, either a list of ``{"input": ..., "output": ...}`` stdin/stdout
cases (outputs compared after stripping trailing whitespace per line) or ``{"test_code": "..."}``,
assertions appended to the program (a case passes when the program exits 0).

``reward_type``: "soft" scores the fraction of cases passed, "hard" 1.0 only when all pass. Each
case runs under ``time_limit_s`` and ``memory_mb`` (see ``roll.pipeline.rewards.sandbox``);
give the reward role a ``timeout_s`` above cases x time_limit_s / concurrency.

``sandbox`` picks where programs run (``roll.pipeline.rewards.sandbox_config``): bubblewrap
namespaces on this machine (default), a SandboxFusion service, or ``unsafe_local`` (no isolation,
by explicit choice only). ``sandbox.concurrency`` test cases of one response run at once.
``check_code_sandbox_kwargs`` runs before launch: a machine that cannot make the bubblewrap
sandbox stops the run there, with one line saying what is missing.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roll.configs.errors import ConfigError
from roll.pipeline.rewards.sandbox import Limits, Sandbox, SandboxResult, backend_class, get_sandbox
from roll.pipeline.rewards.sandbox_config import SandboxConfig, parse_sandbox_config

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _same_output(got: str, want: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(got) == lines(want)


def _case_results(code: str, truth: object, sandbox: Sandbox, limits: Limits, concurrency: int) -> list[bool]:
    if isinstance(truth, dict) and "test_code" in truth:
        program = f"{code}\n\n{truth['test_code']}\n"
        return [sandbox.run(program, "", limits).ok]
    if not isinstance(truth, list) or not truth:
        raise ValueError("ground_truth must be a JSON list of {input, output} cases or {test_code}")

    def run(case: dict[str, Any]) -> SandboxResult:
        return sandbox.run(code, str(case.get("input", "")), limits)

    if concurrency > 1 and len(truth) > 1:
        with ThreadPoolExecutor(min(concurrency, len(truth))) as pool:
            runs = list(pool.map(run, truth))
    else:
        runs = [run(case) for case in truth]
    return [r.ok and _same_output(r.stdout, str(case["output"])) for r, case in zip(runs, truth, strict=True)]


def code_sandbox_reward(
    response: str,
    ground_truth: str,
    *,
    reward_type: str = "soft",
    time_limit_s: float = 2.0,
    memory_mb: int = 512,
    sandbox: dict[str, Any] | None = None,
) -> float:
    if reward_type not in ("soft", "hard"):
        raise ValueError(f"reward_type: expected 'soft' or 'hard', got {reward_type!r}")
    config = parse_sandbox_config(sandbox)
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    limits = Limits(time_limit_s, memory_mb)
    results = _case_results(extract_code(response), truth, get_sandbox(config), limits, config.concurrency)
    if reward_type == "hard":
        return float(all(results))
    return sum(results) / len(results)


def check_code_sandbox_kwargs(reward_kwargs: dict[str, Any], path: str) -> SandboxConfig:
    """Before launch: the ``sandbox`` option parses, and its backend can run here (one ConfigError)."""
    config = parse_sandbox_config(reward_kwargs.get("sandbox"), f"{path}.sandbox")
    reason = backend_class(config.backend).unavailable_reason()
    if reason is not None:
        raise ConfigError(
            f"{path}.sandbox.backend", f"the {config.backend} code sandbox cannot run here: {reason}"
        )
    return config
