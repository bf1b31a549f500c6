"""Write a Hugging Face checkpoint with random weights at a real model's shapes (no hub access).

    # Qwen3-30B-A3B shapes cut to 4 layers, with the default example's tokenizer:
    python examples/prepare_default_example.py
    python examples/make_random_checkpoint.py --preset qwen3-30b-a3b --num_hidden_layers 4 \
        --out output/qwen3-30b-a3b-4l --device cuda

Then point a config's ``pretrain`` at ``--out`` (see examples/config/qwen3-30B-A3B-rlvr_megatron_4gpus.yaml).
Presets: roll/models/random_checkpoint.py.

A vision-language preset (``qwen2.5-vl-3b``) takes the published model's tokenizer and image
processor: ``--tokenizer`` is a directory holding them (e.g. the small files of
Qwen/Qwen2.5-VL-3B-Instruct: ``huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct --include "*.json"
"*.txt" --local-dir models/qwen2.5-vl-3b-files``); its ``preprocessor_config.json`` is copied along.
"""

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roll.configs.errors import ConfigError  # noqa: E402
from roll.models.random_checkpoint import PRESETS, write_random_checkpoint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--num_hidden_layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--tokenizer", default="output/default_example/sft_model", help="'' for none")
    parser.add_argument("--device", default="cpu", help="where the weights are initialised")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite a checkpoint already in --out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    if (out / "config.json").exists() and not args.force:
        print(f"{out} already holds a checkpoint; pass --force to overwrite it")
        return 0
    try:
        write_random_checkpoint(
            args.preset, out, args.num_hidden_layers, args.tokenizer or None, args.device, args.seed
        )
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
