"""Make everything the default example needs, offline and reproducibly from a seed.

    python examples/prepare_default_example.py [--out output/default_example] [--seed 0] [--sft_steps 800] [--force]

Writes under ``--out``:

* ``data/{sft,train,val}.jsonl``: arithmetic word problems (``examples/tasks/arithmetic.py``) for the
  warm start, the RL prompts and the held-out validation, disjoint by arithmetic;
* ``base_model/``: a byte-level BPE tokenizer trained on the task text and a randomly initialised
  tiny Qwen2 (``roll/models/tiny.py``);
* ``sft_model/``: the base model after a short supervised warm start (``roll/pipeline/sft``), a
  Hugging Face checkpoint with its tokenizer: the RL run's ``pretrain``.

The warm start is short on purpose, and half of its targets are bare answers (see ``sft_rows`` in
``examples/tasks/arithmetic.py``): it leaves a model that gets roughly 40-50% of the held-out problems
right when sampling at temperature 1.0, which RL then raises by learning to work the sums out.

Steps whose outputs exist are skipped (``--force`` redoes all of them). The same seed, arguments and
``--threads`` give the same files. At the end it prints the warm start's validation accuracy, greedy
and sampled at temperature 1.0: RL starts from the sampled number.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from examples.tasks.arithmetic import write_task  # noqa: E402
from roll.configs.role import TrainingArgs  # noqa: E402
from roll.models.tiny import TinyModelSpec, build_tiny_qwen2, build_tokenizer, save_model_and_tokenizer  # noqa: E402
from roll.pipeline.sft.evaluate import accuracy  # noqa: E402
from roll.pipeline.sft.warm_start import WARM_START_TRAINING, warm_start  # noqa: E402

RESPONSE_LENGTH = 32  # the longest worked solution is 31 tokens plus the end token


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_manifest(out: Path, settings: dict, force: bool) -> None:
    """Refuse to mix outputs of different settings in one directory (unless --force)."""
    manifest = out / "prepare.json"
    if manifest.exists() and not force:
        previous = json.loads(manifest.read_text())
        if previous != settings:
            raise SystemExit(
                f"{out} was prepared with {previous}, not {settings}: pass --force to redo it, or another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(settings, indent=2) + "\n")


def make_data(out: Path, seed: int, force: bool) -> dict[str, Path]:
    paths = {name: out / "data" / f"{name}.jsonl" for name in ("sft", "train", "val")}
    if force or not all(p.exists() for p in paths.values()):
        paths = write_task(out / "data", seed)
        print(f"data: wrote {', '.join(str(p) for p in paths.values())}")
    else:
        print(f"data: {out / 'data'} exists, skipping")
    return paths


def make_base_model(out: Path, sft_rows: list[dict], train_rows: list[dict], seed: int, force: bool) -> Path:
    path = out / "base_model"
    if not force and (path / "config.json").exists():
        print(f"base model: {path} exists, skipping")
        return path
    texts = [f"user\n{r['messages'][-1]['content']}" for r in sft_rows + train_rows]
    texts += [f"assistant\n{r['solution']}" for r in sft_rows]
    tokenizer = build_tokenizer(texts)
    model = build_tiny_qwen2(tokenizer, TinyModelSpec(), seed)
    save_model_and_tokenizer(model, tokenizer, path)
    print(
        f"base model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)} -> {path}"
    )
    return path


def make_sft_model(
    out: Path,
    base: Path,
    sft_file: Path,
    steps: int,
    seed: int,
    threads: int,
    force: bool,
    training: TrainingArgs = WARM_START_TRAINING,
) -> Path:
    """The warm start through the SFT pipeline (``roll.pipeline.sft.warm_start``); its run
    directory (metrics.jsonl, curves) stays under ``out/sft_run``."""
    path = out / "sft_model"
    if not force and (path / "config.json").exists():
        print(f"sft: {path} exists, skipping")
        return path
    start = time.time()
    exported = warm_start(base, sft_file, out / "sft_run", steps, seed, threads, training)
    losses = [
        row["train/loss"] for row in read_jsonl(out / "sft_run" / "metrics.jsonl") if "train/loss" in row
    ]
    print(
        f"sft: {steps} steps in {time.time() - start:.0f} s, final loss {sum(losses[-20:]) / len(losses[-20:]):.3f}"
    )
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(exported, path)
    return path


def report_accuracy(model_path: Path, val_rows: list[dict], seed: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    result = {
        "greedy": accuracy(model, tokenizer, val_rows, 0.0, RESPONSE_LENGTH, seed),
        "sampled_t1": accuracy(model, tokenizer, val_rows, 1.0, RESPONSE_LENGTH, seed),
    }
    print(f"validation accuracy of {model_path} on {len(val_rows)} held-out problems:")
    print(f"  greedy          {result['greedy']:.3f}")
    print(f"  temperature 1.0 {result['sampled_t1']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="output/default_example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_steps", type=int, default=800)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (results depend on it slightly)"
    )
    parser.add_argument("--force", action="store_true", help="redo every step even when its outputs exist")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    check_manifest(out, {"seed": args.seed, "sft_steps": args.sft_steps, "threads": args.threads}, args.force)
    start = time.time()
    paths = make_data(out, args.seed, args.force)
    sft_rows, train_rows, val_rows = (read_jsonl(paths[name]) for name in ("sft", "train", "val"))
    base = make_base_model(out, sft_rows, train_rows, args.seed, args.force)
    sft = make_sft_model(out, base, paths["sft"], args.sft_steps, args.seed, args.threads, args.force)
    report_accuracy(sft, val_rows, args.seed)
    print(f"done in {time.time() - start:.0f} s; RL starts from {sft}")


if __name__ == "__main__":
    main()
