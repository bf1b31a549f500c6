"""Offline HF <-> megatron-core dist checkpoint conversion, streaming tensor by tensor.

    python -m roll.models.megatron.convert hf-to-mcore --hf DIR --out DIR --tp 2 --pp 2 --ep 1 [--vpp 2] [--layout "E|tt|tt|L"]
    python -m roll.models.megatron.convert mcore-to-hf --mcore DIR --out DIR [--max_shard_size 2GB]

``hf-to-mcore`` starts TP x PP x DP ranks (DP = EP, so the experts split over EP ranks; one process
per GPU where CUDA exists, gloo on CPU), each building its chunks of the layout on the ``meta``
device and writing them with megatron's ``dist_checkpointing`` under ``DIR/mcore``, each tensor
read from its slices of the HF safetensors only when the writer writes it
(``stream_save.save_from_hf``: a rank holds one parameter at a time). ``DIR`` also gets the HF
``config.json``, the tokenizer and ``roll_mcore.json`` (model type, layout, padded vocab).
``mcore-to-hf`` writes the HF safetensors back in parts of at most ``--max_shard_size`` bytes,
each worker loading only the tensors of the part it writes (``stream_export.export_to_hf``). The
conversion is exact: an HF -> mcore -> HF round trip gives the original tensors bit for bit.
Either way ``--out`` is written as ``.tmp-<name>`` next to it and renamed into place when every
rank is done (``atomic_io.write_dir_durably``), so a conversion that fails or is killed leaves a
previous ``--out`` whole.

The per-rank halves (``write_mcore``, ``read_mcore``) are what the CLI's ranks run; they are
collective over the default process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.configs.strategy_configs import MegatronConfig
from roll.models.megatron.mcore_checkpoint import MANIFEST, SUBDIR, cpu_safe_sync, read_manifest
from roll.utils.atomic_io import write_dir_durably

DEFAULT_MAX_SHARD = "2GB"
LAYOUT_KEYS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "layout": "pipeline_model_parallel_layout",
}


def layout_config(
    tp: int, pp: int, ep: int, vpp: int | None = None, layout: str | None = None
) -> MegatronConfig:
    """The parallel layout of the conversion (``layout``: Megatron's pipeline layout string)."""
    try:
        return MegatronConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_model_parallel_layout=layout,
        )
    except ValueError as exc:  # the layout's checks name the key
        raise ConfigError("--layout", str(exc).partition(": ")[2] or str(exc)) from None


def world_size(cfg: MegatronConfig) -> int:
    """TP x PP x DP ranks with DP = EP: the smallest world whose stages hold EP expert groups."""
    return cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.expert_model_parallel_size


def check_layout(hf_dir: str | Path, cfg: MegatronConfig) -> Any:
    """The HF config, after checking that the model splits into ``cfg`` (ConfigError naming --tp etc.)."""
    from transformers import AutoConfig

    from roll.models.megatron.model_fit import check_model_fits

    if not (Path(hf_dir) / "config.json").is_file():
        raise ConfigError(str(hf_dir), "not a Hugging Face model directory (no config.json)")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    try:
        cfg.validate(world_size(cfg), "convert")
        check_model_fits(hf_config, cfg, "convert")
    except ConfigError as exc:
        key = exc.path.rsplit(".", 1)[-1]
        flag = next((f"--{k}" for k, v in LAYOUT_KEYS.items() if v == key), exc.path)
        raise ConfigError(flag, exc.message) from None
    return hf_config


def _init_parallel(cfg: MegatronConfig) -> None:
    from roll.core.worker_context import WorkerContext
    from roll.models.megatron.parallel import init_parallel

    rank = torch.distributed.get_rank()
    init_parallel(WorkerContext("convert", rank, torch.distributed.get_world_size(), rank, _device()), cfg)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def write_mcore(hf_dir: str | Path, out_dir: str | Path, cfg: MegatronConfig) -> Any:
    """This rank's part of ``hf-to-mcore`` (collective). Returns the ``stream_save.HFSource`` that
    fed the writer (``peak_bytes``: the most parameter bytes this rank held at once)."""
    from roll.models.megatron.stream_save import meta_chunks, save_from_hf

    hf_config = check_layout(hf_dir, cfg)
    dtype = getattr(hf_config, "torch_dtype", None) or torch.float32
    _init_parallel(cfg)
    chunks = meta_chunks(hf_config, cfg, dtype)
    out = Path(out_dir)
    (out / SUBDIR).mkdir(parents=True, exist_ok=True)
    with cpu_safe_sync():
        source = save_from_hf(chunks, hf_dir, out / SUBDIR)
    if torch.distributed.get_rank() == 0:
        _write_side_files(Path(hf_dir), out, hf_config, cfg, source.info.padded_vocab_size, dtype)
    torch.distributed.barrier()
    return source


