"""The final ``hf_model`` export and the offline converter's output are written next to their
target and renamed into place: a failed or interrupted export leaves the previous output whole
and nothing half-written under the final name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll.models.megatron import convert, mcore_checkpoint
from roll.pipeline.rlvr import pipeline


class _Trainer:
    """``save_hf_checkpoint`` writes one shard, then fails (``fail``) as a full disk or a signal would."""

    def __init__(self, fail: BaseException | None):
        self.fail = fail
        self.paths: list[str] = []

    def save_hf_checkpoint(self, path: str) -> None:
        self.paths.append(path)
        (Path(path) / "model.safetensors").write_text("new")
        if self.fail is not None:
            raise self.fail


def _run(tmp_path: Path, trainer: _Trainer) -> SimpleNamespace:
    tokenizer = SimpleNamespace(save_pretrained=lambda p: (Path(p) / "tokenizer.json").write_text("{}"))
    tracker = SimpleNamespace(finish=lambda: None)
    return SimpleNamespace(
        run_dir=tmp_path,
        colocated=set(),
        tokenizer=tokenizer,
        processor=None,  # a text model's run (a vision-language one exports its image processor too)
        tracker=tracker,
        model=lambda role: trainer,
    )


def _previous_export(tmp_path: Path) -> Path:
    out = tmp_path / "hf_model"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    return out


@pytest.mark.parametrize("fail", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_interrupted_final_export_keeps_the_previous_hf_model(tmp_path, fail):
    out = _previous_export(tmp_path)
    trainer = _Trainer(fail)
    with pytest.raises(type(fail)):
        pipeline.finish(_run(tmp_path, trainer))
    assert trainer.paths == [str(tmp_path / ".tmp-hf_model")]  # never the final name
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]


def test_a_complete_final_export_replaces_the_previous_one(tmp_path):
    out = _previous_export(tmp_path)
    pipeline.finish(_run(tmp_path, _Trainer(None)))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]


def _mcore_dir(tmp_path: Path) -> Path:
    mcore = tmp_path / "mcore_ckpt"
    mcore.mkdir()
    (mcore / mcore_checkpoint.MANIFEST).write_text(
        json.dumps({"layout": {"tp": 1, "pp": 1, "ep": 1, "vpp": None}})
    )
    return mcore


@pytest.mark.parametrize("command", ["mcore-to-hf", "hf-to-mcore"])
def test_the_converter_writes_beside_out_and_keeps_the_old_one_when_a_rank_fails(
    tmp_path, monkeypatch, command
):
    out = _previous_export(tmp_path)
    monkeypatch.setattr(convert, "check_layout", lambda hf, cfg: None)
    seen = []

    def spawn(fn, args, nprocs, join):
        target = Path(args[3][1])  # (port, world, command, (source, out, ...))
        seen.append(target)
        (target / "model.safetensors").write_text("half")
        raise RuntimeError("rank 0 was killed")  # what mp.spawn raises for a failed rank

    monkeypatch.setattr("torch.multiprocessing.spawn", spawn)
    source = ["--mcore", str(_mcore_dir(tmp_path))] if command == "mcore-to-hf" else ["--hf", str(tmp_path)]
    with pytest.raises(RuntimeError, match="rank 0 was killed"):
        convert.main([command, *source, "--out", str(out)])
    assert seen == [tmp_path / ".tmp-hf_model"]
    assert (out / "model.safetensors").read_text() == "old"
    assert not (tmp_path / ".tmp-hf_model").exists()


def test_the_converter_renames_a_complete_output_into_place(tmp_path, monkeypatch, capsys):
    out = _previous_export(tmp_path)

    def spawn(fn, args, nprocs, join):
        (Path(args[3][1]) / "model-00001.safetensors").write_text("new")

    monkeypatch.setattr("torch.multiprocessing.spawn", spawn)
    assert convert.main(["mcore-to-hf", "--mcore", str(_mcore_dir(tmp_path)), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model-00001.safetensors"]
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    assert capsys.readouterr().out.strip() == f"mcore-to-hf: wrote {out}"


def test_the_converter_refuses_to_write_over_its_input(tmp_path, capsys):
    mcore = _mcore_dir(tmp_path)
    assert convert.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(mcore)]) == 2
    assert capsys.readouterr().err.startswith("ConfigError: --out: ")
