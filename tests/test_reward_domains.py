"""ROLL's multi-domain rewards on CPU: code in a sandbox (hostile programs score 0 and harm nothing;
the escapes one by one are in test_sandbox_escapes.py),
IFEval instruction checks, CrossThinkQA-style multiple choice."""

from __future__ import annotations

import json
import time

import pytest

from roll.pipeline.rewards.code_sandbox import code_sandbox_reward, extract_code
from roll.pipeline.rewards.ifeval import ifeval_reward
from roll.pipeline.rewards.multiple_choice import multiple_choice_reward
from roll.pipeline.rewards.sandbox import run_sandboxed

DOUBLE = json.dumps([{"input": "3", "output": "6"}, {"input": "5", "output": "10"}])


def test_correct_and_partly_correct_programs():
    good = "```python\nprint(int(input()) * 2)\n```"
    half = "```python\nn = int(input())\nprint(6 if n == 3 else 0)\n```"
    assert code_sandbox_reward(good, DOUBLE) == 1.0
    assert code_sandbox_reward(half, DOUBLE) == 0.5
    assert code_sandbox_reward(half, DOUBLE, reward_type="hard") == 0.0
    tests = json.dumps({"test_code": "assert add(2, 3) == 5"})
    assert code_sandbox_reward("def add(a, b):\n    return a + b", tests) == 1.0
    assert code_sandbox_reward("def add(a, b):\n    return a - b", tests) == 0.0


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"


@pytest.mark.parametrize(
    "program",
    [
        "import os\nwhile True:\n    os.fork()",  # fork bomb
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",  # shell fork bomb
        "while True:\n    pass",  # infinite loop
        "import sys\nwhile True:\n    sys.stdout.write('6\\n' * 65536)",  # huge output
        "x = bytearray(4 << 30)\nprint(6)",  # memory
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint(6)",  # network
        "import ctypes\nassert ctypes.CDLL(None).fork() >= 0\nprint(6)",  # fork through libc
    ],
)
def test_hostile_programs_score_zero_quickly(program):
    start = time.monotonic()
    assert code_sandbox_reward(program, json.dumps([{"input": "3", "output": "6"}]), time_limit_s=1.0) == 0.0
    assert time.monotonic() - start < 10


def test_writes_outside_the_temp_dir_are_refused_and_harm_nothing(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    for program in (
        f"open({str(target)!r}, 'w').write('gone')",
        f"import os\nos.remove({str(target)!r})",
        f"import os\nos.rename({str(target)!r}, 'stolen.txt')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"import os\nos.chdir('/')\nopen({str(target)!r}, 'a').write('x')",
    ):
        assert not run_sandboxed(program, time_limit_s=1.0).ok, program
    assert target.read_text() == "keep"


def test_huge_output_is_cut():
    result = run_sandboxed("while True:\n    print('x' * 10000)", time_limit_s=2.0, output_bytes=1 << 16)
    assert not result.ok and len(result.stdout) <= 1 << 16


IFEVAL = json.dumps(
    {
        "instruction_id_list": [
            "punctuation:no_comma",
            "change_case:english_lowercase",
            "length_constraints:number_words",
            "keywords:existence",
        ],
        "kwargs": [{}, {}, {"relation": "less than", "num_words": 6}, {"keywords": ["apple"]}],
    }
)


def test_ifeval_soft_and_hard():
    assert ifeval_reward("i like apple pie", IFEVAL) == 1.0
    # comma and upper case fail, word count (5 < 6) and keyword pass
    assert ifeval_reward("I like apple, pie", IFEVAL) == 0.5
    assert ifeval_reward("I like apple, pie", IFEVAL, reward_type="hard") == 0.0
    bullets = json.dumps(
        {"instruction_id_list": ["detectable_format:number_bullet_lists"], "kwargs": [{"num_bullets": 2}]}
    )
    assert ifeval_reward("* a\n* b", bullets) == 1.0
    assert ifeval_reward("* a", bullets) == 0.0


def test_ifeval_unknown_instruction_raises():
    with pytest.raises(ValueError, match="unknown instruction"):
        ifeval_reward("x", json.dumps({"instruction_id_list": ["made:up"], "kwargs": [{}]}))


@pytest.mark.parametrize(
    ("response", "soft", "loose", "strict"),
    [
        ("so \\boxed{B}", 1.0, 1.0, 1.0),
        ("The answer is B.", 0.5, 1.0, -1.0),
        ("so \\boxed{C}", -0.5, -1.0, -1.0),
        ("I think C", -1.0, -1.0, -1.0),
    ],
)
def test_multiple_choice_reward_types(response, soft, loose, strict):
    assert multiple_choice_reward(response, "B") == soft
    assert multiple_choice_reward(response, "B", reward_type="loose") == loose
    assert multiple_choice_reward(response, "B", reward_type="strict") == strict


def test_code_reward_through_the_scoring_workers_with_kwargs():
    from roll.pipeline.rewards.scoring import score_batch

    responses = ["print(int(input()) * 2)", "while True:\n    pass", "print(6)"]
    stats: dict[str, int] = {}
    scores = score_batch(
        "code_sandbox",
        responses,
        [DOUBLE] * 3,
        {"reward_type": "soft", "time_limit_s": 0.5},
        10.0,
        stats=stats,
    )
    assert scores == [1.0, 0.0, 0.5]
    assert stats["scored"] == 3 and stats.get("timeouts", 0) == 0