def _write_side_files(
    hf_dir: Path, out: Path, hf_config: Any, cfg: MegatronConfig, vocab: int, dtype
) -> None:
    for path in hf_dir.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(path, out / path.name)
    layout = {k: getattr(cfg, v) for k, v in LAYOUT_KEYS.items()}
    manifest = {
        "model_type": hf_config.model_type,
        "layout": layout,
        "padded_vocab_size": vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "megatron_config": asdict(cfg),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))


def whole_model_config(manifest: dict[str, Any]) -> MegatronConfig:
    """The layout that holds every parameter whole (TP = PP = EP = 1), its vocab padded as the
    checkpoint's (the padding depends on the TP it was written with)."""
    return dataclasses.replace(
        layout_config(1, 1, 1), make_vocab_size_divisible_by=manifest["padded_vocab_size"]
    )


def read_mcore(
    mcore_dir: str | Path, out_dir: str | Path, max_shard_size: str | int = DEFAULT_MAX_SHARD
) -> Any:
    """This rank's part of ``mcore-to-hf`` (collective over the default group, any world size):
    HF safetensors parts of at most ``max_shard_size`` bytes each (see ``stream_export``).
    Returns the parts written (rank ``i % world`` wrote part i)."""
    from transformers import AutoConfig

    from roll.models.megatron.hf_io import _copy_tokenizer
    from roll.models.megatron.stream_export import export_to_hf, parse_size
    from roll.models.megatron.stream_save import meta_chunks

    manifest = read_manifest(mcore_dir)
    hf_config = AutoConfig.from_pretrained(mcore_dir)
    cfg = whole_model_config(manifest)
    _init_parallel(cfg)
    chunks = meta_chunks(hf_config, cfg, getattr(torch, manifest["dtype"]))
    with cpu_safe_sync():
        parts = export_to_hf(chunks, Path(mcore_dir) / SUBDIR, out_dir, parse_size(max_shard_size))
    if torch.distributed.get_rank() == 0:
        hf_config.save_pretrained(out_dir)
        _copy_tokenizer(str(mcore_dir), Path(out_dir))
    torch.distributed.barrier()
    return parts


def _rank_main(rank: int, port: int, world: int, command: str, args: tuple) -> None:
    """One rank of the CLI: on a GPU of its own for ``hf-to-mcore`` where CUDA exists (NCCL),
    else (and always for ``mcore-to-hf``, which never touches a GPU) on the CPU over gloo."""
    from roll.utils.process_group import init_default_group

    device = torch.device("cpu")
    if torch.cuda.is_available() and command == "hf-to-mcore":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    init_default_group(rank, world, device, master_addr="127.0.0.1", master_port=port)
    try:
        (write_mcore if command == "hf-to-mcore" else read_mcore)(*args)
    finally:
        torch.distributed.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="HF <-> megatron-core dist checkpoint conversion")
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="one process per rank of the layout (TP x PP x EP)")
    to_mcore.add_argument("--hf", required=True)
    to_mcore.add_argument("--out", required=True)
    for flag in ("tp", "pp", "ep"):
        to_mcore.add_argument(f"--{flag}", type=int, default=1)
    to_mcore.add_argument("--vpp", type=int, default=None)
    to_mcore.add_argument("--layout", default=None, help='pipeline layout, e.g. "E|(tt|)*30,L"')
    to_hf = sub.add_parser("mcore-to-hf")
    to_hf.add_argument("--mcore", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument(
        "--max_shard_size",
        default=DEFAULT_MAX_SHARD,
        help="most bytes per safetensors file (2GB, 500MB, ...)",
    )
    to_hf.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes writing files (default: the checkpoint's TP x PP x EP)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    import sys

    import torch.multiprocessing as mp

    from roll.models.megatron.stream_export import parse_size
    from roll.utils.ports import free_port

    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-mcore":
            cfg = layout_config(args.tp, args.pp, args.ep, args.vpp, args.layout)
            check_layout(args.hf, cfg)
            world = world_size(cfg)
            call = (args.hf, args.out, cfg)
        else:
            world = world_size(layout_config(**read_manifest(args.mcore)["layout"]))
            world = world if args.workers is None else args.workers
            if world < 1:
                raise ConfigError("--workers", f"must be >= 1, got {world}")
            try:
                size = parse_size(args.max_shard_size)
            except ValueError as err:
                raise ConfigError("--max_shard_size", str(err)) from None
            call = (args.mcore, args.out, size)
        source = Path(call[0])
        if Path(args.out).resolve() == source.resolve():
            raise ConfigError("--out", f"{args.out} is the input directory; write the conversion elsewhere")
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    # The ranks write into .tmp-<out> next to --out, renamed into place once every rank is done:
    # a conversion that fails or is killed leaves a previous --out whole and no half one.
    with write_dir_durably(Path(args.out)) as tmp:
        call = (call[0], str(tmp), *call[2:])
        mp.spawn(_rank_main, args=(free_port(), world, args.command, call), nprocs=world, join=True)
    print(f"{args.command}: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
