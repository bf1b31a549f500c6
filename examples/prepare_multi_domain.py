"""Make what the multi-domain example (examples/config/rlvr_multi_domain.yaml) needs on top of the
default example: the generated code task and a model warm-started on it.

    python examples/prepare_default_example.py          # first: model and arithmetic data
    python examples/prepare_multi_domain.py [--base output/default_example] [--out output/multi_domain]

Writes under ``--out``: ``code/{sft,train,val}.jsonl`` (``examples/tasks/python_programs.py``) and
``sft_model/``, the default example's ``sft_model`` after a short warm start on code rows mixed
with as many arithmetic warm-start rows (so it keeps its arithmetic). Half of the code targets are
another operation's program, so the model starts solving some code prompts and confusing others.
Steps whose outputs exist are skipped (``--force`` redoes them). Prints the sampled (temperature
1.0) code and arithmetic accuracy of the result: where RL starts from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.prepare_default_example import make_sft_model, read_jsonl  # noqa: E402
from examples.tasks.python_programs import write_task  # noqa: E402
from roll.pipeline.rewards.code_sandbox import code_sandbox_reward  # noqa: E402
from roll.pipeline.sft.evaluate import accuracy  # noqa: E402
from roll.pipeline.sft.warm_start import WARM_START_TRAINING  # noqa: E402

RESPONSE_LENGTH = 40  # the longest program is 30 tokens plus the end token


# The default example's warm start at a gentler rate, so the arithmetic the model already knows survives.
MULTI_DOMAIN_TRAINING = dataclasses.replace(WARM_START_TRAINING, learning_rate=1e-3, warmup_steps=10)


def write_sft_rows(path: Path, rows: list[dict]) -> Path:
    """The warm-start rows as the SFT pipeline reads them: code rows carry a ``prompt``, which
    becomes their user turn."""
    messages = [
        {**r, "messages": r.get("messages") or [{"role": "user", "content": r["prompt"]}]} for r in rows
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in messages))
    return path


def report(model_path: Path, code_val: list[dict], math_val: list[dict], seed: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    code_rows = [{**r, "messages": [{"role": "user", "content": r["prompt"]}]} for r in code_val]
    code = accuracy(
        model,
        tokenizer,
        code_rows,
        1.0,
        RESPONSE_LENGTH,
        seed,
        partial(code_sandbox_reward, reward_type="hard"),
    )
    math = accuracy(model, tokenizer, math_val, 1.0, 32, seed)
    print(f"sampled accuracy of {model_path}: code {code:.3f} ({len(code_val)} rows), arithmetic {math:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="output/default_example")
    parser.add_argument("--out", default="output/multi_domain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, out = Path(args.base), Path(args.out)
    paths = write_task(out / "code", args.seed)
    code = read_jsonl(paths["sft"])
    math = random.Random(args.seed).sample(read_jsonl(base / "data" / "sft.jsonl"), len(code))
    rows = code + math
    random.Random(args.seed).shuffle(rows)
    sft_file = write_sft_rows(out / "sft_rows.jsonl", rows)
    model = make_sft_model(
        out,
        base / "sft_model",
        sft_file,
        args.steps,
        args.seed,
        args.threads,
        args.force,
        MULTI_DOMAIN_TRAINING,
    )
    report(model, read_jsonl(paths["val"]), read_jsonl(base / "data" / "val.jsonl")[:100], args.seed)


if __name__ == "__main__":
    main()
