"""A verifiable task for the default example: arithmetic word problems with exact integer answers.

    python examples/tasks/arithmetic.py --out output/default_example/data --seed 0

Each problem is a short story ("Ava has 37 marbles and finds 48 more. How many marbles does Ava have
now?") whose answer is one addition or subtraction of two-digit numbers. Rows are written as JSONL
with the fields the RLVR data loader reads (``messages``, ``ground_truth``, ``tag``) plus
``solution``, the target of the supervised warm start: the sum worked column by column, units first,
then the boxed answer::

    37+48: 7+8=15, 3+4+1=8, \\boxed{85}
    61-19: 11-9=2, 6-1-1=4, \\boxed{42}

Column steps keep every digit operation next to its inputs, which a model of a few hundred thousand
parameters learns in a few hundred steps (answering "37 + 48 = 85" directly it barely learns at all).

The validation split is held out by arithmetic: no (operation, a, b) of val.jsonl appears in
train.jsonl, so validation accuracy measures sums never seen, not memorised stories. Everything is a
pure function of the seed.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

TAG = "arithmetic"

NAMES = (
    "Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
    "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Zoe",
)  # fmt: skip
OBJECTS = (
    "marbles", "apples", "stickers", "coins", "books", "shells", "pencils", "cards",
    "stamps", "beads", "cookies", "rocks", "tickets", "buttons", "flowers", "candles",
)  # fmt: skip
CONTAINERS = ("box", "bag", "jar", "basket", "crate", "shelf")

# (operation, template). Placeholders: {name}, {other}, {obj}, {box}, {a}, {b}.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("+", "{name} has {a} {obj} and finds {b} more. How many {obj} does {name} have now?"),
    ("+", "{name} had {a} {obj}. {other} gave {name} {b} more. How many {obj} does {name} have?"),
    ("+", "A {box} holds {a} {obj} and another {box} holds {b} {obj}. How many {obj} are there in all?"),
    ("+", "{name} collected {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} in total?"),
    ("+", "{name} has {a} {obj}. {other} has {b} {obj}. How many {obj} do they have together?"),
    ("+", "There are {a} {obj} in a {box}. {name} puts in {b} more. How many {obj} are in the {box}?"),
    ("-", "{name} has {a} {obj} and gives {b} to {other}. How many {obj} does {name} have left?"),
    ("-", "A {box} had {a} {obj}. {name} took out {b}. How many {obj} are still in the {box}?"),
    ("-", "{name} had {a} {obj} and lost {b} of them. How many {obj} does {name} have now?"),
    ("-", "{name} has {a} {obj}. {other} has {b} {obj}. How many more {obj} does {name} have than {other}?"),
    ("-", "{name} needs {a} {obj} and already has {b}. How many more {obj} does {name} need?"),
)

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}


def _digits(n: int, width: int) -> list[int]:
    """Digits of ``n``, units first, zero-padded to ``width``."""
    return [int(c) for c in reversed(str(n).zfill(width))]


def column_steps(op: str, a: int, b: int) -> list[str]:
    """One step per column, units first: ``7+8=15`` then ``3+4+1=8`` (carry added);
    ``11-9=2`` (10 borrowed) then ``6-1-1=4`` (the borrow paid back)."""
    width = len(str(max(a, b)))
    steps, carry = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
        else:
            borrow = int(x - carry < y)
            top = x + 10 * borrow
            steps.append(f"{top}" + ("-1" if carry else "") + f"-{y}={top - carry - y}")
            carry = borrow
    return steps


@dataclass(frozen=True)
class Problem:
    question: str
    op: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        return OPERATIONS[self.op](self.a, self.b)

    @property
    def solution(self) -> str:
        """The supervised target: the operation, its column steps, then the boxed answer."""
        steps = ", ".join(column_steps(self.op, self.a, self.b))
        return f"{self.a}{self.op}{self.b}: {steps}, \\boxed{{{self.answer}}}"

    def to_row(self) -> dict:
        return {
            "messages": [{"role": "user", "content": self.question}],
            "ground_truth": str(self.answer),
            "tag": TAG,
            "solution": self.solution,
        }


def sample_problem(rng: random.Random, max_value: int = 99) -> Problem:
    """One random problem with operands in [10, max_value]; differences are never negative."""
    op, template = rng.choice(TEMPLATES)
    a, b = rng.randint(10, max_value), rng.randint(10, max_value)
    if op == "-":
        a, b = max(a, b), min(a, b)
    name, other = rng.sample(NAMES, 2)
    text = template.format(
        name=name, other=other, obj=rng.choice(OBJECTS), box=rng.choice(CONTAINERS), a=a, b=b
    )
    return Problem(text, op, a, b)


SPLITS = ("val", "train", "sft")


def make_splits(sizes: dict[str, int], seed: int, max_value: int = 99) -> dict[str, list[Problem]]:
    """Problems per split (``sizes`` maps split name -> count), disjoint by (op, a, b) across splits.
    Splits are drawn in the order of ``sizes``; repeats within a split are allowed."""
    rng = random.Random(seed)
    taken: set[tuple[str, int, int]] = set()
    splits: dict[str, list[Problem]] = {}
    for name, size in sizes.items():
        problems: list[Problem] = []
        mine: set[tuple[str, int, int]] = set()
        while len(problems) < size:
            p = sample_problem(rng, max_value)
            if (p.op, p.a, p.b) not in taken:
                problems.append(p)
                mine.add((p.op, p.a, p.b))
        taken |= mine
        splits[name] = problems
    return splits


def sft_rows(problems: list[Problem], direct_fraction: float, seed: int) -> list[dict]:
    """Warm-start rows: each row's ``target`` is its worked solution, or with probability
    ``direct_fraction`` the bare answer ``\\boxed{85}``. The bare answers teach the model a habit
    that often fails (a tiny model cannot add in its head), which RL can then train away: the
    visible gain of the default example comes from learning that working it out pays."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        target = f"\\boxed{{{p.answer}}}" if rng.random() < direct_fraction else p.solution
        rows.append({**p.to_row(), "target": target})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_task(
    out_dir: str | Path,
    seed: int,
    n_sft: int = 4000,
    n_train: int = 2000,
    n_val: int = 200,
    max_value: int = 99,
    direct_fraction: float = 0.5,
) -> dict[str, Path]:
    """Write ``sft.jsonl`` (warm start), ``train.jsonl`` (RL prompts) and ``val.jsonl`` (held out)
    under ``out_dir``; returns their paths by split name."""
    splits = make_splits({"val": n_val, "train": n_train, "sft": n_sft}, seed, max_value)
    out = Path(out_dir)
    paths = {name: out / f"{name}.jsonl" for name in SPLITS}
    write_jsonl([p.to_row() for p in splits["val"]], paths["val"])
    write_jsonl([p.to_row() for p in splits["train"]], paths["train"])
    write_jsonl(sft_rows(splits["sft"], direct_fraction, seed), paths["sft"])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="output/default_example/data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_sft", type=int, default=4000)
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_val", type=int, default=200)
    parser.add_argument("--max_value", type=int, default=99, help="largest operand")
    parser.add_argument(
        "--direct_fraction", type=float, default=0.5, help="warm-start rows with a bare answer"
    )
    args = parser.parse_args()
    paths = write_task(
        args.out, args.seed, args.n_sft, args.n_train, args.n_val, args.max_value, args.direct_fraction
    )
    for path in paths.values():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
