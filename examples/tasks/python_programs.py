"""A generated code task for the multi-domain example: one-line stdin/stdout Python programs,
scored by the ``code_sandbox`` reward (each row's ``ground_truth`` holds its test cases).

    python examples/tasks/python_programs.py --out output/multi_domain/code --seed 0

Each prompt asks for a program that reads two integers, one per line, and prints one result
(their sum, difference, product, larger one, or twice the first); the test cases are three input
pairs drawn from the seed. Rows carry ``tag: code`` so they route to the code reward role, next to
the arithmetic rows (``tag: arithmetic``) of the math role, and ``solution``, a reference program::

    print(int(input())+int(input()))

``sft.jsonl`` holds warm-start rows (``target``): the reference program, or with probability
``wrong_fraction`` the program of another operation, so the warm start leaves a policy that solves
some prompts and confuses others, which RL then sorts out. Everything is a pure function of the seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TAG = "code"
_A, _B = "int(input())", "int(input())"
# name -> (what the prompt asks, reference program)
OPERATIONS = {
    "sum": ("the sum of a and b", f"print({_A}+{_B})"),
    "difference": ("a minus b", f"print({_A}-{_B})"),
    "product": ("a times b", f"print({_A}*{_B})"),
    "max": ("the larger of a and b", f"print(max({_A},{_B}))"),
    "double": ("twice a", f"print(2*{_A})"),
}
_REFERENCE = {
    "sum": lambda a, b: a + b,
    "difference": lambda a, b: a - b,
    "product": lambda a, b: a * b,
    "max": max,
    "double": lambda a, b: 2 * a,
}


def make_row(op: str, cases: list[tuple[int, int]]) -> dict:
    """One JSONL row: prompt, stdin/stdout cases as JSON, tag, operation and reference program."""
    what, program = OPERATIONS[op]
    tests = [{"input": f"{a}\n{b}\n", "output": str(_REFERENCE[op](a, b))} for a, b in cases]
    prompt = f"Python: read a and b, one per line; print {what}."
    return {
        "prompt": prompt,
        "ground_truth": json.dumps(tests),
        "tag": TAG,
        "operation": op,
        "solution": program,
    }


def make_rows(n: int, rng: random.Random, max_value: int = 99) -> list[dict]:
    ops = sorted(OPERATIONS)
    return [
        make_row(
            ops[rng.randrange(len(ops))],
            [(rng.randint(0, max_value), rng.randint(0, max_value)) for _ in range(3)],
        )
        for _ in range(n)
    ]


def sft_rows(rows: list[dict], wrong_fraction: float, seed: int) -> list[dict]:
    """Warm-start rows: ``target`` is the row's solution, or with probability ``wrong_fraction``
    the solution of another operation."""
    rng = random.Random(seed)
    ops = sorted(OPERATIONS)
    out = []
    for row in rows:
        op = row["operation"]
        if rng.random() < wrong_fraction:
            op = rng.choice([o for o in ops if o != op])
        out.append({**row, "target": OPERATIONS[op][1]})
    return out


def write_task(
    out_dir: str | Path,
    seed: int,
    n_sft: int = 1000,
    n_train: int = 500,
    n_val: int = 100,
    wrong_fraction: float = 0.5,
) -> dict[str, Path]:
    """Write ``sft.jsonl``, ``train.jsonl`` and ``val.jsonl`` under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = {
        "val": make_rows(n_val, random.Random(seed * 3)),
        "train": make_rows(n_train, random.Random(seed * 3 + 1)),
        "sft": sft_rows(make_rows(n_sft, random.Random(seed * 3 + 2)), wrong_fraction, seed),
    }
    paths = {}
    for split, split_rows in rows.items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="output/multi_domain/code")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_task(args.out, args.seed)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    main()
