"""The converter streams (one rank, gloo, in the pytest process, fp32 Qwen2 of 8 layers):

- ``hf-to-mcore`` holds one parameter's value at a time (``HFSource.peak_bytes``, counted from
  the moment a value is read until its memory is freed, through the writer): at most the largest
  parameter, far below two layers, let alone the model; each parameter is read from the HF files once, and the
  dist checkpoint loads (``load_mcore_weights``) to exactly the weights ``load_hf_weights`` gives;
- ``mcore-to-hf`` loads one part at a time (parts of at most ``max_shard_size`` bytes), writes
  ``model-0000i-of-0000N.safetensors`` + an index listing every tensor, and gives the original
  tensors back bit for bit;
- bad input is one line naming the flag or file, before anything is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent.parent))

pytest.importorskip("megatron.core")

from tiny_models import safetensors_dir, save_random_model  # noqa: E402

from roll.core.errors import CheckpointError  # noqa: E402
from roll.models.megatron import convert, mcore_checkpoint, stream_export  # noqa: E402

LAYERS = 8


@pytest.fixture(scope="module")
def group():
    from megatron.core import parallel_state as ps

    from roll.utils.process_group import init_default_group

    init_default_group(0, 1, torch.device("cpu"))
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=272,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return save_random_model(config, path)


_tensors = safetensors_dir


def _layer_bytes(tensors: dict[str, torch.Tensor], layer: int) -> int:
    return sum(t.nbytes for n, t in tensors.items() if n.startswith(f"model.layers.{layer}."))


def test_hf_to_mcore_holds_about_one_parameter(group, hf_dir: Path, tmp_path: Path) -> None:
    from roll.models.megatron.hf_io import load_hf_weights
    from roll.models.megatron.model_builder import build_model_chunks

    original = _tensors(hf_dir)
    source = convert.write_mcore(hf_dir, tmp_path / "mcore", convert.layout_config(1, 1, 1))
    total, layer = sum(t.nbytes for t in original.values()), _layer_bytes(original, 0)
    largest = max(p.numel() * p.element_size() for _, p, _ in source.items.values())
    assert source.peak_bytes <= largest, (source.peak_bytes, largest)
    assert source.peak_bytes < 2 * layer < total / 3, (source.peak_bytes, layer, total)
    params = {w.mcore for w, _, _ in source.items.values()}
    assert source.reads == len(params)  # the two halves of each linear_fc1 share one read
    assert source.live_bytes == 0  # nothing left behind

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    cfg = convert.layout_config(1, 1, 1)
    from_hf = build_model_chunks(hf_config, cfg, torch.float32)
    load_hf_weights(from_hf, hf_dir)
    from_mcore = build_model_chunks(hf_config, cfg, torch.float32)
    mcore_checkpoint.load_mcore_weights(from_mcore, tmp_path / "mcore")
    expected, got = dict(from_hf[0].named_parameters()), dict(from_mcore[0].named_parameters())
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_mcore_to_hf_holds_one_part(group, hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    original = _tensors(hf_dir)
    convert.write_mcore(hf_dir, tmp_path / "mcore", convert.layout_config(1, 1, 1))
    limit = 2 * _layer_bytes(original, 0)
    loaded: list[int] = []
    real_load = stream_export._load_part

    def recording_load(part, mcore_dir):
        values = real_load(part, mcore_dir)
        loaded.append(sum(v.nbytes for v in values.values()))
        return values

    monkeypatch.setattr(stream_export, "_load_part", recording_load)
    parts = convert.read_mcore(tmp_path / "mcore", tmp_path / "back", max_shard_size=limit)
    total = sum(t.nbytes for t in original.values())
    assert len(parts) == len(loaded) > LAYERS // 2
    assert max(loaded) <= limit < total / 3

    back = tmp_path / "back"
    files = sorted(back.glob("*.safetensors"))
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)
    ]
    assert all(f.stat().st_size <= limit + 4096 for f in files)  # + the safetensors header
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == total
    again = _tensors(back)
    assert again.keys() == original.keys()
    assert all(torch.equal(original[n], again[n]) and original[n].dtype == again[n].dtype for n in original)
    assert (back / "config.json").is_file() and (back / "tokenizer_config.json").is_file()


def test_bad_input_is_one_line(group, hf_dir: Path, tmp_path: Path, capsys) -> None:
    args = ["mcore-to-hf", "--mcore", str(hf_dir), "--out", str(tmp_path / "o"), "--max_shard_size", "lots"]
    assert convert.main(args) == 2
    err = capsys.readouterr().err.strip()  # no manifest: names the file
    assert err.startswith("ConfigError: ") and "roll_mcore.json" in err and "\n" not in err
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / mcore_checkpoint.MANIFEST).write_text(
        '{"layout": {"tp": 1, "pp": 1, "ep": 1, "vpp": null}}'
    )
    args[2], args[-1] = str(tmp_path / "ck"), "lots"
    assert convert.main(args) == 2
    assert capsys.readouterr().err.strip().startswith("ConfigError: --max_shard_size: 'lots' is not a size")
    assert convert.main([*args[:-1], "0"]) == 2
    assert capsys.readouterr().err.strip() == "ConfigError: --max_shard_size: '0': a size must be positive"
    assert convert.main([*args[:-1], "1GB", "--workers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "ConfigError: --workers: must be >= 1, got 0"

    # An HF tensor of the wrong shape: CheckpointError naming it and its file, nothing written.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.3.mlp.down_proj.weight"] = tensors["model.layers.3.mlp.down_proj.weight"][
        :, :-8
    ].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"model.layers.3.mlp.down_proj.weight' in .*bad/model.safetensors"
    ):
        convert.write_mcore(bad, tmp_path / "bad_out", convert.layout_config(1, 1, 1))
    assert not (tmp_path / "bad_out" / "mcore" / ".metadata").exists()
