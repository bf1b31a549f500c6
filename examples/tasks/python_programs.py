"""A generated code task for the multi-domain example: tiny stdin/stdout Python programs, scored
by the ``code_sandbox`` reward (each row's ``ground_truth`` holds its test cases).

    python examples/tasks/python_programs.py --out output/default_example/code --seed 0

Each prompt asks for a program that reads two integers, one per line, and prints one result
(their sum, difference, product, larger one, or twice the first); the test cases are three input
pairs drawn from the seed. Rows carry ``tag: code`` so they route to the code reward role, next to
the arithmetic rows (``tag: arithmetic``) of the math role. Everything is a pure function of the
seed (train and validation draw their pairs from different streams).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TAG = "code"
# name -> (what the prompt asks, the reference computation)
OPERATIONS = {
    "sum": ("the sum of a and b", lambda a, b: a + b),
    "difference": ("a minus b", lambda a, b: a - b),
    "product": ("a times b", lambda a, b: a * b),
    "max": ("the larger of a and b", max),
    "double": ("twice a (ignore b)", lambda a, b: 2 * a),
}


def make_row(op: str, cases: list[tuple[int, int]]) -> dict:
    """One JSONL row: the prompt, the stdin/stdout cases as JSON, the tag, and a reference program."""
    what, fn = OPERATIONS[op]
    prompt = f"Write a Python program that reads integers a and b (one per line) and prints {what}."
    tests = [{"input": f"{a}\n{b}\n", "output": str(fn(a, b))} for a, b in cases]
    return {"prompt": prompt, "ground_truth": json.dumps(tests), "tag": TAG, "operation": op}


def make_rows(n: int, rng: random.Random, max_value: int) -> list[dict]:
    ops = sorted(OPERATIONS)
    return [
        make_row(
            ops[i % len(ops)], [(rng.randint(0, max_value), rng.randint(0, max_value)) for _ in range(3)]
        )
        for i in range(n)
    ]


def write_task(
    out_dir: str | Path, seed: int, n_train: int = 500, n_val: int = 50, max_value: int = 99
) -> dict:
    """Write ``train.jsonl`` and ``val.jsonl`` under ``out_dir``; returns their paths by split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = {"val": make_rows(n_val, random.Random(seed * 2 + 1), max_value)}
    rows["train"] = make_rows(n_train, random.Random(seed * 2), max_value)
    paths = {}
    for split, split_rows in rows.items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="output/default_example/code")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_train", type=int, default=500)
    parser.add_argument("--n_val", type=int, default=50)
    args = parser.parse_args()
    paths = write_task(args.out, args.seed, args.n_train, args.n_val)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    main()
